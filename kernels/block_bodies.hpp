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

using ::stepcore::detail::AdamW;
using ::stepcore::detail::ScalarOps;
using ::stepcore::detail::SignSgd;
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
/// place every norm and AdamW block body takes its scale and clip from.
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
  switch (a.dtype[t.tensor]) {
    case DType::f32:
      scale_norm_typed<float>(p, t, thread, threads, pass, lane);
      break;
    case DType::bf16:
      scale_norm_typed<bfloat16_t>(p, t, thread, threads, pass, lane);
      break;
    case DType::f16:
      scale_norm_typed<float16_t>(p, t, thread, threads, pass, lane);
      break;
  }
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
  switch (a.dtype[t.tensor]) {
    case DType::f32:
      scale_typed<float>(p, t, thread, threads, factor);
      break;
    case DType::bf16:
      scale_typed<bfloat16_t>(p, t, thread, threads, factor);
      break;
    case DType::f16:
      scale_typed<float16_t>(p, t, thread, threads, factor);
      break;
  }
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
  switch (a.src_dtype[t.tensor]) {
    case DType::f32:
      accumulate_typed<float>(acc, s, t, thread, threads, copy);
      break;
    case DType::bf16:
      accumulate_typed<bfloat16_t>(acc, s, t, thread, threads, copy);
      break;
    case DType::f16:
      accumulate_typed<float16_t>(acc, s, t, thread, threads, copy);
      break;
  }
}

/// The scalars of slot `slot`'s AdamW update, from device memory: its step counter
/// (t = counter + 1), lr and weight decay (d.hyper, else the configuration's) and the
/// bias corrections of step t from d.bias_table (1 past its end: exactly what the host
/// computes there). Each block computes them once; host and device give the same bits.
STEPCORE_HD_INLINE AdamWScalars adamw_block_scalars(const AdamWLaunchArgs& a, int slot,
                                                    const AdamWDeviceArgs& d) {
  const float t = *a.step[slot] + 1.0f;
  const auto ti = static_cast<std::uint64_t>(t);
  const double* table = d.bias_table;
  const auto len1 = static_cast<std::uint64_t>(table[0]);
  const auto len2 = static_cast<std::uint64_t>(table[1]);
  const double bc1 = ti <= len1 ? table[2 + ti - 1] : 1.0;
  const double bc2 = ti <= len2 ? table[2 + len1 + ti - 1] : 1.0;
  const double lr = d.hyper != nullptr ? d.hyper->lr : a.config.lr;
  const double wd = d.hyper != nullptr ? d.hyper->weight_decay : a.config.weight_decay;
  return ::stepcore::detail::adamw_scalars(a.config, lr, wd, bc1, bc2);
}

/// Counter k of a counter launch: advanced by one (the step was not skipped).
STEPCORE_HD_INLINE void advance_counter(const StepCounterArgs& c, int k) {
  *c.step[k] = *c.step[k] + 1.0f;
}

/// The storage type of an optional output (void: none; float stands in, never written).
template <class O>
using OutStorage = std::conditional_t<std::is_void_v<O>, float, O>;

template <class G, class O, int V>
STEPCORE_HD_INLINE void adamw_range(const AdamWLaunchArgs& a, int t, const BlockTask& task,
                                    int thread, int threads, const AdamWScalars& s, float scale,
                                    float clip) {
  const G* grad = static_cast<const G*>(a.grad[t]);
  O* out = static_cast<O*>(a.out[t]);
  const std::uint64_t tail = a.tail_begin[t];
  const AdamW::Consts<ScalarOps> k_s(s);
  const int variant = AdamW::variant(a.config);
  for_thread_groups<V>(task.begin, task.end, thread, threads, [&]<int W>(std::uint64_t i) {
    float p[W], m[W], v[W];
    G g[W];
    OutStorage<O> o[W];
    // The old state from the sources (the destinations when in place), updated in the
    // thread's registers, then stored to the destinations.
    load_group<float, W>(a.param_src[t] + i, p);
    load_group<float, W>(a.exp_avg_src[t] + i, m);
    load_group<float, W>(a.exp_avg_sq_src[t] + i, v);
    load_group<G, W>(grad + i, g);
    // The torch formula's tail test on the group's own indices: element i + k is in the
    // tail exactly when k >= tail - i.
    const std::uint64_t local_tail = tail > i ? tail - i : 0;
    const float* old_state[AdamW::kSlots] = {m, v};
    float* new_state[AdamW::kSlots] = {m, v};
    with_variant<AdamW::kVariants>(variant, [&](auto form) {
      for (int k = 0; k < W; ++k)
        unit_element<AdamW, decltype(form)::value, G, O>(
            p, old_state, p, new_state, g, std::is_void_v<O> ? nullptr : o, k_s, local_tail, scale,
            clip, static_cast<std::uint64_t>(k));
    });
    store_group<float, W>(a.param[t] + i, p);
    store_group<float, W>(a.exp_avg[t] + i, m);
    store_group<float, W>(a.exp_avg_sq[t] + i, v);
    if constexpr (!std::is_void_v<O>) store_group<O, W>(out + i, o);
  });
}

template <class G, class O>
STEPCORE_HD_INLINE void adamw_typed(const AdamWLaunchArgs& a, int t, const BlockTask& task,
                                    int thread, int threads, const AdamWScalars& s, float scale,
                                    float clip) {
  constexpr int V = kGroup<float>;
  bool vec = aligned_to(a.param[t], kVectorBytes) && aligned_to(a.exp_avg[t], kVectorBytes) &&
             aligned_to(a.exp_avg_sq[t], kVectorBytes) &&
             aligned_to(a.param_src[t], kVectorBytes) &&
             aligned_to(a.exp_avg_src[t], kVectorBytes) &&
             aligned_to(a.exp_avg_sq_src[t], kVectorBytes) && aligned_to(a.grad[t], V * sizeof(G));
  if constexpr (!std::is_void_v<O>) vec = vec && aligned_to(a.out[t], V * sizeof(O));
  if (vec)
    adamw_range<G, O, V>(a, t, task, thread, threads, s, scale, clip);
  else
    adamw_range<G, O, 1>(a, t, task, thread, threads, s, scale, clip);
}

template <class G>
STEPCORE_HD_INLINE void adamw_by_output(const AdamWLaunchArgs& a, int t, const BlockTask& task,
                                        int thread, int threads, const AdamWScalars& s, float scale,
                                        float clip) {
  switch (a.out_kind[t]) {
    case 0:
      adamw_typed<G, void>(a, t, task, thread, threads, s, scale, clip);
      break;
    case 1:
      adamw_typed<G, float>(a, t, task, thread, threads, s, scale, clip);
      break;
    case 2:
      adamw_typed<G, bfloat16_t>(a, t, task, thread, threads, s, scale, clip);
      break;
    default:
      adamw_typed<G, float16_t>(a, t, task, thread, threads, s, scale, clip);
      break;
  }
}

/// Thread `thread` of `threads` on block `block` of an AdamW launch, with the block's
/// scalars `s` (adamw_block_scalars of its tensor slot).
STEPCORE_HD_INLINE void adamw_thread(const AdamWLaunchArgs& a, int block, int thread, int threads,
                                     const AdamWScalars& s, float scale, float clip) {
  const BlockTask task = a.task(block);
  const int t = task.tensor;
  switch (a.grad_dtype[t]) {
    case DType::f32:
      adamw_by_output<float>(a, t, task, thread, threads, s, scale, clip);
      break;
    case DType::bf16:
      adamw_by_output<bfloat16_t>(a, t, task, thread, threads, s, scale, clip);
      break;
    case DType::f16:
      adamw_by_output<float16_t>(a, t, task, thread, threads, s, scale, clip);
      break;
  }
}

/// The scalars of a SignSGD launch: lr and weight decay from device memory when given.
STEPCORE_HD_INLINE SignSgdScalars sign_sgd_block_scalars(const SignSgdLaunchArgs& a,
                                                         const StepHyper* hyper) {
  return hyper != nullptr ? ::stepcore::detail::sign_sgd_scalars(hyper->lr, hyper->weight_decay)
                          : ::stepcore::detail::sign_sgd_scalars(a.lr, a.weight_decay);
}

template <class G, class O, int V>
STEPCORE_HD_INLINE void sign_sgd_range(const SignSgdLaunchArgs& a, int t, const BlockTask& task,
                                       int thread, int threads, const SignSgdScalars& s) {
  const G* grad = static_cast<const G*>(a.grad[t]);
  O* out = static_cast<O*>(a.out[t]);
  const SignSgd::Consts<ScalarOps> k_s(s);
  for_thread_groups<V>(task.begin, task.end, thread, threads, [&]<int W>(std::uint64_t i) {
    float p[W];
    G g[W];
    OutStorage<O> o[W];
    load_group<float, W>(a.param_src[t] + i, p);  // the old parameter (param when in place)
    load_group<G, W>(grad + i, g);
    for (int k = 0; k < W; ++k)
      unit_element<SignSgd, 0, G, O>(p, nullptr, p, nullptr, g, std::is_void_v<O> ? nullptr : o,
                                     k_s, ~std::uint64_t{0}, 1.0f, 1.0f,
                                     static_cast<std::uint64_t>(k));
    store_group<float, W>(a.param[t] + i, p);
    if constexpr (!std::is_void_v<O>) store_group<O, W>(out + i, o);
  });
}

template <class G, class O>
STEPCORE_HD_INLINE void sign_sgd_typed(const SignSgdLaunchArgs& a, int t, const BlockTask& task,
                                       int thread, int threads, const SignSgdScalars& s) {
  constexpr int V = kGroup<float>;
  bool vec = aligned_to(a.param[t], kVectorBytes) && aligned_to(a.param_src[t], kVectorBytes) &&
             aligned_to(a.grad[t], V * sizeof(G));
  if constexpr (!std::is_void_v<O>) vec = vec && aligned_to(a.out[t], V * sizeof(O));
  if (vec)
    sign_sgd_range<G, O, V>(a, t, task, thread, threads, s);
  else
    sign_sgd_range<G, O, 1>(a, t, task, thread, threads, s);
}

template <class G>
STEPCORE_HD_INLINE void sign_sgd_by_output(const SignSgdLaunchArgs& a, int t, const BlockTask& task,
                                           int thread, int threads, const SignSgdScalars& s) {
  switch (a.out_kind[t]) {
    case 0:
      sign_sgd_typed<G, void>(a, t, task, thread, threads, s);
      break;
    case 1:
      sign_sgd_typed<G, float>(a, t, task, thread, threads, s);
      break;
    case 2:
      sign_sgd_typed<G, bfloat16_t>(a, t, task, thread, threads, s);
      break;
    default:
      sign_sgd_typed<G, float16_t>(a, t, task, thread, threads, s);
      break;
  }
}

/// Thread `thread` of `threads` on block `block` of a SignSGD launch.
STEPCORE_HD_INLINE void sign_sgd_thread(const SignSgdLaunchArgs& a, int block, int thread,
                                        int threads, const SignSgdScalars& s) {
  const BlockTask task = a.task(block);
  const int t = task.tensor;
  switch (a.grad_dtype[t]) {
    case DType::f32:
      sign_sgd_by_output<float>(a, t, task, thread, threads, s);
      break;
    case DType::bf16:
      sign_sgd_by_output<bfloat16_t>(a, t, task, thread, threads, s);
      break;
    case DType::f16:
      sign_sgd_by_output<float16_t>(a, t, task, thread, threads, s);
      break;
  }
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
