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
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
  }
  /// Loads 2N bf16 values as two f32 vectors (lane order unspecified: for sums) and
  /// folds their |x| bit patterns into the 16-bit lane maxima `mx16`.
  static void load_bf16_pairs(const std::uint16_t* p, F& a, F& b, U& mx16) {
    const __m512i v = _mm512_loadu_si512(p);
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF));
    mx16 = U(_mm512_max_epi16(mx16, mag));
    a = F(_mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), v)));
    b = F(_mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), v)));
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
