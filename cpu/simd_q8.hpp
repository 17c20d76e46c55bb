// The 8-bit state kernels of the generic body (docs/numerics.md 8f; core/q8.hpp):
// dequantization, the block maximum and the encoding over integer lanes and one f32
// operation each, and each unit's q8 kernel (one pass over memory per block). Part of
// simd_body.hpp, which includes it last; compiled per ISA with it. Do not include it
// elsewhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/q8.hpp"
#include "cpu/simd_body.hpp"

namespace stepcore::cpu::detail {

template <class A>
struct Q8Body : Body<A> {
  using B = Body<A>;
  using B::as_f;
  using B::as_i;
  using B::as_u;
  using B::N;
  using B::splat;
  using typename B::F;
  using typename B::I;
  using typename B::Ops;
  using typename B::U;

  /// x[i] = M[codes[i]] * absmax for i in [0, n), M the map's values (f32 patterns).
  static void q8_dequantize(const std::uint8_t* codes, float absmax, const std::uint32_t* map,
                            float* x, std::size_t n) {
    const F a = splat(absmax);
    std::size_t i = 0;
    for (; i + N <= n; i += N)
      Ops::store(x + i, Ops::mul(as_f(Ops::gather(map, Ops::load_u8(codes + i))), a));
    for (; i < n; ++i) x[i] = f32_from_bits(map[codes[i]]) * absmax;
  }

  /// A codebook's bucket-table constants, splatted once per kernel call (kept in
  /// registers across its loops, not rebuilt for each vector).
  struct CodeConsts {
    const ::stepcore::detail::Q8Codebook* book = nullptr;  ///< the codebook (scalar tails)
    const std::uint32_t* buckets = nullptr;
    I floor, ceil, low_mask, middle, nan_code, one;
    U pos_mask, moves_bit, pos_bias_and_guard, two_guard, abs_mask;
    CodeConsts() = default;
    explicit CodeConsts(const ::stepcore::detail::Q8Codebook& cb)
        : book(&cb),
          buckets(cb.buckets),
          floor(static_cast<std::int32_t>(::stepcore::detail::kQ8KeyFloor)),
          ceil(static_cast<std::int32_t>(::stepcore::detail::kQ8KeyCeil)),
          low_mask(static_cast<std::int32_t>(::stepcore::detail::kQ8KeyLowMask)),
          middle(static_cast<std::int32_t>(::stepcore::detail::kQ8Buckets)),
          nan_code(static_cast<std::int32_t>(cb.nan_code)),
          one(1),
          pos_mask(::stepcore::detail::kQ8PosMask),
          moves_bit(::stepcore::detail::kQ8MovesBit),
          pos_bias_and_guard(static_cast<std::uint32_t>(::stepcore::detail::kQ8PosBias +
                                                        ::stepcore::detail::kQ8Guard)),
          two_guard(static_cast<std::uint32_t>(2 * ::stepcore::detail::kQ8Guard)),
          abs_mask(0x7FFFFFFFu) {}
  };

  /// The codes of y's lanes (y's f32 patterns `b`): ::stepcore::detail::q8_code,
  /// lane-wise; `near` is set in the lanes within kQ8Guard keys of a threshold (core/q8.hpp).
  /// NaNs: whether a lane may hold a NaN (else its code is left to the caller's guarantee).
  template <bool NaNs = true>
  static U q8_codes(const CodeConsts& c, U b, typename U::batch_bool_type& near) {
    namespace d = ::stepcore::detail;
    const I mag = as_i(b & c.abs_mask);
    const I sign = as_i(b) >> 31;  // all ones in negative lanes
    const I key = xsimd::min(xsimd::max(mag, c.floor), c.ceil) - c.floor;
    const I low = key & c.low_mask;
    // kQ8Buckets + k for +y, kQ8Buckets - 1 - k (= kQ8Buckets + ~k) for -y.
    const U e = Ops::gather(c.buckets, as_u(c.middle + ((key >> d::kQ8KeyShift) ^ sign)));
    // from = low - pos + guard, pos = (e & kQ8PosMask) - kQ8PosBias: in [0, 2 * guard)
    // (one unsigned comparison) within the guard of the threshold.
    const U from = as_u(low) - (e & c.pos_mask) + c.pos_bias_and_guard;
    near = from < c.two_guard;
    // The code moves (by sign | 1) in a bucket with a threshold at offsets >= pos, i.e.
    // where from >= guard, read as a signed number (from is low - pos + guard exactly).
    const auto moves = (as_i(e & c.moves_bit) != I(0)) && (as_i(from) >= I(d::kQ8Guard));
    I code = as_i(B::template shr<24>(e)) + xsimd::select(moves, sign | c.one, I(0));
    if constexpr (NaNs) code = xsimd::select(mag > I(0x7F800000), c.nan_code, code);
    return as_u(code);
  }

  /// How a block's values are encoded (q8_encode): the stored maximum `a` and, where it
  /// allows the reciprocal path (core/q8.hpp), r = RN(1 / a).
  struct Encoder {
    F a{}, r{};
    bool fast = false;
    Encoder() = default;
    explicit Encoder(float stored) : a(splat(stored)), r(splat(1.0f / stored)) {
      const std::uint32_t sb = f32_bits(stored);
      fast = sb >= ::stepcore::detail::kQ8FastMinBits && sb <= ::stepcore::detail::kQ8FastMaxBits;
    }
    /// The codes of RN(v / a): from v * r (no NaN: the maximum is finite) unless a lane is
    /// near a threshold, else by division.
    U codes(const CodeConsts& c, F v) const {
      typename U::batch_bool_type near;
      if (fast) {
        const U code = q8_codes<false>(c, as_u(Ops::mul(v, r)), near);
        if (!xsimd::any(near)) return code;
      }
      return q8_codes(c, as_u(Ops::div(v, a)), near);
    }
  };

  /// The largest magnitude pattern of x[0, n), NaN patterns included (they order above
  /// +Inf): the integer maximum of the patterns finds max |x| and any NaN.
  static std::uint32_t q8_max_bits(const float* x, std::size_t n) {
    I mx(0);
    std::size_t i = 0;
    for (; i + N <= n; i += N) mx = xsimd::max(mx, as_i(as_u(Ops::load(x + i)) & U(0x7FFFFFFFu)));
    std::uint32_t top = hmax(mx);
    for (; i < n; ++i) {
      const std::uint32_t a = f32_bits(x[i]) & 0x7FFFFFFFu;
      top = a > top ? a : top;
    }
    return top;
  }
  /// The largest lane of non-negative 32-bit integers.
  static std::uint32_t hmax(I mx) {
    alignas(64) std::int32_t lanes[N];
    mx.store_aligned(lanes);
    std::uint32_t top = 0;
    for (std::size_t l = 0; l < N; ++l)
      top = static_cast<std::uint32_t>(lanes[l]) > top ? static_cast<std::uint32_t>(lanes[l]) : top;
    return top;
  }

  /// codes[i] = the code of RN(x[i] / stored) for i in [0, n), vectors from `from` on (a
  /// multiple of N) and the remainder one at a time (Encoder).
  static void q8_encode(const float* x, std::size_t n, float stored, const CodeConsts& c,
                        std::uint8_t* codes, std::size_t from = 0) {
    const Encoder enc(stored);
    const CodeConsts k = c;  // a local copy: the byte stores below cannot change it
    std::size_t i = from;
    for (; i + N <= n; i += N) Ops::store_u8(codes + i, enc.codes(k, Ops::load(x + i)));
    for (; i < n; ++i)
      codes[i] = static_cast<std::uint8_t>(::stepcore::detail::q8_code(*k.book, x[i] / stored));
  }

  /// Requantizes one block's new values x[0, n) (n <= kQ8BlockSize) into `codes`; returns
  /// the stored maximum.
  static float q8_requantize(const float* x, std::size_t n,
                             const ::stepcore::detail::Q8Codebook& cb, std::uint8_t* codes) {
    const float stored = ::stepcore::detail::q8_stored_max(cb, q8_max_bits(x, n));
    q8_encode(x, n, stored, CodeConsts(cb), codes);
    return stored;
  }

  /// The gradient read (docs/numerics.md 3) of elements [i0, i0 + n) of `grad` (dtype G)
  /// into f32 values g[0, n): R_G(R_G(f32(x) * scale) * clip), or the stored value for a
  /// unit that reads it unscaled.
  template <class G>
  static void q8_read(const void* grad_v, const GradientRead& read, bool scaled, std::size_t i0,
                      float* g, std::size_t n) {
    const G* grad = static_cast<const G*>(grad_v) + i0;
    const F scale = splat(read.scale), clip = splat(read.clip);
    const U f32 = B::f32_lanes(read);
    std::size_t j = 0;
    if (scaled) {
      for (; j + N <= n; j += N)
        Ops::store(g + j, B::template read_mode<2>(grad + j, scale, clip, f32));
      for (; j < n; ++j) g[j] = B::read1(grad + j, read.scale, read.clip, read.as_f32);
    } else {
      for (; j + N <= n; j += N) Ops::store(g + j, B::load(grad + j));
      for (; j < n; ++j) g[j] = to_f32(grad[j]);
    }
  }
  /// The compute output of elements [i0, i0 + n): out = R_O(p) for the new f32 params.
  template <class O>
  static void q8_output(const float* p, void* out_v, std::size_t i0, std::size_t n) {
    O* out = static_cast<O*>(out_v) + i0;
    p += i0;
    std::size_t j = 0;
    for (; j + N <= n; j += N) B::store(out + j, Ops::load(p + j));
    for (; j < n; ++j) out[j] = from_f32<O>(p[j]);
  }
  /// q8_read for the gradient's dtype (an index of kDTypes).
  static void q8_read_any(int g, const void* grad, const GradientRead& read, bool scaled,
                          std::size_t i0, float* out, std::size_t n) {
    if (g == static_cast<int>(DType::bf16))
      q8_read<bfloat16_t>(grad, read, scaled, i0, out, n);
    else if (g == static_cast<int>(DType::f16))
      q8_read<float16_t>(grad, read, scaled, i0, out, n);
    else
      q8_read<float>(grad, read, scaled, i0, out, n);
  }
  /// q8_output for an output kind (1 + its dtype; 0: none).
  static void q8_output_any(int o, const float* p, void* out, std::size_t i0, std::size_t n) {
    if (o == 1 + static_cast<int>(DType::f32))
      q8_output<float>(p, out, i0, n);
    else if (o == 1 + static_cast<int>(DType::bf16))
      q8_output<bfloat16_t>(p, out, i0, n);
    else if (o == 1 + static_cast<int>(DType::f16))
      q8_output<float16_t>(p, out, i0, n);
  }

  /// Unit Opt's step, variant V, over elements [begin, end) of a tensor whose slots are
  /// 8-bit (`q`; begin on a block boundary) and whose parameter and state are St, block
  /// by block in one pass over memory: the block's gradient read into f32 values (L1);
  /// each vector's codes dequantized in registers, stepped, the parameter stored, the new
  /// state kept in an L1 array and its magnitude folded into the block's maximum; the
  /// block's remainder and tail elements one at a time through the same arrays; the
  /// compute output from the stored parameters; then each slot's maximum stored and its
  /// codes encoded from the array. The gradient's dtype and the output are run-time
  /// arguments (q.grad_dtype, q.output_kind), so a unit has one kernel per St and variant.
  template <class Opt, int V, class St>
  static void q8_lanes(const UnitRange<Opt>& r, const Q8Slots& q, std::size_t begin,
                       std::size_t end) {
    constexpr int K = Opt::slots(V);
    constexpr int KA = K > 0 ? K : 1;
    const typename Opt::template Consts<Ops> k(r.scalars);
    CodeConsts consts[KA];
    for (int s = 0; s < K; ++s) consts[s] = CodeConsts(*q.codebook[s]);
    const St* const Ps = static_cast<const St*>(r.src[0]);
    St* const P = static_cast<St*>(r.dst[0]);
    alignas(64) float values[KA][kQ8BlockSize];
    alignas(64) float grads[kQ8BlockSize];
    UnitRange<Opt> rest = r;  // the block's elements one at a time, from the L1 arrays
    for (int s = 0; s < K; ++s) {
      rest.dst[1 + s] = values[s];
      rest.src[1 + s] = values[s];
    }
    rest.grad = grads;
    rest.out = nullptr;
    rest.read = GradientRead{1.0f, 1.0f, false};  // the values read already
    for (std::size_t b0 = begin; b0 < end; b0 += kQ8BlockSize) {
      const std::size_t n = end - b0 < kQ8BlockSize ? end - b0 : kQ8BlockSize;
      const std::size_t block = b0 / kQ8BlockSize;
      const std::size_t tail = r.tail_begin > b0 ? r.tail_begin - b0 : 0;
      const std::size_t lanes_end = (tail < n ? tail : n) / N * N;
      q8_read_any(q.grad_dtype, r.grad, r.read, Opt::kReadsScaled, b0, grads, n);
      F a[KA];
      I mx[KA];
      for (int s = 0; s < K; ++s) {
        a[s] = splat(q.absmax[s][block]);
        mx[s] = I(0);
      }
      for (std::size_t j = 0; j < lanes_end; j += N) {
        const std::size_t i = b0 + j;
        const F g = Ops::load(grads + j);
        F p = B::load(Ps + i);
        F st[KA];
        for (int s = 0; s < K; ++s)
          st[s] =
              Ops::mul(as_f(Ops::gather(q.codebook[s]->map, Ops::load_u8(q.codes[s] + i))), a[s]);
        Opt::template update<Ops, V, false>(k, g, p, st);
        B::store(P + i, p);
        for (int s = 0; s < K; ++s) {
          Ops::store(values[s] + j, st[s]);
          mx[s] = xsimd::max(mx[s], as_i(as_u(st[s]) & U(0x7FFFFFFFu)));
        }
      }
      if (lanes_end < n) {
        for (int s = 0; s < K; ++s)
          for (std::size_t j = lanes_end; j < n; ++j)
            values[s][j] =
                f32_from_bits(q.codebook[s]->map[q.codes[s][b0 + j]]) * q.absmax[s][block];
        rest.dst[0] = P + b0;
        rest.src[0] = Ps + b0;
        rest.tail_begin = tail;
        B::template unit_scalar<Opt, V, float, void, St, float>(rest, lanes_end, n);
      }
      if constexpr (std::is_same_v<St, float>)
        if (q.output_kind != 0) q8_output_any(q.output_kind, P, r.out, b0, n);
      for (int s = 0; s < K; ++s) {
        std::uint32_t top = hmax(mx[s]);
        for (std::size_t j = lanes_end; j < n; ++j) {
          const std::uint32_t m = f32_bits(values[s][j]) & 0x7FFFFFFFu;
          top = m > top ? m : top;
        }
        const float stored = ::stepcore::detail::q8_stored_max(*q.codebook[s], top);
        q.absmax[s][block] = stored;
        q8_encode(values[s], n, stored, consts[s], q.codes[s] + b0);
      }
    }
  }

  /// q8_lanes for the range's variant.
  template <class Opt, class St>
  static void q8_step(const UnitRange<Opt>& r, const Q8Slots& q, std::size_t begin,
                      std::size_t end) {
    ::stepcore::detail::with_variant<Opt::kVariants>(
        r.variant, [&](auto form) { q8_lanes<Opt, decltype(form)::value, St>(r, q, begin, end); });
  }
};

}  // namespace stepcore::cpu::detail
