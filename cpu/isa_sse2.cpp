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
