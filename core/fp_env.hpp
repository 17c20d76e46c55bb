// Scoped floating-point environment for every computing thread: round to nearest,
// no flush-to-zero, no denormals-are-zero (docs/numerics.md section 1). A trainer may
// have set FTZ/DAZ (torch.set_flush_denormal) or another rounding mode on its threads;
// stepcore's results must not depend on that.
#pragma once

#include <cfenv>
#include <cstdint>
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define STEPCORE_HAVE_MXCSR 1
#elif defined(__aarch64__)
#define STEPCORE_HAVE_FPCR 1
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
#elif defined(STEPCORE_HAVE_FPCR)
    // Clear FIZ (bit 0, FEAT_AFP: flush inputs to zero), AH (1, alternate handling), NEP
    // (2, FEAT_AFP: scalar results' upper lanes), FZ16 (19), RMode (22-23: to nearest), FZ
    // (24, flush-to-zero) and DN (25, default NaN); keep the trap enables. FIZ and NEP are
    // RES0 without FEAT_AFP, where writing zero changes nothing.
    saved_fpcr_ = get_fpcr();
    const std::uint64_t want =
        saved_fpcr_ & ~((1ull << 0) | (1ull << 1) | (1ull << 2) | (1ull << 19) | (3ull << 22) |
                        (1ull << 24) | (1ull << 25));
    if (want != saved_fpcr_) set_fpcr(want);
#endif
    saved_round_ = std::fegetround();
    if (saved_round_ != FE_TONEAREST) std::fesetround(FE_TONEAREST);
  }
  ~FpEnvGuard() {
#if defined(STEPCORE_HAVE_MXCSR)
    _mm_setcsr(saved_csr_);
#elif defined(STEPCORE_HAVE_FPCR)
    if (get_fpcr() != saved_fpcr_) set_fpcr(saved_fpcr_);
#endif
    if (saved_round_ != FE_TONEAREST) std::fesetround(saved_round_);
  }
  FpEnvGuard(const FpEnvGuard&) = delete;
  FpEnvGuard& operator=(const FpEnvGuard&) = delete;

 private:
#if defined(STEPCORE_HAVE_MXCSR)
  unsigned saved_csr_ = 0;
#elif defined(STEPCORE_HAVE_FPCR)
  static std::uint64_t get_fpcr() noexcept {
    std::uint64_t r;
    __asm__ volatile("mrs %0, fpcr" : "=r"(r));
    return r;
  }
  static void set_fpcr(std::uint64_t r) noexcept { __asm__ volatile("msr fpcr, %0" : : "r"(r)); }
  std::uint64_t saved_fpcr_ = 0;
#endif
  int saved_round_ = FE_TONEAREST;
};

}  // namespace stepcore::detail
