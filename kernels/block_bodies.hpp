// __host__ __device__ block bodies of the multi-tensor kernels: the per-thread work of
// one block task and the block's combination of its threads' results. The CUDA
// kernels (step_kernels.cu) and the CPU executor (emulate.cpp) both run exactly this
// code; only the thread scheduling differs.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/element_ops.hpp"
#include "stepcore/config.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/detail/norm_finalize.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/norm.hpp"

namespace stepcore::gpu::detail {

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
/// thread deposits at most kChunkElements / 32 squares, so its digits stay below 2^44.
struct ExactNormLane {
  std::uint64_t digits[kNormDigits] = {};
  std::uint32_t max_bits = 0;
  std::uint32_t nan = 0;
  std::uint32_t inf = 0;

  STEPCORE_HD_INLINE void add_square(double square) {
    ::stepcore::detail::deposit_double(digits, square);
  }
};

/// Elements [begin + first, end) with stride `stride` of one tensor, read as
/// x = R_T(R_T(f32(g) * scale) * clip) (a factor is skipped when its flag is off);
/// with `write`, the scaled value R_T(f32(g) * scale) is stored back (the fused
/// scale + norm pass, clip off). The value read goes into the lane.
template <class T, class Lane>
STEPCORE_HD_INLINE void scale_norm_elements(T* data, std::uint64_t begin, std::uint64_t end,
                                            std::uint64_t first, std::uint64_t stride, float scale,
                                            bool apply_scale, float clip, bool apply_clip,
                                            bool write, Lane& lane) {
  for (std::uint64_t i = begin + first; i < end; i += stride) {
    float v = to_f32(data[i]);
    if (apply_scale) {
      const T r = from_f32<T>(v * scale);
      if (write) data[i] = r;
      v = to_f32(r);
    }
    if (apply_clip) v = round_to<T>(v * clip);
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
}

/// What a norm launch does besides summing: the read's factors and whether it writes.
struct NormPass {
  float scale = 1.0f;
  float clip = 1.0f;
  bool write = false;
};

/// Thread `thread` of `threads` on block `block` of launch `a` (Lane: NormLane for the
/// fast pass, ExactNormLane for the exact fallback).
template <class Lane>
STEPCORE_HD_INLINE void scale_norm_thread(const LaunchArgs& a, int block, int thread, int threads,
                                          const NormPass& pass, Lane& lane) {
  const BlockTask& t = a.tasks[block];
  void* p = a.data[t.tensor];
  const bool s = pass.scale != 1.0f, c = pass.clip != 1.0f;
  switch (a.dtype[t.tensor]) {
    case DType::f32:
      scale_norm_elements(static_cast<float*>(p), t.begin, t.end, thread, threads, pass.scale, s,
                          pass.clip, c, pass.write, lane);
      break;
    case DType::bf16:
      scale_norm_elements(static_cast<bfloat16_t*>(p), t.begin, t.end, thread, threads, pass.scale,
                          s, pass.clip, c, pass.write, lane);
      break;
    case DType::f16:
      scale_norm_elements(static_cast<float16_t*>(p), t.begin, t.end, thread, threads, pass.scale,
                          s, pass.clip, c, pass.write, lane);
      break;
  }
}

/// In place g = R_T(f32(g) * factor) (the clip applied eagerly).
template <class T>
STEPCORE_HD_INLINE void scale_elements(T* data, std::uint64_t begin, std::uint64_t end,
                                       std::uint64_t first, std::uint64_t stride, float factor) {
  for (std::uint64_t i = begin + first; i < end; i += stride)
    data[i] = from_f32<T>(to_f32(data[i]) * factor);
}

STEPCORE_HD_INLINE void scale_thread(const LaunchArgs& a, int block, int thread, int threads,
                                     float factor) {
  const BlockTask& t = a.tasks[block];
  void* p = a.data[t.tensor];
  switch (a.dtype[t.tensor]) {
    case DType::f32:
      scale_elements(static_cast<float*>(p), t.begin, t.end, thread, threads, factor);
      break;
    case DType::bf16:
      scale_elements(static_cast<bfloat16_t*>(p), t.begin, t.end, thread, threads, factor);
      break;
    case DType::f16:
      scale_elements(static_cast<float16_t*>(p), t.begin, t.end, thread, threads, factor);
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
/// deposited exactly (every path has at most kChunkElements / threads + log2(threads)
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

/// Thread `thread` of `threads` on block `block` of an accumulate launch.
template <class S>
STEPCORE_HD_INLINE void accumulate_elements(float* acc, const S* src, std::uint64_t begin,
                                            std::uint64_t end, std::uint64_t first,
                                            std::uint64_t stride, bool copy) {
  for (std::uint64_t i = begin + first; i < end; i += stride) {
    const float x = to_f32(src[i]);
    acc[i] = copy ? x : acc[i] + x;
  }
}

STEPCORE_HD_INLINE void accumulate_thread(const LaunchArgs& a, int block, int thread, int threads,
                                          bool copy) {
  const BlockTask& t = a.tasks[block];
  float* acc = static_cast<float*>(a.data[t.tensor]);
  const void* s = a.src[t.tensor];
  switch (a.src_dtype[t.tensor]) {
    case DType::f32:
      accumulate_elements(acc, static_cast<const float*>(s), t.begin, t.end, thread, threads, copy);
      break;
    case DType::bf16:
      accumulate_elements(acc, static_cast<const bfloat16_t*>(s), t.begin, t.end, thread, threads,
                          copy);
      break;
    case DType::f16:
      accumulate_elements(acc, static_cast<const float16_t*>(s), t.begin, t.end, thread, threads,
                          copy);
      break;
  }
}

template <class G, class O>
STEPCORE_HD_INLINE void adamw_elements(const AdamWLaunchArgs& a, int t, const BlockTask& task,
                                       int thread, int threads, float scale, float clip) {
  const G* grad = static_cast<const G*>(a.grad[t]);
  O* out = static_cast<O*>(a.out[t]);
  for (std::uint64_t i = task.begin + thread; i < task.end; i += threads)
    ::stepcore::detail::adamw_element<G, O>(a.param[t], a.exp_avg[t], a.exp_avg_sq[t], grad, out,
                                            a.scalars[t], a.torch, a.tail_begin[t], scale, clip, i);
}

template <class G>
STEPCORE_HD_INLINE void adamw_by_output(const AdamWLaunchArgs& a, int t, const BlockTask& task,
                                        int thread, int threads, float scale, float clip) {
  switch (a.out_kind[t]) {
    case 0:
      adamw_elements<G, void>(a, t, task, thread, threads, scale, clip);
      break;
    case 1:
      adamw_elements<G, float>(a, t, task, thread, threads, scale, clip);
      break;
    case 2:
      adamw_elements<G, bfloat16_t>(a, t, task, thread, threads, scale, clip);
      break;
    default:
      adamw_elements<G, float16_t>(a, t, task, thread, threads, scale, clip);
      break;
  }
}

/// Thread `thread` of `threads` on block `block` of an AdamW launch.
STEPCORE_HD_INLINE void adamw_thread(const AdamWLaunchArgs& a, int block, int thread, int threads,
                                     float scale, float clip) {
  const BlockTask& task = a.tasks[block];
  const int t = task.tensor;
  switch (a.grad_dtype[t]) {
    case DType::f32:
      adamw_by_output<float>(a, t, task, thread, threads, scale, clip);
      break;
    case DType::bf16:
      adamw_by_output<bfloat16_t>(a, t, task, thread, threads, scale, clip);
      break;
    case DType::f16:
      adamw_by_output<float16_t>(a, t, task, thread, threads, scale, clip);
      break;
  }
}

template <class G, class O>
STEPCORE_HD_INLINE void sign_sgd_elements(const SignSgdLaunchArgs& a, int t, const BlockTask& task,
                                          int thread, int threads) {
  const G* grad = static_cast<const G*>(a.grad[t]);
  O* out = static_cast<O*>(a.out[t]);
  for (std::uint64_t i = task.begin + thread; i < task.end; i += threads)
    ::stepcore::detail::sign_sgd_element<G, O>(a.param[t], grad, out, a.scalars, i);
}

template <class G>
STEPCORE_HD_INLINE void sign_sgd_by_output(const SignSgdLaunchArgs& a, int t, const BlockTask& task,
                                           int thread, int threads) {
  switch (a.out_kind[t]) {
    case 0:
      sign_sgd_elements<G, void>(a, t, task, thread, threads);
      break;
    case 1:
      sign_sgd_elements<G, float>(a, t, task, thread, threads);
      break;
    case 2:
      sign_sgd_elements<G, bfloat16_t>(a, t, task, thread, threads);
      break;
    default:
      sign_sgd_elements<G, float16_t>(a, t, task, thread, threads);
      break;
  }
}

/// Thread `thread` of `threads` on block `block` of a SignSGD launch.
STEPCORE_HD_INLINE void sign_sgd_thread(const SignSgdLaunchArgs& a, int block, int thread,
                                        int threads) {
  const BlockTask& task = a.tasks[block];
  const int t = task.tensor;
  switch (a.grad_dtype[t]) {
    case DType::f32:
      sign_sgd_by_output<float>(a, t, task, thread, threads);
      break;
    case DType::bf16:
      sign_sgd_by_output<bfloat16_t>(a, t, task, thread, threads);
      break;
    case DType::f16:
      sign_sgd_by_output<float16_t>(a, t, task, thread, threads);
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
