// ArchOps<xsimd::neon64>: the AArch64 Advanced SIMD (NEON) primitives of the generic body.
// Every floating-point primitive is one NEON instruction with IEEE rounding: FADD, FSUB,
// FMUL, FDIV and FSQRT round once, FMLA (vfmaq_f32) is the fused multiply-add, the
// compares are the ordered ones (false on a NaN), BSL selects bitwise. The engine runs
// them with FPCR's flush-to-zero and default-NaN bits cleared (core/fp_env.hpp). NEON has
// no non-temporal store intrinsic, so `stream` is an ordinary store. Included by
// isa_neon.cpp (the kernel table) and isa_neon_streamed.cpp (its out-of-place kernels);
// nowhere else.
#pragma once
#include <arm_neon.h>

#include "cpu/simd_body.hpp"

namespace stepcore::cpu::detail {

template <>
struct ArchOps<xsimd::neon64> {
  using A = xsimd::neon64;
  struct F {
    float32x4_t r;
  };
  struct D {
    float64x2_t r;
  };
  struct M {
    uint32x4_t r;
  };  // all-ones / all-zeros lanes
  using U = xsimd::batch<std::uint32_t, A>;
  using I = xsimd::batch<std::int32_t, A>;
  static constexpr std::size_t N = 4;

  // ---- f32 lanes ----
  static F load(const float* p) { return {vld1q_f32(p)}; }
  static void store(float* p, F x) { vst1q_f32(p, x.r); }
  /// An ordinary store (NEON has no non-temporal store intrinsic): the same bits.
  static void stream(float* p, F x) { vst1q_f32(p, x.r); }
  static F set1(float x) { return {vdupq_n_f32(x)}; }
  static U as_u(F x) { return U(vreinterpretq_u32_f32(x.r)); }
  static F as_f(U x) { return {vreinterpretq_f32_u32(x)}; }
  static U as_u(I x) { return U(vreinterpretq_u32_s32(x)); }
  static I as_i(U x) { return I(vreinterpretq_s32_u32(x)); }
  template <int k>
  static U shr(U x) {
    return U(vshrq_n_u32(x, k));
  }
  template <int k>
  static U shl(U x) {
    return U(vshlq_n_u32(x, k));
  }
  static F add(F a, F b) { return {vaddq_f32(a.r, b.r)}; }
  static F sub(F a, F b) { return {vsubq_f32(a.r, b.r)}; }
  static F mul(F a, F b) { return {vmulq_f32(a.r, b.r)}; }
  static F div(F a, F b) { return {vdivq_f32(a.r, b.r)}; }
  static F sqrt(F a) { return {vsqrtq_f32(a.r)}; }
  /// RN(a*b + c): FMLA, one rounding.
  static F fma(F a, F b, F c) { return {vfmaq_f32(c.r, a.r, b.r)}; }
  static M gt(F a, F b) { return {vcgtq_f32(a.r, b.r)}; }
  static M lt(F a, F b) { return {vcltq_f32(a.r, b.r)}; }
  static M eq(F a, F b) { return {vceqq_f32(a.r, b.r)}; }
  static M is_nan(F a) { return {vmvnq_u32(vceqq_f32(a.r, a.r))}; }
  static F select(M m, F a, F b) { return {vbslq_f32(m.r, a.r, b.r)}; }

  // ---- binary64 lanes ----
  static D dzero() { return {vdupq_n_f64(0.0)}; }
  static D dload(const double* p) { return {vld1q_f64(p)}; }
  static void dstore(double* p, D x) { vst1q_f64(p, x.r); }
  static void to_double(F x, D& lo, D& hi) {
    lo = {vcvt_f64_f32(vget_low_f32(x.r))};
    hi = {vcvt_high_f64_f32(x.r)};
  }
  /// x*x is exact for x widened from f32 (48 significant bits), so the FMLA rounds once,
  /// as a separate multiply and add would.
  static D add_square(D x, D acc) { return {vfmaq_f64(acc.r, x.r, x.r)}; }
  static D dadd(D a, D b) { return {vaddq_f64(a.r, b.r)}; }
  /// l0 + l1.
  static double dsum(D x) { return vgetq_lane_f64(x.r, 0) + vgetq_lane_f64(x.r, 1); }

  // ---- 16-bit storage (integer lanes) ----
  static U load_u16(const std::uint16_t* p) { return U(vmovl_u16(vld1_u16(p))); }
  /// The low 16 bits of each lane.
  static void store_u16(std::uint16_t* p, U v) { vst1_u16(p, vmovn_u32(v)); }
  /// The high 16 bits of each lane.
  static void store_hi16(std::uint16_t* p, U v) { vst1_u16(p, vshrn_n_u32(v, 16)); }
  /// Loads 2N bf16 values as two f32 vectors (lane order unspecified: for sums) and
  /// folds their |x| bit patterns into the 16-bit lane maxima `mx16`.
  static void load_bf16_pairs(const std::uint16_t* p, F& a, F& b, U& mx16) {
    const uint16x8_t v = vld1q_u16(p);
    const uint16x8_t mag = vandq_u16(v, vdupq_n_u16(0x7FFF));
    mx16 = U(vreinterpretq_u32_u16(vmaxq_u16(vreinterpretq_u16_u32(mx16), mag)));
    const uint16x8_t zero = vdupq_n_u16(0);
    a = {vreinterpretq_f32_u16(vzip1q_u16(zero, v))};  // each value in a lane's high half
    b = {vreinterpretq_f32_u16(vzip2q_u16(zero, v))};
  }

  // ---- 8-bit codes and table reads (integer lanes) ----
  /// N bytes, zero-extended to the lanes.
  static U load_u8(const std::uint8_t* p) {
    std::uint32_t w;
    std::memcpy(&w, p, sizeof w);
    const uint16x8_t h = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w)));
    return U(vmovl_u16(vget_low_u16(h)));
  }
  /// The low byte of each lane (lanes in [0, 255]).
  static void store_u8(std::uint8_t* p, U v) {
    const uint16x4_t h = vmovn_u32(v);
    const uint8x8_t b = vmovn_u16(vcombine_u16(h, h));
    const std::uint32_t w = vget_lane_u32(vreinterpret_u32_u8(b), 0);
    std::memcpy(p, &w, sizeof w);
  }
  /// table[index] in each lane.
  static U gather(const std::uint32_t* table, U index) {
    const uint32x4_t i = index;
    const std::uint32_t g[N] = {table[vgetq_lane_u32(i, 0)], table[vgetq_lane_u32(i, 1)],
                                table[vgetq_lane_u32(i, 2)], table[vgetq_lane_u32(i, 3)]};
    return U(vld1q_u32(g));
  }
};

}  // namespace stepcore::cpu::detail
