// The AVX-512 (F, BW, DQ) instantiation of the generic body.
#include <immintrin.h>

#include "simd_body.hpp"

namespace stepcore::cpu::detail {

using Avx512 = xsimd::avx512bw;

template <>
struct ArchOps<Avx512> {
  using F = xsimd::batch<float, Avx512>;
  using U = xsimd::batch<std::uint32_t, Avx512>;
  using D = xsimd::batch<double, Avx512>;

  static U load_u16(const std::uint16_t* p) {
    return U(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static void store_u16(std::uint16_t* p, U v) {
    const __m512i x = v;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
  }
  static void store_hi16(std::uint16_t* p, U v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
  }
  static void to_double(F x, D& lo, D& hi) {
    const __m512 r = x;
    lo = D(_mm512_cvtps_pd(_mm512_castps512_ps256(r)));
    hi = D(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1))));
  }
  static D muladd(D a, D b, D c) { return xsimd::fma(a, b, c); }
  static F fma(F a, F b, F c) { return xsimd::fma(a, b, c); }
};

const KernelTable& kernel_table_avx512() {
  static const KernelTable table = Body<Avx512>::make_table("avx512");
  return table;
}

}  // namespace stepcore::cpu::detail
