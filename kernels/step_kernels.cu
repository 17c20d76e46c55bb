// CUDA drivers of the multi-tensor block bodies: one thread block per chunk of a launch
// (grid = the launch's blocks, up to 65,536, kBlockThreads threads), launch metadata
// passed by value, results per block into the caller's workspace, then an exact
// integer reduction of the block partials, one block per partial field and slice (two
// passes above kPartialsPerSlice blocks, slices by reduce_plan). No allocation, no host
// synchronisation.
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <string>
#include <type_traits>
#include <vector>

#include "core/superaccumulator.hpp"
#include "core/validate.hpp"
#include "kernels/block_bodies.hpp"
#include "kernels/check.cuh"
#include "kernels/checked_plans.hpp"
#include "kernels/q8_bodies.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"

namespace stepcore::gpu {
namespace {

// Block b of the launch: every thread strides over its task; the lanes are combined in
// shared memory in the same tree order as the CPU executor; thread 0 writes the block's
// partial. Lane = NormLane: the fast pass (binary64 sums, deposited exactly);
// ExactNormLane: the exact fallback (every square deposited; 45 KiB of shared memory,
// under the 48 KiB static limit), run only when *d_found_inf asks for it. The factors
// come from d_scale / d_clip (device memory, read now) where given, else from `pass`.
template <class Lane>
__global__ void __launch_bounds__(kBlockThreads)
    scale_and_sum_squares_kernel(const __grid_constant__ LaunchArgs args,
                                 const detail::NormPass pass, const float* d_scale,
                                 const float* d_clip, const std::int32_t* d_found_inf,
                                 NormPartial* d_block_partials) {
  if (d_found_inf != nullptr && *d_found_inf != kFoundInfNeedsExact) return;
  __shared__ Lane lanes[kBlockThreads];
  Lane lane;
  detail::scale_norm_thread(args, blockIdx.x, threadIdx.x, kBlockThreads,
                            detail::norm_pass_at_run(pass, d_scale, d_clip), lane);
  lanes[threadIdx.x] = lane;
  __syncthreads();
  for (int half = kBlockThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) detail::combine(lanes[threadIdx.x], lanes[threadIdx.x + half]);
    __syncthreads();
  }
  if (threadIdx.x == 0)
    d_block_partials[args.first_block + blockIdx.x] = detail::to_partial(lanes[0]);
}

constexpr int kReduceThreads = 256;

// Block (f, s) reduces field f (detail::kReduceFields) of slice s of d_in's `count`
// partials (slice_bounds: the plan's slices of per_slice partials) into d_out[s]: each
// thread combines a strided share, then a CUB block reduction combines the threads.
// Integer sums, max and or are associative and exact, so the result does not depend on
// the number of blocks, slices, their order or the tree (determinism: bitwise); the
// digits stay unnormalised (normalize_partial_kernel follows). With d_found_inf, it runs
// only for the exact fallback and writes zero partials otherwise.
__global__ void __launch_bounds__(kReduceThreads)
    reduce_partial_fields_kernel(const NormPartial* d_in, std::uint64_t count,
                                 std::uint64_t per_slice, const std::int32_t* d_found_inf,
                                 NormPartial* d_out) {
  const int f = blockIdx.x;
  NormPartial* out = d_out + blockIdx.y;
  if (d_found_inf != nullptr && *d_found_inf != kFoundInfNeedsExact) {
    if (f == 0 && threadIdx.x == 0) *out = NormPartial{};
    return;
  }
  const SliceBounds slice = slice_bounds(count, per_slice, blockIdx.y);
  using Reduce = cub::BlockReduce<std::uint64_t, kReduceThreads>;
  __shared__ typename Reduce::TempStorage temp;
  std::uint64_t acc = 0;
  for (std::uint64_t b = slice.begin + threadIdx.x; b < slice.end; b += kReduceThreads)
    acc = detail::combine_field(f, acc, detail::partial_field(d_in[b], f));
  const std::uint64_t r = Reduce(temp).Reduce(
      acc, [f](std::uint64_t x, std::uint64_t y) { return detail::combine_field(f, x, y); });
  if (threadIdx.x == 0) detail::set_partial_field(*out, f, r);
}

// Normalises the reduced digits (one thread), as the CPU executor's merge does.
__global__ void normalize_partial_kernel(const std::int32_t* d_found_inf, NormPartial* d_out) {
  if (d_found_inf != nullptr && *d_found_inf != kFoundInfNeedsExact) return;
  if (threadIdx.x == 0) ::stepcore::detail::normalize_digits(d_out->digits);
}

// Enqueues the reduction of `blocks` block partials into *d_out: with more than one
// slice (reduce_plan), first the slices' partials, which the workspace holds after the
// block partials (scale_and_norm_workspace_bytes), then those.
void reduce_partials(const NormPartial* d_blocks, std::uint64_t blocks,
                     const std::int32_t* d_found_inf, NormPartial* d_out, cudaStream_t stream) {
  const ReducePlan plan = reduce_plan(blocks);
  if (plan.slices > 1) {
    NormPartial* d_slices = const_cast<NormPartial*>(d_blocks) + blocks;
    reduce_partial_fields_kernel<<<dim3(detail::kReduceFields, plan.slices), kReduceThreads, 0,
                                   stream>>>(d_blocks, blocks, plan.per_slice, d_found_inf,
                                             d_slices);
    cuda::detail::check_launch("reduce_partial_fields_kernel (slices)");
    d_blocks = d_slices;
    blocks = plan.slices;
  }
  reduce_partial_fields_kernel<<<detail::kReduceFields, kReduceThreads, 0, stream>>>(
      d_blocks, blocks, blocks, d_found_inf, d_out);
  cuda::detail::check_launch("reduce_partial_fields_kernel");
  normalize_partial_kernel<<<1, 1, 0, stream>>>(d_found_inf, d_out);
  cuda::detail::check_launch("normalize_partial_kernel");
}

// In place g = R_T(g * *d_factor), one block per task.
__global__ void __launch_bounds__(kBlockThreads)
    scale_kernel(const __grid_constant__ LaunchArgs args, const float* d_factor) {
  detail::scale_thread(args, blockIdx.x, threadIdx.x, kBlockThreads, *d_factor);
}

__global__ void __launch_bounds__(kBlockThreads)
    accumulate_kernel(const __grid_constant__ LaunchArgs args, bool copy) {
  detail::accumulate_thread(args, blockIdx.x, threadIdx.x, kBlockThreads, copy);
}

// Block `blockIdx.x` of a launch of unit Opt on a tensor with 8-bit slots: thread j is lane
// j of each 8-bit block of the task (q8_bodies.hpp): its update, then each slot's block
// maximum (an integer max over the lanes' magnitude patterns in shared memory), then its
// code; thread 0 stores the maximum. Every thread reaches every barrier (a lane past the
// task's end contributes 0).
template <class Opt>
__device__ void q8_task(const OptimizerLaunchArgs<Opt>& a, const typename Opt::Scalars& s,
                        float scale, float clip, const std::uint32_t* image) {
  const BlockTask task = a.task(blockIdx.x);
  const int t = task.tensor;
  const typename Opt::template Consts<detail::ScalarOps> k_s(s);
  const std::uint64_t tail = Opt::tail_begin(a.config, a.map.numel[t]);
  __shared__ std::uint32_t top[Opt::kSlots][kBlockThreads];  // (not in the lambda: nvcc)
  detail::with_q8_forms(a, t, [&](auto form, auto gt, auto ot) {
    constexpr int V = decltype(form)::value;
    using G = typename decltype(gt)::type;
    using O = typename decltype(ot)::type;
    constexpr int K = Opt::slots(V);
    constexpr int KA = K > 0 ? K : 1;
    ::stepcore::detail::Q8Codebook cb[KA];
    for (int k = 0; k < K; ++k) cb[k] = detail::q8_slot_codebook<Opt, V>(image, k);
    const int j = static_cast<int>(threadIdx.x);
    for (std::uint64_t b0 = task.begin; b0 < task.end; b0 += kQ8BlockSize) {
      const std::uint64_t i = b0 + static_cast<std::uint64_t>(j);
      const bool live = i < task.end;
      float st[KA] = {};
      if (live) detail::q8_lane_update<Opt, V, G, O>(a, t, i, cb, k_s, tail, scale, clip, st);
      for (int k = 0; k < K; ++k) top[k][j] = live ? detail::q8_magnitude(st[k]) : 0u;
      __syncthreads();
      for (int half = kBlockThreads / 2; half > 0; half /= 2) {
        if (j < half)
          for (int k = 0; k < K; ++k) top[k][j] = max(top[k][j], top[k][j + half]);
        __syncthreads();
      }
      for (int k = 0; k < K; ++k) {
        const float stored = ::stepcore::detail::q8_stored_max(cb[k], top[k][0]);
        if (live) a.codes[k][t][i] = detail::q8_lane_code(cb[k], st[k], stored);
        if (j == 0) a.absmax[k][t][b0 / kQ8BlockSize] = stored;
      }
      __syncthreads();  // top is read above before the next block writes it
    }
  });
}

// One block per chunk of a launch of unit Opt; everything per step is read from device
// memory when it runs (scale, clip, found-inf flag, step counter, lr, weight decay, the
// unit's table), so a captured graph replays with new values. found-inf set: the kernel
// writes nothing. Thread 0 derives the block's scalars once; the others read them from
// shared memory. Instantiated for every unit by the launches of optimizer_step.
template <class Opt>
__global__ void __launch_bounds__(kBlockThreads)
    optimizer_kernel(const __grid_constant__ OptimizerLaunchArgs<Opt> args,
                     const __grid_constant__ OptimizerDeviceArgs d) {
  using Scalars = typename Opt::Scalars;
  if (d.found_inf != nullptr && *d.found_inf != 0) return;
  // Raw storage: a __shared__ variable takes no initialiser (the Scalars have defaults).
  __shared__ alignas(Scalars) unsigned char storage[sizeof(Scalars)];
  auto* scalars = reinterpret_cast<Scalars*>(storage);
  if (threadIdx.x == 0) {
    const Scalars s = detail::block_scalars<Opt>(args, args.task(blockIdx.x).tensor, d);
    memcpy(storage, &s, sizeof s);
  }
  __syncthreads();
  const GradientRead read = detail::block_read<Opt>(d);
  if constexpr (::stepcore::detail::unit_takes_q8<Opt>()) {
    if (args.q8(args.task(blockIdx.x).tensor)) {  // the same for every thread of the block
      q8_task<Opt>(args, *scalars, read.scale, read.clip, d.q8_codebooks);
      return;
    }
  }
  detail::optimizer_thread<Opt>(args, blockIdx.x, threadIdx.x, kBlockThreads, *scalars, read.scale,
                                read.clip);
}

// After every update launch of the step: each counter advances, unless found-inf.
__global__ void advance_counters_kernel(const __grid_constant__ StepCounterArgs args,
                                        const std::int32_t* d_found_inf) {
  if (d_found_inf != nullptr && *d_found_inf != 0) return;
  if (static_cast<int>(threadIdx.x) < args.count) detail::advance_counter(args, threadIdx.x);
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

// Returns the calling thread's current CUDA device: the device the launches go to.
int current_device() {
  int current = -1;
  cuda::detail::check(cudaGetDevice(&current), "cudaGetDevice");
  return current;
}

// Throws unless p is memory a kernel on device `launch_device` may use
// (check_pointer_device).
void require_device_pointer(const void* p, const ::stepcore::detail::Arg& name, int launch_device) {
  detail::check_pointer_device(detail::pointer_info(p), launch_device, name);
}

// The launchers' memory check on the current device: the runtime must know the start as
// memory of that device (or managed). One check object per device: a cached call is keyed
// by its check's address (plan_cache.hpp), so a call validated with one device current is
// checked again with another. Without a usable device, one check that refuses every
// pointer as the runtime describes it.
const detail::MemoryCheck& device_memory() {
  auto check_on = [](int launch_device) -> detail::MemoryCheck {
    return [launch_device](const void* p, std::size_t, const ::stepcore::detail::Arg& name) {
      require_device_pointer(p, name, launch_device);
    };
  };
  static const std::vector<detail::MemoryCheck> checks = [&] {
    std::vector<detail::MemoryCheck> v;
    for (int d = 0; d < cuda::device_count(); ++d) v.push_back(check_on(d));
    return v;
  }();
  static const detail::MemoryCheck no_device = check_on(-1);
  if (checks.empty()) return no_device;
  const int current = current_device();
  if (current < 0 || static_cast<std::size_t>(current) >= checks.size())
    throw Error(Errc::cuda_error, "device",
                "the current device " + std::to_string(current) + " is not one of the " +
                    std::to_string(checks.size()) + " devices present");
  return checks[static_cast<std::size_t>(current)];
}

// Enqueues a norm pass (Lane: fast or exact) over a checked plan: `pass` with its factors
// from d_scale / d_clip where given (read when the kernels run), then the reduction.
template <class Lane>
void enqueue_norm(const LaunchPlan& plan, const detail::NormPass& pass, const float* d_scale,
                  const float* d_clip, const std::int32_t* d_found_inf, NormPartial* d_partial,
                  void* d_workspace, cudaStream_t stream) {
  auto* d_blocks = static_cast<NormPartial*>(d_workspace);
  for (const LaunchArgs& a : plan.launches) {
    scale_and_sum_squares_kernel<Lane><<<a.num_blocks, kBlockThreads, 0, stream>>>(
        a, pass, d_scale, d_clip, d_found_inf, d_blocks);
    cuda::detail::check_launch(std::is_same_v<Lane, detail::ExactNormLane>
                                   ? "scale_and_sum_squares_kernel (exact)"
                                   : "scale_and_sum_squares_kernel");
  }
  reduce_partials(d_blocks, plan.total_blocks, d_found_inf, d_partial, stream);
}

LaunchPlan checked_plan(std::span<const TensorView> d_tensors, NormPartial* d_partial,
                        const char* partial_name, void* d_workspace, std::size_t workspace_bytes) {
  return detail::checked_norm_plan(d_tensors, d_partial, partial_name, d_workspace, workspace_bytes,
                                   device_memory());
}

}  // namespace

detail::PointerInfo detail::pointer_info(const void* p) noexcept {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // not sticky: the query's own failure
    return {};
  }
  if (attr.type == cudaMemoryTypeManaged) return {PointerInfo::managed, attr.device};
  if (attr.type == cudaMemoryTypeDevice) return {PointerInfo::device, attr.device};
  return {PointerInfo::host, -1};
}

void scale_and_norm_partial(std::span<const TensorView> d_tensors, float scale,
                            NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                            cudaStream_t stream) {
  ::stepcore::detail::validate_scale(d_tensors, scale);
  const LaunchPlan plan =
      checked_plan(d_tensors, d_partial, "d_partial", d_workspace, workspace_bytes);
  enqueue_norm<detail::NormLane>(plan, detail::NormPass{scale, 1.0f, true}, nullptr, nullptr,
                                 nullptr, d_partial, d_workspace, stream);
}

void scale_and_norm_partial(std::span<const TensorView> d_tensors, const float* d_scale,
                            NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                            cudaStream_t stream) {
  detail::check_device_scalar(d_scale, sizeof(float), "d_scale", nullptr);
  ::stepcore::detail::validate_scale_tensors(d_tensors);
  const LaunchPlan plan =
      checked_plan(d_tensors, d_partial, "d_partial", d_workspace, workspace_bytes);
  detail::check_device_scalar(d_scale, sizeof(float), "d_scale", &device_memory());
  enqueue_norm<detail::NormLane>(plan, detail::NormPass{1.0f, 1.0f, true}, d_scale, nullptr,
                                 nullptr, d_partial, d_workspace, stream);
}

void norm_partial(std::span<const ConstTensorView> d_tensors, GradientRead read,
                  NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                  cudaStream_t stream) {
  ::stepcore::detail::validate_device_read(read);
  const LaunchPlan plan = checked_plan(detail::as_views(d_tensors), d_partial, "d_partial",
                                       d_workspace, workspace_bytes);
  enqueue_norm<detail::NormLane>(plan, detail::NormPass{read.scale, read.clip, false}, nullptr,
                                 nullptr, nullptr, d_partial, d_workspace, stream);
}

void norm_partial(std::span<const ConstTensorView> d_tensors, const DeviceGradientRead& d_read,
                  NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                  cudaStream_t stream) {
  detail::check_device_read(d_read, nullptr);
  const LaunchPlan plan = checked_plan(detail::as_views(d_tensors), d_partial, "d_partial",
                                       d_workspace, workspace_bytes);
  detail::check_device_read(d_read, &device_memory());
  enqueue_norm<detail::NormLane>(plan, detail::NormPass{}, d_read.scale, d_read.clip, nullptr,
                                 d_partial, d_workspace, stream);
}

void scale_(std::span<const TensorView> d_tensors, const float* d_factor, cudaStream_t stream) {
  const LaunchPlan plan = detail::checked_scale_plan(d_tensors, d_factor, device_memory());
  for (const LaunchArgs& a : plan.launches) {
    scale_kernel<<<a.num_blocks, kBlockThreads, 0, stream>>>(a, d_factor);
    cuda::detail::check_launch("scale_kernel");
  }
}

void accumulate(std::span<const AccumulatePair> d_pairs, cudaStream_t stream) {
  for (const auto& [copy, plan] : detail::checked_accumulate_plans(d_pairs, device_memory()))
    for (const LaunchArgs& la : plan.launches) {
      accumulate_kernel<<<la.num_blocks, kBlockThreads, 0, stream>>>(la, copy);
      cuda::detail::check_launch("accumulate_kernel");
    }
}

namespace {

// Enqueues a checked plan of unit Opt: its update launches, then its counter advances.
template <class Opt>
void enqueue_optimizer(const OptimizerPlan<Opt>& plan, const OptimizerDeviceArgs& d,
                       cudaStream_t stream) {
  for (const OptimizerLaunchArgs<Opt>& a : plan.launches) {
    optimizer_kernel<Opt><<<a.num_blocks, kBlockThreads, 0, stream>>>(a, d);
    cuda::detail::check_launch("optimizer_kernel");
  }
  for (const StepCounterArgs& c : plan.counters) {
    advance_counters_kernel<<<1, kMaxCountersPerLaunch, 0, stream>>>(c, d.found_inf);
    cuda::detail::check_launch("advance_counters_kernel");
  }
}

}  // namespace

void optimizer_step(std::span<const OptimizerTensor> d_tensors, const OptimizerConfig& config,
                    const OptimizerDeviceArgs& d, cudaStream_t stream) {
  detail::with_checked_optimizer_plan(d_tensors, config, d, device_memory(), [&](const auto& plan) {
    enqueue_optimizer(plan, d, stream);
  });
}

void finalize_and_clip(const NormPartial* d_partial, float max_norm, NormResult* d_result,
                       float* d_clip, std::int32_t* d_found_inf, cudaStream_t stream) {
  detail::check_finalize_args(d_partial, "d_partial", max_norm, d_result, d_clip, d_found_inf,
                              device_memory());
  finalize_and_clip_kernel<<<1, 1, 0, stream>>>(d_partial, max_norm, d_result, d_clip, d_found_inf);
  cuda::detail::check_launch("finalize_and_clip_kernel");
}

void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors, GradientRead read,
                                  const std::int32_t* d_found_inf, NormPartial* d_exact_partial,
                                  void* d_workspace, std::size_t workspace_bytes,
                                  cudaStream_t stream) {
  ::stepcore::detail::validate_device_read(read);
  if (d_found_inf == nullptr) throw Error(Errc::null_pointer, "d_found_inf", "null");
  const LaunchPlan plan = checked_plan(detail::as_views(d_tensors), d_exact_partial,
                                       "d_exact_partial", d_workspace, workspace_bytes);
  device_memory()(d_found_inf, sizeof(std::int32_t), ::stepcore::detail::Arg{"d_found_inf"});
  enqueue_norm<detail::ExactNormLane>(plan, detail::NormPass{read.scale, read.clip, false}, nullptr,
                                      nullptr, d_found_inf, d_exact_partial, d_workspace, stream);
}

void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors,
                                  const DeviceGradientRead& d_read, const std::int32_t* d_found_inf,
                                  NormPartial* d_exact_partial, void* d_workspace,
                                  std::size_t workspace_bytes, cudaStream_t stream) {
  detail::check_device_read(d_read, nullptr);
  if (d_found_inf == nullptr) throw Error(Errc::null_pointer, "d_found_inf", "null");
  const LaunchPlan plan = checked_plan(detail::as_views(d_tensors), d_exact_partial,
                                       "d_exact_partial", d_workspace, workspace_bytes);
  device_memory()(d_found_inf, sizeof(std::int32_t), ::stepcore::detail::Arg{"d_found_inf"});
  detail::check_device_read(d_read, &device_memory());
  enqueue_norm<detail::ExactNormLane>(plan, detail::NormPass{}, d_read.scale, d_read.clip,
                                      d_found_inf, d_exact_partial, d_workspace, stream);
}

void finalize_exact_and_clip(const NormPartial* d_exact_partial, float max_norm,
                             NormResult* d_result, float* d_clip, std::int32_t* d_found_inf,
                             cudaStream_t stream) {
  detail::check_finalize_args(d_exact_partial, "d_exact_partial", max_norm, d_result, d_clip,
                              d_found_inf, device_memory());
  finalize_exact_and_clip_kernel<<<1, 1, 0, stream>>>(d_exact_partial, max_norm, d_result, d_clip,
                                                      d_found_inf);
  cuda::detail::check_launch("finalize_exact_and_clip_kernel");
}

}  // namespace stepcore::gpu
