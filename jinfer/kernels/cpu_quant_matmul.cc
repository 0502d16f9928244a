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
// register of floats) side by side. Two arithmetics:
//  - Float products (every format; the default): one load gives the R rows' integers for one
//    input index, and they are widened, scaled into float weights in registers and multiplied by
//    each column's x[k, c] into one running R-row sum per column. Activations and sums stay
//    float32: the dequantized matrix's product.
//  - Integer products (attribute int8_activations; Q8_0 / Q5_0, Q4_0, Q4_1, Q5_1; see "Integer
//    products" below): each column quantized to 8 bits per 32 inputs, as llama.cpp does, and a
//    block's integers multiplied by dot-product instructions, 4 inputs of R rows in one vector.
//
// Operands: blocks uint8 [ceil(M / R), K / group, R x record bytes], x float32 [K, N]
// (row-major); attributes `format` (0 Q8_0 / Q5_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q6_K, 5 Q5_1,
// 6 Q5_K) and `int8_activations` (0 or 1). Result: y float32 [R ceil(M / R), N]. A group of a
// block row (R rows x `group` inputs) holds each field of the records in turn
// (jinfer/models/quantized.py), R side by side: float16 scales first, then bytes, integers input
// index-major (for integer products 4 inputs of a row together instead: bytes 4t..4t+3 of R rows
// side by side, quad after quad, Q8_0 / Q5_0's int8 held as q + 128). 4-bit integers: per 32
// inputs, byte j of a row holds input j in its low nibble and input j + 16 in its high one (ggml's
// order inside a Q4_0 / Q4_1 block).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

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

inline Ints LoadInts(const uint8_t* p) {
  Ints v;
  std::memcpy(&v, p, sizeof v);
  return v;
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

// Block rows [b, b + B) x columns [c0, c0 + n), float products, in one pass over their groups.
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
    } else if constexpr (F == kQ5_1) {
      halves(2 * kRows, m);
      unsigned_bytes(4 * kRows, d, m, xg, kGroup);
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

// ---- Integer products: Q8_0 / Q5_0, Q4_0, Q4_1, Q5_1 with int8_activations ----
//
// Each column is first quantized as llama.cpp quantizes activations for these formats, per
// 32 inputs: d = max |x| / 127 and q = x / d rounded to nearest even (all 0 where d is 0; d NaN where
// an input is not finite, so the product is NaN as a float one would be), with the integers' sum.
// A block's product is then exact integer arithmetic, isum = sum_j (u_j - o) q_j, where u is the
// integer as held (unsigned: Q8_0 / Q5_0 hold q + 128, o = 128; Q4_0's o is 8; 0 for the formats
// with an offset m), and the running float sum of a row and a column takes block after block
//   acc = fma(d_w d, isum, acc)      and then, with m:      acc = fma(m, d sum_j q_j, acc).
// That is the reference these products are exact to (tests/test_quantized.py holds it in numpy);
// the dequantized float product differs from it by the activations' 8-bit rounding.
// Weights multiplied so hold each row's integers 4 inputs together (a quad of bytes per int32
// lane, R rows side by side: models/quantized.py, layout_fields), so one dot-product instruction
// (VNNI's vpdpbusd, or maddubs + madd) adds 4 products to each of R rows; the integers are exact,
// so every instruction set gives the same bits.

// The formats with integer products (models/quantized.py: INTEGER_FORMATS; Q5_0 is held as Q8_0).
constexpr bool HasIntegerProduct(int32_t format) {
  return format == kQ8_0 || format == kQ4_0 || format == kQ4_1 || format == kQ5_1;
}
template <Format F>
constexpr bool kIntegerProduct = HasIntegerProduct(F);
template <Format F>
constexpr bool kHasOffset = F == kQ4_1 || F == kQ5_1;  // w = d q + m
template <Format F>
constexpr int kZeroPoint = F == kQ8_0 ? 128 : F == kQ4_0 ? 8 : 0;  // o above

#if defined(__AVX512F__) ? defined(__AVX512VNNI__) || !defined(__AVX512BW__) \
                         : defined(__AVXVNNI__) || !defined(__AVX2__)
constexpr bool kDotTakesWholeBytes = true;  // vpdpbusd, or the lane by lane loop
#else
constexpr bool kDotTakesWholeBytes = false;  // maddubs: a pair of products must fit int16
#endif

// acc + for each int32 lane the 4 products of u's bytes (unsigned) and x's (signed). Where
// kDotTakesWholeBytes is false, u's bytes must be < 128.
inline Ints Dot4(Ints acc, Ints u, Ints x) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return (Ints)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)x);
#elif defined(__AVX512F__) && defined(__AVX512BW__)
  return acc + (Ints)_mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)u, (__m512i)x), _mm512_set1_epi16(1));
#elif !defined(__AVX512F__) && defined(__AVXVNNI__)
  return (Ints)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, (__m256i)x);
#elif !defined(__AVX512F__) && defined(__AVX2__)
  return acc + (Ints)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)x), _mm256_set1_epi16(1));
#else
  for (int r = 0; r < kRows; ++r)
    for (int k = 0; k < 4; ++k)
      acc[r] += static_cast<int32_t>((static_cast<uint32_t>(u[r]) >> (8 * k)) & 255) *
                static_cast<int8_t>((static_cast<uint32_t>(x[r]) >> (8 * k)) & 255);
  return acc;
#endif
}

// Dot4 for bytes of any value: split into nibbles where the instruction needs them small.
inline Ints Dot4Bytes(Ints acc, Ints u, Ints x) {
  if constexpr (kDotTakesWholeBytes) return Dot4(acc, u, x);
  const Ints low = u & 0x0F0F0F0F, high = (u >> 4) & 0x0F0F0F0F;
  return Dot4(acc, low, x) + (Dot4(Ints{}, high, x) << 4);
}

// The columns quantized as above: q int8 [N, K] (a column's inputs together), and per column and
// block of 32 inputs [N, K / 32] the scale d, the integers' sum and d times that sum.
struct QuantizedColumns {
  std::vector<int8_t> q;
  std::vector<float> d, d_sum;
  std::vector<int32_t> sum;
  int64_t K = 0, groups = 0;
};

// Values rounded to the nearest integer, ties to even (std::nearbyint in the default mode).
inline Rows RoundEven(Rows v) {
#if defined(__AVX512F__)
  return (Rows)_mm512_roundscale_ps((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX__)
  return (Rows)_mm256_round_ps((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  for (int r = 0; r < kRows; ++r) v[r] = std::nearbyint(v[r]);
  return v;
#endif
}

// Block g of columns [c0, c0 + R), a column per lane: the arithmetic of the one-column loop in
// QuantizeColumns, lane by lane (IEEE division and rounding: the same bits).
void QuantizeLanes(const float* x, int64_t N, int64_t c0, int64_t g, QuantizedColumns& out) {
  Rows values[kGroup], largest{};
  Ints infinite{};
  for (int j = 0; j < kGroup; ++j) {
    values[j] = jinfer::Load<Rows>(x + (g * kGroup + j) * N + c0);
    const Rows size = values[j] < 0 ? -values[j] : values[j];
    infinite |= ~(size <= std::numeric_limits<float>::max());  // NaN too
    largest = size > largest ? size : largest;
  }
  const Rows d = infinite != 0 ? Broadcast<Rows>(std::numeric_limits<float>::quiet_NaN()) : largest / 127.0f;
  const Rows divisor = d > 0 ? d : Broadcast<Rows>(1.0f);
  Ints sum{};
  for (int j = 0; j < kGroup; ++j) {
    const Ints q = d > 0 ? __builtin_convertvector(RoundEven(values[j] / divisor), Ints) : Ints{};
    for (int r = 0; r < kRows; ++r) out.q[(c0 + r) * out.K + g * kGroup + j] = static_cast<int8_t>(q[r]);
    sum += q;
  }
  const Rows d_sum = d * __builtin_convertvector(sum, Rows);
  for (int r = 0; r < kRows; ++r) {
    const int64_t at = (c0 + r) * out.groups + g;
    out.d[at] = d[r], out.sum[at] = sum[r], out.d_sum[at] = d_sum[r];
  }
}

void QuantizeColumns(const float* x, int64_t K, int64_t N, QuantizedColumns& out) {
  const int64_t groups = K / kGroup;
  out.K = K, out.groups = groups;
  out.q.resize(N * K), out.d.resize(N * groups), out.d_sum.resize(N * groups), out.sum.resize(N * groups);
  int64_t c = 0;
  for (; c + kRows <= N; c += kRows)
    for (int64_t g = 0; g < groups; ++g) QuantizeLanes(x, N, c, g, out);
  float values[kGroup];
  for (; c < N; ++c)
    for (int64_t g = 0; g < groups; ++g) {
      float largest = 0;
      bool finite = true;
      for (int j = 0; j < kGroup; ++j) {
        values[j] = x[(g * kGroup + j) * N + c];
        finite = finite && std::isfinite(values[j]);
        largest = std::max(largest, std::fabs(values[j]));
      }
      const float d = finite ? largest / 127.0f : std::numeric_limits<float>::quiet_NaN();
      int32_t sum = 0;
      for (int j = 0; j < kGroup; ++j) {
        const int32_t q = d > 0 ? static_cast<int32_t>(std::nearbyint(values[j] / d)) : 0;
        out.q[c * K + g * kGroup + j] = static_cast<int8_t>(q);
        sum += q;
      }
      out.d[c * groups + g] = d, out.sum[c * groups + g] = sum;
      out.d_sum[c * groups + g] = d * static_cast<float>(sum);
    }
}

// Block rows [b, b + B) x columns [c0, c0 + n) of an integer-product format, as Tile does for the
// others (each output one running sum over the blocks in order, whatever the tile).
template <Format F, int n, int B>
inline void IntegerTile(const uint8_t* blocks, const QuantizedColumns& x, float* y, int64_t groups, int64_t N,
                        int64_t b, int64_t c0) {
  constexpr int64_t kQuadBytes = 4 * kRows;  // 4 inputs of R rows
  constexpr int64_t kIntegersAt = (kHasOffset<F> ? 4 : 2) * kRows;
  Rows acc[B][n] = {};
  const uint8_t* group[B];
  for (int64_t g = 0; g < groups; ++g) {
    for (int i = 0; i < B; ++i) {
      group[i] = blocks + ((b + i) * groups + g) * kGroupBytes<F>;
      for (int64_t line = 0; line < kGroupBytes<F>; line += 64)
        __builtin_prefetch(group[i] + kPrefetchBytes + line, 0, 1);
    }
    // inputs [j, j + 4) of column c as one int32 in every lane
    auto inputs = [&](int c, int j) {
      int32_t four;
      std::memcpy(&four, x.q.data() + (c0 + c) * x.K + g * kGroup + j, 4);
      return Ints{} + four;
    };
    Ints sums[B][n] = {};
    if constexpr (F == kQ4_0 || F == kQ4_1) {  // quad t: inputs 4t.. (low nibbles), 16 + 4t.. (high)
      for (int t = 0; t < 4; ++t)
        for (int i = 0; i < B; ++i) {
          const Ints v = LoadInts(group[i] + kIntegersAt + t * kQuadBytes);
          const Ints low = v & 0x0F0F0F0F, high = (v >> 4) & 0x0F0F0F0F;
          for (int c = 0; c < n; ++c)
            sums[i][c] = Dot4(Dot4(sums[i][c], low, inputs(c, 4 * t)), high, inputs(c, 16 + 4 * t));
        }
    } else {  // a byte per input: quad t holds inputs 4t..
      for (int t = 0; t < 8; ++t)
        for (int i = 0; i < B; ++i) {
          const Ints v = LoadInts(group[i] + kIntegersAt + t * kQuadBytes);
          for (int c = 0; c < n; ++c)
            sums[i][c] = F == kQ8_0 ? Dot4Bytes(sums[i][c], v, inputs(c, 4 * t))  // bytes up to 255
                                    : Dot4(sums[i][c], v, inputs(c, 4 * t));
        }
    }
    for (int i = 0; i < B; ++i) {
      const Rows d = Halves(group[i]);
      const Rows m = kHasOffset<F> ? Halves(group[i] + 2 * kRows) : Rows{};
      for (int c = 0; c < n; ++c) {
        const int64_t at = (c0 + c) * x.groups + g;
        const Ints sum = sums[i][c] - kZeroPoint<F> * x.sum[at];
        acc[i][c] = MulAdd(d * Broadcast<Rows>(x.d[at]), __builtin_convertvector(sum, Rows), acc[i][c]);
        if constexpr (kHasOffset<F>) acc[i][c] = MulAdd(m, Broadcast<Rows>(x.d_sum[at]), acc[i][c]);
      }
    }
  }
  for (int i = 0; i < B; ++i)
    for (int c = 0; c < n; ++c)
      for (int r = 0; r < kRows; ++r) y[((b + i) * kRows + r) * N + c0 + c] = acc[i][c][r];
}

// A call's columns: as floats, and quantized where the format's product is an integer one.
struct Columns {
  const float* x;
  const QuantizedColumns* quantized;
};

// Running sums in registers: an integer tile holds the blocks' integer sums too.
template <bool Integer>
constexpr int kPassColumnsOf = Integer ? kPassColumns / 2 : kPassColumns;

// The tile for n = columns, 1 <= columns <= kPassColumnsOf<Integer>: integer or float products.
template <Format F, bool Integer, int B, int n = kPassColumnsOf<Integer>>
void TileOf(int64_t columns, const uint8_t* blocks, const Columns& x, float* y, int64_t groups, int64_t N,
            int64_t b, int64_t c0) {
  static_assert(!Integer || kIntegerProduct<F>, "the K-quants have float products only");
  if constexpr (n > 1)
    if (columns < n) return TileOf<F, Integer, B, n - 1>(columns, blocks, x, y, groups, N, b, c0);
  if constexpr (Integer)
    IntegerTile<F, n, B>(blocks, *x.quantized, y, groups, N, b, c0);
  else
    Tile<F, n, B>(blocks, x.x, y, groups, N, b, c0);
}

// Block rows [b, end) B at a time while B of them remain, every column in passes of
// kPassColumnsOf<Integer>; returns the first block row left.
template <Format F, bool Integer, int B>
int64_t RowsBy(const uint8_t* blocks, const Columns& x, float* y, int64_t groups, int64_t N, int64_t b,
               int64_t end) {
  constexpr int64_t pass = kPassColumnsOf<Integer>;
  for (; b + B <= end; b += B)
    for (int64_t c0 = 0; c0 < N; c0 += pass)
      TileOf<F, Integer, B>(std::min(pass, N - c0), blocks, x, y, groups, N, b, c0);
  return b;
}

template <Format F, bool Integer>
void Run(ffi::ThreadPool& pool, const uint8_t* blocks, const Columns& x, float* y, int64_t rows_blocks,
         int64_t groups, int64_t N) {
  const int64_t tasks = (rows_blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  jinfer::RunTasks(pool, jinfer::PoolCores(pool), tasks, [=](int64_t task) {
    const int64_t end = std::min(rows_blocks, (task + 1) * kBlocksPerTask);
    int64_t b = task * kBlocksPerTask;
    // Block rows taken together: enough sums in flight for one or two columns (4-bit blocks make
    // two dependent products per input pair, so each sum's chain is long). An integer tile's
    // block sums take registers too: fewer block rows with AVX2's 16.
    constexpr bool narrow = Integer && kRows == 8;
    if (N == 1) b = RowsBy<F, Integer, narrow ? 4 : 8>(blocks, x, y, groups, N, b, end);
    if (N <= 2) b = RowsBy<F, Integer, narrow ? 2 : 4>(blocks, x, y, groups, N, b, end);
    RowsBy<F, Integer, 1>(blocks, x, y, groups, N, b, end);
  });
}

// Run<F> with integer products where asked for and F has them, else float ones.
template <Format F>
void RunAs(bool integer, ffi::ThreadPool& pool, const uint8_t* blocks, const Columns& x, float* y,
           int64_t rows_blocks, int64_t groups, int64_t N) {
  if constexpr (kIntegerProduct<F>)
    if (integer) return Run<F, true>(pool, blocks, x, y, rows_blocks, groups, N);
  Run<F, false>(pool, blocks, x, y, rows_blocks, groups, N);
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> blocks, ffi::Buffer<ffi::F32> x,
                  ffi::ResultBuffer<ffi::F32> y, int32_t format, int32_t int8_activations) {
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
  float* out = y->typed_data();
  const bool integer = int8_activations != 0 && HasIntegerProduct(format);
  thread_local QuantizedColumns quantized;  // kept between calls: no allocation per call
  if (integer) QuantizeColumns(x.typed_data(), xd[0], xd[1], quantized);
  const Columns columns{x.typed_data(), &quantized};
  if (format == kQ8_0) RunAs<kQ8_0>(integer, pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ4_0) RunAs<kQ4_0>(integer, pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ4_1) RunAs<kQ4_1>(integer, pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ4_K) RunAs<kQ4_K>(integer, pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ6_K) RunAs<kQ6_K>(integer, pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ5_1) RunAs<kQ5_1>(integer, pool, w, columns, out, bd[0], bd[1], xd[1]);
  if (format == kQ5_K) RunAs<kQ5_K>(integer, pool, w, columns, out, bd[0], bd[1], xd[1]);
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
                                  .Attr<int32_t>("format")
                                  .Attr<int32_t>("int8_activations"));
