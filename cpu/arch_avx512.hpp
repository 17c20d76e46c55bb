// ArchOps<Avx512>: the AVX-512 (F, BW, DQ) primitives of the generic body. Every
// floating-point primitive is the ISA's own intrinsic (xsimd 8.1 has no avx512 fma: its
// fallback computes x*y+z with two roundings, so nothing here goes through xsimd float
// math). Included by isa_avx512.cpp (the kernel table) and isa_avx512_streamed.cpp (its
// out-of-place kernels), both compiled with the ISA's -m flags; nowhere else.
#pragma once
#include <immintrin.h>

#include "cpu/simd_body.hpp"

namespace stepcore::cpu::detail {

using Avx512 = xsimd::avx512bw;

template <>
struct ArchOps<Avx512> {
  struct F {
    __m512 r;
  };
  struct D {
    __m512d r;
  };
  struct M {
    __mmask16 r;
  };
  using U = xsimd::batch<std::uint32_t, Avx512>;
  using I = xsimd::batch<std::int32_t, Avx512>;
  static constexpr std::size_t N = 16;

  // ---- f32 lanes ----
  static F load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x.r); }
  /// Non-temporal store (p 64-byte aligned): writes the line without reading it first.
  static void stream(float* p, F x) { _mm512_stream_ps(p, x.r); }
  static F set1(float x) { return {_mm512_set1_ps(x)}; }
  static U as_u(F x) { return U(_mm512_castps_si512(x.r)); }
  static F as_f(U x) { return {_mm512_castsi512_ps(x)}; }
  static U as_u(I x) { return U(__m512i(x)); }
  static I as_i(U x) { return I(__m512i(x)); }
  template <int k>
  static U shr(U x) {
    return U(_mm512_srli_epi32(x, k));
  }
  template <int k>
  static U shl(U x) {
    return U(_mm512_slli_epi32(x, k));
  }
  static F add(F a, F b) { return {_mm512_add_ps(a.r, b.r)}; }
  static F sub(F a, F b) { return {_mm512_sub_ps(a.r, b.r)}; }
  static F mul(F a, F b) { return {_mm512_mul_ps(a.r, b.r)}; }
  static F div(F a, F b) { return {_mm512_div_ps(a.r, b.r)}; }
  static F sqrt(F a) { return {_mm512_sqrt_ps(a.r)}; }
  static F fma(F a, F b, F c) { return {_mm512_fmadd_ps(a.r, b.r, c.r)}; }
  static M gt(F a, F b) { return {_mm512_cmp_ps_mask(a.r, b.r, _CMP_GT_OQ)}; }
  static M lt(F a, F b) { return {_mm512_cmp_ps_mask(a.r, b.r, _CMP_LT_OQ)}; }
  static M eq(F a, F b) { return {_mm512_cmp_ps_mask(a.r, b.r, _CMP_EQ_OQ)}; }
  static M is_nan(F a) { return {_mm512_cmp_ps_mask(a.r, a.r, _CMP_UNORD_Q)}; }
  /// m ? a : b (the blend takes its second operand where the mask bit is set).
  static F select(M m, F a, F b) { return {_mm512_mask_blend_ps(m.r, b.r, a.r)}; }

  // ---- binary64 lanes ----
  static D dzero() { return {_mm512_setzero_pd()}; }
  static D dload(const double* p) { return {_mm512_loadu_pd(p)}; }
  static void dstore(double* p, D x) { _mm512_storeu_pd(p, x.r); }
  static void to_double(F x, D& lo, D& hi) {
    lo = {_mm512_cvtps_pd(_mm512_castps512_ps256(x.r))};
    hi = {_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.r), 1)))};
  }
  static D add_square(D x, D acc) { return {_mm512_fmadd_pd(x.r, x.r, acc.r)}; }
  static D dadd(D a, D b) { return {_mm512_add_pd(a.r, b.r)}; }
  /// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): halves, then quarters, then pairs.
  static double dsum(D x) {
    const __m256d h = _mm256_add_pd(_mm512_castpd512_pd256(x.r), _mm512_extractf64x4_pd(x.r, 1));
    const __m128d q = _mm_add_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));
    return _mm_cvtsd_f64(_mm_add_sd(q, _mm_unpackhi_pd(q, q)));
  }

  // ---- 16-bit storage (integer lanes) ----
  static U load_u16(const std::uint16_t* p) {
    return U(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static void store_u16(std::uint16_t* p, U v) {
    const __m512i x = v;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
  }
  static void store_hi16(std::uint16_t* p, U v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
  }
  /// Loads 2N bf16 values as two f32 vectors (lane order unspecified: for sums) and
  /// folds their |x| bit patterns into the 16-bit lane maxima `mx16`.
  static void load_bf16_pairs(const std::uint16_t* p, F& a, F& b, U& mx16) {
    const __m512i v = _mm512_loadu_si512(p);
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF));
    mx16 = U(_mm512_max_epi16(mx16, mag));
    a = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), v))};
    b = {_mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), v))};
  }

  // ---- 8-bit codes and table reads (integer lanes) ----
  /// N bytes, zero-extended to the lanes.
  static U load_u8(const std::uint8_t* p) {
    return U(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  /// The low byte of each lane (lanes in [0, 255]).
  static void store_u8(std::uint8_t* p, U v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
  }
  /// table[index] in each lane.
  static U gather(const std::uint32_t* table, U index) {
    return U(_mm512_i32gather_epi32(index, table, 4));
  }
};

}  // namespace stepcore::cpu::detail
