// The full-offload manager with 8-bit state slots (ManagerConfig::q8_state; docs/managers.md,
// "8-bit state"; docs/numerics.md 8f) against the independent expectation (manager_model:
// stepcore::reference alone) after every step: adversarial blocks (all zero, one non-zero,
// near-ties, subnormal and near-overflow values) over boundary sizes, every formula,
// amsgrad and Adam, accumulating and holding steps, overlap with commits and rollbacks,
// pieces of a small ring, every ISA with 1 and 3 threads; the state's import, export and
// host views; the bytes it holds; and its bad input.
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "expect_error.hpp"
#include "isa_list.hpp"
#include "managers/checkpoint_file.hpp"
#include "managers_cases.hpp"
#include "stepcore/plan.hpp"

namespace {

using namespace managers_cases;
using stepcore::testing_support::isas_under_test;
using test_support::expect_error;
namespace ckpt = stepcore::detail::checkpoint;

// The magnitudes of the signed map's midpoints between neighbouring codes that are f32
// values: gradients there put a block's new exp_avg on or next to a tie of the rule.
const std::vector<float>& midpoints() {
  static const std::vector<float> mids = [] {
    std::vector<float> out;
    const std::span<const float, 256> map = q8_map(false);
    for (std::size_t k = 0; k + 1 < 256; ++k) {
      const double mid = (static_cast<double>(map[k]) + map[k + 1]) / 2;
      if (static_cast<double>(static_cast<float>(mid)) == mid)
        out.push_back(static_cast<float>(mid));
    }
    return out;
  }();
  return mids;
}

// The adversarial stream: in micro-batch 0, block b of parameter i in step s is, by
// (b + s + i) % 6, all zero; one non-zero element; 1 then midpoints of the signed map;
// subnormal values; values near 2^60 (squares near 2^120); ordinary values. Later
// micro-batches add zeros (the accumulator keeps micro-batch 0's bits).
void adversarial(int s, int mb, std::size_t i, std::size_t off, std::size_t numel, DType dtype,
                 void* out) {
  std::vector<float> v(numel, 0.0f);
  const std::vector<float>& mids = midpoints();
  for (std::size_t k = 0; k < numel && mb == 0; ++k) {
    const std::size_t j = off + k, b = j / kQ8BlockSize, r = j % kQ8BlockSize;
    const float g = gradient_value(3, s, 0, i, j);
    switch ((b + static_cast<std::size_t>(s) + i) % 6) {
      case 0:
        break;
      case 1:
        v[k] = r == (7 * b) % kQ8BlockSize ? 1.5f * (g < 0 ? -1.0f : 1.0f) : 0.0f;
        break;
      case 2:
        v[k] = r == 0 ? 1.0f : mids[(r + static_cast<std::size_t>(s)) % mids.size()];
        break;
      case 3:
        v[k] = g * 0x1p-140f;
        break;
      case 4:
        v[k] = g * 0x1p60f;
        break;
      default:
        v[k] = g;
    }
  }
  ASSERT_EQ(dtype, DType::f32);
  if (numel != 0) std::memcpy(out, v.data(), numel * sizeof(float));
}

// A case of 8-bit state over the boundary sizes (min_8bit_size 1: all but the empty one).
Case q8_case(OptimizerConfig optimizer, AdamWFormula formula = AdamWFormula::torch) {
  Case c;
  c.grad_dtype = DType::f32;
  c.optimizer = optimizer;
  c.formula = formula;
  c.sizes = {257, 1, 0, 255, 256, 4095, 4096, 4097, 1000, 513};
  c.chunk = 6000;
  c.steps = 10;
  c.fill = adversarial;
  c.scale = [](int s) { return s % 3 == 1 ? 0.5f : 1.0f; };  // ties stay ties
  c.q8 = true;
  c.min_8bit_size = 1;
  return c;
}

const OffloadMode kModes[] = {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full};

// Runs the case through the manager of `mode` (full offload: engine `isa`, `threads`) and
// compares every step with the reference.
void expect_reference(const Case& c, OffloadMode mode, std::optional<cpu::Isa> isa = {},
                      int threads = 2) {
  auto dev = make_device();
  Build b;
  b.mode = mode;
  b.isa = isa;
  b.threads = threads;
  auto m = make_manager(b, c, *dev);
  const auto got = run_stream(*m, *dev, stream_options(c, nullptr));
  m->close();
  expect_same(got, run_reference(c),
              std::string(offload_mode_name(mode)) + " " + c.label() +
                  (isa ? " " + std::string(cpu::isa_name(*isa)) : "") + " threads " +
                  std::to_string(threads));
}

// In every mode.
void expect_reference(const Case& c) {
  for (OffloadMode mode : kModes) expect_reference(c, mode);
}

std::vector<std::pair<OptimizerConfig, AdamWFormula>> eight_bit_optimizers() {
  AdamWConfig ams;
  ams.amsgrad = true;
  AdamConfig adam_ams;
  adam_ams.amsgrad = true;
  return {{AdamWConfig{}, AdamWFormula::torch},   {AdamWConfig{}, AdamWFormula::native},
          {AdamWConfig{}, AdamWFormula::torchao}, {ams, AdamWFormula::torch},
          {AdamConfig{}, AdamWFormula::torch},    {adam_ams, AdamWFormula::torch}};
}

TEST(ManagersQ8, EveryFormulaAndFlowEqualsTheReferenceAfterEveryStep) {
  for (const auto& [opt, formula] : eight_bit_optimizers())
    for (Flow flow : {Flow::sft, Flow::rl_single, Flow::rl}) {
      Case c = q8_case(opt, formula);
      c.flow = flow;
      expect_reference(c);
    }
}

TEST(ManagersQ8, OverlapCommitsAndRollsBackWithTheReferenceBits) {
  for (const auto& [opt, formula] : eight_bit_optimizers()) {
    Case c = q8_case(opt, formula);
    c.overlap = true;
    c.speculation = Speculation::always;
    // Steps that do not clip (commit), that clip hard (roll back), and that clip loosely.
    c.max_norm_of = [](int s) -> std::optional<float> {
      if (s % 3 == 0) return std::nullopt;
      return s % 3 == 1 ? 1e-3f : 1e30f;
    };
    c.ring_slot_elements = 700;  // 768 with 8-bit state: pieces of three blocks
    c.ring_slots = 2;
    expect_reference(c);
    c.flow = Flow::rl_single;  // a holding step speculates from the held gradients
    expect_reference(c);
    c.min_8bit_size = 0;  // the empty parameter too: a speculated slot of no bytes
    expect_reference(c);
  }
}

TEST(ManagersQ8, ASkippedStepWritesNothingAndTheNextEqualsTheReference) {
  Case c = q8_case(AdamWConfig{});
  c.overlap = true;
  c.speculation = Speculation::always;
  c.poisons = {{2, 0, 3}, {5, 0, 7}};
  expect_reference(c);
}

TEST(ManagersQ8, EveryIsaAndThreadCountGivesTheReferenceBits) {
  Case c = q8_case(AdamWConfig{}, AdamWFormula::torchao);
  c.overlap = true;
  c.max_norm_of = [](int s) -> std::optional<float> {
    return s % 2 ? std::optional<float>(1e-2f) : std::nullopt;
  };
  for (cpu::Isa isa : isas_under_test())
    for (int threads : {1, 3}) expect_reference(c, OffloadMode::full, isa, threads);
}

TEST(ManagersQ8, MixedSizesKeepF32StateBelowTheThreshold) {
  // The default threshold: the parameters below 4,096 elements keep f32 slots, which the
  // reference steps as f32 in the same model; a tensor of 0 elements at threshold 0.
  for (std::size_t min : {std::size_t{4096}, std::size_t{0}}) {
    Case c = q8_case(AdamWConfig{});
    c.min_8bit_size = min;
    c.sizes.push_back(20000);
    expect_reference(c);
  }
}

TEST(ManagersQ8, AboutAMillionElementsEqualTheReference) {
  Case c = q8_case(AdamWConfig{});
  c.steps = stepcore::testing_support::by_profile(10, 4, "4 steps of 10");
  c.sizes = {1000003, 300};
  c.chunk = 1 << 20;
  c.ring_slot_elements = 1 << 17;
  c.overlap = true;
  c.max_norm_of = [](int s) -> std::optional<float> {
    return s == 2 ? std::optional<float>(1e-3f) : std::nullopt;  // a rollback
  };
  expect_reference(c);
}

// ---- the state's interface --------------------------------------------------------------

ManagerConfig small_config(device::Device& dev) {
  ManagerConfig cfg;
  cfg.mode = OffloadMode::full;
  cfg.optimizer = AdamWConfig{};
  cfg.device = &dev;
  cfg.q8_state = true;
  cfg.min_8bit_size = 300;
  for (std::size_t n : {600u, 100u}) {
    ParamSpec p;
    p.name = "p" + std::to_string(n);
    p.numel = n;
    p.grad_dtype = DType::f32;
    cfg.params.push_back(p);
  }
  return cfg;
}

TEST(ManagersQ8, ImportReadAndHostStateAgree) {
  for (OffloadMode mode : kModes) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    auto dev = device::make_host_device();
    ManagerConfig cfg = small_config(*dev);
    cfg.mode = mode;
    auto m = make_gradient_manager(cfg);
    ASSERT_TRUE(m->q8_parameter(0));
    ASSERT_FALSE(m->q8_parameter(1));
    const std::size_t n = 600, blocks = 3;
    std::vector<float> master(n);
    std::vector<std::uint8_t> c1(n), c2(n);
    std::vector<float> a1 = {0.5f, 2.0f, 0.0f}, a2 = {1e-3f, 0.25f, 7.0f};
    for (std::size_t j = 0; j < n; ++j) {
      master[j] = 0.01f * static_cast<float>(j);
      c1[j] = static_cast<std::uint8_t>(j * 7);
      c2[j] = static_cast<std::uint8_t>(255 - j);
    }
    const SlotIn in[] = {{"exp_avg", {}, c1, a1}, {"exp_avg_sq", {}, c2, a2}};
    m->import_parameter(0, master, in, 12.0f);
    std::vector<float> master_out(n), b1(blocks), b2(blocks);
    std::vector<std::uint8_t> d1(n), d2(n);
    const SlotOut out[] = {{"exp_avg", {}, d1, b1}, {"exp_avg_sq", {}, d2, b2}};
    m->read_parameter(0, master_out, out, {});
    EXPECT_EQ(master_out, master);
    EXPECT_EQ(d1, c1);
    EXPECT_EQ(d2, c2);
    EXPECT_EQ(b1, a1);
    EXPECT_EQ(b2, a2);
    EXPECT_EQ(m->step_count(0), 12.0f);
    const GradientManager::HostState h = m->host_state(0);
    if (mode != OffloadMode::none) {  // host memory: views (mode none: device memory, none)
      ASSERT_EQ(h.slots.size(), 2u);
      EXPECT_TRUE(h.slots[0].values.empty());
      EXPECT_TRUE(std::equal(h.slots[1].codes.begin(), h.slots[1].codes.end(), c2.begin()));
      ASSERT_EQ(h.slots[1].absmax.size(), blocks);
      EXPECT_EQ(h.slots[1].absmax[2], 7.0f);
      EXPECT_TRUE(h.slot("exp_avg").empty());  // f32 values only
    }
    // load_parameter starts 8-bit slots at 0: the zero code of each map, maxima 0.
    m->load_parameter(0, master);
    m->read_parameter(0, master_out, out, {});
    for (std::size_t j = 0; j < n; ++j) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(q8_map(false)[d1[j]]), 0u) << j;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(q8_map(true)[d2[j]]), 0u) << j;
    }
    EXPECT_EQ(b1, std::vector<float>(blocks, 0.0f));
    EXPECT_EQ(m->step_count(0), 0.0f);
    // The f32 parameter keeps values.
    const auto f32 = m->host_state(1);
    EXPECT_EQ(f32.slot("exp_avg").size(), mode == OffloadMode::none ? 0u : 100u);
    m->close();
  }
}

TEST(ManagersQ8, BadStateIsRefusedNamingItWithNothingWritten) {
  auto dev = device::make_host_device();
  auto m = make_gradient_manager(small_config(*dev));
  const std::size_t n = 600;
  std::vector<float> master(n, 1.0f), values(n, 0.0f);
  std::vector<std::uint8_t> codes(n, 127), short_codes(n - 1, 0);
  std::vector<float> absmax = {1.0f, 1.0f, 1.0f};
  m->import_parameter(
      0, master,
      std::vector<SlotIn>{{"exp_avg", {}, codes, absmax}, {"exp_avg_sq", {}, codes, absmax}}, 3.0f);
  auto import = [&](std::span<const SlotIn> state) {
    std::vector<float> other(n, 2.0f);
    m->import_parameter(0, other, state, 4.0f);
  };
  // Each case spoils one slot of an otherwise valid import: its codes, its maxima, or
  // values given for an 8-bit slot.
  const std::vector<float> negative = {1.0f, -1.0f, 1.0f}, nan = {1.0f, 1.0f, NAN},
                           two = {1.0f, 1.0f}, inf = {INFINITY, 1.0f, 1.0f};
  struct Spoil {
    bool sq;  // exp_avg_sq instead of exp_avg
    const std::vector<std::uint8_t>* codes;
    const std::vector<float>* absmax;
    const std::vector<float>* values;
    Errc code;
    const char* arg;
  };
  const Spoil spoils[] = {
      {false, &short_codes, &absmax, nullptr, Errc::size_mismatch, "exp_avg.codes"},
      {false, &codes, &two, nullptr, Errc::size_mismatch, "exp_avg.absmax"},
      {true, &codes, &negative, nullptr, Errc::invalid_argument, "exp_avg_sq.absmax"},
      {false, &codes, &nan, nullptr, Errc::non_finite, "exp_avg.absmax"},
      {false, &codes, &inf, nullptr, Errc::non_finite, "exp_avg.absmax"},
      {false, nullptr, nullptr, &values, Errc::invalid_argument, "exp_avg"},
  };
  using Slots = std::vector<SlotIn>;
  for (const Spoil& sp : spoils) {
    const SlotIn good_avg{"exp_avg", {}, codes, absmax}, good_sq{"exp_avg_sq", {}, codes, absmax};
    SlotIn bad{sp.sq ? "exp_avg_sq" : "exp_avg"};
    if (sp.values != nullptr) bad.values = *sp.values;
    if (sp.codes != nullptr) bad.codes = *sp.codes;
    if (sp.absmax != nullptr) bad.absmax = *sp.absmax;
    expect_error(
        [&] {
          import(Slots{sp.sq ? good_avg : bad, sp.sq ? bad : good_sq});
        },
        sp.code, {sp.arg});
  }
  // Codes for an f32 parameter; values of the wrong kind when reading.
  std::vector<float> m1(100, 0.0f);
  std::vector<std::uint8_t> c100(100, 0);
  std::vector<float> a1 = {1.0f};
  expect_error(
      [&] {
        m->import_parameter(1, m1, Slots{{"exp_avg", {}, c100, a1}, {"exp_avg_sq", m1}}, 0.0f);
      },
      Errc::invalid_argument, {"exp_avg.codes"});
  std::vector<float> out(n);
  expect_error(
      [&] {
        m->read_parameter(0, {}, std::vector<SlotOut>{{"exp_avg", out}}, {});
      },
      Errc::invalid_argument, {"exp_avg"});
  std::vector<std::uint8_t> out_codes(n - 1);
  expect_error(
      [&] {
        m->read_parameter(0, {}, std::vector<SlotOut>{{"exp_avg", {}, out_codes}}, {});
      },
      Errc::size_mismatch, {"exp_avg.codes"});
  expect_error([&] { (void)m->q8_parameter(2); }, Errc::out_of_range, {"i"});
  // Nothing was written by a refused import.
  std::vector<float> got(n), ab(3);
  std::vector<std::uint8_t> gc(n);
  m->read_parameter(0, got, std::vector<SlotOut>{{"exp_avg", {}, gc, ab}}, {});
  EXPECT_EQ(got, master);
  EXPECT_EQ(gc, codes);
  EXPECT_EQ(ab, absmax);
  EXPECT_EQ(m->step_count(0), 3.0f);
  m->close();
}

TEST(ManagersQ8, OptimizersWithout8BitStateAreRefused) {
  auto dev = device::make_host_device();
  for (OffloadMode mode : kModes)
    for (OptimizerConfig opt : {OptimizerConfig{SgdConfig{}}, OptimizerConfig{LionConfig{}},
                                OptimizerConfig{SignSgdConfig{}}}) {
      ManagerConfig cfg = small_config(*dev);
      cfg.mode = mode;
      cfg.optimizer = opt;
      expect_error([&] { (void)make_gradient_manager(cfg); }, Errc::not_supported, {"q8_state"});
      expect_error([&] { (void)plan_memory(cfg, MemoryPlanOptions{}); }, Errc::not_supported,
                   {"q8_state"});
    }
}

TEST(ManagersQ8, MemoryCountsCodesAndMaximaAndThePlanAgrees) {
  for (OffloadMode mode : kModes) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    auto dev = device::make_host_device();
    ManagerConfig cfg = small_config(*dev);
    cfg.mode = mode;
    cfg.speculation = Speculation::always;
    auto m = make_gradient_manager(cfg);
    // 600 codes (768 bytes aligned) + 3 maxima (256), and the f32 parameter's 400 (512).
    const MemoryReport r = m->memory();
    EXPECT_EQ(r.kind("exp_avg").bytes, 768u + 256u + 512u);
    EXPECT_EQ(r.kind("exp_avg_sq").bytes, 768u + 256u + 512u);
    EXPECT_EQ(r.kind("master").bytes, 2560u + 512u);
    // A speculated step: the rollback space holds every chunk's spares.
    const MemoryPlanOptions opts{.micro_batches = 1, .overlap = true};
    std::vector<float> zero(600, 0.0f);
    m->load_parameter(0, zero);
    m->load_parameter(1, std::vector<float>(100, 0.0f));
    m->begin_step(1.0f, true);
    m->begin_backward(true);
    for (std::size_t i : {1u, 0u}) {
      const TensorView g = m->gradient(i);
      std::memset(g.data, 0, g.bytes());
      m->gradient_ready(i);
    }
    m->finish_backward();
    m->step();
    (void)m->report();
    const MemoryReport after = m->memory();
    const MemoryReport plan = plan_memory(cfg, opts);
    // The same kinds in the same order (device and host "scalars" both), the same peaks.
    ASSERT_EQ(plan.kinds.size(), after.kinds.size());
    for (std::size_t j = 0; j < after.kinds.size(); ++j) {
      EXPECT_EQ(plan.kinds[j].kind, after.kinds[j].kind);
      EXPECT_EQ(plan.kinds[j].device, after.kinds[j].device) << after.kinds[j].kind;
      EXPECT_EQ(plan.kinds[j].peak, after.kinds[j].peak) << after.kinds[j].kind;
    }
    m->close();
  }
}

// ---- checkpoints ------------------------------------------------------------------------

namespace checkpoints {

std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() /
          ("stepcore-q8-" + std::to_string(::getpid()) + "-" + name))
      .string();
}

// Runs steps [first, first + steps) of the case's stream through `m`.
std::vector<StepRecord> run_steps(GradientManager& m, device::Device& dev, const Case& c, int first,
                                  int steps) {
  return run_stream(m, dev, stream_options(c, nullptr, first, steps));
}

TEST(ManagersQ8, ACheckpointResumesInAnotherModeIsaAndThreadCountBitForBit) {
  // Four steps in mode none, a save, then a manager of another mode (full offload: of each
  // engine ISA, another thread count and ring) loads it and runs the last six: every one
  // equals the reference's uninterrupted run.
  Case c = q8_case(AdamWConfig{}, AdamWFormula::torchao);
  c.overlap = true;
  c.max_norm_of = [](int s) -> std::optional<float> {
    return s % 3 == 2 ? std::optional<float>(1e-3f) : std::nullopt;
  };
  const std::vector<StepRecord> want = run_reference(c);
  const std::string path = temp_path("resume.stepcore");
  const std::vector<cpu::Isa> isas = isas_under_test();
  {
    auto dev = make_device();
    Build b;
    b.mode = OffloadMode::none;
    auto m = make_manager(b, c, *dev);
    const auto first = run_steps(*m, *dev, c, 0, 4);
    expect_same(first, std::vector<StepRecord>(want.begin(), want.begin() + 4), "before the save");
    m->save_checkpoint(path);
    m->close();
  }
  std::vector<std::pair<OffloadMode, std::optional<cpu::Isa>>> loaders = {
      {OffloadMode::optimizer, std::nullopt}};
  for (cpu::Isa isa : isas) loaders.push_back({OffloadMode::full, isa});
  for (const auto& [mode, isa] : loaders) {
    auto dev = make_device();
    Build b;
    b.mode = mode;
    b.isa = isa;
    b.threads = 1;
    Case other = c;
    other.ring_slot_elements = 300;  // 512: other pieces
    auto m = make_manager(b, other, *dev);
    m->load_checkpoint(path);
    const auto rest = run_steps(*m, *dev, c, 4, 6);
    m->close();
    expect_same(rest, std::vector<StepRecord>(want.begin() + 4, want.end()),
                "resumed in mode " + std::string(offload_mode_name(mode)) +
                    (isa ? " on " + std::string(cpu::isa_name(*isa)) : ""));
  }
  std::filesystem::remove(path);
}

// The file of a run of the case, read back (its header and every array's bytes).
struct Saved {
  ckpt::Header header;
  std::vector<std::vector<std::vector<std::byte>>> arrays;  // [param][array]
};
Saved save_and_read(const Case& c, const std::string& path) {
  auto dev = make_device();
  Build b;
  b.mode = OffloadMode::full;
  auto m = make_manager(b, c, *dev);
  (void)run_steps(*m, *dev, c, 0, 2);
  m->save_checkpoint(path);
  m->close();
  const ckpt::File f = ckpt::File::open(path);
  Saved s{f.header(), {}};
  for (std::size_t i = 0; i < s.header.params.size(); ++i) {
    s.arrays.emplace_back();
    for (std::size_t a = 0; a < s.header.arrays(); ++a)
      s.arrays[i].emplace_back(f.bytes(i, a).begin(), f.bytes(i, a).end());
  }
  return s;
}

TEST(ManagersQ8, SpoiledMaximaAndMismatchedStateAreRefusedWithNothingLoaded) {
  Case c = q8_case(AdamWConfig{});
  c.sizes = {700, 5};
  c.min_8bit_size = 256;
  const std::string path = temp_path("spoiled.stepcore");
  const Saved saved = save_and_read(c, path);
  ASSERT_TRUE(saved.header.params[0].q8);
  ASSERT_FALSE(saved.header.params[1].q8);
  ASSERT_EQ(saved.header.arrays(), 5u);  // master, exp_avg, exp_avg_sq, their maxima
  // Each file differs from the saved one in one value, its checksums valid: the load
  // refuses it naming the array, before anything is imported.
  struct Spoil {
    std::size_t array;
    float value;
    Errc code;
    const char* arg;
  };
  const Spoil spoils[] = {
      {3, -1.0f, Errc::invalid_argument, "checkpoint.params[0].exp_avg.absmax"},
      {4, NAN, Errc::non_finite, "checkpoint.params[0].exp_avg_sq.absmax"},
      {4, INFINITY, Errc::non_finite, "checkpoint.params[0].exp_avg_sq.absmax"},
  };
  auto dev = make_device();
  Build b;
  b.mode = OffloadMode::full;
  for (const Spoil& sp : spoils) {
    Saved bad = saved;
    std::memcpy(bad.arrays[0][sp.array].data() + 4, &sp.value, 4);  // block 1
    const std::string bad_path = temp_path("bad.stepcore");
    ckpt::save(bad_path, bad.header, [&](std::size_t i, std::size_t a) {
      return std::span<const std::byte>(bad.arrays[i][a]);
    });
    auto m = make_manager(b, c, *dev);
    std::vector<std::uint8_t> codes(700), after_codes(700);
    std::vector<float> maxima(3), after_maxima(3);
    const SlotOut out[] = {{"exp_avg", {}, codes, maxima}};
    m->read_parameter(0, {}, out, {});
    expect_error([&] { m->load_checkpoint(bad_path); }, sp.code, {sp.arg});
    const SlotOut again[] = {{"exp_avg", {}, after_codes, after_maxima}};
    m->read_parameter(0, {}, again, {});
    EXPECT_EQ(after_codes, codes) << sp.arg;
    EXPECT_EQ(after_maxima, maxima) << sp.arg;
    m->close();
    std::filesystem::remove(bad_path);
  }
  // A flipped code byte: any byte is a code, so the checksum finds it.
  {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    const ckpt::ParsedFile parsed = ckpt::parse(std::as_bytes(std::span<const char>(bytes)), path);
    bytes[parsed.payload_start + parsed.array_offsets[1] + 9] ^= 0x20;  // exp_avg's codes
    const std::string flipped = temp_path("flipped.stepcore");
    std::ofstream(flipped, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    auto m = make_manager(b, c, *dev);
    expect_error([&] { m->load_checkpoint(flipped); }, Errc::corrupt_file, {"path"});
    m->close();
    std::filesystem::remove(flipped);
  }
  // The state's storage must agree: 8-bit into f32 and f32 into 8-bit are refused.
  Case f32 = c;
  f32.q8 = false;
  auto m = make_manager(b, f32, *dev);
  expect_error([&] { m->load_checkpoint(path); }, Errc::invalid_argument,
               {"checkpoint.params[0].state"});
  const std::string f32_path = temp_path("f32.stepcore");
  m->save_checkpoint(f32_path);
  m->close();
  auto q = make_manager(b, c, *dev);
  expect_error([&] { q->load_checkpoint(f32_path); }, Errc::invalid_argument,
               {"checkpoint.params[0].state"});
  q->close();
  std::filesystem::remove(f32_path);
  std::filesystem::remove(path);
}

}  // namespace checkpoints

}  // namespace
