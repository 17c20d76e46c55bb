// What a real training loop needs from the gradient managers, against the independent
// simulation built from stepcore::reference (manager_model): parameter groups with a
// warm-up + cosine schedule set before every step, the trainer's own gradient buffers
// (poisoned as soon as the manager releases them) and compute-weight destinations in the
// model's storage (guard bands around them), in every mode, with and without overlap,
// on 1 and 2 in-process ranks; and every new call's bad input refused with nothing changed.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "expect_error.hpp"
#include "forwarding_device.hpp"
#include "isa_list.hpp"
#include "managers/checkpoint_file.hpp"
#include "managers/testing.hpp"
#include "managers_cases.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

namespace {

using namespace managers_cases;
namespace checkpoint = stepcore::detail::checkpoint;
using test_support::errc_name;

constexpr OffloadMode kModes[] = {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full};

Build build_of(OffloadMode mode, int threads = 2, std::optional<cpu::Isa> isa = {},
               bool lazy = false) {
  Build b;
  b.mode = mode;
  b.threads = threads;
  b.isa = isa;
  b.lazy = lazy;
  return b;
}

// Expects every mode (none eager and lazy, optimizer, full) on one rank, and each mode on
// 2 in-process ranks, to equal the reference after every step.
void expect_every_mode_equals(const Case& c, const std::vector<StepRecord>& want) {
  expect_same(run_mode(OffloadMode::none, c), want, "none");
  expect_same(run_mode(OffloadMode::none, c, /*lazy=*/true), want, "none (lazy scale)");
  expect_same(run_mode(OffloadMode::optimizer, c), want, "optimizer");
  expect_same(run_mode(OffloadMode::full, c), want, "full");
  const std::vector<StreamParam> model = stream_model(c.grad_dtype);
  const Sharding sh = shard_model(model, 2);
  // Each rank's optimizer is given its shards as tensors of their own: the reference
  // updates each shard separately (the torch formula's tails fall on each one's end).
  const auto sharded_want = run_reference(c, &sh);
  if (is_adamw(c.optimizer) && c.formula == AdamWFormula::torch) {
    bool differs = false;  // the shards' own tails: not a slice of the unsharded run
    for (std::size_t i = 0; i < want.back().state.size(); ++i)
      differs = differs || want.back().state[i] != sharded_want.back().state[i];
    EXPECT_TRUE(differs) << "the sharded expectation does not exercise the shards' tails";
  }
  for (OffloadMode mode : kModes) {
    SCOPED_TRACE(std::string("2 ranks, mode ") + std::string(offload_mode_name(mode)));
    const auto got = run_sharded(2, mode, c, sh);
    if (::testing::Test::HasFailure()) return;
    for (int r = 0; r < 2; ++r)
      expect_shard_of(got[static_cast<std::size_t>(r)], sharded_want, model, sh, r,
                      manager_model::initial_slots(c.optimizer).size());
  }
}

TEST(TrainerApi, ATwentyStepScheduleOverTwoGroupsEqualsTheReferenceInEveryMode) {
  for (OptimizerConfig opt : std::vector<OptimizerConfig>{AdamWConfig{}, SignSgdConfig{}})
    for (bool overlap : {false, true}) {
      Case c{DType::bf16, opt, overlap ? std::optional<float>{} : std::optional<float>{0.05f},
             Flow::sft, overlap};
      c.schedule = true;
      c.steps = 20;
      SCOPED_TRACE(c.label());
      const auto want = run_reference(c);
      // The run must exercise what it claims: the schedule changes the result, and
      // without overlap clipping clips (the effective scale is below the step's scale).
      Case constant = c;
      constant.schedule = false;
      ASSERT_NE(run_reference(constant)[19].state[0], want[19].state[0]);
      if (!overlap) {
        bool clipped = false;
        for (int s = 0; s < c.steps; ++s)
          clipped = clipped || std::bit_cast<float>(want[static_cast<std::size_t>(s)].scale_bits) <
                                   plan_step(c.flow, s, want[0].state.size(), 1).scale;
        ASSERT_TRUE(clipped) << "max_norm 0.05 never clipped";
      }
      expect_every_mode_equals(c, want);
      if (HasFatalFailure()) return;
    }
}

TEST(TrainerApi, CallerOwnedGradientsGiveTheOwnedBuffersBitsAndAreNeverWritten) {
  // run_stream hands each gradient over in a buffer of its own, checks after
  // gradient_released(i) that the manager did not write it, then poisons it with NaN.
  for (bool overlap : {false, true})
    for (Flow flow : {Flow::sft, Flow::rl}) {
      Case c{DType::bf16, AdamWConfig{},
             overlap ? std::optional<float>{} : std::optional<float>{0.05f}, flow, overlap};
      c.schedule = true;
      c.steps = 6;
      SCOPED_TRACE(c.label());
      Case owned = c;
      const auto want = run_reference(owned);
      c.caller_gradients = true;
      expect_every_mode_equals(c, want);
      if (HasFatalFailure()) return;
    }
}

// A device allocation holding every parameter's compute-weight destination between
// guard bands of a fixed pattern.
struct Destinations {
  static constexpr std::size_t kGuard = 256;
  static constexpr std::uint8_t kPattern = 0xA5;
  device::Device& dev;
  std::vector<std::size_t> offsets;
  std::size_t bytes = kGuard;
  void* base = nullptr;
  Destinations(device::Device& d, const std::vector<ParamSpec>& params) : dev(d) {
    for (const ParamSpec& p : params) {
      offsets.push_back(bytes);
      bytes += p.numel * dtype_size(p.compute_dtype) + kGuard;
    }
    base = dev.allocate(bytes);
    const std::vector<std::uint8_t> fill(bytes, kPattern);
    dev.copy(device::Queue::compute, base, fill.data(), bytes);
    dev.synchronize();
  }
  ~Destinations() { dev.deallocate(base); }
  TensorView view(std::size_t i, const ParamSpec& p) const {
    return {static_cast<std::uint8_t*>(base) + offsets[i], p.numel, p.compute_dtype};
  }
  std::vector<std::uint8_t> contents() const {
    std::vector<std::uint8_t> out(bytes);
    dev.copy(device::Queue::compute, out.data(), base, bytes);
    dev.synchronize();
    return out;
  }
};

TEST(TrainerApi, ComputeWeightsGoIntoTheCallersStorageAndNowhereElse) {
  Case c{DType::bf16, AdamWConfig{}, 0.05f, Flow::rl, false};
  c.schedule = true;
  c.steps = 5;
  const auto want = run_reference(c);
  for (OffloadMode mode : kModes)
    for (bool overlap : {false, true}) {
      SCOPED_TRACE(std::string(offload_mode_name(mode)) + (overlap ? " overlap" : ""));
      Case run_case = c;
      run_case.overlap = overlap;
      if (overlap) run_case.max_norm.reset();
      const auto expected = overlap ? run_reference(run_case) : want;
      auto dev = make_device();
      const std::vector<ParamSpec> specs = param_specs(stream_model(c.grad_dtype));
      Destinations dest(*dev, specs);
      // The manager of make_manager, with destinations: built the same way by hand.
      ManagerConfig cfg = config_of(mode, *dev, c.optimizer);
      for (std::size_t i = 0; i < specs.size(); ++i)
        cfg.params[i].compute_into = dest.view(i, specs[i]);
      auto m = make_gradient_manager(cfg);
      for (std::size_t i = 0; i < specs.size(); ++i) {
        std::vector<float> init(specs[i].numel);
        for (std::size_t j = 0; j < init.size(); ++j) init[j] = initial_master(i, j);
        m->load_parameter(i, init);
      }
      for (std::size_t i = 0; i < specs.size(); ++i)
        EXPECT_EQ(m->compute_weights(i).data, dest.view(i, specs[i]).data) << "parameter " << i;
      const auto got = run_stream(*m, *dev, stream_options(run_case, nullptr));
      expect_same(got, expected, "destinations");
      // The destinations hold the last step's compute weights (the tail of each record),
      // and every byte between them is the guard pattern.
      const std::vector<std::uint8_t> bytes = dest.contents();
      std::size_t at = 0;
      for (std::size_t i = 0; i < specs.size(); ++i) {
        for (; at < dest.offsets[i]; ++at)
          ASSERT_EQ(bytes[at], Destinations::kPattern) << "guard byte " << at << " written";
        const std::size_t cb = specs[i].numel * dtype_size(specs[i].compute_dtype);
        const auto& rec = expected.back().state[i];
        ASSERT_EQ(0, cb == 0 ? 0 : std::memcmp(bytes.data() + at, rec.data() + rec.size() - cb, cb))
            << "parameter " << i << ": destination bits";
        at += cb;
      }
      for (; at < bytes.size(); ++at)
        ASSERT_EQ(bytes[at], Destinations::kPattern) << "guard byte " << at << " written";
      m->close();
    }
}

TEST(TrainerApi, DeviceManagersTakeANewLearningRateWithoutAHostSynchronisation) {
  // A device that counts host waits (synchronize calls): from the new step's gradients to
  // step(), through set_hyperparameters, the device managers wait for nothing (no clip),
  // and the step uses the new values.
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer}) {
    SCOPED_TRACE(offload_mode_name(mode));
    Case c{DType::bf16, AdamWConfig{}, {}, Flow::sft, false};
    c.steps = 2;
    c.schedule = true;  // the reference: schedule_of's values before each step
    const auto want = run_reference(c);
    test_support::ForwardingDevice dev;
    auto m = make_manager(build_of(mode), c, dev);
    (void)run_stream(*m, dev, stream_options(c, nullptr, 0, 1));  // step 0, as scheduled
    const StepPlan plan = plan_step(c.flow, 1, m->config().params.size(), 1);
    m->begin_step(plan.scale, false);
    std::vector<std::vector<std::uint8_t>> host(m->config().params.size());
    for (int mb = 0; mb < plan.micro_batches; ++mb) {
      m->begin_backward(mb + 1 == plan.micro_batches);
      for (std::size_t i = m->config().params.size(); i-- > 0;) {
        const TensorView g = m->gradient(i);
        dev.synchronize(m->gradient_released(i));  // the trainer's own wait (before `start`)
        host[i].assign(g.bytes() + 1, 0);
        make_gradient(1, 1, mb, i, 0, g.numel, g.dtype, host[i].data());
        dev.copy(device::Queue::compute, g.data, host[i].data(), g.bytes());
        m->gradient_ready(i);
      }
      if (mb + 1 < plan.micro_batches) m->finish_backward();
    }
    const int start = dev.synchronizations();
    m->finish_backward();
    for (std::size_t g = 0; g < m->group_count(); ++g)
      m->set_hyperparameters(g, schedule_of(1, g, c.steps));
    m->step();
    EXPECT_EQ(dev.synchronizations() - start, 0)
        << "finish_backward, set_hyperparameters or step waited on the host";
    (void)m->report();
    EXPECT_GT(dev.synchronizations() - start, 0) << "report() must wait for the step";
    // Step 1's state must be the reference's (which used schedule_of's step-1 values).
    for (std::size_t i = 0; i < m->config().params.size(); ++i) {
      const ParamSpec& p = m->config().params[i];
      std::vector<float> master(p.numel), ea(p.numel), eas(p.numel);
      std::vector<std::uint8_t> compute(p.numel * 2);
      m->read_parameter(i, master, ea, eas, compute);
      std::vector<std::uint8_t> bytes(want[1].state[i].size());
      if (p.numel == 0) continue;
      std::memcpy(bytes.data(), master.data(), p.numel * 4);
      std::memcpy(bytes.data() + p.numel * 4, ea.data(), p.numel * 4);
      std::memcpy(bytes.data() + p.numel * 8, eas.data(), p.numel * 4);
      std::memcpy(bytes.data() + p.numel * 12, compute.data(), compute.size());
      EXPECT_EQ(bytes, want[1].state[i]) << "parameter " << i << ": not the new lr's step";
    }
    m->close();
  }
}

// ---- bad input: the error, naming the argument, and nothing changed --------------------

using test_support::expect_error;

// Everything observable of a manager between steps: groups, every parameter's state,
// step counter and compute weights.
std::vector<std::uint8_t> snapshot(GradientManager& m) {
  std::vector<std::uint8_t> out;
  auto append = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  };
  for (std::size_t g = 0; g < m.group_count(); ++g) {
    append(&m.group(g).lr, sizeof(double));
    append(&m.group(g).weight_decay, sizeof(double));
  }
  const std::vector<std::string_view>& names = m.state_slot_names();
  for (std::size_t i = 0; i < m.config().params.size(); ++i) {
    const ParamSpec& p = m.config().params[i];
    std::vector<std::vector<float>> arrays(1 + names.size(), std::vector<float>(p.numel));
    std::vector<SlotOut> named;
    for (std::size_t s = 0; s < names.size(); ++s) named.push_back({names[s], arrays[1 + s]});
    std::vector<std::uint8_t> compute(p.numel * dtype_size(p.compute_dtype));
    m.read_parameter(i, arrays[0], named, compute);
    for (const auto& v : arrays) append(v.data(), v.size() * sizeof(float));
    append(compute.data(), compute.size());
    const float step = m.step_count(i);
    append(&step, sizeof step);
  }
  return out;
}

// A manager of `mode` after 2 steps of the test stream (moments and counters non-zero).
struct Stepped {
  std::unique_ptr<device::Device> dev = make_device();
  std::unique_ptr<GradientManager> m;
  Stepped(OffloadMode mode, OptimizerConfig opt = AdamWConfig{}) {
    Case c{DType::bf16, opt, 0.05f, Flow::sft, false};
    c.steps = 2;
    Build b;
    b.mode = mode;
    m = make_manager(b, c, *dev);
    (void)run_stream(*m, *dev, stream_options(c, nullptr));
  }
  ~Stepped() { m->close(); }
};

TEST(TrainerApi, SetHyperparametersRefusesBadValuesAndChangesNothing) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (OffloadMode mode : kModes)
    for (OptimizerConfig opt : std::vector<OptimizerConfig>{AdamWConfig{}, SignSgdConfig{}}) {
      SCOPED_TRACE(std::string(offload_mode_name(mode)) + " " + std::string(optimizer_name(opt)));
      Stepped t(mode, opt);
      GradientManager& m = *t.m;
      const auto before = snapshot(m);
      expect_error([&] { m.set_hyperparameters(2, {1e-3, 0.0}); }, Errc::out_of_range, "group");
      expect_error([&] { m.set_hyperparameters(0, {nan, 0.0}); }, Errc::non_finite, "hyper.lr");
      expect_error(
          [&] {
            m.set_hyperparameters(0, {1e-3, INFINITY});
          },
          Errc::non_finite, "hyper.weight_decay");
      expect_error(
          [&] {
            m.set_hyperparameters(1, {-1e-3, 0.0});
          },
          Errc::invalid_argument, "hyper.lr");
      expect_error(
          [&] {
            m.set_hyperparameters(1, {1e-3, -0.5});
          },
          Errc::invalid_argument, "hyper.weight_decay");
      expect_error(
          [&] {
            m.set_hyperparameters(0, {0.5, 2.5});
          },
          Errc::invalid_argument,
          "hyper.weight_decay");  // lr * weight_decay > 1
      expect_error([&] { (void)m.group_index("decayed"); }, Errc::invalid_argument, "group");
      expect_error([&] { (void)m.group(2); }, Errc::out_of_range, "group");
      EXPECT_EQ(snapshot(m), before) << "a refused call changed the manager";
      EXPECT_EQ(m.group_index("no_decay"), 1u);
      // Not while an overlapped step's final backward runs: its chunks use the values.
      m.begin_step(1e-3f, true);
      m.set_hyperparameters(0, {2e-3, 0.1});  // before the final backward: accepted
      m.begin_backward(true);
      expect_error(
          [&] {
            m.set_hyperparameters(0, {3e-3, 0.1});
          },
          Errc::invalid_argument, "set_hyperparameters");
      m.finish_backward();
      expect_error(
          [&] {
            m.set_hyperparameters(0, {3e-3, 0.1});
          },
          Errc::invalid_argument, "set_hyperparameters");
      m.step();
      m.set_hyperparameters(0, {3e-3, 0.1});
      EXPECT_EQ(m.group(0).lr, 3e-3);
    }
}

TEST(TrainerApi, ImportParameterRefusesBadStateAndChangesNothing) {
  for (OffloadMode mode : kModes) {
    SCOPED_TRACE(offload_mode_name(mode));
    Stepped t(mode);
    GradientManager& m = *t.m;
    const auto before = snapshot(m);
    const std::size_t n = m.config().params[3].numel;
    std::vector<float> ok(n, 0.25f), short_(n - 1, 0.25f), nan(n, 0.25f), neg(n, 0.25f);
    nan[n / 2] = std::numeric_limits<float>::quiet_NaN();
    neg[n - 1] = -1e-30f;
    expect_error([&] { m.import_parameter(8, ok, ok, ok, 1.0f); }, Errc::out_of_range, "i");
    expect_error([&] { m.import_parameter(3, short_, ok, ok, 1.0f); }, Errc::size_mismatch,
                 "master");
    expect_error([&] { m.import_parameter(3, ok, short_, ok, 1.0f); }, Errc::size_mismatch,
                 "exp_avg");
    expect_error([&] { m.import_parameter(3, ok, ok, {}, 1.0f); }, Errc::size_mismatch,
                 "exp_avg_sq");
    expect_error([&] { m.import_parameter(3, nan, ok, ok, 1.0f); }, Errc::non_finite, "master");
    expect_error([&] { m.import_parameter(3, ok, nan, ok, 1.0f); }, Errc::non_finite, "exp_avg");
    expect_error([&] { m.import_parameter(3, ok, ok, neg, 1.0f); }, Errc::invalid_argument,
                 "exp_avg_sq");
    for (float step : {-1.0f, 1.5f, 16777218.0f})
      expect_error([&] { m.import_parameter(3, ok, ok, ok, step); }, Errc::out_of_range, "step");
    expect_error([&] { m.import_parameter(3, ok, ok, ok, NAN); }, Errc::non_finite, "step");
    EXPECT_EQ(snapshot(m), before) << "a refused import changed the manager";
    m.begin_step(1e-3f, false);
    expect_error([&] { m.import_parameter(3, ok, ok, ok, 1.0f); }, Errc::invalid_argument,
                 "import_parameter");
    expect_error([&] { (void)m.step_count(3); }, Errc::invalid_argument, "step_count");
    expect_error([&] { (void)m.host_state(3); }, Errc::invalid_argument, "host_state");
    m.begin_backward(true);
    m.finish_backward();
    m.step();
  }
  Stepped sgd(OffloadMode::full, SignSgdConfig{});
  const std::size_t n = sgd.m->config().params[3].numel;
  const std::vector<float> ok(n, 0.25f);
  expect_error([&] { sgd.m->import_parameter(3, ok, ok, ok, 0.0f); }, Errc::invalid_argument,
               "state");
  expect_error([&] { sgd.m->import_parameter(3, ok, {}, {}, 1.0f); }, Errc::invalid_argument,
               "step");
}

// State by slot name, for an optimizer whose slots are not AdamW's (SGD with momentum, in
// mode full): each slot exactly once, by its name; a missing, repeated or unknown name is
// refused naming "state" (with the slot names), nothing changed; the slot reads back by
// name, in host_state too; Adagrad's sum starts at its initial accumulator value.
TEST(TrainerApi, StateSlotsAreImportedAndReadByName) {
  auto dev = device::make_host_device();
  ManagerConfig cfg = config_of(OffloadMode::full, *dev);
  SgdConfig sgd;
  sgd.momentum = 0.9;
  cfg.optimizer = sgd;
  auto m = make_gradient_manager(cfg);
  ASSERT_EQ(m->state_slot_names(), (std::vector<std::string_view>{"momentum_buffer"}));
  const std::size_t n = cfg.params[3].numel;
  std::vector<float> master(n, 0.5f), buf(n);
  for (std::size_t j = 0; j < n; ++j) buf[j] = -0.001f * static_cast<float>(j);
  m->load_parameter(3, master);
  const auto before = snapshot(*m);
  const std::vector<float> ok(n, 0.25f);
  for (const std::vector<SlotIn>& bad :
       {std::vector<SlotIn>{}, std::vector<SlotIn>{{"exp_avg", ok}},
        std::vector<SlotIn>{{"momentum_buffer", ok}, {"momentum_buffer", ok}},
        std::vector<SlotIn>{{"momentum_buffer", ok}, {"sum", ok}}}) {
    try {
      m->import_parameter(3, master, bad, 2.0f);
      ADD_FAILURE() << "accepted " << bad.size() << " slots";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_EQ(e.argument(), "state");
      EXPECT_NE(std::string(e.what()).find("momentum_buffer"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(snapshot(*m), before) << "a refused import changed the manager";
  m->import_parameter(3, master, std::vector<SlotIn>{{"momentum_buffer", buf}}, 2.0f);
  std::vector<float> got(n);
  m->read_parameter(3, {}, std::vector<SlotOut>{{"momentum_buffer", got}}, {});
  EXPECT_EQ(0, std::memcmp(got.data(), buf.data(), n * 4));
  const GradientManager::HostState h = m->host_state(3);
  ASSERT_EQ(h.slots.size(), 1u);
  EXPECT_EQ(h.slots[0].name, "momentum_buffer");
  EXPECT_EQ(0, std::memcmp(h.slot("momentum_buffer").data(), buf.data(), n * 4));
  EXPECT_TRUE(h.slot("exp_avg").empty());
  EXPECT_EQ(m->step_count(3), 2.0f);
  expect_error(
      [&] {
        m->read_parameter(3, {}, std::vector<SlotOut>{{"sum", got}}, {});
      },
      Errc::invalid_argument, "state");
  m->close();
  // Adagrad: load_parameter starts the sum at f32(initial_accumulator_value).
  AdagradConfig adagrad;
  adagrad.initial_accumulator_value = 0.3;
  cfg.optimizer = adagrad;
  auto a = make_gradient_manager(cfg);
  ASSERT_EQ(a->state_slot_names(), (std::vector<std::string_view>{"sum"}));
  a->load_parameter(3, master);
  a->read_parameter(3, {}, std::vector<SlotOut>{{"sum", got}}, {});
  for (float x : got)
    EXPECT_EQ(std::bit_cast<std::uint32_t>(x), std::bit_cast<std::uint32_t>(0.3f));
  a->close();
}

TEST(TrainerApi, ImportedStateReadsBackAndHostStateViewsIt) {
  for (OffloadMode mode : kModes) {
    SCOPED_TRACE(offload_mode_name(mode));
    Stepped t(mode);
    GradientManager& m = *t.m;
    const ParamSpec& p = m.config().params[3];
    std::vector<float> master(p.numel), ea(p.numel), eas(p.numel);
    for (std::size_t j = 0; j < p.numel; ++j) {
      master[j] = -0.0f + 0.001f * static_cast<float>(j);
      ea[j] = j % 2 ? -0.0f : 1e-40f;  // a signed zero and a subnormal survive
      eas[j] = 1e-3f * static_cast<float>(j);
    }
    m.import_parameter(3, master, ea, eas, 17.0f);
    std::vector<float> gm(p.numel), gea(p.numel), geas(p.numel);
    std::vector<std::uint8_t> compute(p.numel * 2);
    m.read_parameter(3, gm, gea, geas, compute);
    EXPECT_EQ(0, std::memcmp(gm.data(), master.data(), p.numel * 4));
    EXPECT_EQ(0, std::memcmp(gea.data(), ea.data(), p.numel * 4));
    EXPECT_EQ(0, std::memcmp(geas.data(), eas.data(), p.numel * 4));
    EXPECT_EQ(compute, manager_model::rounded(master, DType::bf16));
    EXPECT_EQ(m.step_count(3), 17.0f);
    const GradientManager::HostState h = m.host_state(3);
    if (mode == OffloadMode::none) {
      EXPECT_TRUE(h.master.empty() && h.slot("exp_avg").empty())
          << "mode none keeps state on the device";
    } else {
      ASSERT_EQ(h.master.size(), p.numel);
      EXPECT_EQ(0, std::memcmp(h.master.data(), master.data(), p.numel * 4));
      ASSERT_EQ(h.slots.size(), 2u);
      EXPECT_EQ(h.slots[1].name, "exp_avg_sq");
      EXPECT_EQ(0, std::memcmp(h.slot("exp_avg_sq").data(), eas.data(), p.numel * 4));
    }
  }
}

TEST(TrainerApi, CallerGradientsAreValidatedBeforeTheyAreRead) {
  for (OffloadMode mode : kModes) {
    SCOPED_TRACE(offload_mode_name(mode));
    Stepped t(mode);
    GradientManager& m = *t.m;
    device::Device& dev = *t.dev;
    const std::size_t n = m.config().params[3].numel;  // bf16
    void* buf = dev.allocate(n * 2 + 16);
    const ConstTensorView ok(buf, n, DType::bf16);
    const auto before = snapshot(m);
    expect_error([&] { m.gradient_ready(3, ok); }, Errc::invalid_argument, "gradient_ready");
    m.begin_step(1e-3f, false);
    m.begin_backward(true);
    expect_error([&] { m.gradient_ready(3, ConstTensorView(buf, n, DType::f32)); },
                 Errc::unsupported_dtype, "grad");
    expect_error([&] { m.gradient_ready(3, ConstTensorView(buf, n + 1, DType::bf16)); },
                 Errc::size_mismatch, "grad");
    expect_error([&] { m.gradient_ready(3, ConstTensorView(nullptr, n, DType::bf16)); },
                 Errc::null_pointer, "grad");
    expect_error(
        [&] { m.gradient_ready(3, ConstTensorView(static_cast<char*>(buf) + 1, n, DType::bf16)); },
        Errc::invalid_argument, "grad");
    expect_error([&] { m.gradient_ready(9, ok); }, Errc::out_of_range, "i");
    dev.zero(device::Queue::compute, buf, n * 2);
    m.gradient_ready(3, ok);
    expect_error([&] { m.gradient_ready(3, ok); }, Errc::invalid_argument, "gradient_ready");
    m.finish_backward();
    m.step();
    (void)m.report();
    dev.synchronize();
    dev.deallocate(buf);
    EXPECT_NE(snapshot(m), before) << "the accepted gradient stepped";
  }
}

TEST(TrainerApi, TheConfigurationsNewPartsAreValidatedBeforeAnythingIsAllocated) {
  auto dev = make_device();
  auto base = [&] { return config_of(OffloadMode::none, *dev); };
  void* mem = dev->allocate(1 << 16);
  const TensorView dest{mem, 33, DType::bf16};  // parameter 0's size
  std::vector<std::uint16_t> host_dest(33);     // host memory, not the device's
  for (OffloadMode mode : kModes) {
    SCOPED_TRACE(offload_mode_name(mode));
    auto refused = [&](auto&& spoil, Errc code, const test_support::ArgumentNames& arg) {
      ManagerConfig cfg = base();
      cfg.mode = mode;
      spoil(cfg);
      expect_error([&] { (void)make_gradient_manager(cfg); }, code, arg);
    };
    refused([](ManagerConfig& c) { c.params[6].group = 2; }, Errc::out_of_range, "params[6].group");
    refused([](ManagerConfig& c) { c.groups[1].name = "decay"; }, Errc::invalid_argument,
            "groups[1].name");
    refused([](ManagerConfig& c) { c.groups[0].name.clear(); }, Errc::invalid_argument,
            "groups[0].name");
    refused([](ManagerConfig& c) { c.groups[1].lr = -1.0; }, Errc::invalid_argument,
            "groups[1].lr");
    refused([](ManagerConfig& c) { c.groups[0].beta2 = 1.0; }, Errc::invalid_argument,
            "groups[0].beta2");
    refused([](ManagerConfig& c) { c.groups[1].eps = NAN; }, Errc::non_finite, "groups[1].eps");
    refused([](ManagerConfig& c) { c.groups.clear(); }, Errc::out_of_range, "params[1].group");
    refused(
        [](ManagerConfig& c) {
          std::get<AdamWConfig>(c.optimizer).formula = static_cast<AdamWFormula>(7);
        },
        Errc::invalid_argument, "optimizer.adamw.formula");
    refused([](ManagerConfig& c) { c.params[4].name = "p2"; }, Errc::invalid_argument,
            "params[4].name");
    refused(
        [&](ManagerConfig& c) {
          c.params[0].compute_into = {mem, 32, DType::bf16};
        },
        Errc::size_mismatch, "params[0].compute_into");
    refused(
        [&](ManagerConfig& c) {
          c.params[0].compute_into = {mem, 33, DType::f32};
        },
        Errc::unsupported_dtype, "params[0].compute_into");
    refused(
        [&](ManagerConfig& c) {
          c.params[0].compute_into = {nullptr, 33, DType::bf16};
        },
        Errc::null_pointer, "params[0].compute_into");
    refused(
        [&](ManagerConfig& c) {
          c.params[0].compute_into = {static_cast<char*>(mem) + 1, 33, DType::bf16};
        },
        Errc::invalid_argument, "params[0].compute_into");
    refused(
        [&](ManagerConfig& c) {
          c.params[0].compute_into = dest;
          c.params[0].has_compute_weights = false;
        },
        Errc::invalid_argument, "params[0].compute_into");
    refused(
        [&](ManagerConfig& c) {
          c.params[0].compute_into = dest;
          c.params[1].compute_into = {static_cast<char*>(mem) + 64, 1, DType::bf16};
        },
        Errc::overlap, {"params[0].compute_into", "params[1].compute_into"});
    // Modes none and optimizer: the step's kernels write the destinations, so memory the
    // device's kernels may not use (here host memory) is refused at construction.
    if (mode != OffloadMode::full)
      refused(
          [&](ManagerConfig& c) {
            c.params[0].compute_into = {host_dest.data(), 33, DType::bf16};
          },
          Errc::invalid_argument, "params[0].compute_into");
    // Without the manager's buffer, gradient(i) and gradient_ready(i) say what to do.
    ManagerConfig cfg = base();
    cfg.mode = mode;
    cfg.params[3].gradient_buffer = false;
    auto m = make_gradient_manager(cfg);
    m->begin_step(1.0f, false);
    m->begin_backward(true);
    expect_error([&] { (void)m->gradient(3); }, Errc::invalid_argument, "gradient");
    expect_error([&] { m->gradient_ready(3); }, Errc::invalid_argument, "gradient_ready");
    m->close();
  }
  dev->deallocate(mem);
}

// ---- checkpoints and resume -----------------------------------------------------------

// A fresh temporary directory, removed with everything in it at the end.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string templ = (std::filesystem::temp_directory_path() / "stepcore-ckpt-XXXXXX").string();
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = templ;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// Runs steps [first, first + count) of the case through a manager built by `b`, which
// first loads `load` (when given) and finally saves to `save` (when given).
std::vector<StepRecord> run_span(const Build& b, const Case& c, int first, int count,
                                 const std::string& load, const std::string& save) {
  auto dev = make_device();
  auto m = make_manager(b, c, *dev);
  if (!load.empty()) m->load_checkpoint(load);
  auto rec = run_stream(*m, *dev, stream_options(c, b.offsets, first, count));
  if (!save.empty()) m->save_checkpoint(save);
  m->close();
  return rec;
}

std::vector<StepRecord> slice(const std::vector<StepRecord>& r, std::size_t first, std::size_t n) {
  return {r.begin() + static_cast<std::ptrdiff_t>(first),
          r.begin() + static_cast<std::ptrdiff_t>(first + n)};
}

TEST(TrainerApi, AResumedRunEqualsTheUninterruptedOneInAnyModeThreadCountAndIsa) {
  for (OptimizerConfig opt : std::vector<OptimizerConfig>{AdamWConfig{}, SignSgdConfig{}})
    for (bool overlap : {false, true}) {
      Case c{DType::bf16, opt, overlap ? std::optional<float>{} : std::optional<float>{0.05f},
             Flow::rl, overlap};
      c.schedule = true;
      c.steps = 10;
      SCOPED_TRACE(c.label());
      const auto want = run_reference(c);  // 10 steps uninterrupted
      struct Pair {
        const char* what;
        Build saver, loader;
      };
      std::vector<Pair> pairs = {
          {"full -> none", build_of(OffloadMode::full), build_of(OffloadMode::none)},
          {"none -> optimizer", build_of(OffloadMode::none), build_of(OffloadMode::optimizer)},
          {"optimizer -> full", build_of(OffloadMode::optimizer), build_of(OffloadMode::full)},
          {"none lazy -> none", build_of(OffloadMode::none, 2, {}, true),
           build_of(OffloadMode::none)},
      };
      // Another thread count and every other ISA this processor runs (full offload's engine).
      const std::vector<cpu::Isa> isas = stepcore::testing_support::isas_under_test();
      for (cpu::Isa isa : isas)
        pairs.push_back({"full baseline ISA 1 thread -> full (2 threads, another ISA)",
                         build_of(OffloadMode::full, 1, stepcore::testing_support::baseline_isa()),
                         build_of(OffloadMode::full, 2, isa)});
      TempDir dir;
      for (const Pair& p : pairs) {
        SCOPED_TRACE(p.what);
        const std::string path = dir.file("rank-00000.stepcore");
        expect_same(run_span(p.saver, c, 0, 5, "", path), slice(want, 0, 5), "before the save");
        expect_same(run_span(p.loader, c, 5, 5, path, ""), slice(want, 5, 5), "resumed");
        if (HasFatalFailure()) return;
      }
    }
}

TEST(TrainerApi, ShardedRanksResumeFromTheirOwnFiles) {
  Case c{DType::bf16, AdamWConfig{}, 0.05f, Flow::sft, false};
  c.schedule = true;
  c.steps = 8;
  const std::vector<StreamParam> model = stream_model(c.grad_dtype);
  const Sharding sh = shard_model(model, 2);
  const auto want = run_reference(c, &sh);
  TempDir dir;
  for (bool resume : {false, true}) {
    std::vector<std::vector<StepRecord>> got(2);
    const auto errors = test_support::on_ranks(2, [&](int r, comm::Communicator& comm) {
      const auto ru = static_cast<std::size_t>(r);
      Build b = build_of(resume ? OffloadMode::optimizer : OffloadMode::full);
      b.comm = &comm;
      b.shard = &sh.shards[ru];
      b.offsets = &sh.offsets[ru];
      const std::string path = dir.file("rank-" + std::to_string(r) + ".stepcore");
      got[ru] = resume ? run_span(b, c, 4, 4, path, "") : run_span(b, c, 0, 4, "", path);
    });
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
      expect_shard_of(got[static_cast<std::size_t>(r)], slice(want, resume ? 4 : 0, 4), model, sh,
                      r, 2);
    }
  }
  // Rank 1's file is not rank 0's: its rank (and its sizes) differ.
  auto dev = make_device();
  Build b = build_of(OffloadMode::none);
  b.shard = &sh.shards[0];
  b.offsets = &sh.offsets[0];
  auto m = make_manager(b, c, *dev);
  try {
    m->load_checkpoint(dir.file("rank-1.stepcore"));
    ADD_FAILURE() << "another rank's checkpoint was loaded";
  } catch (const Error& e) {
    EXPECT_NE(e.argument().find("checkpoint."), std::string::npos) << e.what();
  }
  m->close();
}

// Expects load_checkpoint(path) to throw `code` naming an argument that contains `arg`,
// and the manager to be exactly as before.
void expect_refused_load(GradientManager& m, const std::string& path, Errc code,
                         const std::string& arg) {
  const auto before = snapshot(m);
  try {
    m.load_checkpoint(path);
    ADD_FAILURE() << "loaded; expected " << errc_name(code) << " naming " << arg;
  } catch (const Error& e) {
    EXPECT_EQ(errc_name(e.code()), errc_name(code)) << e.what();
    EXPECT_NE(e.argument().find(arg), std::string::npos)
        << "argument '" << e.argument() << "', expected one naming " << arg << ": " << e.what();
  }
  EXPECT_EQ(snapshot(m), before) << "a refused checkpoint changed the manager";
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_file(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

TEST(TrainerApi, ACheckpointThatDisagreesIsRefusedWithNothingLoaded) {
  TempDir dir;
  const std::string good = dir.file("good.stepcore");
  {
    Stepped t(OffloadMode::full);
    t.m->save_checkpoint(good);
  }
  const std::vector<char> bytes = read_file(good);
  ASSERT_GT(bytes.size(), 4096u);
  for (OffloadMode mode : kModes) {
    SCOPED_TRACE(offload_mode_name(mode));
    // A manager fresh from its initial masters: anything loaded would show.
    Case c{DType::bf16, AdamWConfig{}, 0.05f, Flow::sft, false};
    auto dev = make_device();
    auto fresh = make_manager(build_of(mode), c, *dev);
    GradientManager& m = *fresh;
    const std::string bad = dir.file("bad.stepcore");
    std::vector<char> b = bytes;
    b.resize(b.size() - 1);
    write_file(bad, b);
    expect_refused_load(m, bad, Errc::corrupt_file, "path");
    b = bytes;
    b[b.size() - 3] ^= 0x10;  // a payload byte
    write_file(bad, b);
    expect_refused_load(m, bad, Errc::corrupt_file, "path");
    expect_refused_load(m, dir.file("missing.stepcore"), Errc::io_error, "path");
    // Other managers: a renamed parameter, other sizes, another optimizer, other groups.
    auto refused_by = [&](auto&& spoil, Errc code, const std::string& arg) {
      ManagerConfig cfg = config_of(mode, *dev);  // make_manager's, but for the spoil
      spoil(cfg);
      auto other = make_gradient_manager(cfg);
      expect_refused_load(*other, good, code, arg);
      other->close();
    };
    refused_by([](ManagerConfig& cfg) { cfg.params[3].name = "p3.weight"; }, Errc::invalid_argument,
               "params[3].name");
    refused_by([](ManagerConfig& cfg) { cfg.params[4].numel += 1; }, Errc::size_mismatch,
               "params[4].numel");
    refused_by([](ManagerConfig& cfg) { cfg.optimizer = optimizer_of(SignSgdConfig{}); },
               Errc::invalid_argument, "optimizer");
    refused_by([](ManagerConfig& cfg) { cfg.groups[1].name = "norms"; }, Errc::invalid_argument,
               "groups[1].name");
    refused_by([](ManagerConfig& cfg) { cfg.groups[0].beta2 = 0.95; }, Errc::invalid_argument,
               "groups[0].beta2");
    refused_by([](ManagerConfig& cfg) { cfg.params.pop_back(); }, Errc::size_mismatch, "params");
    refused_by([](ManagerConfig& cfg) { cfg.layout_fingerprint = 7; }, Errc::invalid_argument,
               "layout_fingerprint");
    // The good file loads into every mode's manager, and so does its state.
    m.load_checkpoint(good);
    fresh->close();
  }
}

TEST(TrainerApi, ValuesAManagerCannotContinueFromAreRefusedAtLoad) {
  // A structurally valid file (written by the format's own writer, checksums right) whose
  // values are not a state: a NaN master, a negative second moment, a fractional step.
  Case c{DType::bf16, AdamWConfig{}, 0.05f, Flow::sft, false};
  TempDir dir;
  const std::string good = dir.file("good.stepcore");
  {
    Stepped t(OffloadMode::none);
    t.m->save_checkpoint(good);
  }
  const checkpoint::File f = checkpoint::File::open(good);
  constexpr std::size_t kStep = 99;  // not an array
  struct Spoil {
    const char* arg;
    Errc code;
    std::size_t array;  // 0 master, 1 exp_avg, 2 exp_avg_sq, kStep: the step counter
    float value;
  };
  const Spoil spoils[] = {
      {"checkpoint.params[3].master", Errc::non_finite, 0, NAN},
      {"checkpoint.params[3].exp_avg", Errc::non_finite, 1, INFINITY},
      {"checkpoint.params[3].exp_avg_sq", Errc::invalid_argument, 2, -1.0f},
      {"checkpoint.params[3].step", Errc::invalid_argument, kStep, 2.5f},
  };
  for (const Spoil& sp : spoils) {
    checkpoint::Header h = f.header();
    std::vector<float> spoiled(f.array(3, sp.array == kStep ? 0 : sp.array).begin(),
                               f.array(3, sp.array == kStep ? 0 : sp.array).end());
    if (sp.array == kStep)
      h.params[3].step = sp.value;
    else
      spoiled[7] = sp.value;
    const std::string bad = dir.file("bad.stepcore");
    checkpoint::save(bad, h, [&](std::size_t i, std::size_t a) -> std::span<const std::byte> {
      return i == 3 && a == sp.array ? std::as_bytes(std::span<const float>(spoiled))
                                     : f.bytes(i, a);
    });
    for (OffloadMode mode : kModes) {
      auto dev = make_device();
      auto m = make_manager(build_of(mode), c, *dev);
      expect_refused_load(*m, bad, sp.code, sp.arg);
      m->close();
    }
  }
}

TEST(TrainerApi, SaveAndLoadOnlyBetweenSteps) {
  TempDir dir;
  Stepped t(OffloadMode::full);
  GradientManager& m = *t.m;
  expect_error([&] { m.save_checkpoint(""); }, Errc::invalid_argument, "path");
  expect_error([&] { m.load_checkpoint(""); }, Errc::invalid_argument, "path");
  expect_error([&] { m.save_checkpoint(dir.file("no/such/dir/x.stepcore")); }, Errc::io_error,
               "path");
  m.begin_step(1e-3f, false);
  expect_error([&] { m.save_checkpoint(dir.file("x.stepcore")); }, Errc::invalid_argument,
               "save_checkpoint");
  expect_error([&] { m.load_checkpoint(dir.file("x.stepcore")); }, Errc::invalid_argument,
               "load_checkpoint");
  EXPECT_FALSE(std::filesystem::exists(dir.file("x.stepcore")));
  m.begin_backward(true);
  m.finish_backward();
  m.step();
}

TEST(TrainerApi, ASaveKilledBeforeItsRenameLeavesThePreviousCheckpointLoadable) {
  namespace faults = checkpoint::testing;
  TempDir dir;
  const std::string path = dir.file("rank-00000.stepcore");
  for (OffloadMode mode : kModes) {
    SCOPED_TRACE(offload_mode_name(mode));
    Stepped t(mode);
    GradientManager& m = *t.m;
    m.save_checkpoint(path);
    const auto saved = snapshot(m);
    // One more step, then saves that fail the ways a disk and a kill do.
    Case c{DType::bf16, AdamWConfig{}, 0.05f, Flow::sft, false};
    (void)run_stream(m, *t.dev, stream_options(c, nullptr, 2, 1));
    ASSERT_NE(snapshot(m), saved);
    for (faults::SaveFaultKind kind :
         {faults::SaveFaultKind::crash_before_rename, faults::SaveFaultKind::fsync_fails,
          faults::SaveFaultKind::disk_full_after}) {
      const faults::ScopedSaveFault fault(kind, 1000);
      expect_error([&] { m.save_checkpoint(path); }, Errc::io_error, "path");
    }
    auto dev = make_device();
    auto fresh = make_manager(build_of(mode), c, *dev);
    fresh->load_checkpoint(path);
    EXPECT_EQ(snapshot(*fresh), saved) << "the previous checkpoint did not survive";
    m.save_checkpoint(path);  // the manager is not failed by a failed save
    const auto now = snapshot(m);
    fresh->load_checkpoint(path);
    EXPECT_EQ(snapshot(*fresh), now);
    fresh->close();
  }
}

}  // namespace
