// The AVX2 + FMA3 instantiation of the generic body.
#include <immintrin.h>

#include "simd_body.hpp"

namespace stepcore::cpu::detail {

using Avx2 = xsimd::fma3<xsimd::avx2>;

template <>
struct ArchOps<Avx2> {
  using F = xsimd::batch<float, Avx2>;
  using U = xsimd::batch<std::uint32_t, Avx2>;
  using D = xsimd::batch<double, Avx2>;

  static U load_u16(const std::uint16_t* p) {
    return U(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store_u16(std::uint16_t* p, U v) {
    const __m256i x = v;
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store_hi16(std::uint16_t* p, U v) {
    // Gather bytes 2,3 of every 32-bit lane into the low 8 bytes of each 128-bit
    // half, then bring the two halves' low quadwords together.
    const __m256i pick =
        _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10,
                         11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i x = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(x));
  }
  /// Loads 2N bf16 values as two f32 vectors (lane order unspecified: for sums) and
  /// folds their |x| bit patterns into the 16-bit lane maxima `mx16`.
  static void load_bf16_pairs(const std::uint16_t* p, F& a, F& b, U& mx16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi16(0x7FFF));
    mx16 = U(_mm256_max_epi16(mx16, mag));
    a = F(_mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v)));
    b = F(_mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v)));
  }
  static void to_double(F x, D& lo, D& hi) {
    const __m256 r = x;
    lo = D(_mm256_cvtps_pd(_mm256_castps256_ps128(r)));
    hi = D(_mm256_cvtps_pd(_mm256_extractf128_ps(r, 1)));
  }
  static D muladd(D a, D b, D c) { return xsimd::fma(a, b, c); }
  static F fma(F a, F b, F c) { return xsimd::fma(a, b, c); }
};

const KernelTable& kernel_table_avx2() {
  static const KernelTable table = Body<Avx2>::make_table("avx2");
  return table;
}

}  // namespace stepcore::cpu::detail
