// Attention of query tokens (one when decoding, a few when verifying, a prompt piece when
// prefilling) per sequence over that sequence's filled keys in the paged KV cache, for XLA:CPU.
//
// A decode step on a CPU spent most of its time, at long contexts, on attention: XLA's einsums
// read a fixed bucket of each row (gathering it out of the cache first) through small batched
// products. This kernel reads each sequence's pages in place, only the keys its queries can see,
// once: per (sequence, kv head) it streams blocks of keys and values (never crossing a page)
// through L1 with an online softmax, and XLA's own CPU threads share the (sequences, kv head, key
// range) tasks. Sequences whose keys in a range lie on the same pages (a cached prefix they
// share) go through it in one task, so that a block read from memory serves all of their queries:
// 32 decode rows over one long prefix read it once, not 32 times.
//
// Operands (all row-major, float32 except the int32 indices):
//   q         [B, K, G, T, H]  queries grouped by kv head (T tokens per sequence: 1 when decoding)
//   pool_k/v  [K, P, S, H]     the layer's pages of S positions each
//   tables    [B, M]           batch entry b's pages in order: position p is at page tables[b, p / S],
//                              offset p % S
//   positions [B, T]           each query's position: it sees keys s <= position, and with a
//                              sliding window only position - s < window; a negative position
//                              sees nothing (its output is zero)
// Result: out [B, K, G, T, H]. Attributes: window (0: none), scale (applied to q . k).
//
// A query's output is the same bits whatever else is in the call (other sequences, other query
// tokens of its own sequence: a speculative verify step's k + 1 positions give what k + 1
// one-token decode steps give): keys are cut into splits and blocks on one fixed grid of
// positions (splits of kSplitKeys from position 0, blocks at multiples of kBlock and page ends),
// each query adds up the blocks it sees in order, and the splits are merged in order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jinfer::Broadcast;
using jinfer::f8;
using jinfer::i8;
using jinfer::Load;
using jinfer::MulAdd;
using jinfer::Splat;
using jinfer::Store;
using jinfer::Sum;

constexpr int64_t kBlock = 32;  // keys per block: a block of K and V rows stays in L1 across queries
constexpr int64_t kPrefetchKeys = 2 * kBlock;  // how far ahead key and value rows are prefetched
// (row, kv head, query token, key) quadruples: below, one thread. A verify step's k + 1 query
// tokens per row multiply the work over the same keys.
constexpr int64_t kKeysPerHelper = 2048;
// Keys per split (a multiple of kBlock): splits let helper threads share one long row, and each
// split's partial sums cost a merge.
constexpr int64_t kSplitKeys = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The widest vector of floats the CPU multiplies in one instruction. Each lane of an output's
// sums is its own chain of multiply-adds, so the width never changes a bit of the result.
#ifdef __AVX512F__
typedef float f16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
using Wide = f16;
using WideInt = i16;
#else
using Wide = f8;
using WideInt = i8;
#endif
constexpr int64_t kWideLanes = sizeof(Wide) / sizeof(float);

// exp(x) in each lane of F (I: as many int32 lanes): Cephes' expf, x = n ln2 + r, a degree-6
// polynomial in r, 2^n through the exponent bits; relative error ~2e-7. Lanes at -inf give 0.
// Every lane the same operations, whatever the width.
template <typename F, typename I>
inline F Exp(F x) {
  const F input = x;
  const F zero{}, low = zero - 87.3f, high = zero + 88.3f;
  x = x < low ? low : x;
  x = x > high ? high : x;
  const F t = x * 1.44269504088896341f + 0.5f;
  I n = __builtin_convertvector(t, I);
  n += __builtin_convertvector(n, F) > t;  // truncation -> floor (a true lane is -1)
  const F nf = __builtin_convertvector(n, F);
  const F r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  F p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (n + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return input == zero + kNegInf ? zero : p * scale;
}

struct Dims {
  int64_t batch, kv_heads, groups, tokens, head_dim, pages, page_size, max_pages;
  int64_t queries() const { return groups * tokens; }
  int64_t seq() const { return max_pages * page_size; }  // positions a block table reaches
};

// One (sequence, kv head)'s key or value rows: where position j lies in the pool.
struct Rows {
  const float* head;  // the head's pages, [P, S, H]
  const int32_t* table;  // [M]
  int64_t page_size, head_dim;
  const float* At(int64_t j) const {
    return head + (table[j / page_size] * page_size + j % page_size) * head_dim;
  }
  int64_t PageEnd(int64_t j) const { return (j / page_size + 1) * page_size; }
};

// The 8 sums of a[0..7]'s lanes, in order: three rounds of pairwise shuffle-and-add instead of 8
// separate horizontal sums.
inline f8 Sums8(const f8* a) {
  f8 b[4], c[2];
  for (int i = 0; i < 4; ++i)  // lanes: 4 partial sums of a[2i], then 4 of a[2i + 1]
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // 2 partial sums each: c[0] a0 a0 a2 a2 a1 a1 a3 a3, c[1] a4 .. a7
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  // d's lanes: a0 a4 a2 a6 a1 a5 a3 a7
  const f8 d = __builtin_shufflevector(c[0], c[1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(c[0], c[1], 1, 9, 3, 11, 5, 13, 7, 15);
  return __builtin_shufflevector(d, d, 0, 4, 2, 6, 1, 5, 3, 7);
}

// Queries that see the same keys of a block (the heads of one kv head's group, and of the tokens
// after it in a prompt piece) go through it together, so that each key and value row loaded
// serves all of them: AVX-512's 32 registers hold six queries' sums (24, two keys' or 16 lanes
// a register) beside the row and the six queries; AVX2's 16 hold one query's.
#ifdef __AVX512F__
constexpr int kQueriesTogether = 6;
#else
constexpr int kQueriesTogether = 1;
#endif

#ifdef __AVX512F__
// Sums8 of a[0..7] held in pairs, z[m] = (a[2m], a[2m + 1]): the same three rounds of additions,
// two of them at a time.
inline f8 Sums8Paired(const __m512* z) {
  auto pick = [](__m512 x, __m512 y, std::initializer_list<int> lanes) {
    alignas(64) int32_t index[16];
    std::copy(lanes.begin(), lanes.end(), index);
    return _mm512_permutex2var_ps(x, _mm512_load_si512(index), y);
  };
  // (b0, b1) and (b2, b3): lanes 0-3 of each a plus lanes 4-7.
  __m512 b[2];
  for (int i = 0; i < 2; ++i)
    b[i] = _mm512_add_ps(
        pick(z[2 * i], z[2 * i + 1], {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}),
        pick(z[2 * i], z[2 * i + 1], {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}));
  // (c0, c1)
  const __m512 c = _mm512_add_ps(
      pick(b[0], b[1], {0, 1, 8, 9, 4, 5, 12, 13, 16, 17, 24, 25, 20, 21, 28, 29}),
      pick(b[0], b[1], {2, 3, 10, 11, 6, 7, 14, 15, 18, 19, 26, 27, 22, 23, 30, 31}));
  // d's last round, its lanes put in key order
  const __m512 d = _mm512_add_ps(pick(c, c, {0, 4, 2, 6, 8, 12, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0}),
                                 pick(c, c, {1, 5, 3, 7, 9, 13, 11, 15, 0, 0, 0, 0, 0, 0, 0, 0}));
  return (f8)_mm512_castps512_ps256(d);
}

// The 8 keys' scores of Scores below on AVX-512: keys 2m and 2m + 1 share a register, so that one
// multiply-add instruction advances two keys' sums (each lane the same chain as on 8 lanes).
template <int NQ>
inline void Scores8(const float* const* q, const float* keys, int64_t H, float scale,
                    float* const* scores) {
  __m512 dots[NQ][4];
  for (int a = 0; a < NQ; ++a)
    for (int m = 0; m < 4; ++m) dots[a][m] = _mm512_setzero_ps();
  for (int64_t v = 0; v < H; v += 8) {
    __m512 qv[NQ];
    for (int a = 0; a < NQ; ++a) qv[a] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[a] + v));
#pragma GCC unroll 4
    for (int m = 0; m < 4; ++m) {
      const __m512 key = _mm512_insertf32x8(
          _mm512_castps256_ps512(_mm256_loadu_ps(keys + 2 * m * H + v)),
          _mm256_loadu_ps(keys + (2 * m + 1) * H + v), 1);
      for (int a = 0; a < NQ; ++a) dots[a][m] = _mm512_fmadd_ps(qv[a], key, dots[a][m]);
    }
  }
  for (int a = 0; a < NQ; ++a) Store(scores[a], Sums8Paired(dots[a]) * scale);
}
#endif

// scores[a][j] = scale * q[a] . keys[j] for j in [0, n) and each of the NQ queries: 8 keys at a
// time, then one by one. Each query's sums are the same chain of multiply-adds whatever NQ is.
template <int NQ>
inline void Scores(const float* const* q, const float* keys, int64_t n, int64_t H, float scale,
                   float* const* scores) {
  int64_t j = 0;
#ifdef __AVX512F__
  for (; j + 8 <= n; j += 8) {
    float* at[NQ];
    for (int a = 0; a < NQ; ++a) at[a] = scores[a] + j;
    Scores8<NQ>(q, keys + j * H, H, scale, at);
  }
#endif
  for (; j + 8 <= n; j += 8) {
    f8 dots[NQ][8] = {};
    for (int64_t v = 0; v < H; v += 8) {
      f8 qv[NQ];
      for (int a = 0; a < NQ; ++a) qv[a] = Load(q[a] + v);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const f8 key = Load(keys + (j + i) * H + v);
        for (int a = 0; a < NQ; ++a) dots[a][i] = MulAdd(qv[a], key, dots[a][i]);
      }
    }
    for (int a = 0; a < NQ; ++a) Store(scores[a] + j, Sums8(dots[a]) * scale);
  }
  for (; j < n; ++j) {
    for (int a = 0; a < NQ; ++a) {
      f8 dot = Splat(0.0f);
      for (int64_t v = 0; v < H; v += 8) dot = MulAdd(Load(q[a] + v), Load(keys + j * H + v), dot);
      scores[a][j] = Sum(dot) * scale;
    }
  }
}

// out[a][0..LW) = out[a] * rescale[a] + sum_j p[a][j] * values[j][0..LW) for each of the NQ
// queries (L: V's lanes): W vectors of sums per query in registers, each value row loaded once
// for all. A rescale of 1 (the running max unchanged) leaves the sums as they are.
template <int NQ, int W, typename V>
inline void Accumulate(float* const* out, const float* const* p, const float* values, int64_t n,
                       int64_t H, const float* rescale) {
  constexpr int L = sizeof(V) / sizeof(float);
  V sums[NQ][W];
  for (int a = 0; a < NQ; ++a)
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      sums[a][w] = Load<V>(out[a] + L * w);
      if (rescale[a] != 1.0f) sums[a][w] *= rescale[a];
    }
  for (int64_t j = 0; j < n; ++j) {
    V pj[NQ];
    for (int a = 0; a < NQ; ++a) pj[a] = Broadcast<V>(p[a][j]);
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      const V value = Load<V>(values + j * H + L * w);
      for (int a = 0; a < NQ; ++a) sums[a][w] = MulAdd(pj[a], value, sums[a][w]);
    }
  }
  for (int a = 0; a < NQ; ++a)
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) Store(out[a] + L * w, sums[a][w]);
}

// Keys [begin, end) of a block, whose scores (the 8-lane vectors covering them) lie in
// scores[begin / 8 * 8 ..): turns them into exp(score - new max) in place, -inf padding around
// them (a short block, a small page, the last keys) giving 0; updates the query's running max
// and denominator and returns the factor its earlier sums are rescaled by (0 for its first block).
inline float Softmax(float* scores, int64_t begin, int64_t end, float& max, float& denominator) {
  const int64_t from = begin / 8 * 8, to = (end + 7) / 8 * 8;
  std::fill(scores + from, scores + begin, kNegInf);
  std::fill(scores + end, scores + to, kNegInf);
  f8 top = Splat(kNegInf);
  for (int64_t j = from; j < to; j += 8) {
    const f8 s = Load(scores + j);
    top = s > top ? s : top;
  }
  float block_max = top[0];
  for (int i = 1; i < 8; ++i) block_max = std::max(block_max, top[i]);
  const float new_max = std::max(max, block_max);
  const float rescale = new_max == max ? 1.0f : std::exp(max - new_max);  // exp(0) is 1 exactly
  max = new_max;
  int64_t j = from;
  for (; j + kWideLanes <= to; j += kWideLanes)
    Store(scores + j, Exp<Wide, WideInt>(Load<Wide>(scores + j) - new_max));
  for (; j < to; j += 8) Store(scores + j, Exp<f8, i8>(Load(scores + j) - new_max));
  f8 total = Splat(0.0f);  // added up 8 lanes at a time, in order, whatever the width above
  for (j = from; j < to; j += 8) total += Load(scores + j);
  denominator = denominator * rescale + Sum(total);
  return rescale;
}

// A query's online-softmax state for the keys of one task, one record: output sums acc [H], then
// the running max and denominator (two pointers a query, where three arrays took four).
inline int64_t StateFloats(int64_t H) { return (H + 2 + 15) / 16 * 16; }  // whole cache lines

// A query: its row of q [H] and its state.
struct Query {
  const float* q;
  float* state;
};

// NQ queries (one position) over keys [begin, end) of a block whose rows start at key_rows and
// value_rows.
template <int NQ>
void AttendBlock(int64_t H, const Query* query, const float* key_rows, const float* value_rows,
                 int64_t begin, int64_t end, float scale) {
  alignas(32) float scores[NQ][kBlock];
  const float* qa[NQ];
  float* sa[NQ];
  for (int a = 0; a < NQ; ++a) qa[a] = query[a].q, sa[a] = scores[a] + begin;
  Scores<NQ>(qa, key_rows + begin * H, end - begin, H, scale, sa);
  float rescale[NQ];
  for (int a = 0; a < NQ; ++a)
    rescale[a] = Softmax(scores[a], begin, end, query[a].state[H], query[a].state[H + 1]);
  const float* v_rows = value_rows + begin * H;
  const float* const* p = sa;
  float* out[NQ];
  int64_t h = 0;
  for (; h + 64 <= H; h += 64) {
    for (int a = 0; a < NQ; ++a) out[a] = query[a].state + h;
    Accumulate<NQ, 64 / kWideLanes, Wide>(out, p, v_rows + h, end - begin, H, rescale);
  }
  for (; h < H; h += 8) {
    for (int a = 0; a < NQ; ++a) out[a] = query[a].state + h;
    Accumulate<NQ, 1, f8>(out, p, v_rows + h, end - begin, H, rescale);
  }
}

// A block of keys: positions [j0, j0 + n), their key and value rows.
struct Block {
  int64_t j0, n;
  const float *key_rows, *value_rows;
};

// AttendBlock over `count` (at most N) queries that see keys [begin, end) of the block.
template <int N>
void AttendSome(int count, int64_t H, const Query* query, const Block& block, int64_t begin,
                int64_t end, float scale) {
  if constexpr (N > 1) {
    if (count < N) return AttendSome<N - 1>(count, H, query, block, begin, end, scale);
  }
  AttendBlock<N>(H, query, block.key_rows, block.value_rows, begin, end, scale);
}

// One kv head of one sequence in a task: its queries q [Q, H] (query g * T + t at position
// positions[t]) and their states for the task's keys, one after the other.
struct Sequence {
  const float* q;
  const int32_t* positions;
  float* states;
  Query At(int64_t query, int64_t H) const { return {q + query * H, states + query * StateFloats(H)}; }
};

// Every query of the sequences (which share this block's pages) over the keys of the block it
// sees; those that see the same ones kQueriesTogether at a time, sequence after sequence, token
// after token.
void AttendBlockQueries(const Dims& d, const Sequence* sequences, int64_t count_sequences,
                        const Block& block, int64_t window, float scale) {
  Query query[kQueriesTogether];
  int count = 0;
  int64_t begin = 0, end = 0;  // the keys the gathered queries see
  auto flush = [&] {
    if (count) AttendSome<kQueriesTogether>(count, d.head_dim, query, block, begin, end, scale);
    count = 0;
  };
  for (int64_t s = 0; s < count_sequences; ++s) {
    for (int64_t t = 0; t < d.tokens; ++t) {
      const int64_t position = sequences[s].positions[t];
      const int64_t first = window ? std::max<int64_t>(0, position - window + 1) : 0;
      const int64_t sees_from = std::max<int64_t>(first - block.j0, 0);
      const int64_t sees_to = std::min<int64_t>(position - block.j0 + 1, block.n);
      if (sees_from >= sees_to) continue;  // nothing this position sees in the block (or at all)
      if (sees_from != begin || sees_to != end) {
        flush();
        begin = sees_from, end = sees_to;
      }
      for (int64_t g = 0; g < d.groups; ++g) {
        query[count++] = sequences[s].At(g * d.tokens + t, d.head_dim);
        if (count == kQueriesTogether) flush();
      }
    }
  }
  flush();
}

// The queries of the sequences over keys [lo, hi), which lie on the same pages for all of them
// (keys and values: that head's rows of any one of them).
void AttendRange(const Dims& d, const Sequence* sequences, int64_t count_sequences,
                 const Rows& keys, const Rows& values, int64_t window, float scale, int64_t lo,
                 int64_t hi) {
  const int64_t H = d.head_dim;
  // Blocks on the fixed grid: from a multiple of kBlock, to the next one or the page's end.
  for (int64_t j0 = lo / kBlock * kBlock, j1; j0 < hi; j0 = j1) {
    j1 = std::min({hi, (j0 / kBlock + 1) * kBlock, keys.PageEnd(j0)});
    const int64_t n = j1 - j0;
    const float* key_rows = keys.At(j0);
    const float* value_rows = values.At(j0);
    // Ask now for the keys and values as far ahead as this block is long: the hardware
    // prefetcher stops at each 4 KiB page, and the next KV page may lie anywhere.
    for (int64_t a = j0 + kPrefetchKeys, a1; a < std::min(j1 + kPrefetchKeys, hi); a = a1) {
      a1 = std::min({j1 + kPrefetchKeys, hi, keys.PageEnd(a)});
      const float *k_ahead = keys.At(a), *v_ahead = values.At(a);
      for (int64_t offset = 0; offset < (a1 - a) * H; offset += 16) {
        __builtin_prefetch(k_ahead + offset);
        __builtin_prefetch(v_ahead + offset);
      }
    }
    const Block block{j0, n, key_rows, value_rows};
    AttendBlockQueries(d, sequences, count_sequences, block, window, scale);
  }
}

// A task: one kv head, one split, the batch entries members[first, first + count) that see the
// same keys of the split on the same pages (a prefix they share).
struct Task {
  int64_t kv_head, split, first, count;
};

// Queries per task at most, in whole batch entries: a block of keys read from memory serves all
// of a task's queries, so entries with few queries each (decode rows, short verify steps) share a
// task, while a prompt piece's queries already use each block enough and keep a task of their
// own (its state then stays in cache, and more tasks keep the threads busy).
constexpr int64_t kQueriesPerTask = 48;

// Tasks are run with jinfer::RunTasks; each entry's state is kept per (entry, kv head, split).
struct Job {
  Dims d;
  const float *q, *pool_k, *pool_v;
  const int32_t *tables, *positions;
  int64_t window, splits;
  float scale;
  std::vector<int64_t> lo, hi;  // per batch entry: the keys any of its queries sees, [lo, hi)
  std::vector<int64_t> members;
  std::vector<Task> tasks;
  // Online-softmax state per (entry, kv head, split) and query (StateFloats each).
  std::vector<float> states;

  // Allocates every query's state: no sums, no keys seen.
  void ClearStates() {
    const int64_t H = d.head_dim, size = StateFloats(H);
    states.assign(d.batch * d.kv_heads * splits * d.queries() * size, 0.0f);
    for (int64_t at = 0; at < static_cast<int64_t>(states.size()); at += size) states[at + H] = kNegInf;
  }

  // Fills lo and hi; returns the longest range.
  int64_t KeyRanges() {
    lo.assign(d.batch, d.seq());
    hi.assign(d.batch, 0);
    int64_t longest = 0;
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t t = 0; t < d.tokens; ++t) {
        const int64_t position = std::min<int64_t>(positions[b * d.tokens + t], d.seq() - 1);
        if (position < 0) continue;
        lo[b] = std::min<int64_t>(lo[b], window ? std::max<int64_t>(0, position - window + 1) : 0);
        hi[b] = std::max<int64_t>(hi[b], position + 1);
      }
      longest = std::max(longest, hi[b] - lo[b]);
    }
    return longest;
  }

  // Entry b's keys in the split: [begin, end), empty where it sees none there.
  std::pair<int64_t, int64_t> SplitKeys(int64_t b, int64_t split) const {
    return {std::max(lo[b], split * kSplitKeys), std::min(hi[b], (split + 1) * kSplitKeys)};
  }

  // Whether entries a and b see the same keys of the split on the same pages.
  bool SameKeys(int64_t a, int64_t b, int64_t split) const {
    const auto keys = SplitKeys(a, split);
    if (keys != SplitKeys(b, split)) return false;
    const int32_t *table_a = tables + a * d.max_pages, *table_b = tables + b * d.max_pages;
    for (int64_t page = keys.first / d.page_size; page * d.page_size < keys.second; ++page)
      if (table_a[page] != table_b[page]) return false;
    return true;
  }

  // Groups the entries that share a split's keys (kQueriesPerTask queries at most, at least one
  // entry) into tasks, one per kv head; the largest first, so that the threads end together.
  void PlanTasks() {
    const int64_t together = std::max<int64_t>(1, kQueriesPerTask / d.queries());
    for (int64_t split = 0; split < splits; ++split) {
      std::vector<std::vector<int64_t>> groups;
      for (int64_t b = 0; b < d.batch; ++b) {
        const auto keys = SplitKeys(b, split);
        if (keys.first >= keys.second) continue;
        auto fits = [&](const std::vector<int64_t>& group) {
          return static_cast<int64_t>(group.size()) < together &&
                 SameKeys(group[0], b, split);
        };
        const auto group = std::find_if(groups.begin(), groups.end(), fits);
        if (group == groups.end()) groups.push_back({b});
        else group->push_back(b);
      }
      for (const auto& group : groups) {
        for (int64_t k = 0; k < d.kv_heads; ++k) {
          tasks.push_back({k, split, static_cast<int64_t>(members.size()),
                           static_cast<int64_t>(group.size())});
        }
        members.insert(members.end(), group.begin(), group.end());
      }
    }
    std::stable_sort(tasks.begin(), tasks.end(),
                     [](const Task& x, const Task& y) { return x.count > y.count; });
  }

  void Run(int64_t index) {
    const Task& task = tasks[index];
    const int64_t Q = d.queries(), H = d.head_dim, k = task.kv_head;
    Sequence sequences[kQueriesPerTask];
    for (int64_t i = 0; i < task.count; ++i) {
      const int64_t b = members[task.first + i];
      const int64_t state = ((b * d.kv_heads + k) * splits + task.split) * Q;
      sequences[i] = {q + (b * d.kv_heads + k) * Q * H, positions + b * d.tokens,
                      &states[state * StateFloats(H)]};
    }
    const int64_t b = members[task.first];
    const auto [begin, end] = SplitKeys(b, task.split);
    const int64_t head_offset = k * d.pages * d.page_size * H;
    const int32_t* table = tables + b * d.max_pages;
    const Rows keys{pool_k + head_offset, table, d.page_size, H};
    const Rows values{pool_v + head_offset, table, d.page_size, H};
    AttendRange(d, sequences, task.count, keys, values, window, scale, begin, end);
  }

  // out[b, k] = the splits' sums, each rescaled to the common maximum, over their denominators.
  void Merge(float* out) const {
    const int64_t Q = d.queries(), H = d.head_dim;
    for (int64_t pair = 0; pair < d.batch * d.kv_heads; ++pair) {
      for (int64_t query = 0; query < Q; ++query) {
        auto at = [&](int64_t s) { return &states[((pair * splits + s) * Q + query) * StateFloats(H)]; };
        float top = kNegInf;
        for (int64_t s = 0; s < splits; ++s) top = std::max(top, at(s)[H]);
        float* o = out + (pair * Q + query) * H;
        std::fill(o, o + H, 0.0f);
        if (top == kNegInf) continue;  // no visible key
        float total = 0.0f;
        for (int64_t s = 0; s < splits; ++s) {
          const float* a = at(s);  // acc [H], max, denominator
          if (a[H] == kNegInf) continue;
          const float w = std::exp(a[H] - top);
          total += w * a[H + 1];
          for (int64_t h = 0; h < H; ++h) o[h] += w * a[h];
        }
        for (int64_t h = 0; h < H; ++h) o[h] /= total;
      }
    }
  }
};

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> pool_k,
                     ffi::Buffer<ffi::F32> pool_v, ffi::Buffer<ffi::S32> tables,
                     ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out,
                     int64_t window, float scale) {
  const auto qd = q.dimensions(), pd = pool_k.dimensions(), vd = pool_v.dimensions();
  const auto td = tables.dimensions();
  const bool shapes_fit =
      qd.size() == 5 && pd.size() == 4 && td.size() == 2 &&
      std::equal(pd.begin(), pd.end(), vd.begin(), vd.end()) && qd[1] == pd[0] &&
      qd[4] == pd[3] && qd[4] % 8 == 0 && td[0] == qd[0] &&
      static_cast<int64_t>(positions.element_count()) == qd[0] * qd[3];
  if (!shapes_fit)
    return ffi::Error::InvalidArgument(
        "jinfer cpu attention: q [B, K, G, T, H], pools [K, P, S, H] (H a multiple of 8), "
        "tables [B, M], positions [B, T] expected");
  Job job;
  job.d = Dims{qd[0], qd[1], qd[2], qd[3], qd[4], pd[1], pd[2], td[1]};
  job.q = q.typed_data();
  job.pool_k = pool_k.typed_data();
  job.pool_v = pool_v.typed_data();
  job.tables = tables.typed_data();
  job.positions = positions.typed_data();
  job.window = window;
  job.scale = scale;
  const int64_t pairs = qd[0] * qd[1];
  const int64_t longest = job.KeyRanges();
  for (int64_t b = 0; b < qd[0]; ++b) {  // every page a query can reach must be in the pool
    for (int64_t page = job.lo[b] / pd[2]; page * pd[2] < job.hi[b]; ++page) {
      const int32_t index = job.tables[b * td[1] + page];
      if (index < 0 || index >= pd[1])
        return ffi::Error::InvalidArgument("jinfer cpu attention: a block table entry is out of range");
    }
  }
  // Helper threads only for enough keys to pay for waking them (measured: ~20 us a call).
  const int64_t work = pairs * longest * qd[3];
  const int64_t threads = work < kKeysPerHelper ? 1 : jinfer::PoolCores(pool);
  int64_t furthest = 0;
  for (int64_t b = 0; b < qd[0]; ++b) furthest = std::max(furthest, job.hi[b]);
  job.splits = std::max<int64_t>(1, (furthest + kSplitKeys - 1) / kSplitKeys);
  job.PlanTasks();
  job.ClearStates();
  const int64_t tasks = job.tasks.size();
  jinfer::RunTasks(pool, threads, tasks, [&job](int64_t task) { job.Run(task); });
  job.Merge(out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JinferCpuAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale"));
