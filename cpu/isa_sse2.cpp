// The SSE2 instantiation of the generic body (x86-64 baseline, no hardware FMA:
// fused multiply-adds go through std::fma, which is exact).
#include <emmintrin.h>

#include "simd_body.hpp"

namespace stepcore::cpu::detail {

template <>
struct ArchOps<xsimd::sse2> {
  using A = xsimd::sse2;
  using F = xsimd::batch<float, A>;
  using U = xsimd::batch<std::uint32_t, A>;
  using D = xsimd::batch<double, A>;

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
    a = F(_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), v)));
    b = F(_mm_castsi128_ps(_mm_unpackhi_epi16(_mm_setzero_si128(), v)));
  }
  static void to_double(F x, D& lo, D& hi) {
    const __m128 r = x;
    lo = D(_mm_cvtps_pd(r));
    hi = D(_mm_cvtps_pd(_mm_movehl_ps(r, r)));
  }
  static D muladd(D a, D b, D c) { return a * b + c; }
  static F fma(F a, F b, F c) {
    alignas(16) float x[4], y[4], z[4];
    a.store_aligned(x);
    b.store_aligned(y);
    c.store_aligned(z);
    for (int l = 0; l < 4; ++l) x[l] = std::fma(x[l], y[l], z[l]);
    return F::load_aligned(x);
  }
};

const KernelTable& kernel_table_sse2() {
  static const KernelTable table = Body<xsimd::sse2>::make_table("sse2");
  return table;
}

}  // namespace stepcore::cpu::detail
