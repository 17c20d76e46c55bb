// CUDA drivers of the multi-tensor block bodies: one thread block per BlockTask of a
// launch (grid = the launch's blocks, kBlockThreads threads), launch metadata passed by
// value, results per block into the caller's workspace, then an exact integer
// reduction of the block partials. No allocation, no host synchronisation.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "../src/core/validate.hpp"
#include "block_bodies.hpp"
#include "check.cuh"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"

namespace stepcore::gpu {
namespace {

// Block b of the launch: every thread strides over its task; the lanes are combined in
// shared memory in the same tree order as the CPU executor; thread 0 writes the block's
// partial. Lane = NormLane: the fast pass (binary64 sums, deposited exactly);
// ExactNormLane: the exact fallback (every square deposited; 45 KiB of shared memory,
// under the 48 KiB static limit), run only when *d_found_inf asks for it.
template <class Lane>
__global__ void __launch_bounds__(kBlockThreads)
    scale_and_sum_squares_kernel(const LaunchArgs args, const detail::NormPass pass,
                                 const std::int32_t* d_found_inf, NormPartial* d_block_partials) {
  if (d_found_inf != nullptr && *d_found_inf != kFoundInfNeedsExact) return;
  __shared__ Lane lanes[kBlockThreads];
  Lane lane;
  detail::scale_norm_thread(args, blockIdx.x, threadIdx.x, kBlockThreads, pass, lane);
  lanes[threadIdx.x] = lane;
  __syncthreads();
  for (int half = kBlockThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) detail::combine(lanes[threadIdx.x], lanes[threadIdx.x + half]);
    __syncthreads();
  }
  if (threadIdx.x == 0)
    d_block_partials[args.first_block + blockIdx.x] = detail::to_partial(lanes[0]);
}

// One block of 32 threads: thread k sums digit k (and the counts / max) over all block
// partials by integer addition, so the result does not depend on the number of blocks
// or their order.
// With d_found_inf, it runs only for the exact fallback and writes a zero partial
// otherwise.
__global__ void reduce_partials_kernel(const NormPartial* d_block_partials, std::uint32_t blocks,
                                       const std::int32_t* d_found_inf, NormPartial* d_out) {
  __shared__ NormPartial out;
  if (d_found_inf != nullptr && *d_found_inf != kFoundInfNeedsExact) {
    if (threadIdx.x == 0) *d_out = NormPartial{};
    return;
  }
  const int k = threadIdx.x;
  if (k < kNormDigits) {
    std::uint64_t s = 0;
    for (std::uint32_t b = 0; b < blocks; ++b) s += d_block_partials[b].digits[k];
    out.digits[k] = s;
  } else if (k == kNormDigits) {
    std::uint64_t n = 0, i = 0;
    std::uint32_t m = 0, approx = 0;
    for (std::uint32_t b = 0; b < blocks; ++b) {
      n += d_block_partials[b].nan_count;
      i += d_block_partials[b].inf_count;
      m = d_block_partials[b].max_abs_bits > m ? d_block_partials[b].max_abs_bits : m;
      approx |= d_block_partials[b].approximate;
    }
    out.nan_count = n;
    out.inf_count = i;
    out.max_abs_bits = m;
    out.approximate = approx;
  }
  __syncthreads();
  if (k == 0) {
    ::stepcore::detail::normalize_digits(out.digits);
    *d_out = out;
  }
}

// In place g = R_T(g * *d_factor), one block per task.
__global__ void __launch_bounds__(kBlockThreads)
    scale_kernel(const LaunchArgs args, const float* d_factor) {
  detail::scale_thread(args, blockIdx.x, threadIdx.x, kBlockThreads, *d_factor);
}

__global__ void __launch_bounds__(kBlockThreads)
    accumulate_kernel(const LaunchArgs args, bool copy) {
  detail::accumulate_thread(args, blockIdx.x, threadIdx.x, kBlockThreads, copy);
}

// One block per task; the scale, clip and found-inf flag are read from device memory,
// so a captured graph replays with new values. found-inf set: the kernel writes nothing.
__global__ void __launch_bounds__(kBlockThreads)
    adamw_kernel(const AdamWLaunchArgs args, const float* d_scale, const float* d_clip,
                 const std::int32_t* d_found_inf) {
  if (d_found_inf != nullptr && *d_found_inf != 0) return;
  detail::adamw_thread(args, blockIdx.x, threadIdx.x, kBlockThreads, *d_scale, *d_clip);
}

__global__ void __launch_bounds__(kBlockThreads)
    sign_sgd_kernel(const SignSgdLaunchArgs args, const std::int32_t* d_found_inf) {
  if (d_found_inf != nullptr && *d_found_inf != 0) return;
  detail::sign_sgd_thread(args, blockIdx.x, threadIdx.x, kBlockThreads);
}

// One thread: the finalisation is a few hundred integer operations on 20 digits.
__global__ void finalize_and_clip_kernel(const NormPartial* d_partial, float max_norm,
                                         NormResult* d_result, float* d_clip,
                                         std::int32_t* d_found_inf) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  NormResult r;
  float clip = 0.0f;
  std::int32_t flag = 0;
  detail::finalize_and_clip_body(*d_partial, max_norm, r, clip, flag);
  *d_result = r;
  *d_clip = clip;
  *d_found_inf = flag;
}

__global__ void finalize_exact_and_clip_kernel(const NormPartial* d_exact_partial, float max_norm,
                                               NormResult* d_result, float* d_clip,
                                               std::int32_t* d_found_inf) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  std::int32_t flag = *d_found_inf;
  if (flag != kFoundInfNeedsExact) return;
  NormResult r;
  float clip = 0.0f;
  detail::finalize_exact_and_clip_body(*d_exact_partial, max_norm, r, clip, flag);
  *d_result = r;
  *d_clip = clip;
  *d_found_inf = flag;
}

void require_device_pointer(const void* p, const std::string& name) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    throw Error(Errc::invalid_argument, name, "not a CUDA pointer");
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    throw Error(Errc::invalid_argument, name, "a host pointer where device memory is needed");
}

}  // namespace

namespace {

// Host-side checks of a tensor list (no CUDA call): dtype and null data.
void check_tensor_shapes(std::span<const TensorView> d_tensors, const char* base) {
  for (std::size_t i = 0; i < d_tensors.size(); ++i) {
    const TensorView& t = d_tensors[i];
    if (!dtype_valid(t.dtype))
      throw Error(Errc::unsupported_dtype, std::string(base) + "[" + std::to_string(i) + "]",
                  "unknown dtype");
    if (t.numel != 0 && t.data == nullptr)
      throw Error(Errc::null_pointer, std::string(base) + "[" + std::to_string(i) + "]",
                  "null data");
  }
}

// Device-memory checks of a tensor list (after the host-side checks).
void check_device_tensors(std::span<const TensorView> d_tensors, const char* base) {
  for (std::size_t i = 0; i < d_tensors.size(); ++i)
    if (d_tensors[i].numel != 0)
      require_device_pointer(d_tensors[i].data, std::string(base) + "[" + std::to_string(i) + "]");
}

// Validates a norm pass's arguments: every host-side check (shapes, workspace size) before
// any CUDA call, then the device pointers. Returns the plan.
LaunchPlan checked_norm_plan(std::span<const TensorView> d_tensors, const NormPartial* d_partial,
                             const char* partial_name, void* d_workspace,
                             std::size_t workspace_bytes) {
  if (d_partial == nullptr) throw Error(Errc::null_pointer, partial_name, "null");
  check_tensor_shapes(d_tensors, "d_tensors");
  const std::size_t need = scale_and_norm_workspace_bytes(d_tensors);
  if (workspace_bytes < need)
    throw Error(Errc::out_of_range, "workspace_bytes",
                std::to_string(workspace_bytes) + " < " + std::to_string(need) +
                    " (scale_and_norm_workspace_bytes)");
  if (need != 0 && d_workspace == nullptr) throw Error(Errc::null_pointer, "d_workspace", "null");
  require_device_pointer(d_partial, partial_name);
  check_device_tensors(d_tensors, "d_tensors");
  if (need != 0) require_device_pointer(d_workspace, "d_workspace");
  const detail::LaunchLimits lim = detail::launch_limits(false);
  return make_plan(d_tensors, {}, lim.max_blocks, lim.max_tensors);
}

void run_norm_launches(std::span<const TensorView> d_tensors, const detail::NormPass& pass,
                       NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                       cudaStream_t stream) {
  const LaunchPlan plan =
      checked_norm_plan(d_tensors, d_partial, "d_partial", d_workspace, workspace_bytes);
  auto* d_blocks = static_cast<NormPartial*>(d_workspace);
  for (const LaunchArgs& a : plan.launches) {
    scale_and_sum_squares_kernel<detail::NormLane>
        <<<a.num_blocks, kBlockThreads, 0, stream>>>(a, pass, nullptr, d_blocks);
    cuda::detail::check_launch("scale_and_sum_squares_kernel");
  }
  reduce_partials_kernel<<<1, 32, 0, stream>>>(d_blocks, plan.total_blocks, nullptr, d_partial);
  cuda::detail::check_launch("reduce_partials_kernel");
}

// Read-only views of const tensors (the norm kernels write only when pass.write).
std::vector<TensorView> as_views(std::span<const ConstTensorView> d_tensors) {
  std::vector<TensorView> views;
  views.reserve(d_tensors.size());
  for (const ConstTensorView& t : d_tensors)
    views.push_back({const_cast<void*>(t.data), t.numel, t.dtype});
  return views;
}

void check_max_norm(float max_norm) {
  if (!(max_norm >= 0.0f) || max_norm > 3.4e38f)
    throw Error(Errc::non_finite, "max_norm", "must be finite and >= 0");
}

}  // namespace

void scale_and_norm_partial(std::span<const TensorView> d_tensors, float scale,
                            NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                            cudaStream_t stream) {
  if (!(scale >= 0.0f) || scale > 3.4e38f)
    throw Error(Errc::non_finite, "scale", "must be finite and >= 0");
  run_norm_launches(d_tensors, detail::NormPass{scale, 1.0f, true}, d_partial, d_workspace,
                    workspace_bytes, stream);
}

void norm_partial(std::span<const ConstTensorView> d_tensors, GradientRead read,
                  NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                  cudaStream_t stream) {
  ::stepcore::detail::validate_read(read);
  run_norm_launches(as_views(d_tensors), detail::NormPass{read.scale, read.clip, false}, d_partial,
                    d_workspace, workspace_bytes, stream);
}

void scale_by_device_scalar(std::span<const TensorView> d_tensors, const float* d_factor,
                            cudaStream_t stream) {
  if (d_factor == nullptr) throw Error(Errc::null_pointer, "d_factor", "null");
  check_tensor_shapes(d_tensors, "d_tensors");
  require_device_pointer(d_factor, "d_factor");
  check_device_tensors(d_tensors, "d_tensors");
  const detail::LaunchLimits lim = detail::launch_limits(false);
  const LaunchPlan plan = make_plan(d_tensors, {}, lim.max_blocks, lim.max_tensors);
  for (const LaunchArgs& a : plan.launches) {
    scale_kernel<<<a.num_blocks, kBlockThreads, 0, stream>>>(a, d_factor);
    cuda::detail::check_launch("scale_kernel");
  }
}

void accumulate(std::span<const AccumulatePair> d_pairs, cudaStream_t stream) {
  ::stepcore::detail::validate_accumulate(d_pairs);
  std::vector<TensorView> acc;
  std::vector<ConstTensorView> src;
  for (const AccumulatePair& p : d_pairs) {
    acc.push_back(p.acc);
    src.push_back(p.src);
  }
  check_tensor_shapes(acc, "d_pairs.acc");
  check_device_tensors(acc, "d_pairs.acc");
  for (std::size_t i = 0; i < src.size(); ++i)
    if (src[i].numel != 0)
      require_device_pointer(src[i].data, "d_pairs[" + std::to_string(i) + "].src");
  // One copy flag per call: split the pairs by it (usually all the same).
  for (bool copy : {false, true}) {
    std::vector<TensorView> a;
    std::vector<ConstTensorView> s;
    for (std::size_t i = 0; i < d_pairs.size(); ++i)
      if (d_pairs[i].copy == copy) {
        a.push_back(acc[i]);
        s.push_back(src[i]);
      }
    const detail::LaunchLimits lim = detail::launch_limits(false);
    const LaunchPlan plan = make_plan(a, s, lim.max_blocks, lim.max_tensors);
    for (const LaunchArgs& la : plan.launches) {
      accumulate_kernel<<<la.num_blocks, kBlockThreads, 0, stream>>>(la, copy);
      cuda::detail::check_launch("accumulate_kernel");
    }
  }
}

void adamw_step(std::span<const AdamWTensor> d_tensors, const AdamWConfig& config,
                const float* d_scale, const float* d_clip, const std::int32_t* d_found_inf,
                cudaStream_t stream) {
  if (d_scale == nullptr) throw Error(Errc::null_pointer, "d_scale", "required");
  if (d_clip == nullptr) throw Error(Errc::null_pointer, "d_clip", "required");
  ::stepcore::detail::validate_adamw(d_tensors, config, GradientRead{});  // before any CUDA call
  require_device_pointer(d_scale, "d_scale");
  require_device_pointer(d_clip, "d_clip");
  if (d_found_inf != nullptr) require_device_pointer(d_found_inf, "d_found_inf");
  for (std::size_t i = 0; i < d_tensors.size(); ++i) {
    const AdamWTensor& t = d_tensors[i];
    const std::string base = "d_tensors[" + std::to_string(i) + "]";
    if (t.param.numel == 0) continue;
    for (const void* p :
         {static_cast<const void*>(t.param.data), static_cast<const void*>(t.exp_avg.data),
          static_cast<const void*>(t.exp_avg_sq.data), t.grad.data})
      if (p != nullptr) require_device_pointer(p, base);
    if (t.compute_param.data != nullptr)
      require_device_pointer(t.compute_param.data, base + ".compute_param");
  }
  const std::vector<AdamWLaunchArgs> launches =
      make_adamw_plan(d_tensors, config, detail::launch_limits(true).max_blocks,
                      detail::launch_limits(true).max_tensors);  // validates, then steps
  for (const AdamWLaunchArgs& a : launches) {
    adamw_kernel<<<a.num_blocks, kBlockThreads, 0, stream>>>(a, d_scale, d_clip, d_found_inf);
    cuda::detail::check_launch("adamw_kernel");
  }
}

void sign_sgd_step(std::span<const SignSgdTensor> d_tensors, const SignSgdConfig& config,
                   const std::int32_t* d_found_inf, cudaStream_t stream) {
  ::stepcore::detail::validate_sign_sgd(d_tensors, config, GradientRead{});  // before CUDA calls
  if (d_found_inf != nullptr) require_device_pointer(d_found_inf, "d_found_inf");
  for (std::size_t i = 0; i < d_tensors.size(); ++i) {
    const SignSgdTensor& t = d_tensors[i];
    if (t.param.numel == 0) continue;
    const std::string base = "d_tensors[" + std::to_string(i) + "]";
    require_device_pointer(t.param.data, base + ".param");
    require_device_pointer(t.grad.data, base + ".grad");
    if (t.compute_param.data != nullptr)
      require_device_pointer(t.compute_param.data, base + ".compute_param");
  }
  const detail::LaunchLimits lim = detail::launch_limits(true);
  for (const SignSgdLaunchArgs& a :
       make_sign_sgd_plan(d_tensors, config, lim.max_blocks, lim.max_tensors)) {
    sign_sgd_kernel<<<a.num_blocks, kBlockThreads, 0, stream>>>(a, d_found_inf);
    cuda::detail::check_launch("sign_sgd_kernel");
  }
}

void finalize_and_clip(const NormPartial* d_partial, float max_norm, NormResult* d_result,
                       float* d_clip, std::int32_t* d_found_inf, cudaStream_t stream) {
  check_max_norm(max_norm);
  require_device_pointer(d_partial, "d_partial");
  require_device_pointer(d_result, "d_result");
  require_device_pointer(d_clip, "d_clip");
  require_device_pointer(d_found_inf, "d_found_inf");
  finalize_and_clip_kernel<<<1, 1, 0, stream>>>(d_partial, max_norm, d_result, d_clip, d_found_inf);
  cuda::detail::check_launch("finalize_and_clip_kernel");
}

void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors, GradientRead read,
                                  const std::int32_t* d_found_inf, NormPartial* d_exact_partial,
                                  void* d_workspace, std::size_t workspace_bytes,
                                  cudaStream_t stream) {
  ::stepcore::detail::validate_read(read);
  if (d_found_inf == nullptr) throw Error(Errc::null_pointer, "d_found_inf", "null");
  const std::vector<TensorView> views = as_views(d_tensors);
  const LaunchPlan plan =
      checked_norm_plan(views, d_exact_partial, "d_exact_partial", d_workspace, workspace_bytes);
  require_device_pointer(d_found_inf, "d_found_inf");
  const detail::NormPass pass{read.scale, read.clip, false};
  auto* d_blocks = static_cast<NormPartial*>(d_workspace);
  for (const LaunchArgs& a : plan.launches) {
    scale_and_sum_squares_kernel<detail::ExactNormLane>
        <<<a.num_blocks, kBlockThreads, 0, stream>>>(a, pass, d_found_inf, d_blocks);
    cuda::detail::check_launch("scale_and_sum_squares_kernel (exact)");
  }
  reduce_partials_kernel<<<1, 32, 0, stream>>>(d_blocks, plan.total_blocks, d_found_inf,
                                               d_exact_partial);
  cuda::detail::check_launch("reduce_partials_kernel");
}

void finalize_exact_and_clip(const NormPartial* d_exact_partial, float max_norm,
                             NormResult* d_result, float* d_clip, std::int32_t* d_found_inf,
                             cudaStream_t stream) {
  check_max_norm(max_norm);
  require_device_pointer(d_exact_partial, "d_exact_partial");
  require_device_pointer(d_result, "d_result");
  require_device_pointer(d_clip, "d_clip");
  require_device_pointer(d_found_inf, "d_found_inf");
  finalize_exact_and_clip_kernel<<<1, 1, 0, stream>>>(d_exact_partial, max_norm, d_result, d_clip,
                                                      d_found_inf);
  cuda::detail::check_launch("finalize_exact_and_clip_kernel");
}

}  // namespace stepcore::gpu
