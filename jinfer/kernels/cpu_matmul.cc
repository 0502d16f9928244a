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
//
// The same tiles make a weight's low-rank adapter deltas in one call (LoraDelta, at the end).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include <string>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A tile's running sums live in vector registers: 24 of AVX-512's 32, 8 of AVX2's 16 (the rest
// hold weights and x). A prompt's tile (kWidePass columns of two blocks) takes 12 of AVX2's: its
// weights come from cache, and 8 sums left the FMA units idle half the time (a 3072 x 576 matrix
// times 256 columns: 95 GFLOP/s with 2 x 4 sums).
#ifdef __AVX512F__
constexpr int kRows = 16;
constexpr int kSumRegisters = 24;
constexpr int kWidePass = 12;
#else
constexpr int kRows = 8;
constexpr int kSumRegisters = 8;
constexpr int kWidePass = 6;
#endif
constexpr int kWidestTile = 16;  // columns
constexpr int kSumsInFlight = 8;  // independent sums that keep the FMA units busy: 2 units x 4 cycles
typedef float Rows __attribute__((vector_size(kRows * sizeof(float))));

// 128 rows: small enough to balance, big enough to stream, and a whole number of the widest
// group of blocks one tile takes (8, for one column).
constexpr int64_t kBlocksPerTask = 128 / kRows;

// Weights are read kPrefetchAhead input indices (16 KB with AVX-512) before use. At 8 columns the
// multiplies take about as long as the bytes take to arrive, and without this the two did not
// overlap: a core's misses to memory waited on its own line fill buffers while the multiplies ran
// (SmolLM2's 8-slot decode step 47-53 ms without, 30-32 ms with; one slot level). A prefetch into
// L2 (not L1, whose fill buffers are the limit) far enough ahead keeps memory busy meanwhile.
constexpr int64_t kPrefetchAhead = 256;

// Blocks [b, b + B) x columns [c0, c0 + n), in one pass over their weights. Each x[k, c] loaded
// is multiplied into B blocks' rows: with one block the loads of x (one per column and k)
// outnumber its multiplies, and the load ports set the pace once the weights come from cache.
//
// Every output is one running sum over k = 0, 1, ..., K - 1 in that order, whatever the tile:
// a column's products are the same bits whether it is multiplied alone or beside 31 others (a
// slot's tokens never depend on its neighbours; a speculative verify step's k + 1 positions per
// row give what k + 1 one-column decode steps give). The sums in flight that keep the FMA units
// busy therefore come from more blocks of rows (B), never from splitting k.
//
// x[k, c] is xc[k * x_stride + c]: the columns where they are (x + c0, stride N), or a packed copy.
template <int n, int B>
inline void Tile(const float* packed, const float* xc, int64_t x_stride, float* y, int64_t K,
                 int64_t N, int64_t b, int64_t c0) {
  static_assert(B * n <= std::max(kSumRegisters, 2 * kWidePass));
  Rows acc[B][n] = {};
  const float* w = packed + b * K * kRows;
  for (int64_t k = 0; k < K; ++k) {
    Rows wv[B];
    for (int i = 0; i < B; ++i) {
      const float* wk = w + (i * K + k) * kRows;
      __builtin_prefetch(wk + kPrefetchAhead * kRows, 0, 1);  // toward L2
      wv[i] = jinfer::Load<Rows>(wk);
    }
    // Each x[k, c] is used by every block as soon as it is loaded: holding all n at once took n
    // more registers (GCC spilled sums at 12 columns).
    for (int c = 0; c < n; ++c) {
      const Rows xkc = jinfer::Broadcast<Rows>(xc[k * x_stride + c]);
      for (int i = 0; i < B; ++i) acc[i][c] = jinfer::MulAdd(wv[i], xkc, acc[i][c]);
    }
  }
  for (int i = 0; i < B; ++i)
    for (int c = 0; c < n; ++c)
      for (int r = 0; r < kRows; ++r) y[((b + i) * kRows + r) * N + c0 + c] = acc[i][c][r];
}

// Columns one pass multiplies into B blocks: with AVX-512 12 for two blocks, 16 for one.
template <int B>
constexpr int kPassColumns = std::min(kWidestTile, kSumRegisters / B);

// Tile<n, B> for n = columns, 1 <= columns <= n.
template <int B, int n = kPassColumns<B>>
void TileOf(int64_t columns, const float* packed, const float* xc, int64_t x_stride, float* y,
            int64_t K, int64_t N, int64_t b, int64_t c0) {
  if constexpr (n > 1)
    if (columns < n) return TileOf<B, n - 1>(columns, packed, xc, x_stride, y, K, N, b, c0);
  Tile<n, B>(packed, xc, x_stride, y, K, N, b, c0);
}

// Blocks [b, b + B) against every column, kPassColumns<B> at a time. Columns taken in one pass
// stream the weights from memory once; a second pass reads them again from cache at the pace of
// its loads. SmolLM2's products in one pass against two of 8 columns, alternating runs: 12 columns
// 24-29 ms against 31-32, 16 columns 30-33 against 35-40; its decode step at 16 slots 45-50 ms
// against 52-59, level at 8.
template <int B>
void Blocks(const float* packed, const float* x, float* y, int64_t K, int64_t N, int64_t b) {
  for (int64_t c0 = 0; c0 < N; c0 += kPassColumns<B>)
    TileOf<B>(std::min<int64_t>(kPassColumns<B>, N - c0), packed, x + c0, N, y, K, N, b, c0);
}

// Blocks [b, end) B at a time while B of them remain; returns the first block left.
template <int B>
int64_t BlocksBy(const float* packed, const float* x, float* y, int64_t K, int64_t N, int64_t b,
                 int64_t end) {
  for (; b + B <= end; b += B) Blocks<B>(packed, x, y, K, N, b);
  return b;
}

// Blocks taken together for N columns: the fewest (of 8, 4) that keep kSumsInFlight sums in
// flight for few columns, else pairs while every column fits one pass of two (each x load then
// serves two blocks).
constexpr int BlocksFor(int64_t N) {
  for (int B : {8, 4})
    if (B / 2 * N < kSumsInFlight && B * N <= kSumRegisters) return B;
  return N <= kPassColumns<2> ? 2 : 1;
}

// Tile<n, B> for n = columns, 1 <= columns <= n (a prompt's passes).
template <int B, int n>
void WideTileOf(int64_t columns, const float* packed, const float* xc, int64_t x_stride, float* y,
                int64_t K, int64_t N, int64_t b, int64_t c0) {
  if constexpr (n > 1)
    if (columns < n) return WideTileOf<B, n - 1>(columns, packed, xc, x_stride, y, K, N, b, c0);
  Tile<n, B>(packed, xc, x_stride, y, K, N, b, c0);
}

// Prompts' products: hundreds of columns, every weight used by each of them, so the weights can
// come from cache rather than memory. The columns are first copied pass by pass into panels
// [passes, K, kWidePass] (a pass's x, 27 KB at K = 576, then lies in consecutive lines:
// read in place, rows of x a power of two apart fall into few of L1's sets and evict each other).
// Then a task takes a group of blocks and a span of whole passes, both small enough to stay in L2
// together (kGroupWeightBytes of weights, kSpanBytes of panels), and runs each pass over the
// group's pairs of blocks. Spans are narrower still where the groups alone would give the threads
// too few tasks to share evenly (a 576-row matrix is 36 blocks). Consecutive tasks share a span.
constexpr int64_t kGroupWeightBytes = 256 * 1024;
constexpr int64_t kSpanBytes = 512 * 1024;
constexpr int64_t kTasksPerThread = 4;

void Wide(ffi::ThreadPool& pool, const float* w, const float* x, float* y, int64_t blocks, int64_t K,
          int64_t N) {
  constexpr int64_t pass = kWidePass;
  const int64_t threads = jinfer::PoolCores(pool);
  const int64_t passes = (N + pass - 1) / pass;
  // Kept by the calling thread from call to call: fresh megabytes would be page-faulted in each
  // time. A short last pass leaves columns of its panel unwritten, and its tiles never read them.
  static thread_local std::vector<float> panels;
  if (panels.size() < static_cast<size_t>(passes * K * pass)) panels.resize(passes * K * pass);
  float* panel = panels.data();
  jinfer::RunTasks(pool, threads, passes, [=](int64_t p) {
    const int64_t c0 = p * pass, columns = std::min(pass, N - c0);
    for (int64_t k = 0; k < K; ++k)
      std::memcpy(panel + (p * K + k) * pass, x + k * N + c0, columns * sizeof(float));
  });
  const int64_t group = std::max<int64_t>(2, kGroupWeightBytes / (K * kRows * sizeof(float)) / 2 * 2);
  const int64_t groups = (blocks + group - 1) / group;
  const int64_t fitting = std::max<int64_t>(1, kSpanBytes / (K * pass * sizeof(float)));
  const int64_t even = (kTasksPerThread * threads + groups - 1) / groups;
  const int64_t spans = std::min(passes, std::max((passes + fitting - 1) / fitting, even));
  const int64_t span = (passes + spans - 1) / spans;  // passes per task
  jinfer::RunTasks(pool, threads, groups * ((passes + span - 1) / span), [=](int64_t task) {
    const int64_t first = task % groups * group, end = std::min(blocks, first + group);
    const int64_t p_end = std::min(passes, (task / groups + 1) * span);
    for (int64_t p = task / groups * span; p < p_end; ++p) {
      const int64_t c0 = p * pass, columns = std::min(pass, N - c0);
      const float* xp = panel + p * K * pass;
      int64_t b = first;
      for (; b + 2 <= end; b += 2) WideTileOf<2, kWidePass>(columns, w, xp, pass, y, K, N, b, c0);
      if (b < end) WideTileOf<1, kWidePass>(columns, w, xp, pass, y, K, N, b, c0);
    }
  });
}

// Up to kWideFrom - 1 columns the weights stream from memory once for all of them (Blocks); from
// there on, Wide.
constexpr int64_t kWideFrom = 33;

// Blocks [b, end) against N < kWideFrom columns, as many blocks a tile as keep the sums in flight.
void NarrowBlocks(const float* w, const float* x, float* y, int64_t K, int64_t N, int64_t b,
                  int64_t end) {
  const int widest = BlocksFor(N);
  if (widest >= 8) b = BlocksBy<8>(w, x, y, K, N, b, end);
  if (widest >= 4) b = BlocksBy<4>(w, x, y, K, N, b, end);
  if (widest >= 2) b = BlocksBy<2>(w, x, y, K, N, b, end);
  BlocksBy<1>(w, x, y, K, N, b, end);
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
  if (N >= kWideFrom) {
    Wide(pool, w, columns, out, blocks, K, N);
    return ffi::Error::Success();
  }
  const int64_t tasks = (blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  jinfer::RunTasks(pool, jinfer::PoolCores(pool), tasks, [=](int64_t task) {
    NarrowBlocks(w, columns, out, K, N, task * kBlocksPerTask, std::min(blocks, (task + 1) * kBlocksPerTask));
  });
  return ffi::Error::Success();
}

// Bytes fetched ahead when a stream starts, before its tiles' own prefetches reach that far.
constexpr int64_t kStartBytes = 16 * 1024;

inline void FetchStart(const float* stream) {
  for (int64_t line = 0; line < kStartBytes; line += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(stream) + line, 0, 1);
}

// Blocks [b, b + B) of a slot's packed B [., rank, R] times its columns' rows of A x (kept [rank,
// n] at kept_at, a column's apart) -> deltas column by column: yt[c * rows + row]. Each a running
// sum over the rank in order, as the matmul's tiles make it.
template <int n, int B>
inline void DeltaTile(const float* b_packed, const float* kept, int64_t n_all, int64_t rank, float* yt,
                      int64_t rows, int64_t b, int64_t c0) {
  Rows acc[B][n] = {};
  for (int i = 0; i < B; ++i) {  // the blocks kStartBytes ahead, as Tile fetches its weights
    const char* ahead = reinterpret_cast<const char*>(b_packed + (b + i) * rank * kRows) + kStartBytes;
    for (int64_t line = 0; line < rank * kRows * 4; line += 64) __builtin_prefetch(ahead + line, 0, 1);
  }
  for (int64_t j = 0; j < rank; ++j)
    for (int i = 0; i < B; ++i) {
      const Rows w = jinfer::Load<Rows>(b_packed + ((b + i) * rank + j) * kRows);
      for (int c = 0; c < n; ++c)
        acc[i][c] = jinfer::MulAdd(w, jinfer::Broadcast<Rows>(kept[j * n_all + c0 + c]), acc[i][c]);
    }
  for (int i = 0; i < B; ++i)
    for (int c = 0; c < n; ++c) jinfer::Store(yt + (c0 + c) * rows + (b + i) * kRows, acc[i][c]);
}

// DeltaTile over blocks [b, end) and all n columns: 4 blocks at a time for 1 or 2 columns (8
// sums in flight over the rank's short chain), else one block and up to 8 columns a pass.
template <int n = 8>
void DeltaColumns(int64_t columns, const float* b_packed, const float* kept, int64_t n_all, int64_t rank,
                  float* yt, int64_t rows, int64_t b, int64_t end, int64_t c0) {
  if constexpr (n > 1)
    if (columns < n) return DeltaColumns<n - 1>(columns, b_packed, kept, n_all, rank, yt, rows, b, end, c0);
  if constexpr (n <= 2)
    for (; b + 4 <= end; b += 4) DeltaTile<n, 4>(b_packed, kept, n_all, rank, yt, rows, b, c0);
  for (; b < end; ++b) DeltaTile<n, 1>(b_packed, kept, n_all, rank, yt, rows, b, c0);
}

// The operands of one weight's adapter deltas (LoraDelta): per slot, A_s packed [a_blocks, K, R]
// and B_s packed [b_blocks, rank, R]; kept_at per block of B's rows.
struct LoraOperands {
  const float *a, *b;
  const int32_t* kept_at;
  int64_t K, a_blocks, b_blocks, rank;
};

// Slot s's deltas for its n columns, xs [K, n]: A_s xs scaled into kept [a_blocks R, n], then B_s
// kept by projection into yt [n, R b_blocks], column by column.
void SlotDeltas(const LoraOperands& op, int64_t s, float scale, const float* xs, float* kept, int64_t n,
                float* yt) {
  const float* a_slot = op.a + s * op.a_blocks * op.K * kRows;
  const float* b_slot = op.b + s * op.b_blocks * op.rank * kRows;
  FetchStart(b_slot);
  NarrowBlocks(a_slot, xs, kept, op.K, n, 0, op.a_blocks);
  for (int64_t i = 0; i < op.a_blocks * kRows * n; ++i) kept[i] *= scale;
  const int64_t rows = op.b_blocks * kRows;
  for (int64_t run = 0, next; run < op.b_blocks; run = next) {  // blocks of one projection
    for (next = run + 1; next < op.b_blocks && op.kept_at[next] == op.kept_at[run];) ++next;
    if (op.kept_at[run] < 0) {
      for (int64_t c = 0; c < n; ++c) std::fill(yt + c * rows + run * kRows, yt + c * rows + next * kRows, 0.0f);
      continue;
    }
    const float* rows_of_a = kept + op.kept_at[run] * n;
    for (int64_t c0 = 0; c0 < n; c0 += 8)
      DeltaColumns(std::min<int64_t>(8, n - c0), b_slot, rows_of_a, n, op.rank, yt, rows, run, next, c0);
  }
}

// A weight's low-rank adapters' deltas, column by column (see jinfer.lora's FusedPairs): for a
// column on slot s (slots[c] >= 0), B_s (scale_s (A_s x)). Per slot, A_s [T r, K] holds the rank
// rows of each of the weight's T projections in turn, and B_s [M, r] holds, for each output row
// of the weight, the B of the projection it belongs to, whose rows of A_s x start at kept_at[b]
// for every row of packed block b (-1: rows no projection covers, whose delta is 0). Each slot's
// rows multiply only its own columns: a slot's bytes are read once, and no product is made that
// a zero scale would discard. The products are the matmul's running sums over the inputs and then
// over the slot's rank in order: the separate calls' values (A's product over every slot, the
// scaling that zeroes the other slots' rows, each projection's B product over them), but for the
// sign of an exact zero. The result yt [N, R Bb] holds the columns in order of their slots
// (stably: a slot's columns in their order, columns without one first, left zero), each slot's
// written by the thread that made it; the caller adds them to the weight's product (the
// addition fuses into what reads it). Up to kWideFrom - 1 columns a call.
ffi::Error LoraDelta(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots,
                     ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                     ffi::Buffer<ffi::S32> kept_at, ffi::ResultBuffer<ffi::F32> yt) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions(), yd = yt->dimensions();
  const int64_t S = scales.dimensions()[0];
  if (xd.size() != 2 || ad.size() != 4 || bd.size() != 4 || yd.size() != 2 || xd[1] >= kWideFrom ||
      slots.dimensions()[0] != xd[1] || ad[0] != S || ad[2] != xd[0] || ad[3] != kRows || bd[0] != S ||
      bd[3] != kRows || kept_at.dimensions()[0] != bd[1] || yd[0] != xd[1] || yd[1] != bd[1] * kRows)
    return ffi::Error::InvalidArgument("jinfer lora delta: operands of mismatched shapes");
  const LoraOperands op{a.typed_data(), b.typed_data(), kept_at.typed_data(), xd[0], ad[1], bd[1], bd[2]};
  const int64_t N = xd[1], K = op.K, rows = yd[1];
  const int32_t* slot_of = slots.typed_data();
  for (int64_t block = 0; block < op.b_blocks; ++block)
    if (op.kept_at[block] + op.rank > op.a_blocks * kRows)
      return ffi::Error::InvalidArgument("jinfer lora delta: kept_at past the adapters' rows");
  if (std::any_of(slot_of, slot_of + N, [S](int32_t s) { return s >= S; }))
    return ffi::Error::InvalidArgument("jinfer lora delta: a slot past the stack");
  // The columns in order of their slots: the slots in use, their first column there and count.
  int64_t used[kWideFrom], first[kWideFrom], count_of[kWideFrom], count = 0;
  const int64_t unadapted = std::count_if(slot_of, slot_of + N, [](int32_t s) { return s < 0; });
  for (int64_t at = unadapted, s = 0; s < S && at < N; ++s) {
    const int64_t n = std::count(slot_of, slot_of + N, static_cast<int32_t>(s));
    if (n) used[count] = s, first[count] = at, count_of[count++] = n, at += n;
  }
  float* out = yt->typed_data();
  std::fill(out, out + unadapted * rows, 0.0f);
  // Per column, room for it gathered [K] and for its rows of A x [a_blocks R]; kept by the calling
  // thread from call to call, as the panels are.
  const int64_t per_column = K + op.a_blocks * kRows;
  static thread_local std::vector<float> scratch;
  if (scratch.size() < static_cast<size_t>(per_column * N)) scratch.resize(per_column * N);
  float* area = scratch.data();
  const float *columns = x.typed_data(), *scale = scales.typed_data();
  jinfer::RunTasks(pool, jinfer::PoolCores(pool), count, [=, &op, &used, &first, &count_of](int64_t u) {
    const int64_t s = used[u], n = count_of[u];
    FetchStart(op.a + s * op.a_blocks * K * kRows);
    float *xs = area + per_column * first[u], *kept = xs + K * n;
    for (int64_t c = 0, i = 0; c < N; ++c)
      if (slot_of[c] == s) {
        for (int64_t k = 0; k < K; ++k) xs[k * n + i] = columns[k * N + c];
        ++i;
      }
    SlotDeltas(op, s, scale[s], xs, kept, n, out + first[u] * rows);
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int JinferCpuMatmulBlockRows() { return kRows; }
extern "C" int JinferCpuLoraDeltaColumns() { return kWideFrom - 1; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JinferCpuLoraDelta, LoraDelta,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // A packed [S, Ab, K, R]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // B packed [S, Bb, r, R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kept_at [Bb]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // yt [N, R Bb]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JinferCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
