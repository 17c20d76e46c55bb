// The generic GPU path of every optimizer unit on the CPU executor (gpu::emulate) and the
// host device (Device::optimizer_step), no GPU needed: every unit and option against the
// reference (the oracle, reference/) bit for bit after every step of 10, with lr and
// weight decay changed between steps through "device memory" (a schedule) and one plan
// built once and replayed (a captured graph); gradient dtypes f32/bf16/f16, compute
// copies, in place and out of place, aligned and misaligned, several launch shapes and
// thread counts, boundary sizes, found-inf skips; bad input refused by name before
// anything is written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "core/optimizers/all.hpp"
#include "expect_error.hpp"
#include "kernels/checked_plans.hpp"
#include "kernels/plans.hpp"
#include "kernels/testing.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/reference.hpp"

namespace {

// memcmp/memcpy with a null pointer are undefined even for zero bytes, and an empty
// tensor's vector has no storage: these two skip the call then.
bool same_bytes(const void* a, const void* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}
void copy_bytes(void* to, const void* from, std::size_t n) {
  if (n != 0) std::memcpy(to, from, n);
}

using namespace stepcore;
using ::stepcore::detail::UnitForConfig;
using test_support::expect_error;

// ---- the cases: every unit and option --------------------------------------------------

struct Case {
  std::string name;
  OptimizerConfig config;
};

std::vector<Case> all_cases() {
  std::vector<Case> c;
  auto adamw = [](AdamWFormula f, bool amsgrad, bool maximize, double wd, int tail = 8) {
    AdamWConfig a;
    a.formula = f;
    a.amsgrad = amsgrad;
    a.maximize = maximize;
    a.weight_decay = wd;
    a.torch_tail_width = tail;
    a.lr = 2e-3;
    return a;
  };
  c.push_back({"adamw native", adamw(AdamWFormula::native, false, false, 0.02)});
  c.push_back({"adamw torch", adamw(AdamWFormula::torch, false, false, 0.02)});
  c.push_back({"adamw torch wd 0", adamw(AdamWFormula::torch, false, false, 0.0)});
  c.push_back({"adamw torch tail 16", adamw(AdamWFormula::torch, false, false, 0.02, 16)});
  c.push_back({"adamw amsgrad", adamw(AdamWFormula::torch, true, false, 0.02)});
  c.push_back({"adamw maximize", adamw(AdamWFormula::torch, false, true, 0.02)});
  c.push_back({"adamw amsgrad maximize", adamw(AdamWFormula::torch, true, true, 0.02)});
  auto adam = [](bool amsgrad, bool maximize, double wd) {
    AdamConfig a;
    a.lr = 3e-3;
    a.amsgrad = amsgrad;
    a.maximize = maximize;
    a.weight_decay = wd;
    a.beta1 = 0.8;
    a.beta2 = 0.99;
    return a;
  };
  c.push_back({"adam", adam(false, false, 0.0)});
  c.push_back({"adam amsgrad", adam(true, false, 0.0)});
  c.push_back({"adam maximize", adam(false, true, 0.0)});
  c.push_back({"adam weight decay", adam(false, false, 0.1)});
  c.push_back({"adam amsgrad maximize weight decay", adam(true, true, 0.05)});
  auto sgd = [](double mom, double damp, bool nesterov, double wd, bool maximize) {
    SgdConfig s;
    s.lr = 0.05;
    s.momentum = mom;
    s.dampening = damp;
    s.nesterov = nesterov;
    s.weight_decay = wd;
    s.maximize = maximize;
    return s;
  };
  c.push_back({"sgd momentum 0", sgd(0.0, 0.0, false, 0.0, false)});
  c.push_back({"sgd momentum 0 wd maximize", sgd(0.0, 0.0, false, 0.01, true)});
  c.push_back({"sgd momentum", sgd(0.9, 0.0, false, 0.0, false)});
  c.push_back({"sgd momentum dampening", sgd(0.9, 0.1, false, 0.0, false)});
  c.push_back({"sgd nesterov", sgd(0.9, 0.0, true, 0.01, false)});
  c.push_back({"sgd momentum wd maximize", sgd(0.5, 0.2, false, 0.02, true)});
  auto adagrad = [](double lr_decay, double wd, double init, double eps, bool maximize) {
    AdagradConfig a;
    a.lr = 0.02;
    a.lr_decay = lr_decay;
    a.weight_decay = wd;
    a.initial_accumulator_value = init;
    a.eps = eps;
    a.maximize = maximize;
    return a;
  };
  c.push_back({"adagrad", adagrad(0.0, 0.0, 0.0, 1e-10, false)});
  c.push_back({"adagrad lr_decay", adagrad(0.01, 0.0, 0.0, 1e-10, false)});
  c.push_back({"adagrad weight decay", adagrad(0.0, 0.1, 0.0, 1e-10, false)});
  c.push_back({"adagrad initial accumulator", adagrad(0.0, 0.0, 0.5, 1e-10, false)});
  c.push_back({"adagrad eps", adagrad(0.0, 0.0, 0.0, 1e-6, false)});
  c.push_back({"adagrad lr_decay wd maximize", adagrad(0.05, 0.01, 0.1, 1e-8, true)});
  SignSgdConfig s;
  s.lr = 1e-3;
  c.push_back({"sign_sgd", s});
  s.weight_decay = 0.1;
  c.push_back({"sign_sgd weight decay", s});
  auto lion = [](double beta1, double beta2, double wd) {
    LionConfig l;
    l.lr = 3e-3;
    l.beta1 = beta1;
    l.beta2 = beta2;
    l.weight_decay = wd;
    return l;
  };
  c.push_back({"lion", lion(0.9, 0.99, 0.0)});
  c.push_back({"lion weight decay", lion(0.9, 0.99, 0.1)});
  c.push_back({"lion betas", lion(0.95, 0.98, 0.01)});
  return c;
}

/// The slots the case's unit uses, and whether it counts steps.
struct Shape {
  int slots;
  bool counts;
};
Shape unit_shape(const OptimizerConfig& config) {
  return std::visit(
      [](const auto& c) {
        using Opt =
            typename UnitForConfig<std::decay_t<decltype(c)>, ::stepcore::detail::AllUnits>::type;
        return Shape{Opt::slots(Opt::variant(c)), Opt::kCountsSteps};
      },
      config);
}

/// `config` with lr and weight decay replaced (what the schedule writes to device memory).
OptimizerConfig with_hyper(OptimizerConfig config, const StepHyper& h) {
  std::visit(
      [&](auto& c) {
        c.lr = h.lr;
        c.weight_decay = h.weight_decay;
      },
      config);
  return config;
}

/// One reference step (the oracle) of `config`'s optimizer on OptimizerTensors.
void reference_step(std::span<const OptimizerTensor> t, const OptimizerConfig& config,
                    GradientRead read) {
  reference::optimizer_step(t, config, read);
}

// ---- the model: tensors in host memory standing for device memory ---------------------

/// Tensors of one optimizer: f32 parameters and state, step counters, gradients of one
/// dtype and optional compute copies, each array `offset` elements into its buffer (1:
/// misaligned, the one-element path). Copies re-point nothing: views are built on use.
struct Model {
  std::vector<std::size_t> sizes;
  std::size_t offset = 0;
  DType grad_dtype = DType::f32;
  int out_kind = 0;  // 0: no compute copy, else 1 + DType
  int slots = 0;
  bool counts = true;
  std::vector<std::vector<float>> p, st[kMaxOptimizerSlots];
  std::vector<std::vector<std::uint8_t>> g, o;
  std::vector<float> steps;

  std::vector<OptimizerTensor> tensors() {
    std::vector<OptimizerTensor> t(sizes.size());
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t n = sizes[k];
      t[k].param = {p[k].data() + offset, n, DType::f32};
      for (int s = 0; s < slots; ++s) t[k].state[s] = {st[s][k].data() + offset, n, DType::f32};
      t[k].step = counts ? &steps[k] : nullptr;
      t[k].grad = {g[k].data() + offset * dtype_size(grad_dtype), n, grad_dtype};
      if (out_kind != 0) {
        const DType od = static_cast<DType>(out_kind - 1);
        t[k].compute_param = {o[k].data() + offset * dtype_size(od), n, od};
      }
    }
    return t;
  }
};

/// A gradient element of dtype d with value x (rounded), as bytes at index i.
void put(std::vector<std::uint8_t>& b, DType d, std::size_t i, float x) {
  if (d == DType::f32) {
    std::memcpy(b.data() + 4 * i, &x, 4);
  } else {
    const std::uint16_t h = d == DType::bf16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
    std::memcpy(b.data() + 2 * i, &h, 2);
  }
}

Model make_model(const OptimizerConfig& config, const std::vector<std::size_t>& sizes,
                 std::size_t offset, DType grad_dtype, int out_kind, std::uint32_t seed) {
  Model m;
  m.sizes = sizes;
  m.offset = offset;
  m.grad_dtype = grad_dtype;
  m.out_kind = out_kind;
  const Shape shape = unit_shape(config);
  m.slots = shape.slots;
  m.counts = shape.counts;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const double init = std::holds_alternative<AdagradConfig>(config)
                          ? std::get<AdagradConfig>(config).initial_accumulator_value
                          : 0.0;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    const std::size_t n = sizes[k] + offset;
    m.p.emplace_back(n);
    for (auto& v : m.p.back()) v = nd(rng) * 0.1f;
    for (int s = 0; s < kMaxOptimizerSlots; ++s) {
      m.st[s].emplace_back(n);
      // Slot 0 signed (exp_avg, momentum_buffer), the rest non-negative (second
      // moments, Adagrad's sum starting at initial_accumulator_value).
      for (auto& v : m.st[s].back())
        v = s == 0 && init == 0.0 ? nd(rng) * 0.01f
                                  : static_cast<float>(init) + std::fabs(nd(rng)) * 1e-4f;
    }
    m.g.emplace_back(n * 4);
    for (std::size_t i = 0; i < n; ++i) {
      const float x = i % 11 == 3 ? 0.0f : i % 13 == 5 ? -0.0f : nd(rng);  // signs of zero
      put(m.g.back(), grad_dtype, i, x);
    }
    m.o.emplace_back(n * 4, std::uint8_t{0xA5});
    // Counters at 0 (a fresh optimizer) and further along (a resumed one).
    m.steps.push_back(k % 3 == 2 ? 5.0f : 0.0f);
  }
  return m;
}

/// Fresh gradients for the next step (a new backward pass).
void new_gradients(Model& a, Model& b, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::size_t k = 0; k < a.sizes.size(); ++k)
    for (std::size_t i = 0; i < a.sizes[k] + a.offset; ++i) {
      const float x = i % 17 == 2 ? 0.0f : nd(rng);
      put(a.g[k], a.grad_dtype, i, x);
      put(b.g[k], b.grad_dtype, i, x);
    }
}

/// Every array of `got` equals `want`'s bit for bit (compute copies where written).
::testing::AssertionResult same_bits(const Model& got, const Model& want) {
  for (std::size_t k = 0; k < got.sizes.size(); ++k) {
    const std::size_t n = got.sizes[k] + got.offset;
    if (!same_bytes(got.p[k].data(), want.p[k].data(), 4 * n))
      return ::testing::AssertionFailure() << "param of tensor " << k;
    for (int s = 0; s < kMaxOptimizerSlots; ++s)
      if (!same_bytes(got.st[s][k].data(), want.st[s][k].data(), 4 * n))
        return ::testing::AssertionFailure() << "state " << s << " of tensor " << k;
    if (got.o[k] != want.o[k]) return ::testing::AssertionFailure() << "compute of tensor " << k;
    if (std::memcmp(&got.steps[k], &want.steps[k], 4) != 0)
      return ::testing::AssertionFailure() << "counter of tensor " << k;
  }
  return ::testing::AssertionSuccess();
}

/// Copies every value of `from` into `to`'s buffers (same shapes; the buffers stay put,
/// so tensors and plans over them stay valid).
void assign(Model& to, const Model& from) {
  for (std::size_t k = 0; k < to.sizes.size(); ++k) {
    to.p[k] = from.p[k];
    for (int s = 0; s < kMaxOptimizerSlots; ++s) to.st[s][k] = from.st[s][k];
    to.g[k] = from.g[k];
    to.o[k] = from.o[k];
  }
  to.steps = from.steps;
}

/// The out-of-place tensors of `m` (destinations) reading from `src` (sources; a model of
/// the same shapes).
std::vector<OptimizerTensor> out_of_place(Model& m, Model& src) {
  std::vector<OptimizerTensor> dst = m.tensors(), from = src.tensors();
  for (std::size_t k = 0; k < dst.size(); ++k) {
    dst[k].param_src = from[k].param;
    for (int s = 0; s < m.slots; ++s) dst[k].state_src[s] = from[k].state[s];
  }
  return dst;
}

/// Before an out-of-place step: the sources take the current values, the destinations
/// NaNs (a read of one would show).
void refresh_sources(Model& m, Model& src) {
  assign(src, m);
  for (std::size_t k = 0; k < m.sizes.size(); ++k) {
    const std::size_t b = m.offset, e = m.offset + m.sizes[k];  // the tensor's elements
    for (std::size_t i = b; i < e; ++i) m.p[k][i] = std::nanf("");
    for (int s = 0; s < m.slots; ++s)
      for (std::size_t i = b; i < e; ++i) m.st[s][k][i] = std::nanf("");
  }
}

/// The schedule's lr and weight decay of step `s` (what a trainer writes to device
/// memory before each step or replay), scaled from the configuration's.
StepHyper schedule(const OptimizerConfig& config, int s) {
  const double factors[] = {1.0, 0.5, 1.7, 0.25, 1.0, 3.0, 0.8, 1.3, 0.1, 2.0};
  return std::visit(
      [&](const auto& c) {
        return StepHyper{c.lr * factors[s], c.weight_decay * factors[(s + 3) % 10]};
      },
      config);
}

constexpr int kSteps = 10;
constexpr int kSkippedStep = 4;  // found-inf: nothing written, counters kept

struct LaunchShape {
  int max_blocks;
  int max_tensors;
  int threads;
};

/// Runs 10 steps of `c` on the executor with one plan built once (replayed each step)
/// against the reference, comparing every array after every step.
void run_replayed(const Case& c, const std::vector<std::size_t>& sizes, std::size_t offset,
                  DType gd, int out_kind, bool in_place, const LaunchShape& shape) {
  SCOPED_TRACE(c.name + " grad " + std::to_string(static_cast<int>(gd)) + " out " +
               std::to_string(out_kind) + (in_place ? " in place" : " out of place") + " offset " +
               std::to_string(offset) + " shape " + std::to_string(shape.max_blocks) + "/" +
               std::to_string(shape.max_tensors) + "/" + std::to_string(shape.threads));
  Model got = make_model(c.config, sizes, offset, gd, out_kind, 7);
  Model ref = got;
  Model src = got;  // the sources of an out-of-place step (buffers of their own)
  const std::vector<double> table = gpu::make_optimizer_table(c.config);
  // "Device memory" the replays read when they run.
  float scale = 1.0f, clip = 1.0f;
  std::int32_t found_inf = 0;
  StepHyper hyper{};
  OptimizerDeviceArgs d;
  d.scale = &scale;
  d.clip = &clip;
  d.found_inf = &found_inf;
  d.hyper = &hyper;
  d.table = table.empty() ? nullptr : table.data();
  // One plan (out of place: over the source and destination buffers), built once.
  std::vector<OptimizerTensor> gt = in_place ? got.tensors() : out_of_place(got, src);
  std::visit(
      [&](const auto& cfg) {
        using Opt =
            typename UnitForConfig<std::decay_t<decltype(cfg)>, ::stepcore::detail::AllUnits>::type;
        const gpu::OptimizerPlan<Opt> plan =
            gpu::make_optimizer_plan<Opt>(gt, cfg, shape.max_blocks, shape.max_tensors);
        for (int s = 0; s < kSteps; ++s) {
          new_gradients(got, ref, 100 + static_cast<std::uint32_t>(s));
          if (!in_place) refresh_sources(got, src);
          scale = s % 3 == 0 ? 1.0f : 1.0f / static_cast<float>(3 + s);
          clip = s % 2 == 0 ? 1.0f : 0.75f;
          hyper = schedule(c.config, s);
          found_inf = s == kSkippedStep ? 1 : 0;
          const Model before = in_place ? got : src;
          gpu::emulate::optimizer_step(plan, d, shape.threads);
          if (found_inf != 0) {
            // Nothing written: in place, every array as it was; out of place, the
            // sources untouched and the (poisoned) destinations too.
            if (in_place) {
              ASSERT_TRUE(same_bits(got, before)) << "step " << s << " skipped";
            } else {
              ASSERT_TRUE(same_bits(src, before)) << "step " << s << " skipped";
              assign(got, src);  // the next step's sources are the same values
            }
            continue;
          }
          std::vector<OptimizerTensor> rt = ref.tensors();
          reference_step(rt, with_hyper(c.config, hyper), GradientRead{scale, clip});
          if (!in_place) ASSERT_TRUE(same_bits(src, before)) << "sources left intact, step " << s;
          ASSERT_TRUE(same_bits(got, ref)) << "step " << s;
        }
      },
      c.config);
}

std::vector<std::size_t> small_sizes() { return {0, 1, 7, 8, 9, 31, 32, 33, 1023, 1024, 1025}; }

TEST(GpuUnits, EveryUnitAndOptionEqualsTheReferenceAfterEveryStepOfAReplayedPlan) {
  const LaunchShape shapes[] = {
      {gpu::kMaxOptimizerBlocksPerLaunch, gpu::kMaxOptimizerTensorsPerLaunch, 256},
      {3, 2, 64},
      {1, 1, 32}};
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
  for (const Case& c : all_cases())
    for (int di = 0; di < 3; ++di)
      for (int si = 0; si < 3; ++si)
        for (bool in_place : {true, false}) {
          // Every compute-copy kind (none, f32, bf16, f16) across the combinations, and
          // both the aligned (16-byte groups) and misaligned (one element) paths.
          const int out_kind = (di + si + (in_place ? 0 : 2)) % 4;
          const std::size_t offset = (si + di) % 2;
          run_replayed(c, small_sizes(), offset, dtypes[di], out_kind, in_place, shapes[si]);
          if (::testing::Test::HasFatalFailure()) return;
        }
}

// Tensors of several blocks (a chunk +- 1) spanning launches: a tensor continues into
// the next launch, which takes its counter and table row again.
TEST(GpuUnits, TensorsOfManyBlocksSpanningLaunchesEqualTheReference) {
  const std::size_t c = gpu::kBlockElements;
  const std::vector<std::size_t> sizes{c - 1, c + 1, 1};
  for (const Case& k : all_cases()) {
    run_replayed(k, sizes, 0, DType::bf16, 1 + static_cast<int>(DType::bf16), true, {2, 2, 256});
    if (::testing::Test::HasFatalFailure()) return;
    run_replayed(k, sizes, 1, DType::f32, 0, false, {1, 3, 128});
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// ---- the device entry point ---------------------------------------------------------------

/// The host device's Device::optimizer_step with every input in its allocated memory
/// (the stand-in GPU refuses anything else), under lowered launch limits: 10 steps of
/// every case against the reference, the schedule and the found-inf flag written to
/// device memory between steps.
TEST(GpuUnits, HostDeviceOptimizerStepEqualsTheReferenceForEveryUnit) {
  const gpu::testing::ScopedPlanCache cache(true);  // the cached path, after the first step
  for (int limits = 0; limits < 2; ++limits) {
    std::unique_ptr<gpu::testing::ScopedLaunchLimits> lim;
    if (limits == 1) lim = std::make_unique<gpu::testing::ScopedLaunchLimits>(2, 2);
    auto dev = device::make_host_device(64);
    for (const Case& c : all_cases()) {
      SCOPED_TRACE(c.name + (limits ? " lowered limits" : ""));
      const std::vector<std::size_t> sizes{33, 0, 1025, gpu::kBlockElements + 9, 8};
      Model ref = make_model(c.config, sizes, 0, DType::bf16, 1 + static_cast<int>(DType::f16), 3);
      // The device's copy: every array in its memory.
      std::vector<void*> owned;
      auto up = [&](const void* p, std::size_t bytes) {
        void* d = dev->allocate(bytes == 0 ? 4 : bytes);
        copy_bytes(d, p, bytes);
        owned.push_back(d);
        return d;
      };
      std::vector<OptimizerTensor> host_t = ref.tensors(), dev_t(host_t.size());
      for (std::size_t k = 0; k < host_t.size(); ++k) {
        const OptimizerTensor& h = host_t[k];
        OptimizerTensor& t = dev_t[k];
        t.param = {up(h.param.data, h.param.bytes()), h.param.numel, h.param.dtype};
        for (int s = 0; s < kMaxOptimizerSlots; ++s)
          if (h.state[s].data != nullptr)
            t.state[s] = {up(h.state[s].data, h.state[s].bytes()), h.state[s].numel, DType::f32};
        if (h.step != nullptr) t.step = static_cast<float*>(up(h.step, 4));
        t.grad = {up(h.grad.data, h.grad.bytes()), h.grad.numel, h.grad.dtype};
        t.compute_param = {up(h.compute_param.data, h.compute_param.bytes()), h.compute_param.numel,
                           h.compute_param.dtype};
      }
      const std::vector<double> table = gpu::make_optimizer_table(c.config);
      auto* d_scale = static_cast<float*>(dev->allocate(4));
      auto* d_clip = static_cast<float*>(dev->allocate(4));
      auto* d_flag = static_cast<std::int32_t*>(dev->allocate(4));
      auto* d_hyper = static_cast<StepHyper*>(dev->allocate(sizeof(StepHyper)));
      double* d_table =
          table.empty() ? nullptr : static_cast<double*>(up(table.data(), 8 * table.size()));
      OptimizerDeviceArgs d;
      d.scale = d_scale;
      d.clip = d_clip;
      d.found_inf = d_flag;
      d.hyper = d_hyper;
      d.table = d_table;
      for (int s = 0; s < kSteps; ++s) {
        // A new backward pass: fresh gradients on both sides.
        std::mt19937 rng(50 + static_cast<std::uint32_t>(s));
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (std::size_t k = 0; k < sizes.size(); ++k)
          for (std::size_t i = 0; i < sizes[k]; ++i) put(ref.g[k], ref.grad_dtype, i, nd(rng));
        for (std::size_t k = 0; k < sizes.size(); ++k)
          copy_bytes(const_cast<void*>(dev_t[k].grad.data), ref.g[k].data(),
                     host_t[k].grad.bytes());
        *d_scale = 1.0f / static_cast<float>(1 + s);
        *d_clip = s == 3 ? 0.5f : 1.0f;
        *d_hyper = schedule(c.config, s);
        *d_flag = s == kSkippedStep ? 1 : 0;
        dev->optimizer_step(dev_t, c.config, d);
        dev->synchronize();
        if (s != kSkippedStep) {
          std::vector<OptimizerTensor> rt = ref.tensors();
          reference_step(rt, with_hyper(c.config, *d_hyper), GradientRead{*d_scale, *d_clip});
        }
        for (std::size_t k = 0; k < sizes.size(); ++k) {
          const OptimizerTensor& h = host_t[k];
          const OptimizerTensor& t = dev_t[k];
          ASSERT_TRUE(same_bytes(t.param.data, h.param.data, h.param.bytes()))
              << "step " << s << " param " << k;
          for (int sl = 0; sl < kMaxOptimizerSlots; ++sl)
            if (h.state[sl].data != nullptr)
              ASSERT_TRUE(same_bytes(t.state[sl].data, h.state[sl].data, h.state[sl].bytes()))
                  << "step " << s << " state " << sl << " of " << k;
          ASSERT_TRUE(
              same_bytes(t.compute_param.data, h.compute_param.data, h.compute_param.bytes()))
              << "step " << s << " compute " << k;
          if (h.step != nullptr) ASSERT_EQ(*t.step, *h.step) << "step " << s << " counter " << k;
        }
      }
      for (void* p : owned) dev->deallocate(p);
      for (void* p : {static_cast<void*>(d_scale), static_cast<void*>(d_clip),
                      static_cast<void*>(d_flag), static_cast<void*>(d_hyper)})
        dev->deallocate(p);
    }
  }
}

// ---- the tables ----------------------------------------------------------------------------

// AdamW's and Adam's tables are their bias corrections, entry for entry the host's
// 1 - beta^t (the C library's pow in binary64, the formula's betas), 1 past each column's
// end; the others need none.
TEST(GpuUnits, TablesHoldWhatTheHostComputesAndOnlyWhereNeeded) {
  AdamConfig adam;
  adam.beta1 = 0.5;
  adam.beta2 = 0.9;
  const std::vector<double> t = gpu::make_optimizer_table(adam);
  ASSERT_GE(t.size(), 2u);
  const auto len1 = static_cast<std::size_t>(t[0]), len2 = static_cast<std::size_t>(t[1]);
  ASSERT_EQ(t.size(), 2 + len1 + len2);
  for (std::size_t s = 1; s <= len1 + len2 + 10; ++s) {
    const double bc1 = 1.0 - std::pow(0.5, static_cast<double>(s));
    const double bc2 = 1.0 - std::pow(0.9, static_cast<double>(s));
    ASSERT_EQ(s <= len1 ? t[2 + s - 1] : 1.0, bc1) << s;
    ASSERT_EQ(s <= len2 ? t[2 + len1 + s - 1] : 1.0, bc2) << s;
  }
  AdamWConfig ams;  // amsgrad takes the same bias corrections
  ams.amsgrad = true;
  EXPECT_EQ(gpu::make_optimizer_table(ams), gpu::make_optimizer_table(AdamWConfig{}));
  EXPECT_TRUE(gpu::make_optimizer_table(SgdConfig{}).empty());
  EXPECT_TRUE(gpu::make_optimizer_table(AdagradConfig{}).empty());
  EXPECT_TRUE(gpu::make_optimizer_table(SignSgdConfig{}).empty());
  // A beta this close to 1 would need more than 2^22 rows: refused by name.
  adam.beta2 = 1.0 - 1e-7;
  expect_error([&] { (void)gpu::make_optimizer_table(adam); }, Errc::not_supported, "config.beta2");
  adam.beta2 = 1.5;
  expect_error([&] { (void)gpu::make_optimizer_table(adam); }, Errc::invalid_argument,
               "config.beta2");
}

// ---- bad input ------------------------------------------------------------------------------

/// A bad hyper-parameter of each unit, the field it must be named by.
struct BadConfig {
  OptimizerConfig config;
  const char* field;
};

std::vector<BadConfig> bad_configs() {
  std::vector<BadConfig> b;
  AdamWConfig w;
  w.eps = -1.0;
  b.push_back({w, "config.eps"});
  w = AdamWConfig{};
  w.formula = AdamWFormula::native;
  w.amsgrad = true;
  b.push_back({w, "config.amsgrad"});
  AdamConfig a;
  a.beta1 = 1.0;
  b.push_back({a, "config.beta1"});
  a = AdamConfig{};
  a.weight_decay = -0.5;
  b.push_back({a, "config.weight_decay"});
  SgdConfig s;
  s.momentum = 0.0;
  s.nesterov = true;
  b.push_back({s, "config.nesterov"});
  s = SgdConfig{};
  s.lr = std::nan("");
  b.push_back({s, "config.lr"});
  AdagradConfig g;
  g.lr_decay = -1.0;
  b.push_back({g, "config.lr_decay"});
  g = AdagradConfig{};
  g.initial_accumulator_value = -1.0;
  b.push_back({g, "config.initial_accumulator_value"});
  SignSgdConfig sg;
  sg.weight_decay = -1.0;
  b.push_back({sg, "config.weight_decay"});
  return b;
}

/// Returns the error the call raised, or a failure when it raised none.
template <class F>
Error caught(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no error";
  return Error(Errc::internal, "", "");
}

TEST(GpuUnits, ABadConfigurationIsNamedBeforeAnythingIsWritten) {
  auto dev = device::make_host_device(32, device::HostDeviceMemory::any_host_memory);
  for (const BadConfig& b : bad_configs()) {
    SCOPED_TRACE(b.field);
    // Tensors valid for the unit's good configuration (the slots it would use).
    Model m = make_model(b.config, {5, 9}, 0, DType::f32, 0, 1);
    m.slots = 3;  // enough slots for every variant; extra ones are refused after config
    const Model before = m;
    std::vector<OptimizerTensor> t = m.tensors();
    float one = 1.0f;
    const double table[2] = {0.0, 0.0};
    OptimizerDeviceArgs d;
    d.scale = d.clip = &one;
    d.table = table;
    const Error e = caught([&] { dev->optimizer_step(t, b.config, d); });
    EXPECT_EQ(e.argument(), b.field) << e.what();
    EXPECT_TRUE(same_bits(m, before));
    // The plan builder names it too.
    std::visit(
        [&](const auto& c) {
          using Opt =
              typename UnitForConfig<std::decay_t<decltype(c)>, ::stepcore::detail::AllUnits>::type;
          const Error p = caught([&] { (void)gpu::make_optimizer_plan<Opt>(t, c); });
          EXPECT_EQ(p.argument(), b.field) << p.what();
          const Error q = caught([&] { (void)gpu::make_optimizer_table(c); });
          EXPECT_EQ(q.argument(), b.field) << q.what();
        },
        b.config);
  }
}

// The device inputs each unit needs, named when missing; the device-memory refusals of
// the stand-in GPU (a host pointer where device memory is needed) named too; nothing
// written either way.
TEST(GpuUnits, MissingOrHostDeviceInputsAreNamed) {
  auto dev = device::make_host_device(32);  // allocated memory only, as a GPU
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(c.name);
    Model m = make_model(c.config, {5}, 0, DType::f32, 0, 1);
    const Model before = m;
    std::vector<OptimizerTensor> host_t = m.tensors();
    const Shape shape = unit_shape(c.config);
    const bool table_needed = !gpu::make_optimizer_table(c.config).empty();
    const bool reads_scaled = !std::holds_alternative<SignSgdConfig>(c.config);
    auto* d_scale = static_cast<float*>(dev->allocate(4));
    auto* d_table = static_cast<double*>(dev->allocate(64));
    *d_scale = 1.0f;
    OptimizerDeviceArgs d;
    d.scale = d.clip = d_scale;
    d.table = d_table;
    // Host tensors on the stand-in GPU: the first array is refused by name.
    const Error host = caught([&] { dev->optimizer_step(host_t, c.config, d); });
    EXPECT_EQ(host.argument(), shape.counts ? "tensors[0].step" : "tensors[0].param")
        << host.what();
    EXPECT_TRUE(same_bits(m, before));
    if (reads_scaled) {
      OptimizerDeviceArgs n = d;
      n.clip = nullptr;
      expect_error([&] { dev->optimizer_step(host_t, c.config, n); }, Errc::null_pointer, "d.clip");
    }
    if (table_needed) {
      OptimizerDeviceArgs n = d;
      n.table = nullptr;
      expect_error([&] { dev->optimizer_step(host_t, c.config, n); }, Errc::null_pointer,
                   "d.table");
    }
    // A device input in host memory.
    float host_scale = 1.0f;
    OptimizerDeviceArgs h = d;
    h.found_inf = reinterpret_cast<const std::int32_t*>(&host_scale);
    const std::vector<OptimizerTensor> none;  // no tensors: only d is checked
    expect_error([&] { dev->optimizer_step(none, c.config, h); }, Errc::invalid_argument,
                 "d.found_inf");
    EXPECT_TRUE(same_bits(m, before));
    dev->deallocate(d_scale);
    dev->deallocate(d_table);
  }
}

// A state slot the variant does not use, and a counter on a unit that counts none, are
// refused by the unit's checker (validate_unit) naming the array.
TEST(GpuUnits, SlotsAndCountersAreCheckedByTheUnitsChecker) {
  std::vector<float> p(4), s(4), g(4);
  float step = 0.0f;
  OptimizerTensor t;
  t.param = {p.data(), 4, DType::f32};
  t.grad = {g.data(), 4, DType::f32};
  t.state[0] = {s.data(), 4, DType::f32};
  t.step = &step;
  const std::vector<OptimizerTensor> ts{t};
  // SGD without momentum keeps no buffer.
  expect_error([&] { (void)gpu::make_optimizer_plan<::stepcore::detail::Sgd>(ts, SgdConfig{}); },
               Errc::invalid_argument, "tensors[0].state[0]");
  // SignSGD keeps no counter.
  OptimizerTensor u = t;
  u.state[0] = {};
  const std::vector<OptimizerTensor> us{u};
  expect_error(
      [&] { (void)gpu::make_optimizer_plan<::stepcore::detail::SignSgd>(us, SignSgdConfig{}); },
      Errc::invalid_argument, "tensors[0].step");
  // AdamW amsgrad needs max_exp_avg_sq.
  AdamWConfig ams;
  ams.amsgrad = true;
  OptimizerTensor w = t;
  std::vector<float> v(4);
  w.state[1] = {v.data(), 4, DType::f32};
  const std::vector<OptimizerTensor> ws{w};
  expect_error([&] { (void)gpu::make_optimizer_plan<::stepcore::detail::AdamW>(ws, ams); },
               Errc::size_mismatch, "tensors[0].max_exp_avg_sq");
}

// The cache of validated calls keys a generic call by its tensors, the configuration's
// variant and the device inputs, not by the rest of the configuration: a repeated call
// with other hyper-parameters gets a plan carrying them, a bad one is still refused, and
// another variant (other slots) is validated again.
TEST(GpuUnits, ACachedPlanTakesEachCallsConfiguration) {
  const gpu::testing::ScopedPlanCache on(true);
  std::vector<float> mem(5 * 64);
  float step = 0.0f, one = 1.0f;
  const double table[2] = {0.0, 0.0};
  OptimizerTensor t;
  t.param = {mem.data(), 64, DType::f32};
  t.state[0] = {mem.data() + 64, 64, DType::f32};
  t.state[1] = {mem.data() + 128, 64, DType::f32};
  t.step = &step;
  t.grad = {mem.data() + 192, 64, DType::f32};
  const std::vector<OptimizerTensor> ts{t};
  OptimizerDeviceArgs d;
  d.scale = d.clip = &one;
  d.table = table;
  std::size_t checks = 0;
  const gpu::detail::MemoryCheck check = [&](const void*, std::size_t, const detail::Arg&) {
    ++checks;
  };
  using ::stepcore::detail::AdamW;
  AdamWConfig c;
  const auto first = gpu::detail::checked_optimizer_plan<AdamW>(ts, c, d, check);
  const std::size_t per_call = checks;
  c.lr = 0.125;
  c.beta2 = 0.5;
  c.torch_tail_width = 16;
  const auto again = gpu::detail::checked_optimizer_plan<AdamW>(ts, c, d, check);
  EXPECT_EQ(checks, per_call) << "served from the cache";
  ASSERT_EQ(again.launches.size(), 1u);
  EXPECT_EQ(again.launches[0].config.lr, 0.125);
  EXPECT_EQ(again.launches[0].config.beta2, 0.5);
  EXPECT_EQ(again.launches[0].config.torch_tail_width, 16);
  EXPECT_EQ(first.launches[0].config.lr, AdamWConfig{}.lr);
  c.eps = -1.0;
  expect_error([&] { (void)gpu::detail::checked_optimizer_plan<AdamW>(ts, c, d, check); },
               Errc::invalid_argument, "config.eps");
  c.eps = 1e-8;
  c.amsgrad = true;  // three slots: the tensors lack max_exp_avg_sq
  expect_error([&] { (void)gpu::detail::checked_optimizer_plan<AdamW>(ts, c, d, check); },
               Errc::size_mismatch, "tensors[0].max_exp_avg_sq");
}

}  // namespace
