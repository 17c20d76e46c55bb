// The cache of validated multi-tensor calls (kernels/plan_cache.hpp): a repeated call
// makes no memory check, any changed argument is validated again, memory released
// through a device is checked again, and the keys are exact; a gradient manager of
// several hundred parameters validates nothing after its first step.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "kernels/checked_plans.hpp"
#include "kernels/plan_cache.hpp"
#include "kernels/testing.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/managers.hpp"

namespace {

using namespace stepcore;
using gpu::detail::CallKey;
using test_support::expect_error;
using AdamWUnit = stepcore::detail::AdamW;

// 40 AdamW tensors in one host vector: param, exp_avg, exp_avg_sq, grad (f32) each.
struct Call {
  std::vector<float> memory, steps;
  std::vector<OptimizerTensor> tensors;
  float scale = 1.0f, clip = 1.0f;
  double bias[2] = {1.0, 1.0};
  OptimizerDeviceArgs d{&scale, &clip, nullptr, nullptr, bias};
  explicit Call(std::size_t n = 40, std::size_t numel = 1000)
      : memory(4 * n * numel), steps(n), tensors(n) {
    for (std::size_t i = 0; i < n; ++i) {
      float* p = memory.data() + 4 * i * numel;
      tensors[i] = OptimizerTensor{
          {p, numel, DType::f32},
          {TensorView{p + numel, numel, DType::f32}, TensorView{p + 2 * numel, numel, DType::f32}},
          &steps[i],
          {p + 3 * numel, numel, DType::f32},
          {}};
    }
  }
};

struct Counter {
  std::size_t checks = 0;
  gpu::detail::MemoryCheck check() {
    return [this](const void*, std::size_t, const detail::Arg&) { ++checks; };
  }
};

TEST(PlanCache, IsOnInReleaseBuildsAndOffInDebugBuilds) {
#ifdef NDEBUG
  EXPECT_TRUE(gpu::detail::plan_cache_enabled());
#else
  EXPECT_FALSE(gpu::detail::plan_cache_enabled()) << "debug builds check every call";
#endif
}

TEST(PlanCache, ARepeatedCallMakesNoMemoryCheckAndGetsTheSamePlan) {
  const gpu::testing::ScopedPlanCache on(true);
  Call c;
  Counter n;
  const auto check = n.check();
  const gpu::OptimizerPlan<AdamWUnit> first =
      gpu::detail::checked_optimizer_plan<AdamWUnit>(c.tensors, AdamWConfig{}, c.d, check);
  const std::size_t per_call = n.checks;
  EXPECT_EQ(per_call, 5 * c.tensors.size() + 3) << "each buffer, counter and scalar once";
  const gpu::OptimizerPlan<AdamWUnit> again =
      gpu::detail::checked_optimizer_plan<AdamWUnit>(c.tensors, AdamWConfig{}, c.d, check);
  EXPECT_EQ(n.checks, per_call) << "the repeated call checked memory again";
  ASSERT_EQ(again.launches.size(), first.launches.size());
  ASSERT_EQ(again.counters.size(), first.counters.size());
  // The plan the cache returns is the one a fresh validation builds.
  const gpu::OptimizerPlan<AdamWUnit> fresh =
      gpu::make_optimizer_plan<AdamWUnit>(c.tensors, AdamWConfig{});
  ASSERT_EQ(again.launches.size(), fresh.launches.size());
  for (std::size_t l = 0; l < fresh.launches.size(); ++l) {
    const auto& a = again.launches[l];
    const auto& b = fresh.launches[l];
    EXPECT_EQ(a.num_tensors, b.num_tensors) << l;
    for (int t = 0; t < b.num_tensors; ++t) {
      EXPECT_EQ(a.dst[0][t], b.dst[0][t]);
      EXPECT_EQ(a.grad[t], b.grad[t]);
      EXPECT_EQ(a.step[t], b.step[t]);
      EXPECT_EQ(a.map.numel[t], b.map.numel[t]);
      EXPECT_EQ(a.map.block_end[t], b.map.block_end[t]);
    }
  }
}

// A step's distinct calls (per group, per chunk) stay cached, the least recently used
// go first when more than the cache holds come.
TEST(PlanCache, DistinctCallsStayCachedAndTheLeastRecentlyUsedGoFirst) {
  const gpu::testing::ScopedPlanCache on(true);
  constexpr std::size_t kEntries = gpu::detail::PlanCache<gpu::OptimizerPlan<AdamWUnit>>::kEntries;
  std::vector<Call> calls;
  calls.reserve(kEntries + 1);  // each Call's device arguments point into it: no moves
  for (std::size_t i = 0; i < kEntries + 1; ++i) calls.emplace_back(2, 100);
  Counter n;
  const auto check = n.check();
  auto run = [&](std::size_t i) {
    const std::size_t before = n.checks;
    (void)gpu::detail::checked_optimizer_plan<AdamWUnit>(calls[i].tensors, AdamWConfig{},
                                                         calls[i].d, check);
    return n.checks - before;
  };
  const std::size_t per_call = run(0);
  ASSERT_GT(per_call, 0u);
  for (std::size_t i = 1; i < kEntries; ++i) EXPECT_EQ(run(i), per_call) << i;
  for (std::size_t i = kEntries; i-- > 0;) EXPECT_EQ(run(i), 0u) << "cached call " << i;
  // Now call 0 is the most recent and kEntries - 1 the least: one more evicts it.
  EXPECT_EQ(run(kEntries), per_call);
  EXPECT_EQ(run(0), 0u);
  EXPECT_EQ(run(kEntries - 1), per_call) << "the least recently used call was kept";
}

TEST(PlanCache, WithTheCacheOffEveryCallChecksMemory) {
  const gpu::testing::ScopedPlanCache off(false);
  Call c;
  Counter n;
  const auto check = n.check();
  (void)gpu::detail::checked_optimizer_plan<AdamWUnit>(c.tensors, AdamWConfig{}, c.d, check);
  const std::size_t per_call = n.checks;
  (void)gpu::detail::checked_optimizer_plan<AdamWUnit>(c.tensors, AdamWConfig{}, c.d, check);
  EXPECT_EQ(n.checks, 2 * per_call);
}

TEST(PlanCache, AnyChangedArgumentIsValidatedAgain) {
  const gpu::testing::ScopedPlanCache on(true);
  Call c;
  Counter n;
  const auto check = n.check();
  (void)gpu::detail::checked_optimizer_plan<AdamWUnit>(c.tensors, AdamWConfig{}, c.d, check);
  // A moment that now overlaps the next tensor's parameter.
  std::vector<OptimizerTensor> overlapping = c.tensors;
  overlapping[3].state[0].data = c.tensors[4].param.data;
  expect_error(
      [&] {
        (void)gpu::detail::checked_optimizer_plan<AdamWUnit>(overlapping, AdamWConfig{}, c.d,
                                                             check);
      },
      Errc::overlap);
  // The same tensors with a bad configuration.
  AdamWConfig bad;
  bad.lr = -1.0;
  expect_error(
      [&] { (void)gpu::detail::checked_optimizer_plan<AdamWUnit>(c.tensors, bad, c.d, check); },
      Errc::invalid_argument, "config.lr");
  // The same call with a flag its tensors cannot take (amsgrad: no max_exp_avg_sq slot):
  // refused, not served from the plan cached without it; maximize is taken, and the plan
  // carries it.
  AdamWConfig flagged;
  flagged.maximize = true;
  const gpu::OptimizerPlan<AdamWUnit> maximizing =
      gpu::detail::checked_optimizer_plan<AdamWUnit>(c.tensors, flagged, c.d, check);
  ASSERT_FALSE(maximizing.launches.empty());
  EXPECT_TRUE(maximizing.launches[0].config.maximize);
  flagged.maximize = false;
  flagged.amsgrad = true;
  expect_error(
      [&] { (void)gpu::detail::checked_optimizer_plan<AdamWUnit>(c.tensors, flagged, c.d, check); },
      Errc::size_mismatch, "tensors[0].max_exp_avg_sq");
  // A scalar pointer that became null.
  OptimizerDeviceArgs no_clip = c.d;
  no_clip.clip = nullptr;
  expect_error(
      [&] {
        (void)gpu::detail::checked_optimizer_plan<AdamWUnit>(c.tensors, AdamWConfig{}, no_clip,
                                                             check);
      },
      Errc::null_pointer, "d.clip");
  // A dtype change alone (same pointers and sizes): an f16 master is refused.
  std::vector<OptimizerTensor> f16_param = c.tensors;
  f16_param[0].param.dtype = DType::f16;
  expect_error(
      [&] {
        (void)gpu::detail::checked_optimizer_plan<AdamWUnit>(f16_param, AdamWConfig{}, c.d, check);
      },
      Errc::unsupported_dtype, "tensors[0].param");
  // A failed call is not cached: the same bad call fails again.
  expect_error(
      [&] {
        (void)gpu::detail::checked_optimizer_plan<AdamWUnit>(overlapping, AdamWConfig{}, c.d,
                                                             check);
      },
      Errc::overlap);
}

TEST(PlanCache, AMemoryCheckThatFailsIsNeverCached) {
  const gpu::testing::ScopedPlanCache on(true);
  Call c;
  int calls = 0;
  const gpu::detail::MemoryCheck refuse = [&calls](const void*, std::size_t, const detail::Arg& a) {
    ++calls;
    throw Error(Errc::invalid_argument, a.str(), "refused by the test");
  };
  for (int i = 0; i < 2; ++i)
    expect_error(
        [&] {
          (void)gpu::detail::checked_optimizer_plan<AdamWUnit>(c.tensors, AdamWConfig{}, c.d,
                                                               refuse);
        },
        Errc::invalid_argument, "d.scale");
  EXPECT_EQ(calls, 2);
}

// On the host device: a cached call whose buffer the device then releases is checked
// again, and refused naming the released buffer.
TEST(PlanCache, MemoryReleasedThroughADeviceIsCheckedAgain) {
  const gpu::testing::ScopedPlanCache on(true);
  auto dev = device::make_host_device(32);
  const std::size_t n = 3000;
  auto* param = static_cast<float*>(dev->allocate(4 * n));
  auto* m = static_cast<float*>(dev->allocate(4 * n));
  auto* v = static_cast<float*>(dev->allocate(4 * n));
  auto* grad = static_cast<float*>(dev->allocate(4 * n));
  auto* step = static_cast<float*>(dev->allocate(4));
  auto* scalars = static_cast<float*>(dev->allocate(8));
  const AdamWConfig config;
  const std::vector<double> table = gpu::make_optimizer_table(config);
  auto* bias = static_cast<double*>(dev->allocate(8 * table.size()));
  std::copy(table.begin(), table.end(), bias);
  scalars[0] = scalars[1] = 1.0f;
  const OptimizerTensor t{{param, n, DType::f32},
                          {TensorView{m, n, DType::f32}, TensorView{v, n, DType::f32}},
                          step,
                          {grad, n, DType::f32},
                          {}};
  const OptimizerDeviceArgs d{&scalars[0], &scalars[1], nullptr, nullptr, bias};
  dev->optimizer_step({&t, 1}, config, d);
  dev->optimizer_step({&t, 1}, config, d);  // from the cache
  dev->synchronize();
  EXPECT_EQ(*step, 2.0f);
  dev->deallocate(m);
  expect_error(
      [&] {
        dev->optimizer_step({&t, 1}, config, d);
      },
      Errc::invalid_argument, "tensors[0].exp_avg");
  for (void* p : {static_cast<void*>(param), static_cast<void*>(v), static_cast<void*>(grad),
                  static_cast<void*>(step), static_cast<void*>(scalars), static_cast<void*>(bias)})
    dev->deallocate(p);
}

TEST(PlanCache, KeysAreExact) {
  float x[4];
  auto key = [](std::initializer_list<ConstTensorView> views) {
    CallKey k(2);  // short on purpose: the key grows
    for (const auto& v : views) k.add(v);
    return k;
  };
  const std::size_t big = std::size_t{1} << 56;
  EXPECT_TRUE(key({{x, 4, DType::f32}, {x + 1, 2, DType::bf16}}) ==
              key({{x, 4, DType::f32}, {x + 1, 2, DType::bf16}}));
  EXPECT_FALSE(key({{x, 4, DType::f32}}) == key({{x, 4, DType::bf16}}));
  EXPECT_FALSE(key({{x, 4, DType::f32}}) == key({{x, 5, DType::f32}}));
  EXPECT_FALSE(key({{x, 4, DType::f32}}) == key({{x + 1, 4, DType::f32}}));
  EXPECT_FALSE(key({{x, big, DType::f32}}) == key({{x, 0, DType::f32}}));
  EXPECT_FALSE(key({{x, big + 3, DType::f32}}) == key({{x, 3, DType::f32}}));
  EXPECT_TRUE(key({{x, big + 3, DType::f32}}) == key({{x, big + 3, DType::f32}}));
  EXPECT_FALSE(key({{x, 4, DType::f32}, {x, 4, DType::f32}}) == key({{x, 4, DType::f32}}));
}

// The call counts of every kind (testing::call_counts).
struct AllCounts {
  gpu::testing::CallCounts kind[gpu::detail::kCallKinds];
  static AllCounts now() {
    AllCounts c;
    for (int k = 0; k < gpu::detail::kCallKinds; ++k)
      c.kind[k] = gpu::testing::call_counts(static_cast<gpu::detail::CallKind>(k));
    return c;
  }
  gpu::testing::CallCounts since(const AllCounts& before, gpu::detail::CallKind k) const {
    const int i = static_cast<int>(k);
    return {kind[i].reused - before.kind[i].reused, kind[i].validated - before.kind[i].validated};
  }
};

// A device-resident manager of 300 parameters on the host device (each micro-batch makes
// one accumulate per parameter: 300 distinct calls per copy flag, more than a
// least-recently-used cache of a step's few calls holds): its first step validates each
// call once; every later step reuses every plan, the accumulates (the manager's own,
// one per parameter and copy flag), the norms and the optimizer steps. With the manager's
// gradient buffers and with the caller's own (the same buffers every micro-batch).
TEST(PlanCache, AManagerOfSeveralHundredParametersValidatesNothingAfterItsFirstStep) {
  using gpu::detail::CallKind;
  const gpu::testing::ScopedPlanCache on(true);
  constexpr std::size_t kParams = 300;
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer})
    for (bool own_buffers : {true, false}) {
      SCOPED_TRACE(std::string(mode == OffloadMode::none ? "mode none" : "mode optimizer") +
                   (own_buffers ? ", the manager's gradient buffers" : ", the caller's"));
      auto dev = device::make_host_device(32);
      ManagerConfig cfg;
      cfg.mode = mode;
      cfg.device = dev.get();
      cfg.chunk_elements = 4096;  // mode optimizer: a few dozen chunks
      for (std::size_t i = 0; i < kParams; ++i) {
        ParamSpec p;
        p.name = "p" + std::to_string(i);
        p.numel = 40 + 13 * (i % 7);
        p.gradient_buffer = own_buffers;
        cfg.params.push_back(p);
      }
      auto m = make_gradient_manager(cfg);
      for (std::size_t i = 0; i < kParams; ++i)
        m->load_parameter(i, std::vector<float>(cfg.params[i].numel, 0.5f));
      std::vector<void*> grads(kParams, nullptr);  // the caller's, when it keeps its own
      for (std::size_t i = 0; i < kParams && !own_buffers; ++i)
        grads[i] = dev->allocate(2 * cfg.params[i].numel);
      auto run_step = [&](int step) {
        m->begin_step(1.0f, false);
        for (bool final_backward : {false, true}) {  // two micro-batches: copy, then add
          m->begin_backward(final_backward);
          for (std::size_t i = kParams; i-- > 0;) {
            const std::size_t n = cfg.params[i].numel;
            const std::vector<std::uint16_t> bits(n, static_cast<std::uint16_t>(0x3C00 + step));
            const TensorView g =
                own_buffers ? m->gradient(i) : TensorView{grads[i], n, DType::bf16};
            dev->copy(device::Queue::compute, g.data, bits.data(), 2 * n);
            dev->synchronize(dev->record(device::Queue::compute));
            if (own_buffers)
              m->gradient_ready(i);
            else
              m->gradient_ready(i, ConstTensorView(g));
          }
          m->finish_backward();
        }
        (void)m->clip_grad_norm(1.0f);
        m->step();
        m->synchronize();
        ASSERT_TRUE(m->report().stepped);
      };
      const AllCounts before = AllCounts::now();
      run_step(0);
      const AllCounts first = AllCounts::now();
      EXPECT_GE(first.since(before, CallKind::accumulate).validated, 2 * kParams)
          << "each parameter and copy flag validated once";
      for (int step = 1; step < 3; ++step) run_step(step);
      const AllCounts later = AllCounts::now();
      for (CallKind k :
           {CallKind::norm, CallKind::scale, CallKind::accumulate, CallKind::optimizer})
        EXPECT_EQ(later.since(first, k).validated, 0u)
            << "kind " << static_cast<int>(k) << " validated after the first step";
      EXPECT_EQ(later.since(first, CallKind::accumulate).reused, 2 * 2 * kParams)
          << "one accumulate per parameter and micro-batch, every one reused";
      m->close();
      for (void* p : grads)
        if (p != nullptr) dev->deallocate(p);
    }
}

}  // namespace
