// y = W x for a few columns x, with W packed for it, for XLA:CPU.
//
// A decode step multiplies every weight matrix by one column per busy slot. XLA:CPU's products
// run far below the memory bandwidth for 2-8 columns (its GEMM is tuned for many). Here W [M, K]
// is packed once as [ceil(M / 8), K, 8]: block b holds rows 8b..8b+7, and for each input index k
// their 8 weights are one vector. The inner loop loads that vector and multiplies it by each
// column's broadcast x[k, c] into one running 8-row sum per column, so the weights stream front to
// back exactly once whatever the column count, and blocks of rows are shared over XLA's threads.
//
// Operands (row-major float32): packed [B, K, 8], x [K, N]. Result: y [8 B, N] (rows past M are
// the zero padding's products).
#include <algorithm>
#include <cstdint>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jinfer::f8;

constexpr int64_t kBlocksPerTask = 8;  // 64 rows: small enough to balance, big enough to stream

// Rows [8b, 8b + 8) x columns [c0, c0 + n). Fewer columns leave FMA units idle, so the k loop is
// unrolled U ways with separate sums to keep as many multiplies in flight.
template <int n>
inline void Tile(const float* packed, const float* x, float* y, int64_t K, int64_t N, int64_t b,
                 int64_t c0) {
  constexpr int U = n >= 8 ? 1 : (n >= 4 ? 2 : (n >= 2 ? 4 : 8));
  f8 acc[U][n] = {};
  const float* w = packed + b * K * 8;
  const float* xc = x + c0;
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int u = 0; u < U; ++u) {
      const f8 wv = jinfer::Load(w + (k + u) * 8);
      const float* xk = xc + (k + u) * N;
      for (int c = 0; c < n; ++c) acc[u][c] += wv * xk[c];
    }
  }
  for (; k < K; ++k) {
    const f8 wv = jinfer::Load(w + k * 8);
    for (int c = 0; c < n; ++c) acc[0][c] += wv * xc[k * N + c];
  }
  for (int c = 0; c < n; ++c) {
    f8 sum = acc[0][c];
    for (int u = 1; u < U; ++u) sum += acc[u][c];
    for (int r = 0; r < 8; ++r) y[(b * 8 + r) * N + c0 + c] = sum[r];
  }
}

// One block of 8 rows against every column, 8 columns at a time.
void Block(const float* packed, const float* x, float* y, int64_t K, int64_t N, int64_t b) {
  int64_t c0 = 0;
  for (; c0 + 8 <= N; c0 += 8) Tile<8>(packed, x, y, K, N, b, c0);
  switch (N - c0) {
    case 7: Tile<7>(packed, x, y, K, N, b, c0); break;
    case 6: Tile<6>(packed, x, y, K, N, b, c0); break;
    case 5: Tile<5>(packed, x, y, K, N, b, c0); break;
    case 4: Tile<4>(packed, x, y, K, N, b, c0); break;
    case 3: Tile<3>(packed, x, y, K, N, b, c0); break;
    case 2: Tile<2>(packed, x, y, K, N, b, c0); break;
    case 1: Tile<1>(packed, x, y, K, N, b, c0); break;
  }
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> packed, ffi::Buffer<ffi::F32> x,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto pd = packed.dimensions(), xd = x.dimensions(), yd = y->dimensions();
  if (pd.size() != 3 || pd[2] != 8 || xd.size() != 2 || xd[0] != pd[1] || yd[0] != 8 * pd[0] ||
      yd[1] != xd[1])
    return ffi::Error::InvalidArgument(
        "jinfer cpu matmul: packed [B, K, 8], x [K, N] and y [8 B, N] expected");
  const float* w = packed.typed_data();
  const float* columns = x.typed_data();
  float* out = y->typed_data();
  const int64_t blocks = pd[0], K = pd[1], N = xd[1];
  const int64_t tasks = (blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  jinfer::RunTasks(pool, jinfer::PoolCores(pool), tasks, [=](int64_t task) {
    const int64_t end = std::min(blocks, (task + 1) * kBlocksPerTask);
    for (int64_t b = task * kBlocksPerTask; b < end; ++b) Block(w, columns, out, K, N, b);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JinferCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
