// The optimizer x surface matrix: every optimizer unit of the library's table (AllUnits,
// core/optimizers/all.hpp), in every C++ entry point that steps an optimizer, equals the
// reference (stepcore::reference, the oracle) bit for bit. The rows are generated from the
// table — one typed test suite instantiated for each unit, named by the unit — and the
// columns are the surfaces, one test each: the CPU engine on every ISA and two thread
// counts, the CUDA kernels' block bodies on the CPU executor, the host device, the
// gradient managers in modes none (eager and lazy scale), optimizer and full, with and
// without optimizer overlap, and a checkpoint resumed across every pair of modes. Each
// cell runs the unit's own sample configurations (Unit::kSamples: one per formula and
// variant). A unit that a surface refuses, lacks or computes differently fails its cell,
// so a new optimizer cannot be left out of one place. The Python surfaces (the drop-ins
// and stepcore.torch.GradientManager) have the same matrix in python/tests, generated
// from stepcore.optimizers().
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "core/optimizers/all.hpp"
#include "isa_list.hpp"
#include "kernels/plans.hpp"
#include "managers_cases.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/device.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"

namespace {

using namespace stepcore;
using ::stepcore::detail::AllUnits;
using ::stepcore::detail::UnitList;

// ---- the rows: the table's units as gtest types ------------------------------------------

template <class List>
struct GtestTypes;
template <class... Units>
struct GtestTypes<UnitList<Units...>> {
  using type = ::testing::Types<Units...>;
};

/// Names each row by its unit ("adamw", "lion", ...).
struct UnitName {
  template <class Unit>
  static std::string GetName(int) {
    return Unit::kName;
  }
};

/// The unit's own sample configurations (Unit::kSamples: one per formula and variant).
template <class Unit>
std::vector<typename Unit::Config> configs_of() {
  std::vector<typename Unit::Config> out;
  for (const auto& sample : Unit::kSamples) out.push_back(sample.config);
  return out;
}

/// A short label of configuration k of the unit, for failure messages.
template <class Unit>
std::string label(std::size_t k) {
  return std::string(Unit::kName) + " sample " + std::to_string(k);
}

// ---- tensors: one optimizer's arrays in host memory ----------------------------------------

/// An element of dtype d holding x (rounded to nearest even), stored at index i.
void put(std::vector<std::uint8_t>& b, DType d, std::size_t i, float x) {
  if (d == DType::f32) {
    std::memcpy(b.data() + 4 * i, &x, 4);
  } else {
    const std::uint16_t h = d == DType::bf16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
    std::memcpy(b.data() + 2 * i, &h, 2);
  }
}

/// The arrays of one optimizer over tensors of `sizes`: the parameter and every slot the
/// configuration uses in `param_dtype`, f32 step counters, gradients of `grad_dtype`, an
/// optional compute copy (out_kind 0: none, else 1 + its DType).
struct Arrays {
  std::vector<std::size_t> sizes;
  DType param_dtype = DType::f32, grad_dtype = DType::f32;
  int out_kind = 0;
  int slots = 0;
  bool counts = false;
  std::vector<std::vector<std::uint8_t>> p, st[kMaxOptimizerSlots], g, o;
  std::vector<float> steps;

  std::vector<OptimizerTensor> tensors() {
    std::vector<OptimizerTensor> t(sizes.size());
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t n = sizes[k];
      t[k].param = {p[k].data(), n, param_dtype};
      for (int s = 0; s < slots; ++s) t[k].state[s] = {st[s][k].data(), n, param_dtype};
      t[k].step = counts ? &steps[k] : nullptr;
      t[k].grad = {g[k].data(), n, grad_dtype};
      if (out_kind != 0) t[k].compute_param = {o[k].data(), n, static_cast<DType>(out_kind - 1)};
    }
    return t;
  }
  bool operator==(const Arrays& b) const {
    for (int s = 0; s < kMaxOptimizerSlots; ++s)
      if (st[s] != b.st[s]) return false;
    return p == b.p && o == b.o && std::memcmp(steps.data(), b.steps.data(), 4 * steps.size()) == 0;
  }
};

/// The value slot s of `config` starts from, as the unit declares it (a fresh optimizer's
/// state: Adagrad's sum at f32(initial_accumulator_value)), else +0.
template <class Unit>
float initial_slot(const typename Unit::Config& config, int s) {
  return stepcore::detail::unit_initial_slot<Unit>(config, s);
}

/// The arrays of `config` (unit Unit): parameters from a normal draw with signed zeros,
/// every slot at the unit's initial value (a fresh optimizer), counters at 0 and, for every
/// third tensor, 5 (a resumed one).
template <class Unit>
Arrays make_arrays(const typename Unit::Config& config, const std::vector<std::size_t>& sizes,
                   DType param_dtype, DType grad_dtype, int out_kind) {
  Arrays a;
  a.sizes = sizes;
  a.param_dtype = param_dtype;
  a.grad_dtype = grad_dtype;
  a.out_kind = out_kind;
  a.slots = Unit::slots(Unit::variant(config));
  a.counts = Unit::kCountsSteps;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  const std::size_t ps = dtype_size(param_dtype);
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    const std::size_t n = sizes[k];
    a.p.emplace_back(n * ps + 1);
    for (std::size_t i = 0; i < n; ++i)
      put(a.p.back(), param_dtype, i, i % 9 == 4 ? (i % 2 ? -0.0f : 0.0f) : nd(rng));
    for (int s = 0; s < kMaxOptimizerSlots; ++s) {
      a.st[s].emplace_back(n * ps + 1);
      const float init = s < a.slots ? initial_slot<Unit>(config, s) : 0.0f;
      for (std::size_t i = 0; i < n; ++i) put(a.st[s].back(), param_dtype, i, init);
    }
    a.g.emplace_back(n * 4 + 1);
    a.o.emplace_back(n * 4 + 1, std::uint8_t{0xA5});
    a.steps.push_back(k % 3 == 2 ? 5.0f : 0.0f);
  }
  return a;
}

/// Fresh gradients of step `step` (a new backward pass), the same in every Arrays given.
void new_gradients(std::initializer_list<Arrays*> all, int step) {
  std::mt19937 rng(1000 + static_cast<std::uint32_t>(step));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const Arrays& first = **all.begin();
  for (std::size_t k = 0; k < first.sizes.size(); ++k)
    for (std::size_t i = 0; i < first.sizes[k]; ++i) {
      const float x = i % 11 == 3 ? 0.0f : i % 13 == 5 ? -0.0f : nd(rng);
      for (Arrays* a : all) put(a->g[k], a->grad_dtype, i, x);
    }
}

/// The gradient read of step s: the step's scale (1 / loss tokens) and a clip on odd steps.
GradientRead read_of(int s) {
  return GradientRead{1.0f / static_cast<float>(17 + 5 * s), s % 2 == 1 ? 0.625f : 1.0f};
}

/// `config` with step s's lr and weight decay (a schedule).
template <class Config>
Config scheduled(Config c, int s) {
  const double f[] = {1.0, 0.5, 1.5, 0.25};
  c.lr *= f[s % 4];
  c.weight_decay *= f[(s + 1) % 4];
  return c;
}

constexpr int kSteps = 3;

/// Tensor sizes at every boundary the fast paths branch on: empty, one element, around the
/// vector widths and torch's tails, and around the CPU engine's work chunk.
std::vector<std::size_t> boundary_sizes() {
  const std::size_t c = cpu::Engine::kWorkChunkElements;
  return {0, 1, 31, 32, 33, 1023, 1024, 1025, c - 1, c + 1};
}

template <class Unit>
class OptimizerMatrix : public ::testing::Test {};
TYPED_TEST_SUITE(OptimizerMatrix, typename GtestTypes<AllUnits>::type, UnitName);

// ---- the table itself ---------------------------------------------------------------------

// The rows are the whole table: one unit for each OptimizerConfig alternative, each named
// once, each with sample configurations its own checker accepts.
TEST(OptimizerMatrixRows, EveryAlternativeOfTheConfigurationIsARow) {
  std::set<std::string> names;
  std::size_t rows = 0;
  AllUnits::for_each([&](auto unit) {
    using Unit = decltype(unit);
    ++rows;
    EXPECT_TRUE(names.insert(Unit::kName).second) << Unit::kName << " twice";
    EXPECT_FALSE(configs_of<Unit>().empty()) << Unit::kName << " has no sample configuration";
    for (const auto& c : configs_of<Unit>()) EXPECT_NO_THROW(Unit::validate(c, GradientRead{}));
  });
  EXPECT_EQ(rows, std::variant_size_v<OptimizerConfig>);
}

// ---- column: the CPU engine -----------------------------------------------------------------

// Every ISA this processor runs, 1 and 3 threads; parameters (and state) in f32, bf16 and
// f16; gradients in every dtype; f32 parameters with a compute copy of each dtype.
TYPED_TEST(OptimizerMatrix, CpuEngineOnEveryIsaAndThreadCount) {
  using Unit = TypeParam;
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
  for (const cpu::Isa isa : testing_support::isas_under_test())
    for (const int threads : {1, 3}) {
      cpu::EngineConfig ec;
      ec.isa = isa;
      ec.threads = threads;
      const cpu::Engine engine(ec);
      const auto configs = configs_of<Unit>();
      for (std::size_t k = 0; k < configs.size(); ++k)
        for (int pd = 0; pd < 3; ++pd)
          for (int gd = 0; gd < 3; ++gd) {
            // A compute copy only for f32 parameters; each kind across the combinations.
            const int out_kind = pd == 0 ? (gd + static_cast<int>(k)) % 4 : 0;
            SCOPED_TRACE(label<Unit>(k) + " isa " + std::string(cpu::isa_name(isa)) + " threads " +
                         std::to_string(threads) + " param " + std::string(dtype_name(dtypes[pd])) +
                         " grad " + std::string(dtype_name(dtypes[gd])) + " out " +
                         std::to_string(out_kind));
            Arrays got =
                make_arrays<Unit>(configs[k], boundary_sizes(), dtypes[pd], dtypes[gd], out_kind);
            Arrays want = got;
            for (int s = 0; s < kSteps; ++s) {
              new_gradients({&got, &want}, s);
              const auto c = scheduled(configs[k], s);
              const auto wt = want.tensors();
              reference::optimizer_step(wt, OptimizerConfig{c}, read_of(s));
              const auto gt = got.tensors();
              engine.step(std::span<const OptimizerTensor>(gt), c, read_of(s));
              ASSERT_TRUE(got == want) << "step " << s;
            }
          }
    }
}

// ---- column: the CUDA kernels' block bodies on the CPU executor -----------------------------

// One plan built once and replayed each step (a captured graph), every per-step value in
// "device memory" read when the bodies run; the default launch shape and a small one.
TYPED_TEST(OptimizerMatrix, KernelBlockBodiesOnTheExecutor) {
  using Unit = TypeParam;
  const auto configs = configs_of<Unit>();
  const std::vector<std::size_t> sizes{0, 1, 33, 1025, gpu::kBlockElements + 1};
  for (std::size_t k = 0; k < configs.size(); ++k)
    for (const int shape : {0, 1}) {
      SCOPED_TRACE(label<Unit>(k) + (shape == 0 ? " default launches" : " small launches"));
      Arrays got = make_arrays<Unit>(configs[k], sizes, DType::f32, DType::bf16,
                                     1 + static_cast<int>(DType::bf16));
      Arrays want = got;
      const std::vector<double> table = gpu::make_optimizer_table(OptimizerConfig{configs[k]});
      float scale = 1.0f, clip = 1.0f;
      std::int32_t found_inf = 0;
      StepHyper hyper{};
      OptimizerDeviceArgs d;
      d.scale = &scale;
      d.clip = &clip;
      d.found_inf = &found_inf;
      d.hyper = &hyper;
      d.table = table.empty() ? nullptr : table.data();
      const auto gt = got.tensors();
      const gpu::OptimizerPlan<Unit> plan =
          shape == 0 ? gpu::make_optimizer_plan<Unit>(gt, configs[k])
                     : gpu::make_optimizer_plan<Unit>(gt, configs[k], 2, 2);
      for (int s = 0; s < kSteps; ++s) {
        new_gradients({&got, &want}, s);
        const auto c = scheduled(configs[k], s);
        scale = read_of(s).scale;
        clip = read_of(s).clip;
        hyper = StepHyper{c.lr, c.weight_decay};
        gpu::emulate::optimizer_step(plan, d, shape == 0 ? 256 : 32);
        const auto wt = want.tensors();
        reference::optimizer_step(wt, OptimizerConfig{c}, read_of(s));
        ASSERT_TRUE(got == want) << "step " << s;
      }
    }
}

// ---- column: the host device -----------------------------------------------------------------

// Device::optimizer_step on the host device (the CPU stand-in for a GPU), every array and
// per-step value in its allocated memory.
TYPED_TEST(OptimizerMatrix, HostDeviceOptimizerStep) {
  using Unit = TypeParam;
  auto dev = device::make_host_device(64);
  const auto configs = configs_of<Unit>();
  const std::vector<std::size_t> sizes{33, 0, 1025, gpu::kBlockElements + 9};
  for (std::size_t k = 0; k < configs.size(); ++k) {
    SCOPED_TRACE(label<Unit>(k));
    Arrays want = make_arrays<Unit>(configs[k], sizes, DType::f32, DType::f16,
                                    1 + static_cast<int>(DType::bf16));
    std::vector<void*> owned;
    auto up = [&](const void* p, std::size_t bytes) {
      void* x = dev->allocate(bytes == 0 ? 4 : bytes);
      if (bytes != 0) std::memcpy(x, p, bytes);
      owned.push_back(x);
      return x;
    };
    const std::vector<OptimizerTensor> host = want.tensors();
    std::vector<OptimizerTensor> on_dev(host.size());
    for (std::size_t t = 0; t < host.size(); ++t) {
      const OptimizerTensor& h = host[t];
      OptimizerTensor& x = on_dev[t];
      x.param = {up(h.param.data, h.param.bytes()), h.param.numel, h.param.dtype};
      for (int s = 0; s < kMaxOptimizerSlots; ++s)
        if (h.state[s].data != nullptr)
          x.state[s] = {up(h.state[s].data, h.state[s].bytes()), h.state[s].numel, DType::f32};
      if (h.step != nullptr) x.step = static_cast<float*>(up(h.step, 4));
      x.grad = {up(h.grad.data, h.grad.bytes()), h.grad.numel, h.grad.dtype};
      x.compute_param = {up(h.compute_param.data, h.compute_param.bytes()), h.compute_param.numel,
                         h.compute_param.dtype};
    }
    const std::vector<double> table = gpu::make_optimizer_table(OptimizerConfig{configs[k]});
    auto* d_scale = static_cast<float*>(up(nullptr, 0));
    auto* d_clip = static_cast<float*>(up(nullptr, 0));
    auto* d_flag = static_cast<std::int32_t*>(up(nullptr, 0));
    auto* d_hyper = static_cast<StepHyper*>(dev->allocate(sizeof(StepHyper)));
    owned.push_back(d_hyper);
    OptimizerDeviceArgs d;
    d.scale = d_scale;
    d.clip = d_clip;
    d.found_inf = d_flag;
    d.hyper = d_hyper;
    d.table = table.empty() ? nullptr : static_cast<double*>(up(table.data(), 8 * table.size()));
    for (int s = 0; s < kSteps; ++s) {
      Arrays& w = want;
      new_gradients({&w}, s);
      for (std::size_t t = 0; t < host.size(); ++t)
        if (host[t].grad.numel != 0)
          std::memcpy(const_cast<void*>(on_dev[t].grad.data), w.g[t].data(), host[t].grad.bytes());
      const auto c = scheduled(configs[k], s);
      *d_scale = read_of(s).scale;
      *d_clip = read_of(s).clip;
      *d_hyper = StepHyper{c.lr, c.weight_decay};
      *d_flag = 0;
      dev->optimizer_step(on_dev, OptimizerConfig{configs[k]}, d);
      dev->synchronize();
      const auto wt = want.tensors();
      reference::optimizer_step(wt, OptimizerConfig{c}, read_of(s));
      for (std::size_t t = 0; t < host.size(); ++t) {
        const OptimizerTensor& h = wt[t];
        const OptimizerTensor& x = on_dev[t];
        auto same = [](const auto& a, const auto& b) {
          return a.numel == 0 || std::memcmp(a.data, b.data, a.bytes()) == 0;
        };
        ASSERT_TRUE(same(x.param, h.param)) << "step " << s << " param of tensor " << t;
        for (int sl = 0; sl < kMaxOptimizerSlots; ++sl)
          if (h.state[sl].data != nullptr)
            ASSERT_TRUE(same(x.state[sl], h.state[sl]))
                << "step " << s << " slot " << sl << " of tensor " << t;
        ASSERT_TRUE(same(x.compute_param, h.compute_param))
            << "step " << s << " compute copy of tensor " << t;
        if (h.step != nullptr) ASSERT_EQ(*x.step, *h.step) << "step " << s << " counter " << t;
      }
    }
    for (void* p : owned) dev->deallocate(p);
  }
}

// ---- columns: the gradient managers ---------------------------------------------------------

/// The managers' cases of a sample: the test model (bf16 or f32 gradients) in the RL flow
/// (parameters without a gradient in some micro-batches) under a schedule; variant 0:
/// bf16, clipped at 0.05, no overlap; 1: f32, clipped, optimizer overlap (speculated
/// chunks rolled back and committed); 2: bf16, no clip_grad_norm, overlap.
template <class Unit>
managers_cases::Case manager_case(const typename Unit::Config& config, int variant, int steps) {
  managers_cases::Case c;
  c.optimizer = config;
  c.grad_dtype = variant == 1 ? DType::f32 : DType::bf16;
  c.max_norm = variant == 2 ? std::optional<float>{} : std::optional<float>{0.05f};
  c.flow = stepcore::testing::Flow::rl;
  c.schedule = true;
  c.overlap = variant != 0;
  c.steps = steps;
  return c;
}

/// Runs every sample of Unit through the manager of `mode` (lazy: mode none's lazy scale),
/// in each variant of manager_case, against the independent simulation (reference).
template <class Unit>
void manager_column(OffloadMode mode, bool lazy = false) {
  const auto configs = configs_of<Unit>();
  for (std::size_t k = 0; k < configs.size(); ++k)
    for (int variant = 0; variant < 3; ++variant) {
      const managers_cases::Case c = manager_case<Unit>(configs[k], variant, 6);
      SCOPED_TRACE(label<Unit>(k) + " " + c.label());
      const auto want = managers_cases::run_reference(c);
      ASSERT_NE(want[0].state[0], want[5].state[0]) << "the stream changes the state";
      managers_cases::expect_same(managers_cases::run_mode(mode, c, lazy), want,
                                  std::string(offload_mode_name(mode)));
      if (::testing::Test::HasFatalFailure()) return;
    }
}

TYPED_TEST(OptimizerMatrix, ManagerModeNone) { manager_column<TypeParam>(OffloadMode::none); }
TYPED_TEST(OptimizerMatrix, ManagerModeNoneLazyScale) {
  manager_column<TypeParam>(OffloadMode::none, /*lazy=*/true);
}
TYPED_TEST(OptimizerMatrix, ManagerModeOptimizer) {
  manager_column<TypeParam>(OffloadMode::optimizer);
}
TYPED_TEST(OptimizerMatrix, ManagerModeFull) { manager_column<TypeParam>(OffloadMode::full); }

// ---- column: checkpoints resumed across modes ----------------------------------------------

// A checkpoint saved after 3 steps in each mode resumes in each mode (mode full with another
// thread count, so another partition), and the resumed steps have the bits of the run that
// never stopped (the reference).
TYPED_TEST(OptimizerMatrix, CheckpointResumedAcrossModes) {
  using Unit = TypeParam;
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("stepcore-matrix-" + std::string(Unit::kName) +
                                                    "-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "state.stepcore").string();
  const OffloadMode modes[] = {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full};
  const auto configs = configs_of<Unit>();
  for (std::size_t k = 0; k < configs.size(); ++k) {
    const managers_cases::Case c = manager_case<Unit>(configs[k], 0, 5);
    SCOPED_TRACE(label<Unit>(k));
    const auto want = managers_cases::run_reference(c);
    for (const OffloadMode from : modes)
      for (const OffloadMode to : modes) {
        SCOPED_TRACE(std::string(offload_mode_name(from)) + " -> " +
                     std::string(offload_mode_name(to)));
        auto dev = managers_cases::make_device();
        managers_cases::Build b;
        b.mode = from;
        b.threads = 1;
        auto saver = managers_cases::make_manager(b, c, *dev);
        (void)stepcore::testing::run_stream(*saver, *dev,
                                            managers_cases::stream_options(c, nullptr, 0, 3));
        saver->save_checkpoint(path);
        saver->close();
        b.mode = to;
        b.threads = 3;
        auto m = managers_cases::make_manager(b, c, *dev);
        m->load_checkpoint(path);
        const auto got = stepcore::testing::run_stream(
            *m, *dev, managers_cases::stream_options(c, nullptr, 3, 2));
        m->close();
        managers_cases::expect_same(got, {want.begin() + 3, want.end()}, "resumed");
        if (::testing::Test::HasFatalFailure()) return;
      }
  }
  fs::remove_all(dir);
}

}  // namespace
