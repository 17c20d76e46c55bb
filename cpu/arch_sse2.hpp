// ArchOps<xsimd::sse2>: the SSE2 primitives of the generic body (x86-64 baseline).
// Every floating-point primitive is an SSE2 intrinsic, except the fused multiply-add,
// which SSE2 lacks: it is std::fma per lane (C's fma: one rounding, exact by its
// definition in every libm). Included by isa_sse2.cpp (the kernel table) and
// isa_sse2_streamed.cpp (its out-of-place kernels), both compiled with the ISA's -m
// flags; nowhere else.
#pragma once
#include <emmintrin.h>

#include "cpu/simd_body.hpp"

namespace stepcore::cpu::detail {

template <>
struct ArchOps<xsimd::sse2> {
  using A = xsimd::sse2;
  struct F {
    __m128 r;
  };
  struct D {
    __m128d r;
  };
  struct M {
    __m128 r;
  };  // all-ones / all-zeros lanes
  using U = xsimd::batch<std::uint32_t, A>;
  using I = xsimd::batch<std::int32_t, A>;
  static constexpr std::size_t N = 4;

  // ---- f32 lanes ----
  static F load(const float* p) { return {_mm_loadu_ps(p)}; }
  static void store(float* p, F x) { _mm_storeu_ps(p, x.r); }
  /// Non-temporal store (p 16-byte aligned): writes the line without reading it first.
  static void stream(float* p, F x) { _mm_stream_ps(p, x.r); }
  static F set1(float x) { return {_mm_set1_ps(x)}; }
  static U as_u(F x) { return U(_mm_castps_si128(x.r)); }
  static F as_f(U x) { return {_mm_castsi128_ps(x)}; }
  static U as_u(I x) { return U(__m128i(x)); }
  static I as_i(U x) { return I(__m128i(x)); }
  template <int k>
  static U shr(U x) {
    return U(_mm_srli_epi32(x, k));
  }
  template <int k>
  static U shl(U x) {
    return U(_mm_slli_epi32(x, k));
  }
  static F add(F a, F b) { return {_mm_add_ps(a.r, b.r)}; }
  static F sub(F a, F b) { return {_mm_sub_ps(a.r, b.r)}; }
  static F mul(F a, F b) { return {_mm_mul_ps(a.r, b.r)}; }
  static F div(F a, F b) { return {_mm_div_ps(a.r, b.r)}; }
  static F sqrt(F a) { return {_mm_sqrt_ps(a.r)}; }
  static F fma(F a, F b, F c) {
    alignas(16) float x[4], y[4], z[4];
    _mm_store_ps(x, a.r);
    _mm_store_ps(y, b.r);
    _mm_store_ps(z, c.r);
    for (int l = 0; l < 4; ++l) x[l] = std::fma(x[l], y[l], z[l]);
    return {_mm_load_ps(x)};
  }
  // cmpgt/cmplt are the ordered predicates (false on a NaN); SSE2 has no quiet form,
  // which changes only the invalid flag, never a result.
  static M gt(F a, F b) { return {_mm_cmpgt_ps(a.r, b.r)}; }
  static M lt(F a, F b) { return {_mm_cmplt_ps(a.r, b.r)}; }
  static M eq(F a, F b) { return {_mm_cmpeq_ps(a.r, b.r)}; }
  static M is_nan(F a) { return {_mm_cmpunord_ps(a.r, a.r)}; }
  static F select(M m, F a, F b) {
    return {_mm_or_ps(_mm_and_ps(m.r, a.r), _mm_andnot_ps(m.r, b.r))};
  }

  // ---- binary64 lanes ----
  static D dzero() { return {_mm_setzero_pd()}; }
  static D dload(const double* p) { return {_mm_loadu_pd(p)}; }
  static void dstore(double* p, D x) { _mm_storeu_pd(p, x.r); }
  static void to_double(F x, D& lo, D& hi) {
    lo = {_mm_cvtps_pd(x.r)};
    hi = {_mm_cvtps_pd(_mm_movehl_ps(x.r, x.r))};
  }
  /// x*x is exact for x widened from f32 (48 significant bits), so one rounding.
  static D add_square(D x, D acc) { return {_mm_add_pd(_mm_mul_pd(x.r, x.r), acc.r)}; }
  static D dadd(D a, D b) { return {_mm_add_pd(a.r, b.r)}; }
  /// l0 + l1.
  static double dsum(D x) { return _mm_cvtsd_f64(_mm_add_sd(x.r, _mm_unpackhi_pd(x.r, x.r))); }

  // ---- 16-bit storage (integer lanes) ----
  static U load_u16(const std::uint16_t* p) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return U(_mm_unpacklo_epi16(v, _mm_setzero_si128()));
  }
  static void store_u16(std::uint16_t* p, U v) {
    __m128i x = v;
    x = _mm_srai_epi32(_mm_slli_epi32(x, 16), 16);  // sign-extend: packs cannot saturate
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(x, x));
  }
  static void store_hi16(std::uint16_t* p, U v) {
    const __m128i x = _mm_srai_epi32(v, 16);  // sign-extended high halves: packs is exact
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(x, x));
  }
  /// Loads 2N bf16 values as two f32 vectors (lane order unspecified: for sums) and
  /// folds their |x| bit patterns into the 16-bit lane maxima `mx16`.
  static void load_bf16_pairs(const std::uint16_t* p, F& a, F& b, U& mx16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mag = _mm_and_si128(v, _mm_set1_epi16(0x7FFF));
    mx16 = U(_mm_max_epi16(mx16, mag));  // magnitudes <= 0x7FFF: signed max is exact
    a = {_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), v))};
    b = {_mm_castsi128_ps(_mm_unpackhi_epi16(_mm_setzero_si128(), v))};
  }

  // ---- 8-bit codes and table reads (integer lanes) ----
  /// N bytes, zero-extended to the lanes.
  static U load_u8(const std::uint8_t* p) {
    std::int32_t w;
    std::memcpy(&w, p, sizeof w);
    const __m128i z = _mm_setzero_si128();
    return U(_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(w), z), z));
  }
  /// The low byte of each lane (lanes in [0, 255]).
  static void store_u8(std::uint8_t* p, U v) {
    const __m128i h = _mm_packs_epi32(v, v);  // exact: lanes in [0, 255]
    const std::int32_t w = _mm_cvtsi128_si32(_mm_packus_epi16(h, h));
    std::memcpy(p, &w, sizeof w);
  }
  /// table[index] in each lane.
  static U gather(const std::uint32_t* table, U index) {
    alignas(16) std::uint32_t i[N];
    _mm_store_si128(reinterpret_cast<__m128i*>(i), index);
    return U(_mm_setr_epi32(static_cast<int>(table[i[0]]), static_cast<int>(table[i[1]]),
                            static_cast<int>(table[i[2]]), static_cast<int>(table[i[3]])));
  }
};

}  // namespace stepcore::cpu::detail
