// Test hooks of the multi-tensor kernels (internal, not installed): tests run the
// launchers under other launch shapes to show that results do not depend on them.
#pragma once

#include "kernels/plans.hpp"

namespace stepcore::gpu::testing {

/// Lowers the blocks and tensors per launch of the CUDA entry points on this thread
/// while alive (tests run the device kernels under two launch shapes with it). Results
/// do not depend on it: that is what the tests show.
class ScopedLaunchLimits {
 public:
  ScopedLaunchLimits(int max_blocks, int max_tensors);
  ~ScopedLaunchLimits();
  ScopedLaunchLimits(const ScopedLaunchLimits&) = delete;
  ScopedLaunchLimits& operator=(const ScopedLaunchLimits&) = delete;

 private:
  int saved_blocks_, saved_tensors_;
};

}  // namespace stepcore::gpu::testing
