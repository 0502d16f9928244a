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

using jinfer::Broadcast;
using jinfer::MulAdd;

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
constexpr int64_t kBlocksPerTask = 128 / kRows;  // a whole number of the widest group of block rows
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

// Block rows [b, b + B) x columns [c0, c0 + n), in one pass over their groups.
//
// Every output is one running sum over the inputs in a fixed order (a block's inputs in turn;
// for 4-bit blocks input j, then j + 16), whatever the tile: a column's products are the same
// bits whether it is multiplied alone or beside 31 others (a slot's tokens never depend on its
// neighbours; a speculative verify step's k + 1 positions per row give what k + 1 one-column
// decode steps give). The sums in flight that keep the FMA units busy therefore come from more
// block rows (B), never from splitting the inputs.
template <Format F, int n, int B>
inline void Tile(const uint8_t* blocks, const float* x, float* y, int64_t groups, int64_t N, int64_t b,
                 int64_t c0) {
  Rows acc[B][n] = {};
  const uint8_t* group[B];  // each block row's current group
  // `inputs` int8 rows of R integers at offset q of each group, times scale d, against x rows xg.
  auto bytes = [&](int64_t q, const Rows* d, const float* xg, int inputs) {
    for (int j = 0; j < inputs; ++j)
      for (int i = 0; i < B; ++i) {
        const Rows w = __builtin_convertvector(WidenSigned(group[i] + q + j * kRows), Rows) * d[i];
        for (int c = 0; c < n; ++c) acc[i][c] = MulAdd(w, Broadcast<Rows>(xg[j * N + c]), acc[i][c]);
      }
  };
  // `inputs` uint8 rows of R integers at offset q: w = d q + m.
  auto unsigned_bytes = [&](int64_t q, const Rows* d, const Rows* m, const float* xg, int inputs) {
    for (int j = 0; j < inputs; ++j)
      for (int i = 0; i < B; ++i) {
        const Rows w = MulAdd(__builtin_convertvector(WidenUnsigned(group[i] + q + j * kRows), Rows), d[i], m[i]);
        for (int c = 0; c < n; ++c) acc[i][c] = MulAdd(w, Broadcast<Rows>(xg[j * N + c]), acc[i][c]);
      }
  };
  // 32 inputs of 4-bit integers at offset q (16 rows of R bytes): w = d q + m.
  auto nibbles = [&](int64_t q, const Rows* d, const Rows* m, const float* xg) {
    for (int j = 0; j < kGroup / 2; ++j)
      for (int i = 0; i < B; ++i) {
        const Ints v = WidenUnsigned(group[i] + q + j * kRows);
        const Rows low = MulAdd(__builtin_convertvector(v & 15, Rows), d[i], m[i]);
        const Rows high = MulAdd(__builtin_convertvector(v >> 4, Rows), d[i], m[i]);
        for (int c = 0; c < n; ++c) {
          acc[i][c] = MulAdd(low, Broadcast<Rows>(xg[j * N + c]), acc[i][c]);
          acc[i][c] = MulAdd(high, Broadcast<Rows>(xg[(j + kGroup / 2) * N + c]), acc[i][c]);
        }
      }
  };
  // Per block row: a float16 field at offset `at`; a byte field scaled (d * byte).
  auto halves = [&](int64_t at, Rows* out) {
    for (int i = 0; i < B; ++i) out[i] = Halves(group[i] + at);
  };
  auto scaled = [&](const Rows* d, int64_t at, Rows* out, bool is_signed) {
    for (int i = 0; i < B; ++i) {
      const Ints v = is_signed ? WidenSigned(group[i] + at) : WidenUnsigned(group[i] + at);
      out[i] = d[i] * __builtin_convertvector(v, Rows);
    }
  };
  for (int64_t g = 0; g < groups; ++g) {
    for (int i = 0; i < B; ++i) {
      group[i] = blocks + ((b + i) * groups + g) * kGroupBytes<F>;
      for (int64_t line = 0; line < kGroupBytes<F>; line += 64)
        __builtin_prefetch(group[i] + kPrefetchBytes + line, 0, 1);
    }
    const float* xg = x + g * kInputs<F> * N + c0;
    Rows d[B], m[B];
    halves(0, d);
    if constexpr (F == kQ8_0) {
      bytes(2 * kRows, d, xg, kGroup);
    } else if constexpr (F == kQ4_0) {
      for (int i = 0; i < B; ++i) m[i] = d[i] * -8.0f;
      nibbles(2 * kRows, d, m, xg);
    } else if constexpr (F == kQ4_1) {
      halves(2 * kRows, m);
      nibbles(4 * kRows, d, m, xg);
    } else if constexpr (F == kQ4_K || F == kQ5_K) {  // d, dmin, sc[8], m[8], then 8 x 32 inputs
      Rows dmin[B], scale[B], offset[B];
      halves(2 * kRows, dmin);
      for (int s = 0; s < 8; ++s) {
        scaled(d, (4 + s) * kRows, scale, false);
        scaled(dmin, (12 + s) * kRows, offset, false);
        for (int i = 0; i < B; ++i) offset[i] = -offset[i];
        if constexpr (F == kQ4_K)  // nibbles
          nibbles((20 + 16 * s) * kRows, scale, offset, xg + kGroup * s * N);
        else  // a byte per input
          unsigned_bytes((20 + 32 * s) * kRows, scale, offset, xg + kGroup * s * N, kGroup);
      }
    } else if constexpr (F == kQ5_1) {
      halves(2 * kRows, m);
      unsigned_bytes(4 * kRows, d, m, xg, kGroup);
    } else {  // Q6_K: d, sc[16] int8, then 16 x 16 inputs of int8
      Rows scale[B];
      for (int s = 0; s < 16; ++s) {
        scaled(d, (2 + s) * kRows, scale, true);
        bytes((18 + 16 * s) * kRows, scale, xg + 16 * s * N, 16);
      }
    }
  }
  for (int i = 0; i < B; ++i)
    for (int c = 0; c < n; ++c)
      for (int r = 0; r < kRows; ++r) y[((b + i) * kRows + r) * N + c0 + c] = acc[i][c][r];
}

// Tile<F, n, B> for n = columns, 1 <= columns <= kPassColumns.
template <Format F, int B, int n = kPassColumns>
void TileOf(int64_t columns, const uint8_t* blocks, const float* x, float* y, int64_t groups, int64_t N,
            int64_t b, int64_t c0) {
  if constexpr (n > 1)
    if (columns < n) return TileOf<F, B, n - 1>(columns, blocks, x, y, groups, N, b, c0);
  Tile<F, n, B>(blocks, x, y, groups, N, b, c0);
}

// Block rows [b, end) B at a time while B of them remain, every column in passes of
// kPassColumns; returns the first block row left.
template <Format F, int B>
int64_t RowsBy(const uint8_t* blocks, const float* x, float* y, int64_t groups, int64_t N, int64_t b,
               int64_t end) {
  for (; b + B <= end; b += B)
    for (int64_t c0 = 0; c0 < N; c0 += kPassColumns)
      TileOf<F, B>(std::min<int64_t>(kPassColumns, N - c0), blocks, x, y, groups, N, b, c0);
  return b;
}

template <Format F>
void Run(ffi::ThreadPool& pool, const uint8_t* blocks, const float* x, float* y, int64_t rows_blocks,
         int64_t groups, int64_t N) {
  const int64_t tasks = (rows_blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  jinfer::RunTasks(pool, jinfer::PoolCores(pool), tasks, [=](int64_t task) {
    const int64_t end = std::min(rows_blocks, (task + 1) * kBlocksPerTask);
    int64_t b = task * kBlocksPerTask;
    // Block rows taken together: enough sums in flight for one or two columns (4-bit blocks make
    // two dependent products per input pair, so each sum's chain is long).
    if (N == 1) b = RowsBy<F, 8>(blocks, x, y, groups, N, b, end);
    if (N <= 2) b = RowsBy<F, 4>(blocks, x, y, groups, N, b, end);
    RowsBy<F, 1>(blocks, x, y, groups, N, b, end);
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
