// __host__ __device__ block bodies of the multi-tensor kernels: the per-thread work of
// one block task and the block's combination of its threads' results. The CUDA
// kernels (step_kernels.cu) and the CPU executor (emulate.cpp) both run exactly this
// code; only the thread scheduling differs.
//
// Thread work: each thread takes groups of V consecutive elements, group g = thread,
// thread + threads, ..., loaded and stored as one V * sizeof(T)-byte access (16 bytes:
// 8 bf16 or 4 f32) when every pointer of the tensor is aligned to it, else V = 1; the
// remainder past the last whole group goes one element per thread. Element results
// never depend on the grouping; a norm's block partial does (its binary64 sums), and
// the finalised norm does not (docs/numerics.md 6.3).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/norm_finalize.hpp"
#include "core/optimizers/all.hpp"
#include "core/superaccumulator.hpp"
#include "kernels/plans.hpp"
#include "stepcore/config.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::gpu::detail {

using ::stepcore::detail::ScalarOps;
using ::stepcore::detail::unit_element;
using ::stepcore::detail::with_variant;

/// Returns true when p is aligned to `bytes` (a power of two).
STEPCORE_HD_INLINE bool aligned_to(const void* p, std::uint64_t bytes) {
  return (reinterpret_cast<std::uintptr_t>(p) & (bytes - 1)) == 0;
}

#if defined(__CUDA_ARCH__)
/// The device's native word of B bytes: one ld/st.global instruction (v4.u32: 16 bytes).
template <int B>
struct DeviceWord;
template <>
struct DeviceWord<16> {
  using type = uint4;
};
template <>
struct DeviceWord<8> {
  using type = uint2;
};
template <>
struct DeviceWord<4> {
  using type = unsigned int;
};
#endif

/// out[0, V) = p[0, V), one access of V * sizeof(T) bytes (p aligned to it when V > 1).
template <class T, int V>
STEPCORE_HD_INLINE void load_group(const T* p, T (&out)[V]) {
  if constexpr (V == 1) {
    out[0] = p[0];
  } else {
#if defined(__CUDA_ARCH__)
    using W = typename DeviceWord<sizeof(T) * V>::type;
    const W w = *reinterpret_cast<const W*>(p);
    memcpy(out, &w, sizeof w);
#else
    std::memcpy(out, p, sizeof(T) * V);
#endif
  }
}

/// p[0, V) = in[0, V), one access.
template <class T, int V>
STEPCORE_HD_INLINE void store_group(T* p, const T (&in)[V]) {
  if constexpr (V == 1) {
    p[0] = in[0];
  } else {
#if defined(__CUDA_ARCH__)
    using W = typename DeviceWord<sizeof(T) * V>::type;
    W w;
    memcpy(&w, in, sizeof w);
    *reinterpret_cast<W*>(p) = w;
#else
    std::memcpy(p, in, sizeof(T) * V);
#endif
  }
}

/// Elements per group of a 16-byte access of T.
template <class T>
inline constexpr int kGroup = kVectorBytes / static_cast<int>(sizeof(T));

/// Calls fn(std::type_identity<T>{}) for the storage type T of `dtype`: the one dtype
/// dispatch of every block body.
template <class Fn>
STEPCORE_HD_INLINE STEPCORE_DISPATCH_INLINE void with_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32:
      fn(std::type_identity<float>{});
      break;
    case DType::bf16:
      fn(std::type_identity<bfloat16_t>{});
      break;
    case DType::f16:
      fn(std::type_identity<float16_t>{});
      break;
  }
}

/// Calls fn(std::type_identity<O>{}) for an optional output's kind (0: none, O = void;
/// else 1 + its DType).
template <class Fn>
STEPCORE_HD_INLINE STEPCORE_DISPATCH_INLINE void with_output(std::int8_t kind, Fn&& fn) {
  if (kind == 0)
    fn(std::type_identity<void>{});
  else
    with_dtype(static_cast<DType>(kind - 1), static_cast<Fn&&>(fn));
}

/// Calls f(i, V_tag) for thread `thread`'s groups of V elements of [begin, end), then
/// f(i, 1) for its remainder elements (see the file comment).
template <int V, class F>
STEPCORE_HD_INLINE void for_thread_groups(std::uint64_t begin, std::uint64_t end, int thread,
                                          int threads, F&& f) {
  const std::uint64_t groups = (end - begin) / V;
  for (std::uint64_t g = static_cast<std::uint64_t>(thread); g < groups;
       g += static_cast<std::uint64_t>(threads))
    f.template operator()<V>(begin + g * V);
  if constexpr (V > 1)
    for (std::uint64_t i = begin + groups * V + static_cast<std::uint64_t>(thread); i < end;
         i += static_cast<std::uint64_t>(threads))
      f.template operator()<1>(i);
}

/// One thread's share of a norm: binary64 sum of exact squares of finite values, the
/// largest finite |x| bit pattern and the non-finite counts.
struct NormLane {
  double sum = 0.0;
  std::uint32_t max_bits = 0;
  std::uint32_t nan = 0;
  std::uint32_t inf = 0;

  /// Adds the exact square of a finite value (binary64 holds it exactly).
  STEPCORE_HD_INLINE void add_square(double square) { sum = sum + square; }
};

/// One thread's share of an exact norm (the rare fallback for an uncertifiable
/// rounding): every square is deposited into integer digits, no rounding at all. A
/// thread deposits at most kBlockElements / 32 squares, so its digits stay below 2^44.
struct ExactNormLane {
  std::uint64_t digits[kNormDigits] = {};
  std::uint32_t max_bits = 0;
  std::uint32_t nan = 0;
  std::uint32_t inf = 0;

  STEPCORE_HD_INLINE void add_square(double square) {
    ::stepcore::detail::deposit_double(digits, square);
  }
};

/// Adds one read value to a norm lane: NaN and Inf are counted, a finite value's exact
/// square is summed and its |x| bits kept for the max.
template <class Lane>
STEPCORE_HD_INLINE void norm_add(Lane& lane, float v) {
  const std::uint32_t a = f32_bits(v) & 0x7FFFFFFFu;
  if (a > 0x7F800000u) {
    ++lane.nan;
  } else if (a == 0x7F800000u) {
    ++lane.inf;
  } else {
    if (a > lane.max_bits) lane.max_bits = a;
    const double d = static_cast<double>(v);
    lane.add_square(d * d);  // exact: a 24-bit significand squared fits binary64
  }
}

/// What a norm launch does besides summing: the read's factors and whether it writes.
struct NormPass {
  float scale = 1.0f;
  float clip = 1.0f;
  bool write = false;
};

/// The gradient read a block applies: each factor from device memory where `d` points
/// (read now, when the kernel runs: a replayed CUDA graph takes the value there at
/// replay), else `value`'s (a by-value launch argument, fixed when enqueued). The one
/// place every norm and optimizer block body takes its scale and clip from.
STEPCORE_HD_INLINE GradientRead read_at_run(const float* d_scale, const float* d_clip,
                                            GradientRead value = {}) {
  return GradientRead{d_scale != nullptr ? *d_scale : value.scale,
                      d_clip != nullptr ? *d_clip : value.clip};
}

/// The pass a norm block runs: `pass` with its factors read by read_at_run.
STEPCORE_HD_INLINE NormPass norm_pass_at_run(const NormPass& pass, const float* d_scale,
                                             const float* d_clip) {
  const GradientRead r = read_at_run(d_scale, d_clip, GradientRead{pass.scale, pass.clip});
  return NormPass{r.scale, r.clip, pass.write};
}

/// Thread `thread`'s elements of [begin, end) of one tensor, in groups of V, read as
/// x = R_T(R_T(f32(g) * scale) * clip) (a factor is skipped when it is 1); with
/// pass.write, the scaled value R_T(f32(g) * scale) is stored back (the fused scale +
/// norm pass, clip off). The value read goes into the lane.
template <class T, int V, class Lane>
STEPCORE_HD_INLINE void scale_norm_range(T* data, std::uint64_t begin, std::uint64_t end,
                                         int thread, int threads, const NormPass& pass,
                                         Lane& lane) {
  const bool s = pass.scale != 1.0f, c = pass.clip != 1.0f;
  for_thread_groups<V>(begin, end, thread, threads, [&]<int W>(std::uint64_t i) {
    T v[W];
    load_group<T, W>(data + i, v);
    for (int k = 0; k < W; ++k) {
      float x = to_f32(v[k]);
      if (s) {
        v[k] = from_f32<T>(x * pass.scale);
        x = to_f32(v[k]);
      }
      if (c) x = round_to<T>(x * pass.clip);
      norm_add(lane, x);
    }
    if (s && pass.write) store_group<T, W>(data + i, v);
  });
}

template <class T, class Lane>
STEPCORE_HD_INLINE void scale_norm_typed(void* p, const BlockTask& t, int thread, int threads,
                                         const NormPass& pass, Lane& lane) {
  T* data = static_cast<T*>(p);
  if (aligned_to(data, kVectorBytes))
    scale_norm_range<T, kGroup<T>>(data, t.begin, t.end, thread, threads, pass, lane);
  else
    scale_norm_range<T, 1>(data, t.begin, t.end, thread, threads, pass, lane);
}

/// Thread `thread` of `threads` on block `block` of launch `a` (Lane: NormLane for the
/// fast pass, ExactNormLane for the exact fallback).
template <class Lane>
STEPCORE_HD_INLINE void scale_norm_thread(const LaunchArgs& a, int block, int thread, int threads,
                                          const NormPass& pass, Lane& lane) {
  const BlockTask t = a.task(block);
  void* p = a.data[t.tensor];
  with_dtype(a.dtype[t.tensor], [&](auto type) STEPCORE_DISPATCH_INLINE {
    scale_norm_typed<typename decltype(type)::type>(p, t, thread, threads, pass, lane);
  });
}

/// In place g = R_T(f32(g) * factor) (the clip applied eagerly).
template <class T, int V>
STEPCORE_HD_INLINE void scale_range(T* data, std::uint64_t begin, std::uint64_t end, int thread,
                                    int threads, float factor) {
  for_thread_groups<V>(begin, end, thread, threads, [&]<int W>(std::uint64_t i) {
    T v[W];
    load_group<T, W>(data + i, v);
    for (int k = 0; k < W; ++k) v[k] = from_f32<T>(to_f32(v[k]) * factor);
    store_group<T, W>(data + i, v);
  });
}

template <class T>
STEPCORE_HD_INLINE void scale_typed(void* p, const BlockTask& t, int thread, int threads,
                                    float factor) {
  T* data = static_cast<T*>(p);
  if (aligned_to(data, kVectorBytes))
    scale_range<T, kGroup<T>>(data, t.begin, t.end, thread, threads, factor);
  else
    scale_range<T, 1>(data, t.begin, t.end, thread, threads, factor);
}

STEPCORE_HD_INLINE void scale_thread(const LaunchArgs& a, int block, int thread, int threads,
                                     float factor) {
  const BlockTask t = a.task(block);
  void* p = a.data[t.tensor];
  with_dtype(a.dtype[t.tensor], [&](auto type) STEPCORE_DISPATCH_INLINE {
    scale_typed<typename decltype(type)::type>(p, t, thread, threads, factor);
  });
}

/// a += b (the block's tree combination).
STEPCORE_HD_INLINE void combine(NormLane& a, const NormLane& b) {
  a.sum = a.sum + b.sum;
  a.max_bits = a.max_bits > b.max_bits ? a.max_bits : b.max_bits;
  a.nan += b.nan;
  a.inf += b.inf;
}

/// a += b for exact lanes (integer digit sums; no normalisation needed below 2^64).
STEPCORE_HD_INLINE void combine(ExactNormLane& a, const ExactNormLane& b) {
  for (int k = 0; k < kNormDigits; ++k) a.digits[k] += b.digits[k];
  a.max_bits = a.max_bits > b.max_bits ? a.max_bits : b.max_bits;
  a.nan += b.nan;
  a.inf += b.inf;
}

/// Returns the block's exact partial (normalised digits, approximate = 0).
STEPCORE_HD_INLINE NormPartial to_partial(const ExactNormLane& l) {
  NormPartial p;
  for (int k = 0; k < kNormDigits; ++k) p.digits[k] = l.digits[k];
  ::stepcore::detail::normalize_digits(p.digits);
  p.max_abs_bits = l.max_bits;
  p.nan_count = l.nan;
  p.inf_count = l.inf;
  p.approximate = 0;
  return p;
}

/// Returns the block's partial from its combined lane: the binary64 block sum is
/// deposited exactly (every path has at most kBlockElements / threads + log2(threads)
/// additions, within kNormMaxBlockAdditions).
STEPCORE_HD_INLINE NormPartial to_partial(const NormLane& l) {
  NormPartial p;
  ::stepcore::detail::deposit_double(p.digits, l.sum);
  ::stepcore::detail::normalize_digits(p.digits);
  p.max_abs_bits = l.max_bits;
  p.nan_count = l.nan;
  p.inf_count = l.inf;
  p.approximate = 1;
  return p;
}

/// The fields of a NormPartial the partials' reduction combines one at a time (the
/// CUDA reduction runs one block per field and slice): the digits and the two counts are
/// summed, max_abs_bits is a max, approximate an or. Block partials hold normalised
/// digits (below 2^32, to_partial) and there are fewer than 2^32 blocks, so the digit
/// sums stay below 2^64 unnormalised; the result is normalised once at the end.
inline constexpr int kReduceFields = kNormDigits + 4;

/// Returns field f of p, widened.
STEPCORE_HD_INLINE std::uint64_t partial_field(const NormPartial& p, int f) {
  if (f < kNormDigits) return p.digits[f];
  if (f == kNormDigits) return p.nan_count;
  if (f == kNormDigits + 1) return p.inf_count;
  if (f == kNormDigits + 2) return p.max_abs_bits;
  return p.approximate;
}

/// Returns field f's combination of a and b: a sum, a max or an or (exact, associative
/// and commutative: any order and tree give the same bits).
STEPCORE_HD_INLINE std::uint64_t combine_field(int f, std::uint64_t a, std::uint64_t b) {
  if (f < kNormDigits + 2) return a + b;
  if (f == kNormDigits + 2) return a > b ? a : b;
  return a | b;
}

/// Stores a reduced field f into p.
STEPCORE_HD_INLINE void set_partial_field(NormPartial& p, int f, std::uint64_t v) {
  if (f < kNormDigits)
    p.digits[f] = v;
  else if (f == kNormDigits)
    p.nan_count = v;
  else if (f == kNormDigits + 1)
    p.inf_count = v;
  else if (f == kNormDigits + 2)
    p.max_abs_bits = static_cast<std::uint32_t>(v);
  else
    p.approximate = static_cast<std::uint32_t>(v);
}

/// acc = copy ? f32(src) : acc + f32(src) over thread `thread`'s groups of V.
template <class S, int V>
STEPCORE_HD_INLINE void accumulate_range(float* acc, const S* src, std::uint64_t begin,
                                         std::uint64_t end, int thread, int threads, bool copy) {
  for_thread_groups<V>(begin, end, thread, threads, [&]<int W>(std::uint64_t i) {
    S x[W];
    float y[W];
    load_group<S, W>(src + i, x);
    if (!copy) load_group<float, W>(acc + i, y);
    for (int k = 0; k < W; ++k) y[k] = copy ? to_f32(x[k]) : y[k] + to_f32(x[k]);
    store_group<float, W>(acc + i, y);
  });
}

template <class S>
STEPCORE_HD_INLINE void accumulate_typed(float* acc, const void* s, const BlockTask& t, int thread,
                                         int threads, bool copy) {
  const S* src = static_cast<const S*>(s);
  constexpr int V = kGroup<float>;
  if (aligned_to(acc, kVectorBytes) && aligned_to(src, V * sizeof(S)))
    accumulate_range<S, V>(acc, src, t.begin, t.end, thread, threads, copy);
  else
    accumulate_range<S, 1>(acc, src, t.begin, t.end, thread, threads, copy);
}

/// Thread `thread` of `threads` on block `block` of an accumulate launch.
STEPCORE_HD_INLINE void accumulate_thread(const LaunchArgs& a, int block, int thread, int threads,
                                          bool copy) {
  const BlockTask t = a.task(block);
  float* acc = static_cast<float*>(a.data[t.tensor]);
  const void* s = a.src[t.tensor];
  with_dtype(a.src_dtype[t.tensor], [&](auto type) STEPCORE_DISPATCH_INLINE {
    accumulate_typed<typename decltype(type)::type>(acc, s, t, thread, threads, copy);
  });
}

/// Unit Opt's table row of step t from `table` (gpu::make_optimizer_table's layout:
/// {len_0 .. len_{K-1}, column 0, column 1, ...}): entry t of each column, or the unit's
/// kTableLimit past its end. A counter that is not a positive integer (device memory,
/// unchecked) reads an entry of the table, never outside it.
template <class Opt>
STEPCORE_HD_INLINE void table_row(const double* table, float t, double* row) {
  constexpr int K = Opt::kTableColumns;
  // t >= 1 and below 2^32 converts exactly (a counter holds integers below 2^24).
  const std::uint64_t ti = t >= 1.0f && t < 4294967296.0f ? static_cast<std::uint64_t>(t) : 1;
  std::uint64_t offset = K;
  for (int k = 0; k < K; ++k) {
    const auto len = static_cast<std::uint64_t>(table[k]);
    row[k] = ti <= len ? table[offset + ti - 1] : Opt::kTableLimit;
    offset += len;
  }
}

/// The scalars of slot `slot`'s update of unit Opt, from device memory when the block
/// runs: its step counter (t = counter + 1), lr and weight decay (d.hyper, else the
/// configuration's) and the table row of step t; then the unit's step_scalars, the
/// operations the host engine runs (unit_scalars), so host and device give the same bits.
template <class Opt>
STEPCORE_HD_INLINE typename Opt::Scalars block_scalars(const OptimizerLaunchArgs<Opt>& a, int slot,
                                                       const OptimizerDeviceArgs& d) {
  ::stepcore::detail::StepInputs in;
  if constexpr (Opt::kCountsSteps) in.t = *a.step[slot] + 1.0f;
  in.lr = d.hyper != nullptr ? d.hyper->lr : a.config.lr;
  in.weight_decay = d.hyper != nullptr ? d.hyper->weight_decay : a.config.weight_decay;
  double row[Opt::kTableColumns > 0 ? Opt::kTableColumns : 1] = {};
  if constexpr (Opt::kTableColumns > 0) table_row<Opt>(d.table, in.t, row);
  in.row = row;
  return Opt::step_scalars(a.config, in);
}

/// The read factors of a block of unit Opt: from device memory when the unit applies the
/// read, else 1 (its d.scale and d.clip may be null).
template <class Opt>
STEPCORE_HD_INLINE GradientRead block_read(const OptimizerDeviceArgs& d) {
  if constexpr (Opt::kReadsScaled) return read_at_run(d.scale, d.clip);
  return GradientRead{};
}

/// Counter k of a counter launch: advanced by one (the step was not skipped).
STEPCORE_HD_INLINE void advance_counter(const StepCounterArgs& c, int k) {
  *c.step[k] = *c.step[k] + 1.0f;
}

/// The storage type of an optional output (void: none; float stands in, never written).
template <class O>
using OutStorage = std::conditional_t<std::is_void_v<O>, float, O>;

/// Thread `thread`'s groups of W elements of [task.begin, task.end) of slot t, variant V
/// of unit Opt: the old parameter and the variant's state slots loaded from their
/// sources, the unit's element applied to each, the new values stored (and the
/// parameter rounded to O into the compute copy).
template <class Opt, int V, class G, class O, int W>
STEPCORE_HD_INLINE void optimizer_range(const OptimizerLaunchArgs<Opt>& a, int t,
                                        const BlockTask& task, int thread, int threads,
                                        const typename Opt::template Consts<ScalarOps>& k_s,
                                        std::uint64_t tail, float scale, float clip) {
  constexpr int K = Opt::slots(V);  // the state slots this variant reads and writes
  const G* grad = static_cast<const G*>(a.grad[t]);
  O* out = static_cast<O*>(a.out[t]);
  for_thread_groups<W>(task.begin, task.end, thread, threads, [&]<int X>(std::uint64_t i) {
    float p[X];
    float st[K > 0 ? K : 1][X];
    G g[X];
    OutStorage<O> o[X];
    // The old values from the sources (the destinations when in place), updated in the
    // thread's registers, then stored to the destinations.
    load_group<float, X>(a.src[0][t] + i, p);
    for (int s = 0; s < K; ++s) load_group<float, X>(a.src[1 + s][t] + i, st[s]);
    load_group<G, X>(grad + i, g);
    // The tail test on the group's own indices: element i + k is in the tail exactly
    // when k >= tail - i.
    const std::uint64_t local_tail = tail > i ? tail - i : 0;
    float* state[K > 0 ? K : 1];
    for (int s = 0; s < K; ++s) state[s] = st[s];
    for (int k = 0; k < X; ++k)
      unit_element<Opt, V, G, O>(p, state, p, state, g, std::is_void_v<O> ? nullptr : o, k_s,
                                 local_tail, scale, clip, static_cast<std::uint64_t>(k));
    store_group<float, X>(a.dst[0][t] + i, p);
    for (int s = 0; s < K; ++s) store_group<float, X>(a.dst[1 + s][t] + i, st[s]);
    if constexpr (!std::is_void_v<O>) store_group<O, X>(out + i, o);
  });
}

/// Thread `thread` of `threads` on block `block` of a launch of unit Opt, with the
/// block's scalars `s` (block_scalars of its tensor slot) and read factors: the variant,
/// gradient dtype and output dtype resolved once, then whole 16-byte groups where every
/// array of the tensor is aligned to them, single elements otherwise.
template <class Opt>
STEPCORE_HD_INLINE void optimizer_thread(const OptimizerLaunchArgs<Opt>& a, int block, int thread,
                                         int threads, const typename Opt::Scalars& s, float scale,
                                         float clip) {
  const BlockTask task = a.task(block);
  const int t = task.tensor;
  const typename Opt::template Consts<ScalarOps> k_s(s);
  const std::uint64_t tail = Opt::tail_begin(a.config, a.map.numel[t]);
  with_variant<Opt::kVariants>(Opt::variant(a.config), [&](auto form) STEPCORE_DISPATCH_INLINE {
    constexpr int V = decltype(form)::value;
    with_dtype(a.grad_dtype[t], [&](auto gt) STEPCORE_DISPATCH_INLINE {
      using G = typename decltype(gt)::type;
      with_output(a.out_kind[t], [&](auto ot) STEPCORE_DISPATCH_INLINE {
        using O = typename decltype(ot)::type;
        constexpr int W = kGroup<float>;
        bool vec = aligned_to(a.grad[t], W * sizeof(G));
        for (int k = 0; k <= Opt::slots(V); ++k)
          vec =
              vec && aligned_to(a.dst[k][t], kVectorBytes) && aligned_to(a.src[k][t], kVectorBytes);
        if constexpr (!std::is_void_v<O>) vec = vec && aligned_to(a.out[t], W * sizeof(O));
        if (vec)
          optimizer_range<Opt, V, G, O, W>(a, t, task, thread, threads, k_s, tail, scale, clip);
        else
          optimizer_range<Opt, V, G, O, 1>(a, t, task, thread, threads, k_s, tail, scale, clip);
      });
    });
  });
}

/// finalize + clip coefficient + found-inf flag (see gpu::finalize_and_clip).
STEPCORE_HD_INLINE void finalize_and_clip_body(const NormPartial& partial, float max_norm,
                                               NormResult& result, float& clip,
                                               std::int32_t& found_inf) {
  result = ::stepcore::detail::finalize_partial(partial);
  if (result.needs_exact) {
    found_inf = kFoundInfNeedsExact;
    clip = 0.0f;
  } else if (!result.finite) {
    found_inf = kFoundInfNonFinite;
    clip = 0.0f;
  } else {
    found_inf = kFoundInfNone;
    clip = clip_coefficient(result.norm, max_norm);
  }
}

/// The exact fallback's finalisation: when found_inf is kFoundInfNeedsExact, replaces
/// result, clip and found_inf by the finalisation of the exact partial; otherwise
/// leaves them as the fast pass set them.
STEPCORE_HD_INLINE void finalize_exact_and_clip_body(const NormPartial& exact, float max_norm,
                                                     NormResult& result, float& clip,
                                                     std::int32_t& found_inf) {
  if (found_inf != kFoundInfNeedsExact) return;
  finalize_and_clip_body(exact, max_norm, result, clip, found_inf);
}

}  // namespace stepcore::gpu::detail
