// Multi-tensor launch plans (host, plain data) and the CPU executor that runs them
// through the kernels' __host__ __device__ block bodies.
#include <algorithm>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "core/fp_env.hpp"
#include "core/validate.hpp"
#include "kernels/block_bodies.hpp"
#include "kernels/checked_plans.hpp"
#include "kernels/plans.hpp"
#include "kernels/q8_bodies.hpp"
#include "kernels/testing.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"

namespace stepcore::gpu {

namespace {

/// Splits tensors [0, count) into chunks of kBlockElements, one block each, packed into
/// launches of type Args (at most max_blocks blocks and max_tensors tensor slots each):
/// `numel(i)` gives tensor i's size, `bind(args, slot, i)` fills the launch's per-tensor
/// fields for it. Empty tensors get no block; a tensor continuing into the next launch
/// takes a slot there too.
template <class Args, class Numel, class Bind>
std::vector<Args> build_launches(std::size_t count, Numel numel, Bind bind, int max_blocks,
                                 int max_tensors, const Args& blank) {
  std::vector<Args> out;
  Args cur = blank;
  auto flush = [&] {
    if (cur.num_blocks == 0) return;
    out.push_back(cur);
    cur = blank;
  };
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint64_t n = numel(i);
    const std::uint64_t chunks = (n + kBlockElements - 1) / kBlockElements;
    for (std::uint64_t c = 0; c < chunks;) {
      if (cur.num_blocks == max_blocks || cur.num_tensors == max_tensors) flush();
      const int slot = cur.num_tensors++;
      bind(cur, slot, i);
      const std::uint64_t take = std::min<std::uint64_t>(
          chunks - c, static_cast<std::uint64_t>(max_blocks - cur.num_blocks));
      cur.map.numel[slot] = n;
      cur.map.first_chunk[slot] = c;
      cur.num_blocks += static_cast<int>(take);
      cur.map.block_end[slot] = static_cast<std::uint32_t>(cur.num_blocks);
      c += take;
    }
  }
  flush();
  return out;
}

// Throws Errc::out_of_range naming `name` unless lo <= v <= hi (an int's negative value
// converts to a value above 2^63: out of range too).
void check_in_range(std::uint64_t v, std::uint64_t lo, std::uint64_t hi, const char* name) {
  if (v < lo || v > hi)
    throw Error(Errc::out_of_range, name,
                "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

void check_limits(int max_blocks, int max_tensors, int block_limit, int tensor_limit) {
  check_in_range(static_cast<std::uint64_t>(max_blocks), 1, static_cast<std::uint64_t>(block_limit),
                 "max_blocks");
  check_in_range(static_cast<std::uint64_t>(max_tensors), 1,
                 static_cast<std::uint64_t>(tensor_limit), "max_tensors");
}

std::int8_t output_kind(const TensorView& v) {
  const bool has = v.data != nullptr || v.numel != 0;
  return static_cast<std::int8_t>(has ? 1 + static_cast<int>(v.dtype) : 0);
}

}  // namespace

LaunchPlan make_plan(std::span<const TensorView> tensors, std::span<const ConstTensorView> sources,
                     int max_blocks, int max_tensors) {
  check_limits(max_blocks, max_tensors, kMaxBlocksPerLaunch, kMaxTensorsPerLaunch);
  if (!sources.empty() && sources.size() != tensors.size())
    throw Error(Errc::size_mismatch, "sources", "one source per tensor");
  // The block indices (first_block, the norm's partials) are 32-bit: at most 2^32 - 1
  // blocks (2^48 elements), refused before anything is built.
  std::uint64_t blocks = 0;
  for (const TensorView& t : tensors) {
    const auto n = static_cast<std::uint64_t>(t.numel);
    blocks += n / kBlockElements + (n % kBlockElements != 0 ? 1 : 0);
    if (blocks > UINT32_MAX)
      throw Error(Errc::out_of_range, "tensors",
                  "more than 2^32 - 1 blocks of " + std::to_string(kBlockElements) + " elements");
  }
  LaunchPlan plan;
  plan.launches = build_launches(
      tensors.size(), [&](std::size_t i) { return tensors[i].numel; },
      [&](LaunchArgs& a, int slot, std::size_t i) {
        a.data[slot] = tensors[i].data;
        a.dtype[slot] = tensors[i].dtype;
        a.src[slot] = sources.empty() ? nullptr : sources[i].data;
        a.src_dtype[slot] = sources.empty() ? DType::f32 : sources[i].dtype;
      },
      max_blocks, max_tensors, LaunchArgs{});
  for (LaunchArgs& a : plan.launches) {
    a.first_block = plan.total_blocks;
    plan.total_blocks += static_cast<std::uint32_t>(a.num_blocks);
  }
  return plan;
}

template <class Opt>
OptimizerPlan<Opt> make_optimizer_plan(std::span<const OptimizerTensor> tensors,
                                       const typename Opt::Config& config, int max_blocks,
                                       int max_tensors) {
  check_limits(max_blocks, max_tensors, kMaxOptimizerBlocksPerLaunch,
               kMaxOptimizerTensorsPerLaunch);
  ::stepcore::detail::validate_unit<Opt>(
      tensors, config, GradientRead{}, ::stepcore::detail::StepCounters::unread,
      ::stepcore::detail::unit_takes_q8<Opt>() ? ::stepcore::detail::ParamDTypes::f32_and_q8
                                               : ::stepcore::detail::ParamDTypes::f32);
  OptimizerLaunchArgs<Opt> blank{};
  blank.config = config;
  OptimizerPlan<Opt> plan;
  plan.launches = build_launches(
      tensors.size(), [&](std::size_t i) { return tensors[i].param.numel; },
      [&](OptimizerLaunchArgs<Opt>& a, int slot, std::size_t i) {
        const OptimizerTensor& t = tensors[i];
        a.dst[0][slot] = static_cast<float*>(t.param.data);
        a.src[0][slot] = ::stepcore::detail::source_or(t.param_src, t.param);
        for (int s = 0; s < Opt::kSlots; ++s) {  // unused slots: empty (null)
          a.dst[1 + s][slot] = static_cast<float*>(t.state[s].data);
          a.src[1 + s][slot] = ::stepcore::detail::source_or(t.state_src[s], t.state[s]);
        }
        a.grad[slot] = t.grad.data;
        a.grad_dtype[slot] = t.grad.dtype;
        a.out[slot] = t.compute_param.data;
        a.out_kind[slot] = output_kind(t.compute_param);
        a.step[slot] = t.step;
        if constexpr (::stepcore::detail::unit_takes_q8<Opt>())
          for (int s = 0; s < Opt::kSlots; ++s) {  // null unless the slot is 8-bit
            a.codes[s][slot] = t.q8[s].codes;
            a.absmax[s][slot] = t.q8[s].absmax;
          }
      },
      max_blocks, max_tensors, blank);
  // Every counter advances once per step, empty tensors' too (as on the host).
  if constexpr (Opt::kCountsSteps)
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (plan.counters.empty() || plan.counters.back().count == kMaxCountersPerLaunch)
        plan.counters.push_back(StepCounterArgs{});
      StepCounterArgs& c = plan.counters.back();
      c.step[c.count++] = tensors[i].step;
    }
  return plan;
}

namespace {

// The table of unit Opt (make_optimizer_table's layout), its configuration validated.
template <class Opt>
std::vector<double> unit_table(const typename Opt::Config& config) {
  Opt::validate(config, GradientRead{});
  std::vector<double> table;
  if constexpr (Opt::kTableColumns > 0) {
    const ::stepcore::detail::FpEnvGuard env;
    constexpr int K = Opt::kTableColumns;
    std::vector<double> columns[K];
    for (int k = 0; k < K; ++k)
      for (std::uint32_t t = 1;; ++t) {
        // Opt::table_entry is what the host engine computes at each step.
        const double v = Opt::table_entry(config, k, static_cast<float>(t));
        if (v == Opt::kTableLimit) break;  // and at every later step (the unit's promise)
        if (t == kMaxBiasTableSteps)
          throw Error(Errc::not_supported, Opt::kTableNames[k],
                      "so close to its limit that the table would pass 2^22 steps; "
                      "the device table does not cover it");
        columns[k].push_back(v);
      }
    std::size_t size = K;
    for (int k = 0; k < K; ++k) size += columns[k].size();
    table.reserve(size);
    for (int k = 0; k < K; ++k) table.push_back(static_cast<double>(columns[k].size()));
    for (int k = 0; k < K; ++k) table.insert(table.end(), columns[k].begin(), columns[k].end());
  }
  return table;
}

}  // namespace

std::vector<double> make_optimizer_table(const OptimizerConfig& config) {
  return std::visit(
      [](const auto& c) {
        using Opt = typename ::stepcore::detail::UnitForConfig<std::decay_t<decltype(c)>,
                                                               ::stepcore::detail::AllUnits>::type;
        return unit_table<Opt>(c);
      },
      config);
}

std::vector<std::uint32_t> q8_codebooks() { return ::stepcore::detail::q8_codebook_image(); }

std::size_t scale_and_norm_workspace_bytes(std::span<const TensorView> tensors) {
  std::size_t blocks = 0;
  for (const TensorView& t : tensors) blocks += (t.numel + kBlockElements - 1) / kBlockElements;
  const std::uint32_t slices = reduce_slices(blocks);  // the slices' partials follow
  return (blocks + (slices > 1 ? slices : 0)) * sizeof(NormPartial);
}

namespace detail {
namespace {
thread_local int tl_max_blocks = kMaxBlocksPerLaunch;
thread_local int tl_max_tensors = kMaxTensorsPerLaunch;
// The executor's reduction limits (testing::ScopedReduceSlicing).
thread_local std::uint64_t tl_min_per_slice = kPartialsPerSlice;
thread_local std::uint64_t tl_max_slices = kMaxReduceSlices;
}  // namespace

LaunchLimits launch_limits(bool optimizer) {
  if (!optimizer) return {tl_max_blocks, tl_max_tensors};
  return {
      tl_max_blocks < kMaxOptimizerBlocksPerLaunch ? tl_max_blocks : kMaxOptimizerBlocksPerLaunch,
      tl_max_tensors < kMaxOptimizerTensorsPerLaunch ? tl_max_tensors
                                                     : kMaxOptimizerTensorsPerLaunch};
}
}  // namespace detail

namespace testing {
ScopedLaunchLimits::ScopedLaunchLimits(int max_blocks, int max_tensors)
    : saved_blocks_(detail::tl_max_blocks), saved_tensors_(detail::tl_max_tensors) {
  check_limits(max_blocks, max_tensors, kMaxBlocksPerLaunch, kMaxTensorsPerLaunch);
  detail::tl_max_blocks = max_blocks;
  detail::tl_max_tensors = max_tensors;
}
ScopedLaunchLimits::~ScopedLaunchLimits() {
  detail::tl_max_blocks = saved_blocks_;
  detail::tl_max_tensors = saved_tensors_;
}

ScopedReduceSlicing::ScopedReduceSlicing(std::uint64_t min_per_slice, std::uint64_t max_slices)
    : saved_min_per_slice_(detail::tl_min_per_slice), saved_max_slices_(detail::tl_max_slices) {
  check_in_range(min_per_slice, 1, kPartialsPerSlice, "min_per_slice");
  check_in_range(max_slices, 2, kMaxReduceSlices, "max_slices");
  detail::tl_min_per_slice = min_per_slice;
  detail::tl_max_slices = max_slices;
}
ScopedReduceSlicing::~ScopedReduceSlicing() {
  detail::tl_min_per_slice = saved_min_per_slice_;
  detail::tl_max_slices = saved_max_slices_;
}
}  // namespace testing

namespace emulate {
namespace {
void check_threads(int threads) {
  // Each thread sums at most kBlockElements / threads squares: keep every path within
  // the certified bound (kNormMaxBlockAdditions).
  if (threads < 32 || threads > 1024 || (threads & (threads - 1)) != 0)
    throw Error(Errc::out_of_range, "threads", "must be a power of two in [32, 1024]");
}
}  // namespace

namespace {
// One pass of the CUDA reduction (reduce_partial_fields_kernel) over `count` partials:
// field by field, slice s (slice_bounds) into out[s]. The kernel's threads and CUB tree
// combine the same exact integer operations in another order: the same bits.
void reduce_pass(const NormPartial* in, std::uint64_t count, const ReducePlan& plan,
                 NormPartial* out) {
  for (std::uint32_t s = 0; s < plan.slices; ++s) {
    const SliceBounds slice = slice_bounds(count, plan.per_slice, s);
    for (int f = 0; f < detail::kReduceFields; ++f) {
      std::uint64_t acc = 0;
      for (std::uint64_t b = slice.begin; b < slice.end; ++b)
        acc = detail::combine_field(f, acc, detail::partial_field(in[b], f));
      detail::set_partial_field(out[s], f, acc);
    }
  }
}

// The device's reduction of the block partials (reduce_partials in step_kernels.cu): the
// slices of reduce_plan first when there are several, then one pass over their partials,
// then the digits normalised.
NormPartial reduce_block_partials(const std::vector<NormPartial>& blocks) {
  const ReducePlan plan =
      reduce_plan(blocks.size(), detail::tl_min_per_slice, detail::tl_max_slices);
  std::vector<NormPartial> slices(plan.slices);
  const NormPartial* in = blocks.data();
  std::uint64_t count = blocks.size();
  if (plan.slices > 1) {
    reduce_pass(in, count, plan, slices.data());
    in = slices.data();
    count = plan.slices;
  }
  NormPartial total;
  reduce_pass(in, count, ReducePlan{count, 1}, &total);
  ::stepcore::detail::normalize_digits(total.digits);
  return total;
}

// Every block's partial into its place (first_block + b, as the kernels write the
// workspace), then the device's reduction.
template <class Lane = detail::NormLane>
NormPartial run_norm(const LaunchPlan& plan, const detail::NormPass& pass, int threads) {
  std::vector<NormPartial> partials(plan.total_blocks);
  std::vector<Lane> lanes(static_cast<std::size_t>(threads));
  for (const LaunchArgs& a : plan.launches) {
    for (int b = 0; b < a.num_blocks; ++b) {
      for (int t = 0; t < threads; ++t) {
        lanes[static_cast<std::size_t>(t)] = Lane{};
        detail::scale_norm_thread(a, b, t, threads, pass, lanes[static_cast<std::size_t>(t)]);
      }
      // The same tree as the kernel's shared-memory reduction.
      for (int half = threads / 2; half > 0; half /= 2)
        for (int t = 0; t < half; ++t)
          detail::combine(lanes[static_cast<std::size_t>(t)],
                          lanes[static_cast<std::size_t>(t + half)]);
      partials[a.first_block + static_cast<std::size_t>(b)] = detail::to_partial(lanes[0]);
    }
  }
  return reduce_block_partials(partials);
}
}  // namespace

NormPartial scale_and_norm_partial(const LaunchPlan& plan, float scale, int threads) {
  ::stepcore::detail::check_scale_factor(scale, "scale");
  check_threads(threads);
  return run_norm(plan, detail::NormPass{scale, 1.0f, true}, threads);
}

NormPartial norm_partial(const LaunchPlan& plan, GradientRead read, int threads) {
  ::stepcore::detail::validate_device_read(read);
  check_threads(threads);
  return run_norm(plan, detail::NormPass{read.scale, read.clip, false}, threads);
}

NormPartial scale_and_norm_partial(const LaunchPlan& plan, const float* d_scale, int threads) {
  detail::check_device_scalar(d_scale, sizeof(float), "d_scale", nullptr);
  check_threads(threads);
  return run_norm(plan,
                  detail::norm_pass_at_run(detail::NormPass{1.0f, 1.0f, true}, d_scale, nullptr),
                  threads);
}

NormPartial norm_partial(const LaunchPlan& plan, const DeviceGradientRead& d_read, int threads) {
  detail::check_device_read(d_read, nullptr);
  check_threads(threads);
  return run_norm(plan, detail::norm_pass_at_run(detail::NormPass{}, d_read.scale, d_read.clip),
                  threads);
}

NormPartial exact_norm_partial_if_needed(const LaunchPlan& plan, const DeviceGradientRead& d_read,
                                         std::int32_t found_inf, int threads) {
  detail::check_device_read(d_read, nullptr);
  check_threads(threads);
  if (found_inf != kFoundInfNeedsExact) return NormPartial{};
  return run_norm<detail::ExactNormLane>(
      plan, detail::norm_pass_at_run(detail::NormPass{}, d_read.scale, d_read.clip), threads);
}

void scale_(const LaunchPlan& plan, float factor, int threads) {
  ::stepcore::detail::check_scale_factor(factor, "factor");
  check_threads(threads);
  for (const LaunchArgs& a : plan.launches)
    for (int b = 0; b < a.num_blocks; ++b)
      for (int t = 0; t < threads; ++t) detail::scale_thread(a, b, t, threads, factor);
}

template <class Opt>
void optimizer_step(const OptimizerPlan<Opt>& plan, const OptimizerDeviceArgs& d, int threads) {
  check_threads(threads);
  if constexpr (Opt::kReadsScaled) {
    if (d.scale == nullptr) throw Error(Errc::null_pointer, "d.scale", "required");
    if (d.clip == nullptr) throw Error(Errc::null_pointer, "d.clip", "required");
  }
  if (Opt::kTableColumns > 0 && d.table == nullptr)
    throw Error(Errc::null_pointer, "d.table", "required: gpu::make_optimizer_table(config)");
  if constexpr (::stepcore::detail::unit_takes_q8<Opt>())
    for (const OptimizerLaunchArgs<Opt>& a : plan.launches)
      for (int t = 0; t < a.num_tensors; ++t)
        if (a.q8(t)) detail::check_device_scalar(d.q8_codebooks, 0, "d.q8_codebooks", nullptr);
  if (d.found_inf != nullptr && *d.found_inf != 0) return;
  for (const OptimizerLaunchArgs<Opt>& a : plan.launches)
    for (int b = 0; b < a.num_blocks; ++b) {
      // As the kernel: the block's scalars once, then its threads (an 8-bit tensor's
      // block: its lanes, one per element of each 8-bit block, with the block-wide
      // maximum between the update and the encoding).
      const typename Opt::Scalars s = detail::block_scalars<Opt>(a, a.task(b).tensor, d);
      const GradientRead read = detail::block_read<Opt>(d);
      if (a.q8(a.task(b).tensor)) {
        if constexpr (::stepcore::detail::unit_takes_q8<Opt>())
          detail::q8_block_emulated<Opt>(a, b, s, read.scale, read.clip, d.q8_codebooks);
        continue;
      }
      for (int t = 0; t < threads; ++t)
        detail::optimizer_thread<Opt>(a, b, t, threads, s, read.scale, read.clip);
    }
  for (const StepCounterArgs& c : plan.counters)
    for (int k = 0; k < c.count; ++k) detail::advance_counter(c, k);
}

void finalize_and_clip(const NormPartial& partial, float max_norm, NormResult& result, float& clip,
                       std::int32_t& found_inf) {
  ::stepcore::detail::check_max_norm(max_norm);
  detail::finalize_and_clip_body(partial, max_norm, result, clip, found_inf);
}

NormPartial exact_norm_partial_if_needed(const LaunchPlan& plan, GradientRead read,
                                         std::int32_t found_inf, int threads) {
  ::stepcore::detail::validate_device_read(read);
  check_threads(threads);
  if (found_inf != kFoundInfNeedsExact) return NormPartial{};
  return run_norm<detail::ExactNormLane>(plan, detail::NormPass{read.scale, read.clip, false},
                                         threads);
}

void finalize_exact_and_clip(const NormPartial& exact_partial, float max_norm, NormResult& result,
                             float& clip, std::int32_t& found_inf) {
  ::stepcore::detail::check_max_norm(max_norm);
  detail::finalize_exact_and_clip_body(exact_partial, max_norm, result, clip, found_inf);
}

void accumulate(const LaunchPlan& plan, bool copy, int threads) {
  check_threads(threads);
  for (const LaunchArgs& a : plan.launches)
    for (int b = 0; b < a.num_blocks; ++b)
      for (int t = 0; t < threads; ++t) detail::accumulate_thread(a, b, t, threads, copy);
}

}  // namespace emulate
// The generic plan and executor of every unit (AllUnits), by address: an object with
// external linkage that names them instantiates each here, for the other translation
// units (a unit added to AllUnits is instantiated with no edit here).
namespace detail {
template <class... Units>
constexpr auto optimizer_instances(::stepcore::detail::UnitList<Units...>) {
  return std::make_tuple(
      std::make_pair(&make_optimizer_plan<Units>, &emulate::optimizer_step<Units>)...);
}
extern const auto kOptimizerInstances = optimizer_instances(::stepcore::detail::AllUnits{});
}  // namespace detail

}  // namespace stepcore::gpu
