// What jinfer's CPU kernels share: 8-lane float vectors (GCC/Clang vector extensions: AVX
// registers on x86, pairs of NEON registers on ARM), the number of cores XLA's pool may use, and
// running a call's tasks on the calling thread and helpers from that pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jinfer {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline f8 Splat(float x) { return f8{} + x; }
// An unaligned load of a vector of floats (8 lanes unless V says otherwise).
template <typename V = f8>
inline V Load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// An unaligned store of a vector of floats (of any width).
template <typename V>
inline void Store(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
inline float Sum(f8 v) {
  float s = 0;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// x in every lane of a vector of 8 or 16 floats.
template <typename V>
inline V Broadcast(float x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) return (V)_mm512_set1_ps(x);
#endif
#if defined(__AVX__)
  if constexpr (sizeof(V) == 32) return (V)_mm256_set1_ps(x);
#endif
  V v;
  for (int i = 0; i < static_cast<int>(sizeof(V) / sizeof(float)); ++i) v[i] = x;
  return v;
}

// a * b + c for vectors of 8 or 16 floats, rounded once where the CPU has fused multiply-adds.
// Spelled out rather than left to -ffp-contract: GCC fused `acc += w * x` in some instantiations
// of a kernel's tile and not in others, so one column's sums came out differently depending on
// how many columns shared its tile.
template <typename V>
inline V MulAdd(V a, V b, V c) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#endif
#if defined(__FMA__)
  if constexpr (sizeof(V) == 32) return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
  return a * b + c;
}

// The threads that can run at once: XLA's pool, at most the machine's cores. Asked once:
// hardware_concurrency() costs a system call (an attention call with no keys: 20 us -> 5 us).
inline int64_t PoolCores(xla::ffi::ThreadPool& pool) {
  static const int64_t machine_cores = std::thread::hardware_concurrency();
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), machine_cores));
}

// Runs run(task) for every task in [0, tasks) on `threads` threads: the caller and threads - 1
// helpers on XLA's pool claim tasks from a counter, so the caller finishes alone when no helper
// gets to run (waking one costs ~20 us). Returns once every task is done. A helper that starts
// late finds no task left: the counters outlive the call, `run` is never called after it.
template <typename Run>
void RunTasks(xla::ffi::ThreadPool& pool, int64_t threads, int64_t tasks, Run run) {
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [counters, tasks, run] {
    for (int64_t t; (t = counters->next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      run(t);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 1; i < std::min(threads, tasks); ++i) pool.Schedule([work] { work(); });
  work();
  while (counters->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
}

}  // namespace jinfer
