// What jinfer's CPU kernels share: 8-lane float vectors (GCC/Clang vector extensions: AVX
// registers on x86, pairs of NEON registers on ARM) and the number of cores XLA's pool may use.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jinfer {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline f8 Splat(float x) { return f8{} + x; }
inline f8 Load(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void Store(float* p, f8 v) { std::memcpy(p, &v, sizeof v); }
inline float Sum(f8 v) {
  float s = 0;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// The threads that can run at once: XLA's pool, at most the machine's cores. Asked once:
// hardware_concurrency() costs a system call (an attention call with no keys: 20 us -> 5 us).
inline int64_t PoolCores(xla::ffi::ThreadPool& pool) {
  static const int64_t machine_cores = std::thread::hardware_concurrency();
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), machine_cores));
}

}  // namespace jinfer
