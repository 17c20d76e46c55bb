// The one generic body of every CPU kernel, written once over xsimd batches and
// compiled per ISA (each isa_<name>.cpp includes it with its own -m flags and
// supplies ArchOps<Arch>, the few operations xsimd 8.1 lacks: 16-bit widening
// loads and narrowing stores, float->double halves, and an exact FMA).
//
// Every element follows docs/numerics.md with the same operation order as the
// reference; vector lanes and the scalar remainder loop compute identical bits.
// Do not include this header outside an isa_*.cpp file.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <xsimd/xsimd.hpp>

#include "../src/core/element_ops.hpp"
#include "kernel_table.hpp"
#include "stepcore/convert.hpp"

namespace stepcore::cpu::detail {

/// Per-architecture primitives; specialised in each ISA's translation unit.
template <class A>
struct ArchOps;

template <class A>
struct Body {
  using F = xsimd::batch<float, A>;
  using I = xsimd::batch<std::int32_t, A>;
  using U = xsimd::batch<std::uint32_t, A>;
  using D = xsimd::batch<double, A>;
  using Ops = ArchOps<A>;
  static constexpr std::size_t N = F::size;
  /// Software prefetch distance of the streaming loops (bytes ahead of the read).
  static constexpr std::size_t kPrefetchBytes = 1024;

  // ---- bit casts ----------------------------------------------------------------
  static U as_u(F x) { return xsimd::bitwise_cast<U>(x); }
  static U as_u(I x) { return xsimd::bitwise_cast<U>(x); }
  static I as_i(U x) { return xsimd::bitwise_cast<I>(x); }
  static F as_f(U x) { return xsimd::bitwise_cast<F>(x); }

  // ---- conversions (docs/numerics.md section 2) -----------------------------------
  /// f32 -> bf16 bits in the low half of each lane.
  static U bf16_bits(F x) {
    const U u = as_u(x);
    const U r = (u + U(0x7FFFu) + ((u >> 16) & U(1u))) >> 16;
    const auto is_nan = as_i(u & U(0x7FFFFFFFu)) > I(0x7F800000);
    return as_u(xsimd::select(is_nan, I(0x7FC0), as_i(r)));
  }
  /// R_bf16 of a gradient read, in place: f32 rounded to the bf16 grid, still an f32.
  /// Only for x = f32(g) * factor with g read from bf16 and a finite factor: a NaN x
  /// is then g's NaN, quieted by the multiply (x86 returns the NaN operand), whose
  /// low 16 bits are zero, so adding the rounding increment cannot carry out of the
  /// fraction and x stays a NaN (the spec leaves an f32 NaN's payload open). This
  /// saves the NaN select of a general conversion on the hot read path.
  static F round_bf16_read(F x) {
    const U u = as_u(x);
    return as_f((u + U(0x7FFFu) + ((u >> 16) & U(1u))) & U(0xFFFF0000u));
  }
  /// f32 -> f16 bits in the low half of each lane.
  static U f16_bits(F x) {
    const U u = as_u(x);
    const U sign = (u >> 16) & U(0x8000u);
    const U a = u & U(0x7FFFFFFFu);
    const I ai = as_i(a);
    const U t = a - U(0x38000000u);  // rebias 127 -> 15 (normal results only)
    const U normal = (t + U(0xFFFu) + ((t >> 13) & U(1u))) >> 13;
    // |x| < 2^-14: adding 0.5 (ulp 2^-24) rounds |x| to the f16 subnormal grid, RNE.
    const U sub = as_u(as_f(a) + F(0.5f)) - U(0x3F000000u);
    I r = xsimd::select(ai >= I(0x38800000), as_i(normal), as_i(sub));
    r = xsimd::select(ai >= I(0x477FF000), I(0x7C00), r);
    r = xsimd::select(ai > I(0x7F800000), I(0x7E00), r);
    return as_u(r) | sign;
  }
  /// bf16 bits (low half of each lane) -> f32, exact.
  static F from_bf16(U h) { return as_f(h << 16); }
  /// f16 bits (low half of each lane) -> f32, exact (subnormals scaled by 2^112).
  static F from_f16(U h) {
    const U sign = (h & U(0x8000u)) << 16;
    const U em = h & U(0x7FFFu);
    const U shifted = em << 13;
    const F finite = as_f(shifted) * F(0x1p112f);
    const U special = shifted | U(0x7F800000u);
    const auto is_special = as_i(em) >= I(0x7C00);
    return as_f(as_u(xsimd::select(is_special, as_i(special), as_i(as_u(finite)))) | sign);
  }

  // ---- typed loads and stores ------------------------------------------------------
  static F load(const float* p) { return F::load_unaligned(p); }
  static F load(const bfloat16_t* p) {
    return from_bf16(Ops::load_u16(reinterpret_cast<const std::uint16_t*>(p)));
  }
  static F load(const float16_t* p) {
    return from_f16(Ops::load_u16(reinterpret_cast<const std::uint16_t*>(p)));
  }
  static void store(float* p, F x) { x.store_unaligned(p); }
  static void store(bfloat16_t* p, F x) {
    // Round in place on the f32 pattern, then keep each lane's high half.
    const U u = as_u(x);
    const U r = u + U(0x7FFFu) + ((u >> 16) & U(1u));
    const U bits =
        as_u(xsimd::select(xsimd::isnan(x), F(std::numeric_limits<float>::quiet_NaN()), as_f(r)));
    Ops::store_hi16(reinterpret_cast<std::uint16_t*>(p), bits);
  }
  static void store(float16_t* p, F x) {
    Ops::store_u16(reinterpret_cast<std::uint16_t*>(p), f16_bits(x));
  }

  /// R_T of a gradient read (see round_bf16_read): round to T and widen back.
  template <class T>
  static F round_to(F x) {
    if constexpr (std::is_same_v<T, float>) {
      return x;
    } else if constexpr (std::is_same_v<T, bfloat16_t>) {
      return round_bf16_read(x);
    } else {
      return from_f16(f16_bits(x));
    }
  }

  /// The gradient read of section 3: R_T(R_T(f32(g) * scale) * clip). A factor of
  /// exactly 1 is skipped: x * 1 = x and R_T(x) = x for every x read from T (a NaN
  /// stays a NaN, whose payload the spec leaves open).
  /// Which factors of the read a loop applies, as a template parameter so the
  /// hot loops carry no branch: 0 none, 1 scale, 2 scale and clip.
  template <int Mode, class T>
  static F read_mode(const T* p, F scale, F clip) {
    F x = load(p);
    if constexpr (Mode >= 1) x = round_to<T>(x * scale);
    if constexpr (Mode >= 2) x = round_to<T>(x * clip);
    return x;
  }
  static int read_mode_of(const GradientRead& r) {
    if (r.clip != 1.0f) return 2;
    return r.scale != 1.0f ? 1 : 0;
  }
  /// Calls fn(std::integral_constant<int, Mode>{}) for the read's mode.
  template <class Fn>
  static void with_read_mode(const GradientRead& r, Fn fn) {
    switch (read_mode_of(r)) {
      case 0:
        fn(std::integral_constant<int, 0>{});
        break;
      case 1:
        fn(std::integral_constant<int, 1>{});
        break;
      default:
        fn(std::integral_constant<int, 2>{});
        break;
    }
  }
  template <class T>
  static float read1(const T* p, float scale, float clip) {
    float x = to_f32(*p);
    x = ::stepcore::round_to<T>(x * scale);
    x = ::stepcore::round_to<T>(x * clip);
    return x;
  }

  // ---- AdamW ----------------------------------------------------------------------
  /// One element of either formula (the chunk remainder and torch's tail): the
  /// formulas shared with the GPU block bodies.
  template <class G, class O>
  static void adamw_one(const AdamWRange& r, std::size_t i) {
    ::stepcore::detail::adamw_element<G, O>(
        r.param, r.exp_avg, r.exp_avg_sq, static_cast<const G*>(r.grad), static_cast<O*>(r.out),
        r.scalars, r.torch, r.tail_begin, r.read.scale, r.read.clip, i);
  }

  /// Vector lanes of one formula over [i, end): every element uses the body form.
  /// Pointers and scalars are locals so nothing is reloaded per iteration; the
  /// loop-invariant read flags are unswitched by the compiler.
  template <class G, class O, bool Torch, int Mode>
  static void adamw_lanes(float* __restrict P, float* __restrict M, float* __restrict V,
                          const G* __restrict grad, O* __restrict out, const AdamWScalars s,
                          const GradientRead read, std::size_t i, std::size_t end) {
    const F scale(read.scale), clip(read.clip);
    const F decay(s.decay), b1(s.beta1), b2(s.beta2), omb1(s.one_minus_beta1),
        omb2(s.one_minus_beta2), coeff(s.lerp_coeff), step_size(s.step_size), bc2(s.bc2_sqrt),
        eps(s.eps);
    const bool apply_decay = s.apply_decay, lerp_small = s.lerp_small;
    for (; i + N <= end; i += N) {
      const F g = read_mode<Mode>(grad + i, scale, clip);
      F p = F::load_unaligned(P + i);
      F m = F::load_unaligned(M + i);
      F v = F::load_unaligned(V + i);
      if constexpr (!Torch) {
        p = p * decay;
        m = m * b1 + g * omb1;
        v = v * b2 + (g * g) * omb2;
        const F d = xsimd::sqrt(v) / bc2 + eps;
        p = p - (step_size * m) / d;
      } else {
        if (apply_decay) p = p * decay;
        const F diff = g - m;
        m = Ops::fma(coeff, diff, lerp_small ? m : g);
        v = Ops::fma(omb2 * g, g, v * b2);
        const F d = xsimd::sqrt(v) / bc2 + eps;
        p = p + (step_size * m) / d;
      }
      p.store_unaligned(P + i);
      m.store_unaligned(M + i);
      v.store_unaligned(V + i);
      if constexpr (!std::is_void_v<O>) store(out + i, p);
    }
  }

  template <class G, class O>
  static void adamw(const AdamWRange& r, std::size_t begin, std::size_t end) {
    // Vector lanes only where every lane uses the body form; the rest (the chunk's
    // remainder and torch's tail) element by element.
    std::size_t vec_end = end;
    if (r.torch && r.tail_begin < vec_end) vec_end = r.tail_begin > begin ? r.tail_begin : begin;
    const std::size_t lanes_end = begin + (vec_end - begin) / N * N;
    const G* grad = static_cast<const G*>(r.grad);
    O* out = static_cast<O*>(r.out);
    with_read_mode(r.read, [&](auto mode) {
      constexpr int M = decltype(mode)::value;
      if (r.torch)
        adamw_lanes<G, O, true, M>(r.param, r.exp_avg, r.exp_avg_sq, grad, out, r.scalars, r.read,
                                   begin, lanes_end);
      else
        adamw_lanes<G, O, false, M>(r.param, r.exp_avg, r.exp_avg_sq, grad, out, r.scalars, r.read,
                                    begin, lanes_end);
    });
    for (std::size_t i = lanes_end; i < end; ++i) adamw_one<G, O>(r, i);
  }

  // ---- SignSGD --------------------------------------------------------------------

  template <class G, class O>
  static void sign_sgd(const SignSgdRange& r, std::size_t begin, std::size_t end) {
    const SignSgdScalars& s = r.scalars;
    const G* grad = static_cast<const G*>(r.grad);
    const F neg_lr(s.neg_lr), neg_lr_wd(s.neg_lr_wd), one(1.0f), minus_one(-1.0f), zero(0.0f);
    std::size_t i = begin;
    for (; i + N <= end; i += N) {
      const F g = load(grad + i);
      // +1, -1, +0 for zeros, and the NaN itself for NaN (selects keep g there).
      F sg = xsimd::select(g > zero, one, xsimd::select(g < zero, minus_one, g));
      sg = xsimd::select(g == zero, zero, sg);
      F p = F::load_unaligned(r.param + i);
      if (s.apply_decay) p = Ops::fma(p, neg_lr_wd, p);
      // fma(sg, neg_lr, p) with sg in {+-1, +0, NaN}: the product is exact, so a
      // separate multiply and add round once, like the FMA (cheap without FMA too).
      p = p + sg * neg_lr;
      p.store_unaligned(r.param + i);
      if constexpr (!std::is_void_v<O>) store(static_cast<O*>(r.out) + i, p);
    }
    for (; i < end; ++i)
      ::stepcore::detail::sign_sgd_element<G, O>(r.param, grad, static_cast<O*>(r.out), s, i);
  }

  // ---- accumulate and scale ---------------------------------------------------------
  template <class S>
  static void accumulate(float* acc, const void* src_v, bool copy, std::size_t begin,
                         std::size_t end) {
    const S* src = static_cast<const S*>(src_v);
    std::size_t i = begin;
    if (copy) {
      for (; i + N <= end; i += N) load(src + i).store_unaligned(acc + i);
      for (; i < end; ++i) acc[i] = to_f32(src[i]);
    } else {
      for (; i + N <= end; i += N) {
        __builtin_prefetch(acc + i + kPrefetchBytes / sizeof(float), 1);
        __builtin_prefetch(src + i + kPrefetchBytes / sizeof(float));
        (F::load_unaligned(acc + i) + load(src + i)).store_unaligned(acc + i);
      }
      for (; i < end; ++i) acc[i] = acc[i] + to_f32(src[i]);
    }
  }

  template <class T>
  static void scale(void* data_v, float s, std::size_t begin, std::size_t end) {
    T* data = static_cast<T*>(data_v);
    const F sv(s);
    std::size_t i = begin;
    for (; i + N <= end; i += N) store(data + i, load(data + i) * sv);
    for (; i < end; ++i) data[i] = from_f32<T>(to_f32(data[i]) * s);
  }

  // ---- norm partial (approximate: exact squares, binary64 block sums) ---------------
  /// Deposits the exact squares of elements [begin, end) one at a time; counts
  /// non-finite values. Used for blocks that contain a NaN or Inf.
  template <class T>
  static void norm_exact(const T* data, const GradientRead& read, std::size_t begin,
                         std::size_t end, NormPartial& out) {
    for (std::size_t i = begin; i < end; ++i) {
      const float x = read1(data + i, read.scale, read.clip);
      const std::uint32_t a = f32_bits(x) & 0x7FFFFFFFu;
      if (a > 0x7F800000u) {
        ++out.nan_count;
        continue;
      }
      if (a == 0x7F800000u) {
        ++out.inf_count;
        continue;
      }
      if (a > out.max_abs_bits) out.max_abs_bits = a;
      if (a == 0) continue;
      const std::uint32_t e = a >> 23;
      const std::uint64_t m = e == 0 ? (a & 0x7FFFFFu) : ((a & 0x7FFFFFu) | 0x800000u);
      const int shift = 2 * (e == 0 ? -149 : static_cast<int>(e) - 150) + 298;
      ::stepcore::detail::deposit(out.digits, m * m, shift);
    }
    ::stepcore::detail::normalize_digits(out.digits);
  }

  template <class T>
  static void norm_exact_range(const void* data, const GradientRead& read, std::size_t begin,
                               std::size_t end, NormPartial& out) {
    norm_exact(static_cast<const T*>(data), read, begin, end, out);
  }

  template <class T>
  static void norm(const void* data_v, const GradientRead& read, std::size_t begin, std::size_t end,
                   NormPartial& out) {
    with_read_mode(read, [&](auto mode) {
      norm_mode<T, decltype(mode)::value>(static_cast<const T*>(data_v), read, begin, end, out);
    });
  }

  template <class T, int Mode>
  static void norm_mode(const T* data, const GradientRead& read, std::size_t begin, std::size_t end,
                        NormPartial& out) {
    const F scale(read.scale), clip(read.clip);
    const U abs_mask(0x7FFFFFFFu);
    for (std::size_t b = begin; b < end; b += kNormBlockElements) {
      const std::size_t e = b + kNormBlockElements < end ? b + kNormBlockElements : end;
      // Four independent binary64 chains hide the FMA latency.
      D acc0(0.0), acc1(0.0), acc2(0.0), acc3(0.0);
      I mx(0), mx2(0);
      std::size_t i = b;
      if constexpr (std::is_same_v<T, bfloat16_t> && Mode == 0) {
        // Unscaled bf16: the values are f32 bit patterns once a zero low half is
        // interleaved in, and the max is taken on 16-bit magnitudes, two vectors at a time.
        U mx16(0u);
        for (; i + 2 * N <= e; i += 2 * N) {
          __builtin_prefetch(data + i + kPrefetchBytes / sizeof(T));
          F x, y;
          Ops::load_bf16_pairs(reinterpret_cast<const std::uint16_t*>(data + i), x, y, mx16);
          D xl, xh, yl, yh;
          Ops::to_double(x, xl, xh);
          Ops::to_double(y, yl, yh);
          acc0 = Ops::muladd(xl, xl, acc0);
          acc1 = Ops::muladd(xh, xh, acc1);
          acc2 = Ops::muladd(yl, yl, acc2);
          acc3 = Ops::muladd(yh, yh, acc3);
        }
        alignas(64) std::uint16_t m16[2 * N];
        mx16.store_aligned(reinterpret_cast<std::uint32_t*>(m16));
        std::uint16_t top = 0;
        for (std::size_t l = 0; l < 2 * N; ++l) top = m16[l] > top ? m16[l] : top;
        mx = xsimd::max(mx, I(static_cast<std::int32_t>(std::uint32_t{top} << 16)));
      }
      for (; i + 2 * N <= e; i += 2 * N) {
        __builtin_prefetch(data + i + kPrefetchBytes / sizeof(T));
        const F x = read_mode<Mode>(data + i, scale, clip);
        const F y = read_mode<Mode>(data + i + N, scale, clip);
        mx = xsimd::max(mx, as_i(as_u(x) & abs_mask));
        mx2 = xsimd::max(mx2, as_i(as_u(y) & abs_mask));
        D xl, xh, yl, yh;
        Ops::to_double(x, xl, xh);
        Ops::to_double(y, yl, yh);
        acc0 = Ops::muladd(xl, xl, acc0);
        acc1 = Ops::muladd(xh, xh, acc1);
        acc2 = Ops::muladd(yl, yl, acc2);
        acc3 = Ops::muladd(yh, yh, acc3);
      }
      for (; i + N <= e; i += N) {
        const F x = read_mode<Mode>(data + i, scale, clip);
        mx = xsimd::max(mx, as_i(as_u(x) & abs_mask));
        D xl, xh;
        Ops::to_double(x, xl, xh);
        acc0 = Ops::muladd(xl, xl, acc0);
        acc1 = Ops::muladd(xh, xh, acc1);
      }
      mx = xsimd::max(mx, mx2);
      alignas(64) std::int32_t lanes[N];
      mx.store_aligned(lanes);
      std::uint32_t block_max = 0;
      for (std::size_t l = 0; l < N; ++l)
        if (static_cast<std::uint32_t>(lanes[l]) > block_max) block_max = lanes[l];
      double tail = 0.0;
      for (; i < e; ++i) {
        const float x = read1(data + i, read.scale, read.clip);
        const std::uint32_t a = f32_bits(x) & 0x7FFFFFFFu;
        if (a > block_max) block_max = a;
        const double xd = x;
        tail = tail + xd * xd;
      }
      if (block_max >= 0x7F800000u) {  // a NaN or Inf: count them, deposit the rest exactly
        norm_exact(data, read, b, e, out);
        continue;
      }
      const double sum = xsimd::hadd((acc0 + acc1) + (acc2 + acc3)) + tail;
      ::stepcore::detail::deposit_double(out.digits, sum);
      if (block_max > out.max_abs_bits) out.max_abs_bits = block_max;
      out.approximate = 1;
      ::stepcore::detail::normalize_digits(out.digits);
    }
  }

  // ---- the table ---------------------------------------------------------------------
  template <class G>
  static void fill_grad(KernelTable& t, int g) {
    t.adamw[g][0] = &adamw<G, void>;
    t.adamw[g][1] = &adamw<G, float>;
    t.adamw[g][2] = &adamw<G, bfloat16_t>;
    t.adamw[g][3] = &adamw<G, float16_t>;
    t.sign_sgd[g][0] = &sign_sgd<G, void>;
    t.sign_sgd[g][1] = &sign_sgd<G, float>;
    t.sign_sgd[g][2] = &sign_sgd<G, bfloat16_t>;
    t.sign_sgd[g][3] = &sign_sgd<G, float16_t>;
    t.accumulate[g] = &accumulate<G>;
    t.scale[g] = &scale<G>;
    t.norm[g] = &norm<G>;
    t.norm_exact[g] = &norm_exact_range<G>;
  }

  static KernelTable make_table(const char* name) {
    KernelTable t{};
    t.isa = name;
    fill_grad<float>(t, static_cast<int>(DType::f32));
    fill_grad<bfloat16_t>(t, static_cast<int>(DType::bf16));
    fill_grad<float16_t>(t, static_cast<int>(DType::f16));
    return t;
  }
};

}  // namespace stepcore::cpu::detail
