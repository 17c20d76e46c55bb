// Scoped floating-point environment for every computing thread: round to nearest,
// no flush-to-zero, no denormals-are-zero (docs/numerics.md section 1). A trainer may
// have set FTZ/DAZ (torch.set_flush_denormal) or another rounding mode on its threads;
// stepcore's results must not depend on that.
#pragma once

#include <cfenv>
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define STEPCORE_HAVE_MXCSR 1
#endif

namespace stepcore::detail {

/// Sets the spec's environment on construction and restores the caller's on destruction.
class FpEnvGuard {
 public:
  FpEnvGuard() noexcept {
#if defined(STEPCORE_HAVE_MXCSR)
    saved_csr_ = _mm_getcsr();
    // Clear FTZ (bit 15), DAZ (bit 6) and the rounding-control bits (13-14); keep
    // the exception masks and sticky flags as they are.
    _mm_setcsr(saved_csr_ & ~((1u << 15) | (1u << 6) | (3u << 13)));
#endif
    saved_round_ = std::fegetround();
    if (saved_round_ != FE_TONEAREST) std::fesetround(FE_TONEAREST);
  }
  ~FpEnvGuard() {
#if defined(STEPCORE_HAVE_MXCSR)
    _mm_setcsr(saved_csr_);
#endif
    if (saved_round_ != FE_TONEAREST) std::fesetround(saved_round_);
  }
  FpEnvGuard(const FpEnvGuard&) = delete;
  FpEnvGuard& operator=(const FpEnvGuard&) = delete;

 private:
#if defined(STEPCORE_HAVE_MXCSR)
  unsigned saved_csr_ = 0;
#endif
  int saved_round_ = FE_TONEAREST;
};

}  // namespace stepcore::detail
