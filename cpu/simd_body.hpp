// The one generic body of every CPU kernel, written once and compiled per ISA (each
// arch_<name>.hpp includes it and supplies ArchOps<Arch>; isa_<name>.cpp and
// isa_<name>_streamed.cpp compile it with that ISA's -m flags).
//
// Every floating-point operation whose rounding docs/numerics.md fixes — add, sub,
// mul, div, sqrt, the fused multiply-add, the ordered compares, the NaN test, the
// float select, binary64 widening and sums — is an ArchOps primitive written with the
// ISA's own intrinsic. The body never touches xsimd float arithmetic: its f32 and
// binary64 vectors are ArchOps' own register structs, which have no operators at all, so a
// library fallback (Debian's xsimd 8.1 computes avx512 `fma` as x*y+z, two roundings)
// cannot be reached by construction. xsimd is used only for 32-bit integer lanes
// (adds, masks, compares, integer selects, max), where every implementation, intrinsic or
// generic fallback, gives the same bits; integer bit casts and constant shifts are ArchOps'
// own (one instruction, or none). cpu/README.md has the table.
//
// Every element follows docs/numerics.md with the same operation order as the
// reference; vector lanes and the scalar remainder loop compute identical bits.
// Do not include this header outside an arch_*.hpp file.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <xsimd/xsimd.hpp>

#include "core/optimizers/all.hpp"
#include "core/superaccumulator.hpp"
#include "cpu/kernel_table.hpp"
#include "stepcore/convert.hpp"

namespace stepcore::cpu::detail {

/// Per-architecture primitives; specialised in each ISA's translation unit. Contract
/// of the floating-point ones (all lanes, round to nearest even, no FTZ/DAZ):
///   add/sub/mul/div/sqrt  one correctly rounded binary32 operation
///   fma(a, b, c)          RN(a*b + c), one rounding
///   gt/lt/eq              ordered compares: false when either operand is a NaN
///   is_nan                true exactly for NaN lanes
///   select(m, a, b)       m ? a : b, bit for bit (NaN payloads and zero signs kept)
///   to_double             exact f32 -> binary64 widening of the low and high halves
///   add_square(x, acc)    acc + x*x for x widened from f32 (x*x is exact in binary64,
///                         so fused and unfused evaluation give the same bits)
///   dadd, dsum            binary64 add; a horizontal sum in a fixed lane order
template <class A>
struct ArchOps;

template <class A>
struct Q8Body;  // the 8-bit state kernels (simd_q8.hpp)

template <class A>
struct Body {
  using Ops = ArchOps<A>;
  using F = typename Ops::F;  // N binary32 lanes (opaque)
  using D = typename Ops::D;  // N/2 binary64 lanes (opaque)
  using I = xsimd::batch<std::int32_t, A>;
  using U = xsimd::batch<std::uint32_t, A>;
  static constexpr std::size_t N = Ops::N;
  static_assert(N == U::size, "ArchOps and xsimd disagree on the vector width");
  /// Software prefetch distance of the streaming loops (bytes ahead of the read).
  static constexpr std::size_t kPrefetchBytes = 1024;
  /// Vectors per kStreamAlignment line. Streaming stores write each destination a whole
  /// line at a time: interleaved vector by vector across destinations they leave partial
  /// lines in the write-combining buffers, which a processor may write out piecemeal
  /// (AMD Zen 4: three interleaved 16-byte streams run 6x slower, 32-byte 1.4x).
  static constexpr std::size_t kStreamLineVectors = kStreamAlignment / (N * sizeof(float));
  static_assert(kStreamLineVectors * N * sizeof(float) == kStreamAlignment);

  // ---- bit casts ----------------------------------------------------------------
  static U as_u(F x) { return Ops::as_u(x); }
  // Integer bit casts and constant shifts come from ArchOps: xsimd 8.1 routes NEON's
  // through tables of function pointers that GCC 12 leaves as calls in the loops.
  static U as_u(I x) { return Ops::as_u(x); }
  static I as_i(U x) { return Ops::as_i(x); }
  template <int k>
  static U shr(U x) {
    return Ops::template shr<k>(x);
  }
  template <int k>
  static U shl(U x) {
    return Ops::template shl<k>(x);
  }
  static F as_f(U x) { return Ops::as_f(x); }
  static F splat(float x) { return Ops::set1(x); }

  // ---- conversions (docs/numerics.md section 2), integer lanes only ----------------
  /// True in lanes holding a NaN pattern (an integer test: exact on every ISA).
  static auto nan_lanes(U u) { return as_i(u & U(0x7FFFFFFFu)) > I(0x7F800000); }
  /// f32 -> bf16 bits in the low half of each lane.
  static U bf16_bits(F x) {
    const U u = as_u(x);
    const U r = shr<16>(u + U(0x7FFFu) + (shr<16>(u) & U(1u)));
    return as_u(xsimd::select(nan_lanes(u), I(0x7FC0), as_i(r)));
  }
  /// R_bf16 of a gradient read, in place: f32 rounded to the bf16 grid, still an f32.
  /// Only for x = f32(g) * factor with g read from bf16 and a finite factor: a NaN x
  /// is then g's NaN, quieted by the multiply (x86 returns the NaN operand), whose
  /// low 16 bits are zero, so adding the rounding increment cannot carry out of the
  /// fraction and x stays a NaN (the spec leaves an f32 NaN's payload open). This
  /// saves the NaN select of a general conversion on the hot read path.
  static F round_bf16_read(F x) {
    const U u = as_u(x);
    return as_f((u + U(0x7FFFu) + (shr<16>(u) & U(1u))) & U(0xFFFF0000u));
  }
  /// f32 -> f16 bits in the low half of each lane.
  static U f16_bits(F x) {
    const U u = as_u(x);
    const U sign = shr<16>(u) & U(0x8000u);
    const U a = u & U(0x7FFFFFFFu);
    const I ai = as_i(a);
    const U t = a - U(0x38000000u);  // rebias 127 -> 15 (normal results only)
    const U normal = shr<13>(t + U(0xFFFu) + (shr<13>(t) & U(1u)));
    // |x| < 2^-14: adding 0.5 (ulp 2^-24) rounds |x| to the f16 subnormal grid, RNE.
    const U sub = as_u(Ops::add(as_f(a), splat(0.5f))) - U(0x3F000000u);
    I r = xsimd::select(ai >= I(0x38800000), as_i(normal), as_i(sub));
    r = xsimd::select(ai >= I(0x477FF000), I(0x7C00), r);
    r = as_i(as_u(r) | sign);
    return as_u(xsimd::select(ai > I(0x7F800000), I(0x7E00), r));  // a NaN: sign dropped
  }
  /// bf16 bits (low half of each lane) -> f32, exact.
  static F from_bf16(U h) { return as_f(shl<16>(h)); }
  /// f16 bits (low half of each lane) -> f32, exact (subnormals scaled by 2^112, a
  /// power of two: the multiply is exact).
  static F from_f16(U h) {
    const U sign = shl<16>(h & U(0x8000u));
    const U em = h & U(0x7FFFu);
    const U shifted = shl<13>(em);
    const U finite = as_u(Ops::mul(as_f(shifted), splat(0x1p112f)));
    const U special = shifted | U(0x7F800000u);
    const auto is_special = as_i(em) >= I(0x7C00);
    return as_f(as_u(xsimd::select(is_special, as_i(special), as_i(finite))) | sign);
  }

  // ---- typed loads and stores ------------------------------------------------------
  static F load(const float* p) { return Ops::load(p); }
  static F load(const bfloat16_t* p) {
    return from_bf16(Ops::load_u16(reinterpret_cast<const std::uint16_t*>(p)));
  }
  static F load(const float16_t* p) {
    return from_f16(Ops::load_u16(reinterpret_cast<const std::uint16_t*>(p)));
  }
  static void store(float* p, F x) { Ops::store(p, x); }
  static void store(bfloat16_t* p, F x) {
    // Round in place on the f32 pattern, then keep each lane's high half.
    const U u = as_u(x);
    const U r = u + U(0x7FFFu) + (shr<16>(u) & U(1u));
    const U bits = as_u(xsimd::select(nan_lanes(u), I(0x7FC00000), as_i(r)));
    Ops::store_hi16(reinterpret_cast<std::uint16_t*>(p), bits);
  }
  static void store(float16_t* p, F x) {
    Ops::store_u16(reinterpret_cast<std::uint16_t*>(p), f16_bits(x));
  }

  /// Stores one line (kStreamLineVectors vectors from p, p kStreamAlignment-aligned) of a
  /// destination: with consecutive streaming stores when `nt`, else plain stores.
  static void put_line(float* p, const F* line, bool nt) {
    for (std::size_t l = 0; l < kStreamLineVectors; ++l) {
      if (nt)
        Ops::stream(p + l * N, line[l]);
      else
        Ops::store(p + l * N, line[l]);
    }
  }
  /// The first index in [i, end] at which p + index is kStreamAlignment-aligned, or end
  /// (p is element-aligned: validation).
  static std::size_t aligned_from(const float* p, std::size_t i, std::size_t end) {
    const std::size_t misalign = reinterpret_cast<std::uintptr_t>(p + i) % kStreamAlignment;
    const std::size_t skip = misalign == 0 ? 0 : (kStreamAlignment - misalign) / sizeof(float);
    return end - i < skip ? end : i + skip;
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
  /// `f32`: all lanes set for a read whose products round in f32 (GradientRead::as_f32):
  /// a select, not a branch or another instantiation (the loops stay memory-bound).
  template <int Mode, class T>
  static F read_mode(const T* p, F scale, F clip, U f32) {
    F x = load(p);
    if constexpr (Mode >= 1) x = round_read<T>(Ops::mul(x, scale), f32);
    if constexpr (Mode >= 2) x = round_read<T>(Ops::mul(x, clip), f32);
    return x;
  }
  /// R_T(x), or x (R_f32) in the lanes `f32` sets.
  template <class T>
  static F round_read(F x, U f32) {
    if constexpr (std::is_same_v<T, float>)
      return x;
    else
      return as_f((as_u(x) & f32) | (as_u(round_to<T>(x)) & ~f32));
  }
  /// The lane mask of read_mode for a read.
  static U f32_lanes(const GradientRead& r) { return U(r.as_f32 ? 0xFFFFFFFFu : 0u); }
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
  static float read1(const T* p, float scale, float clip, bool as_f32) {
    float x = to_f32(*p);
    if (as_f32) return x * scale * clip;
    x = ::stepcore::round_to<T>(x * scale);
    x = ::stepcore::round_to<T>(x * clip);
    return x;
  }

  // ---- optimizer units (core/optimizers) -------------------------------------------
  // One driver for every unit: the unit's update is written once over an operations
  // type, instantiated here with ArchOps for the vector lanes and with ScalarOps for the
  // elements computed one at a time (the chunk's remainder, the unit's tail, the head
  // before a streamed destination's aligned line).

  /// Elements [i, end) one at a time, variant V; parameter stored as St, state as Sl.
  template <class Opt, int V, class G, class O, class St = float, class Sl = St>
  static void unit_scalar(const UnitRange<Opt>& r, std::size_t i, std::size_t end) {
    if (i >= end) return;
    constexpr int KA = UnitRange<Opt>::kArrays - 1 > 0 ? UnitRange<Opt>::kArrays - 1 : 1;
    const typename Opt::template Consts<::stepcore::detail::ScalarOps> k(r.scalars);
    const G* grad = static_cast<const G*>(r.grad);
    O* out = static_cast<O*>(r.out);
    const Sl* Ss[KA] = {};
    Sl* S[KA] = {};
    for (int s = 0; s + 1 < UnitRange<Opt>::kArrays; ++s) {
      Ss[s] = static_cast<const Sl*>(r.src[1 + s]);
      S[s] = static_cast<Sl*>(r.dst[1 + s]);
    }
    for (; i < end; ++i)
      ::stepcore::detail::unit_element<Opt, V, G, O, St, Sl>(
          static_cast<const St*>(r.src[0]), Ss, static_cast<St*>(r.dst[0]), S, grad, out, k,
          r.tail_begin, r.read.scale, r.read.clip, i, r.read.as_f32);
  }

  /// Calls fn(std::integral_constant<int, Mode>{}) for the read mode of unit Opt's range:
  /// the read's mode, or 0 for a unit that reads the stored gradient.
  template <class Opt, class Fn>
  static void with_unit_read(const GradientRead& read, Fn fn) {
    if constexpr (Opt::kReadsScaled)
      with_read_mode(read, fn);
    else
      fn(std::integral_constant<int, 0>{});
  }

  /// Vector lanes of variant V over [i, end): every element uses the unit's body form.
  /// Pointers and constants are locals so nothing is reloaded per iteration; the
  /// loop-invariant flags in the unit's constants are unswitched by the compiler. The old
  /// values are loaded from src and the new ones stored to dst: the same arrays for an
  /// in-place step, so those pairs carry no __restrict (each vector is loaded before it
  /// is stored, and a source never overlaps another destination: validation); grad and
  /// out never alias. Stream: the destinations named by r.stream take streaming stores a
  /// line at a time, so [i, end) must start where they are kStreamAlignment-aligned; the
  /// rest after the last whole line takes plain stores (f32 storage only). St: the storage
  /// type of the parameter and state (f32, or bf16/f16: widened exactly by load, rounded
  /// to nearest even by store, docs/numerics.md 7.3); Sl: the state's (St, or f32 beside a
  /// 16-bit parameter: the dequantized values of 8-bit slots, docs/numerics.md 8f).
  template <class Opt, class G, class O, int V, int Mode, bool Stream = false, class St = float,
            class Sl = St>
  static void unit_lanes(const UnitRange<Opt>& r, std::size_t i, std::size_t end) {
    static_assert(!Stream || std::is_same_v<St, float>, "streaming stores are f32 lines");
    constexpr int K = Opt::slots(V);  // the slots this variant reads and writes
    constexpr int KA = K > 0 ? K : 1;
    const F scale = splat(r.read.scale), clip = splat(r.read.clip);
    const U f32 = f32_lanes(r.read);
    const typename Opt::template Consts<Ops> k(r.scalars);
    const St* const Ps = static_cast<const St*>(r.src[0]);
    St* const P = static_cast<St*>(r.dst[0]);
    const Sl* Ss[KA] = {};
    Sl* S[KA] = {};
    for (int s = 0; s < K; ++s) {
      Ss[s] = static_cast<const Sl*>(r.src[1 + s]);
      S[s] = static_cast<Sl*>(r.dst[1 + s]);
    }
    const G* __restrict grad = static_cast<const G*>(r.grad);
    O* __restrict out = static_cast<O*>(r.out);
    if constexpr (Stream) {
      // A line (L vectors) of every destination per iteration, each streamed destination's
      // line stored at once: interleaved vector by vector across destinations, streaming
      // stores leave partial lines in the write-combining buffers (kStreamLineVectors).
      constexpr std::size_t L = kStreamLineVectors;
      for (; i + L * N <= end; i += L * N) {
        F pl[L], sl[KA][L];
        for (std::size_t l = 0; l < L; ++l) {
          const std::size_t j = i + l * N;
          const F g = read_mode<Mode>(grad + j, scale, clip, f32);
          F p = load(Ps + j);
          F st[KA];
          for (int s = 0; s < K; ++s) st[s] = load(Ss[s] + j);
          Opt::template update<Ops, V, false>(k, g, p, st);
          pl[l] = p;
          for (int s = 0; s < K; ++s) sl[s][l] = st[s];
          if constexpr (!std::is_void_v<O>) store(out + j, p);
        }
        put_line(P + i, pl, (r.stream & 1u) != 0);  // St is float here (static_assert)
        for (int s = 0; s < K; ++s) put_line(S[s] + i, sl[s], (r.stream & (2u << s)) != 0);
      }
    }
    for (; i + N <= end; i += N) {
      const F g = read_mode<Mode>(grad + i, scale, clip, f32);
      F p = load(Ps + i);
      F st[KA];
      for (int s = 0; s < K; ++s) st[s] = load(Ss[s] + i);
      Opt::template update<Ops, V, false>(k, g, p, st);
      store(P + i, p);
      for (int s = 0; s < K; ++s) store(S[s] + i, st[s]);
      if constexpr (!std::is_void_v<O>) store(out + i, p);
    }
  }

  /// Where the vector lanes of [begin, end) stop: they run only where every lane uses the
  /// body form, so not into the unit's tail.
  template <class Opt>
  static std::size_t vector_end(const UnitRange<Opt>& r, std::size_t begin, std::size_t end) {
    return r.tail_begin < end ? (r.tail_begin > begin ? r.tail_begin : begin) : end;
  }

  /// One range of unit Opt's step, in place or out of place with plain stores, parameter
  /// stored as St and state as Sl (unit_lanes): vector lanes, then the remainder and the
  /// tail element by element.
  template <class Opt, class G, class O, class St = float, class Sl = St>
  static void unit_step(const UnitRange<Opt>& r, std::size_t begin, std::size_t end) {
    const std::size_t lanes_end = begin + (vector_end(r, begin, end) - begin) / N * N;
    ::stepcore::detail::with_variant<Opt::kVariants>(r.variant, [&](auto form) {
      constexpr int V = decltype(form)::value;
      with_unit_read<Opt>(r.read, [&](auto mode) {
        unit_lanes<Opt, G, O, V, decltype(mode)::value, false, St, Sl>(r, begin, lanes_end);
      });
      unit_scalar<Opt, V, G, O, St, Sl>(r, lanes_end, end);
    });
  }

  /// One range with streamed destinations (r.stream != 0: out of place): element by
  /// element up to the line where every streamed destination is aligned (they agree
  /// modulo kStreamAlignment: stream_mask), then the lanes, whose streaming stores skip
  /// the read of the destinations' lines (write-allocate), then the remainder. Unfenced:
  /// the caller drains the streaming stores (the engine, per thread, after its last
  /// range), not each range.
  template <class Opt, class G, class O>
  static void unit_streamed(const UnitRange<Opt>& r, std::size_t begin, std::size_t end) {
    const std::size_t vec_end = vector_end(r, begin, end);
    int first = 0;
    while (first + 1 < UnitRange<Opt>::kArrays && (r.stream & (1u << first)) == 0) ++first;
    const std::size_t head_end =
        aligned_from(static_cast<const float*>(r.dst[first]), begin, vec_end);
    const std::size_t lanes_end = head_end + (vec_end - head_end) / N * N;
    ::stepcore::detail::with_variant<Opt::kVariants>(r.variant, [&](auto form) {
      constexpr int V = decltype(form)::value;
      unit_scalar<Opt, V, G, O>(r, begin, head_end);
      with_unit_read<Opt>(r.read, [&](auto mode) {
        unit_lanes<Opt, G, O, V, decltype(mode)::value, true>(r, head_end, lanes_end);
      });
      unit_scalar<Opt, V, G, O>(r, lanes_end, end);
    });
  }

  // ---- accumulate and scale ---------------------------------------------------------
  template <class S>
  static void accumulate(float* acc, const void* src_v, bool copy, std::size_t begin,
                         std::size_t end) {
    const S* src = static_cast<const S*>(src_v);
    std::size_t i = begin;
    if (copy) {
      for (; i + N <= end; i += N) Ops::store(acc + i, load(src + i));
      for (; i < end; ++i) acc[i] = to_f32(src[i]);
    } else {
      for (; i + N <= end; i += N) {
        __builtin_prefetch(acc + i + kPrefetchBytes / sizeof(float), 1);
        __builtin_prefetch(src + i + kPrefetchBytes / sizeof(float));
        Ops::store(acc + i, Ops::add(Ops::load(acc + i), load(src + i)));
      }
      for (; i < end; ++i) acc[i] = acc[i] + to_f32(src[i]);
    }
  }

  template <class T>
  static void scale(void* data_v, float s, std::size_t begin, std::size_t end) {
    T* data = static_cast<T*>(data_v);
    const F sv = splat(s);
    std::size_t i = begin;
    for (; i + N <= end; i += N) store(data + i, Ops::mul(load(data + i), sv));
    for (; i < end; ++i) data[i] = from_f32<T>(to_f32(data[i]) * s);
  }

  // ---- norm partial (approximate: exact terms, binary64 block sums) -----------------
  // The term of a value x is x^2 (NormOrder::two, units of 2^-298) or |x| (NormOrder::one,
  // units of 2^-149): exact in binary64 either way, and every binary64 sum of terms is a
  // multiple of the unit, so block sums deposit exactly (docs/numerics.md 6.2, 6.6).
  static constexpr bool is_one(NormOrder o) { return o == NormOrder::one; }

  /// Deposits the exact terms of elements [begin, end) one at a time; counts
  /// non-finite values. Used for blocks that contain a NaN or Inf.
  template <class T, NormOrder O>
  static void norm_exact(const T* data, const GradientRead& read, std::size_t begin,
                         std::size_t end, NormPartial& out) {
    for (std::size_t i = begin; i < end; ++i) {
      const float x = read1(data + i, read.scale, read.clip, read.as_f32);
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
      if constexpr (is_one(O)) {
        ::stepcore::detail::deposit_abs(out.digits, a);
      } else {
        const std::uint32_t e = a >> 23;
        const std::uint64_t m = e == 0 ? (a & 0x7FFFFFu) : ((a & 0x7FFFFFu) | 0x800000u);
        const int shift = 2 * (e == 0 ? -149 : static_cast<int>(e) - 150) + 298;
        ::stepcore::detail::deposit(out.digits, m * m, shift);
      }
    }
    ::stepcore::detail::normalize_digits(out.digits);
  }

  template <class T, NormOrder O>
  static void norm_exact_range(const void* data, const GradientRead& read, std::size_t begin,
                               std::size_t end, NormPartial& out) {
    norm_exact<T, O>(static_cast<const T*>(data), read, begin, end, out);
  }

  template <class T, NormOrder O>
  static void norm(const void* data_v, const GradientRead& read, std::size_t begin, std::size_t end,
                   NormPartial& out) {
    with_read_mode(read, [&](auto mode) {
      norm_mode<T, decltype(mode)::value, O>(static_cast<const T*>(data_v), read, begin, end, out);
    });
  }

  /// acc + term(x) for lanes x widened from f32 (|x| already taken for the 1-norm).
  template <NormOrder O>
  static D add_term(D x, D acc) {
    if constexpr (is_one(O))
      return Ops::dadd(acc, x);
    else
      return Ops::add_square(x, acc);
  }

  template <class T, int Mode, NormOrder O>
  static void norm_mode(const T* data, const GradientRead& read, std::size_t begin, std::size_t end,
                        NormPartial& out) {
    const U abs_mask(0x7FFFFFFFu);
    // The 1-norm sums |x|: the sign is cleared before widening (free for the 2-norm).
    auto term_input = [&](F x) { return is_one(O) ? as_f(as_u(x) & abs_mask) : x; };
    const F scale = splat(read.scale), clip = splat(read.clip);
    const U f32 = f32_lanes(read);
    for (std::size_t b = begin; b < end; b += kNormBlockElements) {
      const std::size_t e = b + kNormBlockElements < end ? b + kNormBlockElements : end;
      // Four independent binary64 chains hide the FMA latency.
      D acc0 = Ops::dzero(), acc1 = Ops::dzero(), acc2 = Ops::dzero(), acc3 = Ops::dzero();
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
          Ops::to_double(term_input(x), xl, xh);
          Ops::to_double(term_input(y), yl, yh);
          acc0 = add_term<O>(xl, acc0);
          acc1 = add_term<O>(xh, acc1);
          acc2 = add_term<O>(yl, acc2);
          acc3 = add_term<O>(yh, acc3);
        }
        alignas(64) std::uint16_t m16[2 * N];
        mx16.store_aligned(reinterpret_cast<std::uint32_t*>(m16));
        std::uint16_t top = 0;
        for (std::size_t l = 0; l < 2 * N; ++l) top = m16[l] > top ? m16[l] : top;
        mx = xsimd::max(mx, I(static_cast<std::int32_t>(std::uint32_t{top} << 16)));
      }
      for (; i + 2 * N <= e; i += 2 * N) {
        __builtin_prefetch(data + i + kPrefetchBytes / sizeof(T));
        const F x = read_mode<Mode>(data + i, scale, clip, f32);
        const F y = read_mode<Mode>(data + i + N, scale, clip, f32);
        const U ax = as_u(x) & abs_mask, ay = as_u(y) & abs_mask;
        mx = xsimd::max(mx, as_i(ax));
        mx2 = xsimd::max(mx2, as_i(ay));
        D xl, xh, yl, yh;
        Ops::to_double(is_one(O) ? as_f(ax) : x, xl, xh);
        Ops::to_double(is_one(O) ? as_f(ay) : y, yl, yh);
        acc0 = add_term<O>(xl, acc0);
        acc1 = add_term<O>(xh, acc1);
        acc2 = add_term<O>(yl, acc2);
        acc3 = add_term<O>(yh, acc3);
      }
      for (; i + N <= e; i += N) {
        const F x = read_mode<Mode>(data + i, scale, clip, f32);
        const U ax = as_u(x) & abs_mask;
        mx = xsimd::max(mx, as_i(ax));
        D xl, xh;
        Ops::to_double(is_one(O) ? as_f(ax) : x, xl, xh);
        acc0 = add_term<O>(xl, acc0);
        acc1 = add_term<O>(xh, acc1);
      }
      mx = xsimd::max(mx, mx2);
      alignas(64) std::int32_t lanes[N];
      mx.store_aligned(lanes);
      std::uint32_t block_max = 0;
      for (std::size_t l = 0; l < N; ++l)
        if (static_cast<std::uint32_t>(lanes[l]) > block_max) block_max = lanes[l];
      double tail = 0.0;
      for (; i < e; ++i) {
        const float x = read1(data + i, read.scale, read.clip, read.as_f32);
        const std::uint32_t a = f32_bits(x) & 0x7FFFFFFFu;
        if (a > block_max) block_max = a;
        const double xd = f32_from_bits(a);  // |x|
        tail = tail + (is_one(O) ? xd : xd * xd);
      }
      if (block_max >= 0x7F800000u) {  // a NaN or Inf: count them, deposit the rest exactly
        norm_exact<T, O>(data, read, b, e, out);
        continue;
      }
      const double sum = Ops::dsum(Ops::dadd(Ops::dadd(acc0, acc1), Ops::dadd(acc2, acc3))) + tail;
      if constexpr (is_one(O))
        ::stepcore::detail::deposit_double<kNorm1UnitExponent>(out.digits, sum);
      else
        ::stepcore::detail::deposit_double(out.digits, sum);
      if (block_max > out.max_abs_bits) out.max_abs_bits = block_max;
      out.approximate = 1;
      ::stepcore::detail::normalize_digits(out.digits);
    }
  }

  // ---- the table ---------------------------------------------------------------------
  // The one place where a unit's kernel is chosen per dtype: [param and state dtype]
  // [gradient dtype][output kind]; bf16/f16 params have no compute output (validation).
  template <class G>
  static void fill_grad(KernelTable& t, int g) {
    constexpr int f32 = static_cast<int>(DType::f32);
    constexpr int bf16 = static_cast<int>(DType::bf16);
    constexpr int f16 = static_cast<int>(DType::f16);
    ::stepcore::detail::AllUnits::for_each([&](auto unit) {
      using Opt = decltype(unit);
      UnitKernels<Opt>& k = t.units.template of<Opt>();
      k.step[f32][g][0] = &unit_step<Opt, G, void>;
      k.step[f32][g][1] = &unit_step<Opt, G, float>;
      k.step[f32][g][2] = &unit_step<Opt, G, bfloat16_t>;
      k.step[f32][g][3] = &unit_step<Opt, G, float16_t>;
      k.step[bf16][g][0] = &unit_step<Opt, G, void, bfloat16_t>;
      k.step[f16][g][0] = &unit_step<Opt, G, void, float16_t>;
      if constexpr (::stepcore::detail::unit_takes_q8<Opt>()) {
        if (g == f32) {  // one kernel per param dtype: gradient and output at run time
          using Q = Q8Body<A>;
          k.q8[f32] = &Q::template q8_step<Opt, float>;
          k.q8[bf16] = &Q::template q8_step<Opt, bfloat16_t>;
          k.q8[f16] = &Q::template q8_step<Opt, float16_t>;
        }
      }
    });
    t.accumulate[g] = &accumulate<G>;
    t.scale[g] = &scale<G>;
    constexpr int two = static_cast<int>(NormOrder::two), one = static_cast<int>(NormOrder::one);
    t.norm[two][g] = &norm<G, NormOrder::two>;
    t.norm[one][g] = &norm<G, NormOrder::one>;
    t.norm_exact[two][g] = &norm_exact_range<G, NormOrder::two>;
    t.norm_exact[one][g] = &norm_exact_range<G, NormOrder::one>;
  }

  /// The out-of-place (streamed) kernels: filled apart from make_table, by
  /// isa_<name>_streamed.cpp.
  static void fill_streamed(KernelTable& t) {
    fill_streamed_grad<float>(t, static_cast<int>(DType::f32));
    fill_streamed_grad<bfloat16_t>(t, static_cast<int>(DType::bf16));
    fill_streamed_grad<float16_t>(t, static_cast<int>(DType::f16));
  }
  template <class G>
  static void fill_streamed_grad(KernelTable& t, int g) {
    ::stepcore::detail::AllUnits::for_each([&](auto unit) {
      using Opt = decltype(unit);
      UnitKernels<Opt>& k = t.units.template of<Opt>();
      k.streamed[g][0] = &unit_streamed<Opt, G, void>;
      k.streamed[g][1] = &unit_streamed<Opt, G, float>;
      k.streamed[g][2] = &unit_streamed<Opt, G, bfloat16_t>;
      k.streamed[g][3] = &unit_streamed<Opt, G, float16_t>;
    });
  }

  // ---- the primitives, over arrays (for the primitive tests) -------------------------
  static void primitive(Primitive op, const float* a, const float* b, const float* c, float* out,
                        std::size_t n) {
    const F one = splat(1.0f), zero = splat(0.0f);
    for (std::size_t i = 0; i + N <= n; i += N) {
      const F x = Ops::load(a + i), y = Ops::load(b + i), z = Ops::load(c + i);
      F r = zero;
      switch (op) {
        case Primitive::add:
          r = Ops::add(x, y);
          break;
        case Primitive::sub:
          r = Ops::sub(x, y);
          break;
        case Primitive::mul:
          r = Ops::mul(x, y);
          break;
        case Primitive::div:
          r = Ops::div(x, y);
          break;
        case Primitive::sqrt:
          r = Ops::sqrt(x);
          break;
        case Primitive::fma:
          r = Ops::fma(x, y, z);
          break;
        case Primitive::gt:
          r = Ops::select(Ops::gt(x, y), one, zero);
          break;
        case Primitive::lt:
          r = Ops::select(Ops::lt(x, y), one, zero);
          break;
        case Primitive::eq:
          r = Ops::select(Ops::eq(x, y), one, zero);
          break;
        case Primitive::is_nan:
          r = Ops::select(Ops::is_nan(x), one, zero);
          break;
        case Primitive::select:
          r = Ops::select(Ops::lt(z, zero), x, y);
          break;
      }
      Ops::store(out + i, r);
    }
  }
  static void primitive64(Primitive64 op, const float* x, const double* acc, double* out,
                          std::size_t n) {
    constexpr std::size_t H = N / 2;
    for (std::size_t i = 0; i + N <= n; i += N) {
      D lo, hi;
      Ops::to_double(Ops::load(x + i), lo, hi);
      switch (op) {
        case Primitive64::widen:
          Ops::dstore(out + i, lo);
          Ops::dstore(out + i + H, hi);
          break;
        case Primitive64::add_square:
          Ops::dstore(out + i, Ops::add_square(lo, Ops::dload(acc + i)));
          Ops::dstore(out + i + H, Ops::add_square(hi, Ops::dload(acc + i + H)));
          break;
        case Primitive64::dsum:
          out[i] = Ops::dsum(Ops::dload(acc + i));
          break;
      }
    }
  }

  static KernelTable make_table(const char* name) {
    KernelTable t{};
    t.isa = name;
    t.width = N;
    t.primitive = &primitive;
    t.primitive64 = &primitive64;
    t.q8_dequantize = &Q8Body<A>::q8_dequantize;
    t.q8_requantize = &Q8Body<A>::q8_requantize;
    fill_grad<float>(t, static_cast<int>(DType::f32));
    fill_grad<bfloat16_t>(t, static_cast<int>(DType::bf16));
    fill_grad<float16_t>(t, static_cast<int>(DType::f16));
    return t;
  }
};

}  // namespace stepcore::cpu::detail

// The 8-bit state kernels (Q8Body, which make_table names).
#include "cpu/simd_q8.hpp"
