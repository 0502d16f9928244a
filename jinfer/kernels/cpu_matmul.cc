// y = W x for a few columns x, with W packed for it, for XLA:CPU.
//
// A decode step multiplies every weight matrix by one column per busy slot. XLA:CPU's products
// run far below the memory bandwidth for 2-8 columns (its GEMM is tuned for many). Here W [M, K]
// is packed once as [ceil(M / R), K, R], R = the floats of one vector register (16 with AVX-512,
// 8 otherwise; `JinferCpuMatmulBlockRows` tells the packer): block b holds rows Rb..Rb+R-1, and
// for each input index k their R weights are one vector. The inner loop loads that vector and
// multiplies it by each column's broadcast x[k, c] into one running R-row sum per column, so the
// weights stream front to back exactly once whatever the column count, and blocks of rows are
// shared over XLA's threads. At 8 columns the multiplies take about as long as the bytes take to
// arrive: the wider the register the fewer multiplies, and a prefetch (below) overlaps the two.
//
// Operands (row-major float32): packed [B, K, R], x [K, N]. Result: y [R B, N] (rows past M are
// the zero padding's products).
#include <algorithm>
#include <cstdint>
#include <string>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A tile's running sums live in vector registers: 24 of AVX-512's 32, 8 of AVX2's 16 (the rest
// hold weights and x).
#ifdef __AVX512F__
constexpr int kRows = 16;
constexpr int kSumRegisters = 24;
#else
constexpr int kRows = 8;
constexpr int kSumRegisters = 8;
#endif
constexpr int kWidestTile = 16;  // columns
constexpr int kSumsInFlight = 8;  // independent sums that keep the FMA units busy: 2 units x 4 cycles
typedef float Rows __attribute__((vector_size(kRows * sizeof(float))));

constexpr int64_t kBlocksPerTask = 64 / kRows;  // 64 rows: small enough to balance, big enough to stream

// Weights are read kPrefetchAhead input indices (16 KB with AVX-512) before use. At 8 columns the
// multiplies take about as long as the bytes take to arrive, and without this the two did not
// overlap: a core's misses to memory waited on its own line fill buffers while the multiplies ran
// (SmolLM2's 8-slot decode step 47-53 ms without, 30-32 ms with; one slot level). A prefetch into
// L2 (not L1, whose fill buffers are the limit) far enough ahead keeps memory busy meanwhile.
constexpr int64_t kPrefetchAhead = 256;

// Blocks [b, b + B) x columns [c0, c0 + n), in one pass over their weights. Each x[k, c] loaded
// is multiplied into B blocks' rows: with one block the loads of x (one per column and k)
// outnumber its multiplies, and the load ports set the pace once the weights come from cache.
// Fewer than kSumsInFlight sums leave the FMA units idle, so for few columns the k loop is also
// unrolled U ways with separate sums.
template <int n, int B>
inline void Tile(const float* packed, const float* x, float* y, int64_t K, int64_t N, int64_t b,
                 int64_t c0) {
  static_assert(B * n <= kSumRegisters);
  constexpr int U =
      std::max(1, std::min((kSumsInFlight + B * n - 1) / (B * n), kSumRegisters / (B * n)));
  Rows acc[U][B][n] = {};
  const float* w = packed + b * K * kRows;
  const float* xc = x + c0;
  // Input index k into the u-th set of sums. Each x[k, c] is used by every block as soon as it is
  // loaded: holding all n at once took n more registers (GCC spilled sums at 12 columns).
  auto step = [&](int64_t k, int u) {
    Rows wv[B];
    for (int i = 0; i < B; ++i) {
      const float* wk = w + (i * K + k) * kRows;
      __builtin_prefetch(wk + kPrefetchAhead * kRows, 0, 1);  // toward L2
      wv[i] = jinfer::Load<Rows>(wk);
    }
    for (int c = 0; c < n; ++c) {
      const float xkc = xc[k * N + c];
      for (int i = 0; i < B; ++i) acc[u][i][c] += wv[i] * xkc;
    }
  };
  int64_t k = 0;
  for (; k + U <= K; k += U)
    for (int u = 0; u < U; ++u) step(k + u, u);
  for (; k < K; ++k) step(k, 0);
  for (int i = 0; i < B; ++i)
    for (int c = 0; c < n; ++c) {
      Rows sum = acc[0][i][c];
      for (int u = 1; u < U; ++u) sum += acc[u][i][c];
      for (int r = 0; r < kRows; ++r) y[((b + i) * kRows + r) * N + c0 + c] = sum[r];
    }
}

// Columns one pass multiplies into B blocks: with AVX-512 12 for two blocks, 16 for one.
template <int B>
constexpr int kPassColumns = std::min(kWidestTile, kSumRegisters / B);

// Tile<n, B> for n = columns, 1 <= columns <= n.
template <int B, int n = kPassColumns<B>>
void TileOf(int64_t columns, const float* packed, const float* x, float* y, int64_t K, int64_t N,
            int64_t b, int64_t c0) {
  if constexpr (n > 1)
    if (columns < n) return TileOf<B, n - 1>(columns, packed, x, y, K, N, b, c0);
  Tile<n, B>(packed, x, y, K, N, b, c0);
}

// Blocks [b, b + B) against every column, kPassColumns<B> at a time. Columns taken in one pass
// stream the weights from memory once; a second pass reads them again from cache at the pace of
// its loads. SmolLM2's products in one pass against two of 8 columns, alternating runs: 12 columns
// 24-29 ms against 31-32, 16 columns 30-33 against 35-40; its decode step at 16 slots 45-50 ms
// against 52-59, level at 8.
template <int B>
void Blocks(const float* packed, const float* x, float* y, int64_t K, int64_t N, int64_t b) {
  for (int64_t c0 = 0; c0 < N; c0 += kPassColumns<B>)
    TileOf<B>(std::min<int64_t>(kPassColumns<B>, N - c0), packed, x, y, K, N, b, c0);
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> packed, ffi::Buffer<ffi::F32> x,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto pd = packed.dimensions(), xd = x.dimensions(), yd = y->dimensions();
  if (pd.size() != 3 || pd[2] != kRows || xd.size() != 2 || xd[0] != pd[1] ||
      yd[0] != kRows * pd[0] || yd[1] != xd[1])
    return ffi::Error::InvalidArgument("jinfer cpu matmul: packed [B, K, " + std::to_string(kRows) +
                                       "], x [K, N] and y [" + std::to_string(kRows) +
                                       " B, N] expected");
  const float* w = packed.typed_data();
  const float* columns = x.typed_data();
  float* out = y->typed_data();
  const int64_t blocks = pd[0], K = pd[1], N = xd[1];
  const int64_t tasks = (blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  jinfer::RunTasks(pool, jinfer::PoolCores(pool), tasks, [=](int64_t task) {
    const int64_t end = std::min(blocks, (task + 1) * kBlocksPerTask);
    int64_t b = task * kBlocksPerTask;
    if (N <= kPassColumns<2>)  // every column in one pass of two blocks: take blocks in pairs
      for (; b + 2 <= end; b += 2) Blocks<2>(w, columns, out, K, N, b);
    for (; b < end; ++b) Blocks<1>(w, columns, out, K, N, b);
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int JinferCpuMatmulBlockRows() { return kRows; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JinferCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
