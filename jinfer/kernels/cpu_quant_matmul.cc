// y = W x for a few columns x, with W held as quantized blocks, for XLA:CPU.
//
// The weights of a quantized GGUF stay in memory as their blocks, so a decode step reads 4.5-8.5
// bits per weight instead of 32. A block of one row has float16 scales and small integers q:
//   Q8_0  32 inputs: d, q int8                                   w = d q
//   Q4_0  32 inputs: d, q 4 bits                                 w = d (q - 8)
//   Q4_1  32 inputs: d, m, q 4 bits                              w = d q + m
//   Q4_K  256 inputs: d, dmin; per 32 sc, m (bytes), q 4 bits    w = d sc q - dmin m
//   Q6_K  256 inputs: d; per 16 sc int8, q int8 (6 bits - 32)    w = d sc q
//   Q5_0 is held as Q8_0 (q - 16 as int8); Q5_1 and Q5_K as Q4_1 and Q4_K with a byte per q.
// The blocks are regrouped as the float kernel (cpu_matmul.cc) packs its rows: R rows (one vector
// register of floats) side by side, so one load gives the R rows' integers for one input index,
// and they are widened, scaled into float weights in registers and multiplied by each column's
// x[k, c] into one running R-row sum per column. Activations and sums stay float32.
//
// Operands: blocks uint8 [ceil(M / R), K / group, R x record bytes], x float32 [K, N]
// (row-major); attribute `format` (0 Q8_0 / Q5_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q6_K, 5 Q5_1,
// 6 Q5_K). Result: y float32 [R ceil(M / R), N]. A group of a block row (R rows x `group` inputs)
// holds each field of the records in turn (jinfer/models/quantized.py), R side by side: float16
// scales first, then bytes, integers input index-major. 4-bit integers: per 32 inputs, byte j of a row holds input j in its
// low nibble and input j + 16 in its high one (ggml's order inside a Q4_0 / Q4_1 block).
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

enum Format : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ6_K = 4, kQ5_1 = 5, kQ5_K = 6 };

template <Format F>
constexpr int kInputs = F == kQ4_K || F == kQ6_K || F == kQ5_K ? 256 : kGroup;  // inputs per group
template <Format F>  // bytes of one row's record (models/quantized.py: FORMATS)
constexpr int kRecordBytes = F == kQ8_0   ? 34
                             : F == kQ4_0 ? 18
                             : F == kQ4_1 ? 20
                             : F == kQ4_K ? 148
                             : F == kQ6_K ? 274
                             : F == kQ5_1 ? 36
                                          : 276;
template <Format F>
constexpr int64_t kGroupBytes = int64_t{kRecordBytes<F>} * kRows;

// R consecutive bytes, widened to R int32 lanes (sign-extended as int8 or zero-extended), and R
// float16 -> float.
template <bool Signed>
inline Ints Widen(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128((const __m128i*)p);
  return (Ints)(Signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64((const __m128i*)p);
  return (Ints)(Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
  Ints v;
  for (int r = 0; r < kRows; ++r) v[r] = Signed ? static_cast<int8_t>(p[r]) : p[r];
  return v;
#endif
}
inline Ints WidenSigned(const uint8_t* p) { return Widen<true>(p); }
inline Ints WidenUnsigned(const uint8_t* p) { return Widen<false>(p); }

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
  static_assert(16 % U == 0);
  Rows acc[U][n] = {};
  // `inputs` int8 rows of R integers at q, times scale d, against x rows xg.
  auto bytes = [&](const uint8_t* q, Rows d, const float* xg, int inputs) {
    for (int j = 0; j < inputs; j += U)
      for (int u = 0; u < U; ++u) {
        const Rows w = __builtin_convertvector(WidenSigned(q + (j + u) * kRows), Rows) * d;
        for (int c = 0; c < n; ++c) acc[u][c] += w * xg[(j + u) * N + c];
      }
  };
  // `inputs` uint8 rows of R integers at q: w = d q + m.
  auto unsigned_bytes = [&](const uint8_t* q, Rows d, Rows m, const float* xg, int inputs) {
    for (int j = 0; j < inputs; j += U)
      for (int u = 0; u < U; ++u) {
        const Rows w = __builtin_convertvector(WidenUnsigned(q + (j + u) * kRows), Rows) * d + m;
        for (int c = 0; c < n; ++c) acc[u][c] += w * xg[(j + u) * N + c];
      }
  };
  // 32 inputs of 4-bit integers at q (16 rows of R bytes): w = d q + m.
  auto nibbles = [&](const uint8_t* q, Rows d, Rows m, const float* xg) {
    for (int j = 0; j < kGroup / 2; j += U)
      for (int u = 0; u < U; ++u) {
        const Ints v = WidenUnsigned(q + (j + u) * kRows);
        const Rows low = __builtin_convertvector(v & 15, Rows) * d + m;
        const Rows high = __builtin_convertvector(v >> 4, Rows) * d + m;
        for (int c = 0; c < n; ++c) {
          acc[u][c] += low * xg[(j + u) * N + c];
          acc[u][c] += high * xg[(j + u + kGroup / 2) * N + c];
        }
      }
  };
  const uint8_t* row = blocks + b * groups * kGroupBytes<F>;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = row + g * kGroupBytes<F>;
    for (int64_t line = 0; line < kGroupBytes<F>; line += 64) __builtin_prefetch(group + kPrefetchBytes + line, 0, 1);
    const float* xg = x + g * kInputs<F> * N + c0;
    const Rows d = Halves(group);
    if constexpr (F == kQ8_0) {
      bytes(group + 2 * kRows, d, xg, kGroup);
    } else if constexpr (F == kQ4_0) {
      nibbles(group + 2 * kRows, d, d * -8.0f, xg);
    } else if constexpr (F == kQ4_1) {
      nibbles(group + 4 * kRows, d, Halves(group + 2 * kRows), xg);
    } else if constexpr (F == kQ4_K) {  // d, dmin, sc[8], m[8], then 8 x 32 inputs of nibbles
      const Rows dmin = Halves(group + 2 * kRows);
      for (int s = 0; s < 8; ++s) {
        const Rows scale = d * __builtin_convertvector(WidenUnsigned(group + (4 + s) * kRows), Rows);
        const Rows offset = dmin * __builtin_convertvector(WidenUnsigned(group + (12 + s) * kRows), Rows);
        nibbles(group + (20 + 16 * s) * kRows, scale, -offset, xg + kGroup * s * N);
      }
    } else if constexpr (F == kQ5_1) {
      unsigned_bytes(group + 4 * kRows, d, Halves(group + 2 * kRows), xg, kGroup);
    } else if constexpr (F == kQ5_K) {  // as Q4_K, with 8 x 32 inputs of bytes
      const Rows dmin = Halves(group + 2 * kRows);
      for (int s = 0; s < 8; ++s) {
        const Rows scale = d * __builtin_convertvector(WidenUnsigned(group + (4 + s) * kRows), Rows);
        const Rows offset = dmin * __builtin_convertvector(WidenUnsigned(group + (12 + s) * kRows), Rows);
        unsigned_bytes(group + (20 + 32 * s) * kRows, scale, -offset, xg + kGroup * s * N, kGroup);
      }
    } else {  // Q6_K: d, sc[16] int8, then 16 x 16 inputs of int8
      for (int s = 0; s < 16; ++s) {
        const Rows scale = d * __builtin_convertvector(WidenSigned(group + (2 + s) * kRows), Rows);
        bytes(group + (18 + 16 * s) * kRows, scale, xg + 16 * s * N, 16);
      }
    }
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
  const int64_t group_bytes[] = {kGroupBytes<kQ8_0>, kGroupBytes<kQ4_0>, kGroupBytes<kQ4_1>, kGroupBytes<kQ4_K>,
                                 kGroupBytes<kQ6_K>, kGroupBytes<kQ5_1>, kGroupBytes<kQ5_K>};
  const int64_t inputs[] = {kInputs<kQ8_0>, kInputs<kQ4_0>, kInputs<kQ4_1>, kInputs<kQ4_K>,
                            kInputs<kQ6_K>, kInputs<kQ5_1>, kInputs<kQ5_K>};
  if (format < 0 || format > 6)
    return ffi::Error::InvalidArgument("jinfer cpu quantized matmul: unknown format " + std::to_string(format));
  if (bd.size() != 3 || bd[2] != group_bytes[format] || xd.size() != 2 || xd[0] != inputs[format] * bd[1] ||
      yd[0] != kRows * bd[0] || yd[1] != xd[1])
    return ffi::Error::InvalidArgument(
        "jinfer cpu quantized matmul: blocks [B, K / " + std::to_string(inputs[format]) + ", " +
        std::to_string(group_bytes[format]) +
        "], x [K, N] and y [" + std::to_string(kRows) + " B, N] expected");
  const uint8_t* w = blocks.typed_data();
  const float* columns = x.typed_data();
  float* out = y->typed_data();
  if (format == kQ8_0) Run<kQ8_0>(pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ4_0) Run<kQ4_0>(pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ4_1) Run<kQ4_1>(pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ4_K) Run<kQ4_K>(pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ6_K) Run<kQ6_K>(pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ5_1) Run<kQ5_1>(pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ5_K) Run<kQ5_K>(pool, w, columns, out, bd[0], bd[1], xd[1]);
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
