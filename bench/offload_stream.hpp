// What the full-offload benchmarks (stepcore-bench-offload, stepcore-bench-speculation)
// share: their deterministic gradient values and step scales, and their timing helpers.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

namespace bench_offload {

using Clock = std::chrono::steady_clock;

/// SplitMix64's finaliser: a well-mixed 64-bit value of `z`.
inline std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/// A deterministic value in [-1, 1).
inline float unit(std::uint64_t key) {
  return static_cast<float>(mix(key) >> 40) * 0x1p-23f - 1.0f;
}

/// Step `step`'s gradient scale (1 / loss tokens of a synthetic step).
inline float scale_of(int step) { return 1.0f / static_cast<float>(4096 + step); }

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// The upper median of a non-empty sample.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace bench_offload
