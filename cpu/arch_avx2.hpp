// ArchOps<Avx2>: the AVX2 + FMA3 primitives of the generic body. Every floating-point
// primitive is the ISA's own intrinsic; integer lanes use xsimd. Included by
// isa_avx2.cpp (the kernel table) and isa_avx2_streamed.cpp (its out-of-place kernels),
// both compiled with the ISA's -m flags; nowhere else.
#pragma once
#include <immintrin.h>

#include "cpu/simd_body.hpp"

namespace stepcore::cpu::detail {

using Avx2 = xsimd::fma3<xsimd::avx2>;

template <>
struct ArchOps<Avx2> {
  struct F {
    __m256 r;
  };
  struct D {
    __m256d r;
  };
  struct M {
    __m256 r;
  };  // all-ones / all-zeros lanes
  using U = xsimd::batch<std::uint32_t, Avx2>;
  using I = xsimd::batch<std::int32_t, Avx2>;
  static constexpr std::size_t N = 8;

  // ---- f32 lanes ----
  static F load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x.r); }
  /// Non-temporal store (p 32-byte aligned): writes the line without reading it first.
  static void stream(float* p, F x) { _mm256_stream_ps(p, x.r); }
  static F set1(float x) { return {_mm256_set1_ps(x)}; }
  static U as_u(F x) { return U(_mm256_castps_si256(x.r)); }
  static F as_f(U x) { return {_mm256_castsi256_ps(x)}; }
  static U as_u(I x) { return U(__m256i(x)); }
  static I as_i(U x) { return I(__m256i(x)); }
  template <int k>
  static U shr(U x) {
    return U(_mm256_srli_epi32(x, k));
  }
  template <int k>
  static U shl(U x) {
    return U(_mm256_slli_epi32(x, k));
  }
  static F add(F a, F b) { return {_mm256_add_ps(a.r, b.r)}; }
  static F sub(F a, F b) { return {_mm256_sub_ps(a.r, b.r)}; }
  static F mul(F a, F b) { return {_mm256_mul_ps(a.r, b.r)}; }
  static F div(F a, F b) { return {_mm256_div_ps(a.r, b.r)}; }
  static F sqrt(F a) { return {_mm256_sqrt_ps(a.r)}; }
  static F fma(F a, F b, F c) { return {_mm256_fmadd_ps(a.r, b.r, c.r)}; }
  static M gt(F a, F b) { return {_mm256_cmp_ps(a.r, b.r, _CMP_GT_OQ)}; }
  static M lt(F a, F b) { return {_mm256_cmp_ps(a.r, b.r, _CMP_LT_OQ)}; }
  static M eq(F a, F b) { return {_mm256_cmp_ps(a.r, b.r, _CMP_EQ_OQ)}; }
  static M is_nan(F a) { return {_mm256_cmp_ps(a.r, a.r, _CMP_UNORD_Q)}; }
  /// m ? a : b (blendv takes its second operand where the mask's sign bit is set).
  static F select(M m, F a, F b) { return {_mm256_blendv_ps(b.r, a.r, m.r)}; }

  // ---- binary64 lanes ----
  static D dzero() { return {_mm256_setzero_pd()}; }
  static D dload(const double* p) { return {_mm256_loadu_pd(p)}; }
  static void dstore(double* p, D x) { _mm256_storeu_pd(p, x.r); }
  static void to_double(F x, D& lo, D& hi) {
    lo = {_mm256_cvtps_pd(_mm256_castps256_ps128(x.r))};
    hi = {_mm256_cvtps_pd(_mm256_extractf128_ps(x.r, 1))};
  }
  static D add_square(D x, D acc) { return {_mm256_fmadd_pd(x.r, x.r, acc.r)}; }
  static D dadd(D a, D b) { return {_mm256_add_pd(a.r, b.r)}; }
  /// (l0 + l2) + (l1 + l3).
  static double dsum(D x) {
    const __m128d q = _mm_add_pd(_mm256_castpd256_pd128(x.r), _mm256_extractf128_pd(x.r, 1));
    return _mm_cvtsd_f64(_mm_add_sd(q, _mm_unpackhi_pd(q, q)));
  }

  // ---- 16-bit storage (integer lanes) ----
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
    a = {_mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v))};
    b = {_mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v))};
  }

  // ---- 8-bit codes and table reads (integer lanes) ----
  /// N bytes, zero-extended to the lanes.
  static U load_u8(const std::uint8_t* p) {
    return U(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  /// The low byte of each lane (lanes in [0, 255]).
  static void store_u8(std::uint8_t* p, U v) {
    const __m256i x = v;
    const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(h, h));
  }
  /// table[index] in each lane.
  static U gather(const std::uint32_t* table, U index) {
    return U(_mm256_i32gather_epi32(reinterpret_cast<const int*>(table), index, 4));
  }
};

}  // namespace stepcore::cpu::detail
