// y = W x for a few columns x, with W held as quantized blocks, for XLA:CPU.
//
// The weights of a quantized GGUF stay in memory as their blocks, so a decode step reads 4.5-8.5
// bits per weight instead of 32. Each block of 32 inputs of one row has float16 scale d (and, for
// Q4_1, a float16 offset m) and 32 small integers q: Q8_0 w = d q (q int8), Q4_0 w = d (q - 8),
// Q4_1 w = d q + m (q 4 bits). The blocks are regrouped as the float kernel (cpu_matmul.cc) packs
// its rows: R rows (one vector register of floats) side by side, so one load gives the R rows'
// integers for one input index, and they are widened, scaled into float weights in registers and
// multiplied by each column's x[k, c] into one running R-row sum per column. The bits are the
// file's bits, only reordered; activations and sums stay float32.
//
// Operands: blocks uint8 [ceil(M / R), K / 32, group bytes], x float32 [K, N] (row-major);
// attribute `format` (0 Q8_0, 1 Q4_0, 2 Q4_1). Result: y float32 [R ceil(M / R), N]. One group of
// a block row (R rows x 32 inputs) is: R float16 scales, for Q4_1 R float16 offsets, then the
// integers, input index-major: Q8_0 32 x R int8; Q4 16 x R bytes, byte j of a row holding input j
// in its low nibble and input j + 16 in its high one (ggml's own order inside a block).
#include <algorithm>
#include <cstdint>
#include <string>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#ifdef __AVX512F__
constexpr int kRows = 16;
constexpr int kPassColumns = 16;  // running sums in registers: 16 of 32, the rest decode weights
#else
constexpr int kRows = 8;
constexpr int kPassColumns = 8;  // 8 of AVX2's 16 registers
#endif
typedef float Rows __attribute__((vector_size(kRows * sizeof(float))));
typedef int32_t Ints __attribute__((vector_size(kRows * sizeof(int32_t))));

constexpr int kGroup = 32;        // inputs per block
constexpr int kSumsInFlight = 8;  // independent sums that keep the FMA units busy: 2 units x 4 cycles
constexpr int64_t kBlocksPerTask = 64 / kRows;
constexpr int64_t kPrefetchBytes = 4096;  // read ahead toward L2, as the float kernel does

enum Format : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

template <Format F>
constexpr int kHeaderBytes = (F == kQ4_1 ? 4 : 2) * kRows;  // float16 scales (and offsets)
template <Format F>
constexpr int kIndices = F == kQ8_0 ? kGroup : kGroup / 2;  // rows of R bytes after the header
template <Format F>
constexpr int64_t kGroupBytes = kHeaderBytes<F> + kIndices<F> * kRows;

// R consecutive bytes, widened to R int32 lanes (zero- or sign-extended), and R float16 -> float.
inline Ints WidenUnsigned(const uint8_t* p) {
#if defined(__AVX512F__)
  return (Ints)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
  return (Ints)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#else
  Ints v;
  for (int r = 0; r < kRows; ++r) v[r] = p[r];
  return v;
#endif
}

inline Ints WidenSigned(const uint8_t* p) {
#if defined(__AVX512F__)
  return (Ints)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
  return (Ints)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
#else
  Ints v;
  for (int r = 0; r < kRows; ++r) v[r] = static_cast<int8_t>(p[r]);
  return v;
#endif
}

inline Rows Halves(const uint8_t* p) {
#if defined(__AVX512F__)
  return (Rows)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__)
  return (Rows)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  Rows v;
  for (int r = 0; r < kRows; ++r) {
    _Float16 h;
    std::memcpy(&h, p + 2 * r, 2);
    v[r] = h;
  }
  return v;
#endif
}

// Block row b x columns [c0, c0 + n), in one pass over its groups. With few columns the sums are
// split U ways over input indices so that kSumsInFlight of them are in flight.
template <Format F, int n>
inline void Tile(const uint8_t* blocks, const float* x, float* y, int64_t groups, int64_t N, int64_t b,
                 int64_t c0) {
  constexpr int U = std::max(1, kSumsInFlight / n);
  static_assert(kIndices<F> % U == 0);
  Rows acc[U][n] = {};
  const uint8_t* row = blocks + b * groups * kGroupBytes<F>;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = row + g * kGroupBytes<F>;
    for (int64_t line = 0; line < kGroupBytes<F>; line += 64) __builtin_prefetch(group + kPrefetchBytes + line, 0, 1);
    const Rows d = Halves(group);
    const Rows m = F == kQ4_1 ? Halves(group + 2 * kRows) : d * -8.0f;  // Q4_0: d (q - 8)
    const uint8_t* q = group + kHeaderBytes<F>;
    const float* xg = x + g * kGroup * N + c0;
    auto step = [&](int j, int u) {
      if constexpr (F == kQ8_0) {
        const Rows w = __builtin_convertvector(WidenSigned(q + j * kRows), Rows) * d;
        for (int c = 0; c < n; ++c) acc[u][c] += w * xg[j * N + c];
      } else {
        const Ints v = WidenUnsigned(q + j * kRows);
        const Rows low = __builtin_convertvector(v & 15, Rows) * d + m;
        const Rows high = __builtin_convertvector(v >> 4, Rows) * d + m;
        for (int c = 0; c < n; ++c) {
          acc[u][c] += low * xg[j * N + c];
          acc[u][c] += high * xg[(j + kGroup / 2) * N + c];
        }
      }
    };
    for (int j = 0; j < kIndices<F>; j += U)
      for (int u = 0; u < U; ++u) step(j + u, u);
  }
  for (int c = 0; c < n; ++c) {
    Rows sum = acc[0][c];
    for (int u = 1; u < U; ++u) sum += acc[u][c];
    for (int r = 0; r < kRows; ++r) y[(b * kRows + r) * N + c0 + c] = sum[r];
  }
}

// Tile<F, n> for n = columns, 1 <= columns <= kPassColumns.
template <Format F, int n = kPassColumns>
void TileOf(int64_t columns, const uint8_t* blocks, const float* x, float* y, int64_t groups, int64_t N,
            int64_t b, int64_t c0) {
  if constexpr (n > 1)
    if (columns < n) return TileOf<F, n - 1>(columns, blocks, x, y, groups, N, b, c0);
  Tile<F, n>(blocks, x, y, groups, N, b, c0);
}

template <Format F>
void Run(ffi::ThreadPool& pool, const uint8_t* blocks, const float* x, float* y, int64_t rows_blocks,
         int64_t groups, int64_t N) {
  const int64_t tasks = (rows_blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  jinfer::RunTasks(pool, jinfer::PoolCores(pool), tasks, [=](int64_t task) {
    for (int64_t b = task * kBlocksPerTask; b < std::min(rows_blocks, (task + 1) * kBlocksPerTask); ++b)
      for (int64_t c0 = 0; c0 < N; c0 += kPassColumns)
        TileOf<F>(std::min<int64_t>(kPassColumns, N - c0), blocks, x, y, groups, N, b, c0);
  });
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> blocks, ffi::Buffer<ffi::F32> x,
                  ffi::ResultBuffer<ffi::F32> y, int32_t format) {
  const auto bd = blocks.dimensions(), xd = x.dimensions(), yd = y->dimensions();
  const int64_t group_bytes[] = {kGroupBytes<kQ8_0>, kGroupBytes<kQ4_0>, kGroupBytes<kQ4_1>};
  if (format < 0 || format > 2)
    return ffi::Error::InvalidArgument("jinfer cpu quantized matmul: unknown format " + std::to_string(format));
  if (bd.size() != 3 || bd[2] != group_bytes[format] || xd.size() != 2 || xd[0] != kGroup * bd[1] ||
      yd[0] != kRows * bd[0] || yd[1] != xd[1])
    return ffi::Error::InvalidArgument(
        "jinfer cpu quantized matmul: blocks [B, K / 32, " + std::to_string(group_bytes[format]) +
        "], x [K, N] and y [" + std::to_string(kRows) + " B, N] expected");
  const uint8_t* w = blocks.typed_data();
  const float* columns = x.typed_data();
  float* out = y->typed_data();
  if (format == kQ8_0) Run<kQ8_0>(pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ4_0) Run<kQ4_0>(pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ4_1) Run<kQ4_1>(pool, w, columns, out, bd[0], bd[1], xd[1]);
  return ffi::Error::Success();
}

}  // namespace

extern "C" int JinferCpuQuantMatmulBlockRows() { return kRows; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JinferCpuQuantMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("format"));
