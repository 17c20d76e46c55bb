// Multi-tensor launch plans (host, plain data) and the CPU executor that runs them
// through the kernels' __host__ __device__ block bodies.
#include <algorithm>
#include <string>
#include <vector>

#include "../src/core/validate.hpp"
#include "block_bodies.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"

namespace stepcore::gpu {

LaunchPlan make_plan(std::span<const TensorView> tensors, std::span<const ConstTensorView> sources,
                     int max_blocks, int max_tensors) {
  if (max_blocks < 1 || max_blocks > kMaxBlocksPerLaunch)
    throw Error(Errc::out_of_range, "max_blocks", "must be in [1, " + std::to_string(kMaxBlocksPerLaunch) + "]");
  if (max_tensors < 1 || max_tensors > kMaxTensorsPerLaunch)
    throw Error(Errc::out_of_range, "max_tensors", "must be in [1, " + std::to_string(kMaxTensorsPerLaunch) + "]");
  if (!sources.empty() && sources.size() != tensors.size())
    throw Error(Errc::size_mismatch, "sources", "one source per tensor");
  LaunchPlan plan;
  LaunchArgs cur{};
  auto flush = [&] {
    if (cur.num_blocks == 0) return;
    plan.launches.push_back(cur);
    const std::uint32_t next = cur.first_block + static_cast<std::uint32_t>(cur.num_blocks);
    cur = LaunchArgs{};
    cur.first_block = next;
  };
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& t = tensors[i];
    if (t.numel == 0) continue;  // an empty tensor gets no block
    int slot = -1;
    for (std::uint64_t b = 0; b < t.numel; b += kChunkElements) {
      if (cur.num_blocks == max_blocks || (slot < 0 && cur.num_tensors == max_tensors)) {
        flush();
        slot = -1;
      }
      if (slot < 0) {  // (re)register the tensor in the current launch
        slot = cur.num_tensors++;
        cur.data[slot] = t.data;
        cur.dtype[slot] = t.dtype;
        cur.src[slot] = sources.empty() ? nullptr : sources[i].data;
        cur.src_dtype[slot] = sources.empty() ? DType::f32 : sources[i].dtype;
      }
      cur.tasks[cur.num_blocks++] =
          BlockTask{static_cast<std::uint16_t>(slot), b, std::min<std::uint64_t>(t.numel, b + kChunkElements)};
      ++plan.total_blocks;
    }
  }
  flush();
  return plan;
}

std::vector<AdamWLaunchArgs> make_adamw_plan(std::span<const AdamWTensor> tensors, const AdamWConfig& config,
                                             int max_blocks, int max_tensors) {
  if (max_blocks < 1 || max_blocks > kMaxAdamWBlocksPerLaunch)
    throw Error(Errc::out_of_range, "max_blocks", "must be in [1, " + std::to_string(kMaxAdamWBlocksPerLaunch) + "]");
  if (max_tensors < 1 || max_tensors > kMaxAdamWTensorsPerLaunch)
    throw Error(Errc::out_of_range, "max_tensors", "must be in [1, " + std::to_string(kMaxAdamWTensorsPerLaunch) + "]");
  ::stepcore::detail::validate_adamw(tensors, config, GradientRead{});
  const bool torch = config.formula == AdamWFormula::torch;
  const std::uint64_t w = config.torch_tail_width > 1 ? static_cast<std::uint64_t>(config.torch_tail_width) : 1;
  std::vector<AdamWLaunchArgs> launches;
  AdamWLaunchArgs cur{};
  cur.torch = torch;
  auto flush = [&] {
    if (cur.num_blocks == 0) return;
    launches.push_back(cur);
    cur = AdamWLaunchArgs{};
    cur.torch = torch;
  };
  for (const AdamWTensor& t : tensors) {
    *t.step = *t.step + 1.0f;  // the counter advances first, also for empty tensors
    if (t.param.numel == 0) continue;
    const AdamWScalars sc = prepare_adamw_scalars(config, *t.step);
    int slot = -1;
    for (std::uint64_t b = 0; b < t.param.numel; b += kChunkElements) {
      if (cur.num_blocks == max_blocks || (slot < 0 && cur.num_tensors == max_tensors)) {
        flush();
        slot = -1;
      }
      if (slot < 0) {
        slot = cur.num_tensors++;
        cur.param[slot] = static_cast<float*>(t.param.data);
        cur.exp_avg[slot] = static_cast<float*>(t.exp_avg.data);
        cur.exp_avg_sq[slot] = static_cast<float*>(t.exp_avg_sq.data);
        cur.grad[slot] = t.grad.data;
        cur.grad_dtype[slot] = t.grad.dtype;
        const bool has_out = t.compute_param.data != nullptr || t.compute_param.numel != 0;
        cur.out[slot] = has_out ? t.compute_param.data : nullptr;
        cur.out_kind[slot] = static_cast<std::int8_t>(has_out ? 1 + static_cast<int>(t.compute_param.dtype) : 0);
        cur.scalars[slot] = sc;
        cur.tail_begin[slot] = torch ? t.param.numel - t.param.numel % w : t.param.numel;
      }
      cur.tasks[cur.num_blocks++] =
          BlockTask{static_cast<std::uint16_t>(slot), b, std::min<std::uint64_t>(t.param.numel, b + kChunkElements)};
    }
  }
  flush();
  return launches;
}

std::vector<SignSgdLaunchArgs> make_sign_sgd_plan(std::span<const SignSgdTensor> tensors, const SignSgdConfig& config,
                                                  int max_blocks, int max_tensors) {
  if (max_blocks < 1 || max_blocks > kMaxAdamWBlocksPerLaunch)
    throw Error(Errc::out_of_range, "max_blocks", "must be in [1, " + std::to_string(kMaxAdamWBlocksPerLaunch) + "]");
  if (max_tensors < 1 || max_tensors > kMaxAdamWTensorsPerLaunch)
    throw Error(Errc::out_of_range, "max_tensors", "must be in [1, " + std::to_string(kMaxAdamWTensorsPerLaunch) + "]");
  ::stepcore::detail::validate_sign_sgd(tensors, config, GradientRead{});
  const SignSgdScalars sc = prepare_sign_sgd_scalars(config);
  std::vector<SignSgdLaunchArgs> launches;
  SignSgdLaunchArgs cur{};
  cur.scalars = sc;
  auto flush = [&] {
    if (cur.num_blocks == 0) return;
    launches.push_back(cur);
    cur = SignSgdLaunchArgs{};
    cur.scalars = sc;
  };
  for (const SignSgdTensor& t : tensors) {
    if (t.param.numel == 0) continue;
    int slot = -1;
    for (std::uint64_t b = 0; b < t.param.numel; b += kChunkElements) {
      if (cur.num_blocks == max_blocks || (slot < 0 && cur.num_tensors == max_tensors)) {
        flush();
        slot = -1;
      }
      if (slot < 0) {
        slot = cur.num_tensors++;
        cur.param[slot] = static_cast<float*>(t.param.data);
        cur.grad[slot] = t.grad.data;
        cur.grad_dtype[slot] = t.grad.dtype;
        const bool has_out = t.compute_param.data != nullptr || t.compute_param.numel != 0;
        cur.out[slot] = has_out ? t.compute_param.data : nullptr;
        cur.out_kind[slot] = static_cast<std::int8_t>(has_out ? 1 + static_cast<int>(t.compute_param.dtype) : 0);
      }
      cur.tasks[cur.num_blocks++] =
          BlockTask{static_cast<std::uint16_t>(slot), b, std::min<std::uint64_t>(t.param.numel, b + kChunkElements)};
    }
  }
  flush();
  return launches;
}

std::size_t scale_and_norm_workspace_bytes(std::span<const TensorView> tensors) {
  std::size_t blocks = 0;
  for (const TensorView& t : tensors) blocks += (t.numel + kChunkElements - 1) / kChunkElements;
  return blocks * sizeof(NormPartial);
}

namespace emulate {
namespace {
void check_threads(int threads) {
  // Each thread sums at most kChunkElements / threads squares: keep every path within
  // the certified bound (kNormMaxBlockAdditions).
  if (threads < 32 || threads > 1024 || (threads & (threads - 1)) != 0)
    throw Error(Errc::out_of_range, "threads", "must be a power of two in [32, 1024]");
}
}  // namespace

namespace {
NormPartial run_norm(const LaunchPlan& plan, const detail::NormPass& pass, int threads) {
  NormPartial total;
  std::vector<detail::NormLane> lanes(static_cast<std::size_t>(threads));
  for (const LaunchArgs& a : plan.launches) {
    for (int b = 0; b < a.num_blocks; ++b) {
      for (int t = 0; t < threads; ++t) {
        lanes[static_cast<std::size_t>(t)] = detail::NormLane{};
        detail::scale_norm_thread(a, b, t, threads, pass, lanes[static_cast<std::size_t>(t)]);
      }
      // The same tree as the kernel's shared-memory reduction.
      for (int half = threads / 2; half > 0; half /= 2)
        for (int t = 0; t < half; ++t) detail::combine(lanes[static_cast<std::size_t>(t)], lanes[static_cast<std::size_t>(t + half)]);
      merge(total, detail::to_partial(lanes[0]));
    }
  }
  return total;
}
}  // namespace

NormPartial scale_and_norm_partial(const LaunchPlan& plan, float scale, int threads) {
  check_threads(threads);
  return run_norm(plan, detail::NormPass{scale, 1.0f, true}, threads);
}

NormPartial norm_partial(const LaunchPlan& plan, GradientRead read, int threads) {
  check_threads(threads);
  return run_norm(plan, detail::NormPass{read.scale, read.clip, false}, threads);
}

void scale(const LaunchPlan& plan, float factor, int threads) {
  check_threads(threads);
  for (const LaunchArgs& a : plan.launches)
    for (int b = 0; b < a.num_blocks; ++b)
      for (int t = 0; t < threads; ++t) detail::scale_thread(a, b, t, threads, factor);
}

void adamw(const std::vector<AdamWLaunchArgs>& launches, const float* scale, const float* clip,
           const std::int32_t* found_inf, int threads) {
  check_threads(threads);
  if (found_inf != nullptr && *found_inf != 0) return;
  for (const AdamWLaunchArgs& a : launches)
    for (int b = 0; b < a.num_blocks; ++b)
      for (int t = 0; t < threads; ++t) detail::adamw_thread(a, b, t, threads, *scale, *clip);
}

void sign_sgd(const std::vector<SignSgdLaunchArgs>& launches, const std::int32_t* found_inf, int threads) {
  check_threads(threads);
  if (found_inf != nullptr && *found_inf != 0) return;
  for (const SignSgdLaunchArgs& a : launches)
    for (int b = 0; b < a.num_blocks; ++b)
      for (int t = 0; t < threads; ++t) detail::sign_sgd_thread(a, b, t, threads);
}

void accumulate(const LaunchPlan& plan, bool copy, int threads) {
  check_threads(threads);
  for (const LaunchArgs& a : plan.launches)
    for (int b = 0; b < a.num_blocks; ++b)
      for (int t = 0; t < threads; ++t) detail::accumulate_thread(a, b, t, threads, copy);
}

}  // namespace emulate
}  // namespace stepcore::gpu
