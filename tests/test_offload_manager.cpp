// The full-offload gradient manager (mode "full") on the host device, against the
// independent expectation (manager_model, built from stepcore::reference alone): bits of norms,
// clip coefficients, parameters, moments and compute weights after every step (bf16 and f32
// gradients, AdamW both formulas and SignSGD, max_norm none / 0.05 / 100, with and
// without optimizer overlap), found-inf skips, sharding over 2 and 4 in-process ranks,
// the factory's refusals and the fault behaviour (sequence errors, a failed copy, close);
// the rings' refusals, the bytes memory() reports (from the ParamSpecs, by the documented
// formulas), and a step of one micro-batch (its gradients read again by step()).
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "device/host_device.hpp"
#include "expect_error.hpp"
#include "manager_model.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

namespace {

using namespace stepcore;

constexpr std::size_t kSizes[] = {0, 1, 33, 1025, 4097, 70000, 5};
constexpr std::size_t kParams = std::size(kSizes);
constexpr int kSteps = 3;
constexpr int kMicro = 3;
constexpr std::size_t kManagerChunkElements = 5000;  // four chunks: {0..3}, {4}, {5}, {6}

// One element of the stream: step, micro-batch, parameter, element (logical index).
using Site = std::array<std::size_t, 4>;

struct Scenario {
  DType grad = DType::bf16;
  OptimizerConfig optimizer = AdamWConfig{};
  AdamWFormula formula = AdamWFormula::native;
  std::optional<float> max_norm;
  bool overlap = false;
  std::optional<Site> nan_at;  // a NaN gradient element
  std::string label() const {
    return std::string(dtype_name(grad)) + " " + std::string(optimizer_name(optimizer)) +
           (formula == AdamWFormula::torch ? "(torch)" : "") + " max_norm " +
           (max_norm ? std::to_string(*max_norm) : "none") + (overlap ? " overlap" : "") +
           (nan_at ? " nan" : "");
  }
};

// The model: mixed gradient and compute dtypes, an empty parameter, one without
// compute weights, one that does not count towards the norm.
std::vector<ParamSpec> model(DType grad) {
  const DType compute[] = {DType::bf16, DType::f16,  DType::bf16, DType::f32,
                           DType::bf16, DType::bf16, DType::f16};
  std::vector<ParamSpec> specs;
  for (std::size_t i = 0; i < kParams; ++i)
    specs.push_back({"p" + std::to_string(i), kSizes[i], i == 4 ? DType::f32 : grad, compute[i],
                     i != 3, i != 2});
  return specs;
}

std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A value in [-1, 1) from a key.
float unit(std::uint64_t key) { return static_cast<float>(mix(key) >> 40) * 0x1p-23f - 1.0f; }

float initial_master(std::size_t i, std::size_t k) { return 0.05f * unit(i * 1000003 + k); }

float gradient_scale(int step) { return 1.0f / (3.0f + static_cast<float>(step)); }

// Whether parameter i gets a gradient in micro-batch m of step t: some skip micro-batches,
// parameter 3 gets none in step 1 (it must then read as zero).
bool has_gradient(int t, int m, std::size_t i) {
  if (i == 6) return m == 0;
  if (i == 3 && t == 1) return false;
  if (i == 1 && m == 1) return false;
  return true;
}

// The stored gradient bytes of elements [lo, hi) of parameter i in (t, m).
std::vector<std::uint8_t> gradient_bytes(const Scenario& s, const ParamSpec& p, int t, int m,
                                         std::size_t i, std::size_t lo, std::size_t hi) {
  const std::size_t es = dtype_size(p.grad_dtype);
  std::vector<std::uint8_t> out((hi - lo) * es);
  const float magnitude = 0.002f * static_cast<float>(i + 1);
  for (std::size_t k = lo; k < hi; ++k) {
    float x = magnitude * unit((static_cast<std::uint64_t>(t) << 56) ^
                               (static_cast<std::uint64_t>(m) << 48) ^ (i << 40) ^ k ^ 0x5151);
    if (s.nan_at && (*s.nan_at)[0] == static_cast<std::size_t>(t) &&
        (*s.nan_at)[1] == static_cast<std::size_t>(m) && (*s.nan_at)[2] == i && (*s.nan_at)[3] == k)
      x = std::nanf("");
    std::uint8_t* dst = out.data() + (k - lo) * es;
    if (p.grad_dtype == DType::f32) {
      std::memcpy(dst, &x, 4);
    } else {
      const std::uint16_t b =
          p.grad_dtype == DType::bf16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
      std::memcpy(dst, &b, 2);
    }
  }
  return out;
}

OptimizerConfig optimizer_of(const Scenario& s) {
  OptimizerConfig o = s.optimizer;
  if (auto* a = std::get_if<AdamWConfig>(&o)) {
    a->lr = 1e-2;
    a->weight_decay = 0.1;
    a->formula = s.formula;
  } else {
    std::visit(
        [](auto& c) {
          c.lr = 1e-3;
          c.weight_decay = 0.05;
        },
        o);
  }
  return o;
}

bool is_adamw(const OptimizerConfig& c) { return std::holds_alternative<AdamWConfig>(c); }

// The expectation: the whole (unsharded) model through manager_model (stepcore::reference).
manager_model::Run expected(const Scenario& s) {
  const manager_model::Setup setup{model(s.grad), optimizer_of(s), kManagerChunkElements,
                                   s.max_norm, s.overlap};
  auto gradient = [&](int t, int m, std::size_t i) {
    return gradient_bytes(s, setup.params[i], t, m, i, 0, kSizes[i]);
  };
  return manager_model::run(
      setup, manager_model::fixed_stream(kSteps, kMicro, gradient_scale, has_gradient, gradient,
                                         initial_master));
}

// Shard [lo, hi) of every parameter held by one rank (the whole model: [0, numel)).
using Shards = std::vector<std::pair<std::size_t, std::size_t>>;

Shards whole_model() {
  Shards s;
  for (std::size_t n : kSizes) s.emplace_back(0, n);
  return s;
}

// Uneven shards over `ranks`: rank (i % ranks) holds nothing of parameter i, the others
// get parts in proportion 1 : 2 : 3 ...
Shards shards_of(int ranks, int rank) {
  Shards out;
  for (std::size_t i = 0; i < kParams; ++i) {
    const int empty = static_cast<int>(i % static_cast<std::size_t>(ranks));
    std::size_t total_w = 0, before_w = 0;
    for (int r = 0; r < ranks; ++r) {
      const std::size_t w = r == empty ? 0 : static_cast<std::size_t>(r + 1);
      if (r < rank) before_w += w;
      total_w += w;
    }
    const std::size_t w = rank == empty ? 0 : static_cast<std::size_t>(rank + 1);
    const std::size_t lo = kSizes[i] * before_w / total_w;
    const std::size_t hi = kSizes[i] * (before_w + w) / total_w;
    out.emplace_back(lo, hi);
  }
  return out;
}

ManagerConfig config_of(const Scenario& s, const Shards& shards, device::Device* dev,
                        comm::Communicator* comm = nullptr, int threads = 2) {
  ManagerConfig cfg;
  cfg.mode = OffloadMode::full;
  cfg.optimizer = optimizer_of(s);
  cfg.params = model(s.grad);
  for (std::size_t i = 0; i < kParams; ++i)
    cfg.params[i].numel = shards[i].second - shards[i].first;
  cfg.chunk_elements = kManagerChunkElements;
  cfg.device = dev;
  cfg.comm = comm;
  cfg.layout_fingerprint = 0x5eedull;
  cfg.engine.threads = threads;
  return cfg;
}

void load(GradientManager& mgr, const Shards& shards) {
  for (std::size_t i = 0; i < kParams; ++i) {
    std::vector<float> init;
    for (std::size_t k = shards[i].first; k < shards[i].second; ++k)
      init.push_back(initial_master(i, k));
    mgr.load_parameter(i, init);
  }
}

// One step of the stream through the manager: backward hands gradients over in reverse
// parameter order, as a real backward does.
StepReport drive_step(GradientManager& mgr, const Scenario& s, const Shards& shards, int t,
                      float* clip_norm = nullptr) {
  const auto specs = model(s.grad);
  mgr.begin_step(gradient_scale(t), s.overlap);
  for (int mb = 0; mb < kMicro; ++mb) {
    mgr.begin_backward(mb == kMicro - 1);
    for (std::size_t j = kParams; j-- > 0;) {
      if (!has_gradient(t, mb, j)) continue;
      const auto g = gradient_bytes(s, specs[j], t, mb, j, shards[j].first, shards[j].second);
      const TensorView buf = mgr.gradient(j);
      EXPECT_EQ(buf.numel, shards[j].second - shards[j].first);
      EXPECT_EQ(buf.dtype, specs[j].grad_dtype);
      if (!g.empty()) std::memcpy(buf.data, g.data(), g.size());  // "backward"
      mgr.gradient_ready(j);
    }
    mgr.finish_backward();
  }
  if (s.max_norm) {
    const float n = mgr.clip_grad_norm(*s.max_norm);
    if (clip_norm) *clip_norm = n;
  }
  mgr.step();
  return mgr.report();
}

// Everything a rank holds after a step, as read back from its manager.
struct State {
  std::vector<std::vector<float>> p, m, v;
  std::vector<std::vector<std::uint8_t>> compute, device_view;
};

State read_state(GradientManager& mgr, const Scenario& s, const Shards& shards) {
  const auto specs = model(s.grad);
  const bool adamw = is_adamw(s.optimizer);
  State st;
  for (std::size_t i = 0; i < kParams; ++i) {
    const std::size_t n = shards[i].second - shards[i].first;
    const std::size_t cb =
        specs[i].has_compute_weights ? n * dtype_size(specs[i].compute_dtype) : 0;
    st.p.emplace_back(n);
    st.m.emplace_back(adamw ? n : 0);
    st.v.emplace_back(adamw ? n : 0);
    st.compute.emplace_back(cb);
    mgr.read_parameter(i, st.p.back(), st.m.back(), st.v.back(), st.compute.back());
    const ConstTensorView cw = mgr.compute_weights(i);
    EXPECT_EQ(cw.numel, specs[i].has_compute_weights ? n : 0);
    const auto* d = static_cast<const std::uint8_t*>(cw.data);
    st.device_view.emplace_back(d, d + cw.bytes());  // host device: device memory is host
  }
  return st;
}

template <class T>
::testing::AssertionResult same_bits(const std::vector<T>& got, const T* want, std::size_t n,
                                     const std::string& what) {
  if (got.size() != n)
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values for " << n;
  if (n == 0 || std::memcmp(got.data(), want, n * sizeof(T)) == 0)
    return ::testing::AssertionSuccess();
  std::size_t k = 0;
  while (std::memcmp(&got[k], &want[k], sizeof(T)) == 0) ++k;
  return ::testing::AssertionFailure() << what << ": first difference at element " << k;
}

// Expects a rank's state to be its shards of the expectation's whole-model `want`.
void expect_state(const State& st, const std::vector<manager_model::ParamState>& want,
                  const Scenario& s, const Shards& shards, const std::string& where) {
  const auto specs = model(s.grad);
  for (std::size_t i = 0; i < kParams; ++i) {
    const auto [lo, hi] = shards[i];
    const std::string at = where + " param " + std::to_string(i);
    EXPECT_TRUE(same_bits(st.p[i], want[i].master.data() + lo, hi - lo, at + " master"));
    if (is_adamw(s.optimizer)) {
      EXPECT_TRUE(same_bits(st.m[i], want[i].slots[0].data() + lo, hi - lo, at + " exp_avg"));
      EXPECT_TRUE(same_bits(st.v[i], want[i].slots[1].data() + lo, hi - lo, at + " exp_avg_sq"));
    }
    if (specs[i].has_compute_weights) {
      const std::size_t es = dtype_size(specs[i].compute_dtype);
      const std::uint8_t* w = want[i].compute.data() + lo * es;
      EXPECT_TRUE(same_bits(st.compute[i], w, (hi - lo) * es, at + " compute (read)"));
      EXPECT_TRUE(same_bits(st.device_view[i], w, (hi - lo) * es, at + " compute (view)"));
    }
  }
}

void expect_norm(const NormResult& got, const NormResult& want, const std::string& where) {
  EXPECT_EQ(std::bit_cast<std::uint32_t>(got.norm), std::bit_cast<std::uint32_t>(want.norm))
      << where << " norm " << got.norm << " vs " << want.norm;
  EXPECT_EQ(std::bit_cast<std::uint32_t>(got.max_abs), std::bit_cast<std::uint32_t>(want.max_abs))
      << where;
  EXPECT_EQ(got.finite, want.finite) << where;
  EXPECT_EQ(got.nan_count, want.nan_count) << where;
  EXPECT_EQ(got.inf_count, want.inf_count) << where;
  EXPECT_FALSE(got.needs_exact) << where;
}

void expect_report(const StepReport& got, const StepReport& want, const std::string& where) {
  EXPECT_EQ(got.stepped, want.stepped) << where;
  EXPECT_EQ(got.skipped, want.skipped) << where;
  EXPECT_EQ(got.chunks_speculated, want.chunks_speculated) << where;
  EXPECT_EQ(got.chunks_committed, want.chunks_committed) << where;
  EXPECT_EQ(got.chunks_rolled_back, want.chunks_rolled_back) << where;
  EXPECT_EQ(std::bit_cast<std::uint32_t>(got.clip_coefficient),
            std::bit_cast<std::uint32_t>(want.clip_coefficient))
      << where << " clip " << got.clip_coefficient << " vs " << want.clip_coefficient;
  expect_norm(got.norm, want.norm, where);
}

// Runs the stream through a single-process manager, checking every step's bits.
void run_and_compare(const Scenario& s) {
  SCOPED_TRACE(s.label());
  auto dev = device::make_host_device();
  const Shards whole = whole_model();
  auto mgr = make_gradient_manager(config_of(s, whole, dev.get()));
  ASSERT_EQ(mgr->mode(), OffloadMode::full);
  const manager_model::Run e = expected(s);
  load(*mgr, whole);
  expect_state(read_state(*mgr, s, whole), e.loaded, s, whole, "after load");
  for (int t = 0; t < kSteps; ++t) {
    const std::string where = "step " + std::to_string(t);
    float returned = 0.0f;
    const StepReport r = drive_step(*mgr, s, whole, t, &returned);
    expect_report(r, e.steps[t].report, where);
    if (s.max_norm)
      EXPECT_EQ(std::bit_cast<std::uint32_t>(returned),
                std::bit_cast<std::uint32_t>(e.steps[t].report.norm.norm));
    expect_state(read_state(*mgr, s, whole), e.steps[t].state, s, whole, where);
  }
  EXPECT_NO_THROW(mgr->close());
}

TEST(OffloadManager, MatchesTheReferenceBitForBit) {
  for (DType g : {DType::bf16, DType::f32})
    for (const char* opt : {"adamw", "adamw_torch", "sign_sgd"})
      for (int variant = 0; variant < 4; ++variant) {
        Scenario s;
        s.grad = g;
        s.optimizer = std::string(opt) == "sign_sgd" ? OptimizerConfig{SignSgdConfig{}}
                                                     : OptimizerConfig{AdamWConfig{}};
        s.formula = std::string(opt) == "adamw_torch" ? AdamWFormula::torch : AdamWFormula::native;
        if (variant == 1) s.max_norm = 0.05f;
        if (variant == 2) s.max_norm = 100.0f;
        s.overlap = variant == 3;
        run_and_compare(s);
      }
}

TEST(OffloadManager, ClippingBitesAndTheNormIsReported) {
  // Guard against a vacuous comparison: 0.05 must clip, 100 must not.
  Scenario s;
  s.max_norm = 0.05f;
  EXPECT_LT(expected(s).steps[0].report.clip_coefficient, 1.0f);
  Scenario big = s;
  big.max_norm = 100.0f;
  const StepReport e2 = expected(big).steps[0].report;
  EXPECT_EQ(e2.clip_coefficient, 1.0f);
  EXPECT_GT(e2.norm.norm, 0.05f);
}

TEST(OffloadManager, NonFiniteGradientSkipsTheStep) {
  for (OptimizerConfig opt : std::vector<OptimizerConfig>{AdamWConfig{}, SignSgdConfig{}}) {
    Scenario s;
    s.optimizer = opt;
    s.max_norm = 1.0f;
    s.nan_at = Site{1, 1, 5, 7};  // step 1, micro-batch 1, parameter 5 (chunk 2)
    SCOPED_TRACE(s.label());
    auto dev = device::make_host_device();
    const Shards whole = whole_model();
    auto mgr = make_gradient_manager(config_of(s, whole, dev.get()));
    load(*mgr, whole);
    const manager_model::Run e = expected(s);
    State before;
    for (int t = 0; t < kSteps; ++t) {
      float returned = 0.0f;
      const StepReport r = drive_step(*mgr, s, whole, t, &returned);
      expect_report(r, e.steps[t].report, "step " + std::to_string(t));
      const State after = read_state(*mgr, s, whole);
      if (t == 1) {
        EXPECT_TRUE(std::isnan(returned));
        EXPECT_TRUE(r.skipped);
        EXPECT_FALSE(r.stepped);
        EXPECT_FALSE(r.norm.finite);
        EXPECT_EQ(r.norm.nan_count, 1u);
        EXPECT_EQ(r.clip_coefficient, 0.0f);
        for (std::size_t i = 0; i < kParams; ++i) {  // nothing changed
          EXPECT_EQ(after.p[i], before.p[i]);
          EXPECT_EQ(after.m[i], before.m[i]);
          EXPECT_EQ(after.v[i], before.v[i]);
          EXPECT_EQ(after.compute[i], before.compute[i]);
        }
      }
      // Step 2 matches the reference only if the counters did not advance in step 1.
      expect_state(after, e.steps[t].state, s, whole, "step " + std::to_string(t));
      before = after;
    }
  }
}

TEST(OffloadManager, NonFiniteGradientWithOverlapSkipsOnlyItsChunk) {
  Scenario s;
  s.overlap = true;
  s.nan_at = Site{1, 2, 5, 11};  // in the final micro-batch
  auto dev = device::make_host_device();
  const Shards whole = whole_model();
  auto mgr = make_gradient_manager(config_of(s, whole, dev.get()));
  load(*mgr, whole);
  const manager_model::Run e = expected(s);
  State before;
  for (int t = 0; t < kSteps; ++t) {
    const StepReport r = drive_step(*mgr, s, whole, t);
    expect_report(r, e.steps[t].report, "step " + std::to_string(t));
    const State after = read_state(*mgr, s, whole);
    if (t == 1) {  // the NaN skips the whole step, speculated chunks restored
      EXPECT_TRUE(r.skipped);
      EXPECT_FALSE(r.stepped);
      EXPECT_EQ(r.chunks_rolled_back, r.chunks_speculated);
      EXPECT_EQ(after.p, before.p);
      EXPECT_EQ(after.m, before.m);
    }
    expect_state(after, e.steps[t].state, s, whole, "step " + std::to_string(t));
    before = after;
  }
}

TEST(OffloadManager, ClipWithOverlapGivesTheSerialBits) {
  Scenario s;
  s.overlap = true;
  s.max_norm = 1e-3f;  // clips: every speculated chunk rolls back and steps again
  auto dev = device::make_host_device();
  const Shards whole = whole_model();
  auto mgr = make_gradient_manager(config_of(s, whole, dev.get()));
  load(*mgr, whole);
  const manager_model::Run e = expected(s);
  const auto specs = model(s.grad);
  mgr->begin_step(gradient_scale(0), true);
  for (int mb = 0; mb < kMicro; ++mb) {
    mgr->begin_backward(mb == kMicro - 1);
    for (std::size_t j = kParams; j-- > 0;) {
      if (!has_gradient(0, mb, j)) continue;
      const auto g = gradient_bytes(s, specs[j], 0, mb, j, 0, kSizes[j]);
      if (!g.empty()) std::memcpy(mgr->gradient(j).data, g.data(), g.size());
      mgr->gradient_ready(j);
    }
    mgr->finish_backward();
  }
  const float norm = mgr->clip_grad_norm(*s.max_norm);
  EXPECT_EQ(std::bit_cast<std::uint32_t>(norm),
            std::bit_cast<std::uint32_t>(e.steps[0].report.norm.norm));
  test_support::expect_error([&] { mgr->clip_grad_norm(1.0f); }, Errc::invalid_argument,
                             "clip_grad_norm");
  mgr->step();
  const StepReport r = mgr->report();
  ASSERT_LT(r.clip_coefficient, 1.0f);
  EXPECT_GT(r.chunks_rolled_back, 0u);
  expect_report(r, e.steps[0].report, "clipped with overlap");
  expect_state(read_state(*mgr, s, whole), e.steps[0].state, s, whole, "clipped with overlap");
}

TEST(OffloadManager, SequenceErrorsAndCloseTwice) {
  Scenario s;
  auto dev = device::make_host_device();
  const Shards whole = whole_model();
  auto mgr = make_gradient_manager(config_of(s, whole, dev.get()));
  load(*mgr, whole);
  EXPECT_THROW(mgr->step(), Error);
  EXPECT_THROW(mgr->clip_grad_norm(1.0f), Error);
  drive_step(*mgr, s, whole, 0);
  EXPECT_NO_THROW(mgr->close());
  EXPECT_NO_THROW(mgr->close());
  EXPECT_THROW(mgr->begin_step(1.0f, false), Error);
  EXPECT_THROW(mgr->report(), Error);
}

TEST(OffloadManager, DestructorWithoutCloseMidStep) {
  Scenario s;
  auto dev = device::make_host_device();
  const Shards whole = whole_model();
  auto mgr = make_gradient_manager(config_of(s, whole, dev.get()));
  load(*mgr, whole);
  mgr->begin_step(1.0f, true);
  mgr->begin_backward(true);
  mgr->gradient_ready(5);
  mgr.reset();  // joins the worker, frees everything, does not throw
  SUCCEED();
}

TEST(OffloadManager, FailedCopySurfacesOnTheNextCallAndCloseDoesNotHang) {
  for (bool overlap : {false, true}) {
    Scenario s;
    s.overlap = overlap;
    auto dev = device::make_host_device();
    const Shards whole = whole_model();
    auto mgr = make_gradient_manager(config_of(s, whole, dev.get()));
    load(*mgr, whole);
    drive_step(*mgr, s, whole, 0);
    device::detail::inject_copy_failure(*dev, device::Queue::d2h, 4);
    bool raised = false;
    try {
      drive_step(*mgr, s, whole, 1);
    } catch (const Error& err) {
      raised = true;
      EXPECT_EQ(err.code(), Errc::internal);
      EXPECT_NE(std::string(err.what()).find("injected copy failure"), std::string::npos)
          << err.what();
    }
    EXPECT_TRUE(raised);
    // The manager is failed: every later call raises the error; close() raises it too.
    try {
      mgr->synchronize();
      ADD_FAILURE() << "synchronize after a failed copy did not throw";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), Errc::internal);
    }
    try {
      mgr->close();
      ADD_FAILURE() << "close after a failed copy did not throw";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), Errc::internal);
    }
    EXPECT_NO_THROW(mgr->close());
  }
}

TEST(OffloadManager, ShardedOverRanksGivesTheUnshardedBits) {
  for (int ranks : {2, 4}) {
    for (bool with_nan : {false, true}) {
      Scenario s;
      s.max_norm = 0.05f;
      if (with_nan) s.nan_at = Site{1, 0, 5, 69000};  // on one rank only
      SCOPED_TRACE(std::to_string(ranks) + " ranks " + s.label());
      const manager_model::Run e = expected(s);
      std::vector<StepReport> want;
      for (const manager_model::Step& step : e.steps) want.push_back(step.report);
      auto group = comm::make_in_process_group(ranks, std::chrono::seconds(60));
      std::vector<std::vector<StepReport>> got(ranks);
      std::vector<std::vector<State>> states(ranks);
      std::vector<std::exception_ptr> errors(ranks);
      std::vector<std::thread> threads;
      for (int r = 0; r < ranks; ++r)
        threads.emplace_back([&, r] {
          try {
            auto dev = device::make_host_device();
            const Shards shards = shards_of(ranks, r);
            auto mgr = make_gradient_manager(config_of(s, shards, dev.get(), group[r].get(), 1));
            load(*mgr, shards);
            for (int t = 0; t < kSteps; ++t) {
              got[r].push_back(drive_step(*mgr, s, shards, t));
              states[r].push_back(read_state(*mgr, s, shards));
            }
            mgr->close();
          } catch (...) {
            errors[r] = std::current_exception();
            group[r]->abort();
          }
        });
      for (auto& th : threads) th.join();
      for (int r = 0; r < ranks; ++r) {
        if (errors[r]) {
          try {
            std::rethrow_exception(errors[r]);
          } catch (const std::exception& x) {
            FAIL() << "rank " << r << ": " << x.what();
          }
        }
        const Shards shards = shards_of(ranks, r);
        for (int t = 0; t < kSteps; ++t) {
          const std::string where = "rank " + std::to_string(r) + " step " + std::to_string(t);
          expect_report(got[r][t], want[t], where);
          expect_state(states[r][t], e.steps[t].state, s, shards, where);
        }
      }
      if (with_nan) EXPECT_TRUE(want[1].skipped);
    }
  }
}

TEST(OffloadManager, ShardsAreUnevenWithAnEmptyOne) {
  for (int ranks : {2, 4})
    for (std::size_t i = 0; i < kParams; ++i) {
      std::size_t covered = 0, empties = 0;
      for (int r = 0; r < ranks; ++r) {
        const auto [lo, hi] = shards_of(ranks, r)[i];
        EXPECT_EQ(lo, covered);
        covered = hi;
        empties += lo == hi;
      }
      EXPECT_EQ(covered, kSizes[i]);
      EXPECT_GE(empties, 1u);
    }
}

TEST(OffloadManager, FactoryRefusals) {
  auto dev = device::make_host_device();
  Scenario s;
  test_support::expect_error([] { parse_optimizer("muon"); }, Errc::invalid_argument, "optimizer");
  // Mode full builds every optimizer: AdamW with amsgrad, SGD with momentum, Adagrad.
  for (const OptimizerConfig& opt :
       std::vector<OptimizerConfig>{AdamConfig{}, SgdConfig{0.1, 0.9}, AdagradConfig{}}) {
    ManagerConfig cfg = config_of(s, whole_model(), dev.get());
    cfg.optimizer = opt;
    make_gradient_manager(cfg)->close();
  }
  test_support::expect_error([] { parse_offload_mode("fsdp"); }, Errc::invalid_argument,
                             "offload_mode");
  EXPECT_EQ(parse_offload_mode("full"), OffloadMode::full);
  // Bad hyper-parameters are refused at construction, before any step.
  ManagerConfig bad = config_of(s, whole_model(), dev.get());
  std::get<AdamWConfig>(bad.optimizer).beta1 = 1.5;
  bad.groups.clear();  // the optimizer's betas are the single group's
  test_support::expect_error([&] { make_gradient_manager(bad); }, Errc::invalid_argument,
                             "optimizer.adamw.beta1");
  SgdConfig nesterov;
  nesterov.nesterov = true;  // needs momentum
  bad.optimizer = nesterov;
  test_support::expect_error([&] { make_gradient_manager(bad); }, Errc::invalid_argument,
                             "optimizer.sgd.nesterov");
}

TEST(OffloadManager, BadRingsAreRefusedNamingTheFieldInEveryMode) {
  auto dev = device::make_host_device();
  const Scenario s;
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    ManagerConfig cfg = config_of(s, whole_model(), dev.get());
    cfg.mode = mode;
    for (std::int64_t slots : {std::int64_t{0}, std::int64_t{-2}}) {
      cfg.ring_slots = slots;
      test_support::expect_error([&] { make_gradient_manager(cfg); }, Errc::out_of_range,
                                 "ring_slots");
    }
    cfg.ring_slots = ManagerConfig::kDefaultRing;
    cfg.ring_slot_elements = 0;
    test_support::expect_error([&] { make_gradient_manager(cfg); }, Errc::out_of_range,
                               "ring_slot_elements");
    // 256-element slots: the model's 75,161 elements fill 297 of them (pieces of at most a
    // slot, packed in order at 64-element boundaries), far fewer than 1,000.
    cfg.ring_slot_elements = 256;
    cfg.ring_slots = 1000;
    test_support::expect_error([&] { make_gradient_manager(cfg); }, Errc::invalid_argument,
                               "ring_slots");
    cfg.ring_slots = 2;
    make_gradient_manager(cfg)->close();
  }
}

// Σ over the parameters of `bytes(numel)` rounded up to 256 (each array's view).
template <class F>
std::size_t sum_views(const std::vector<ParamSpec>& specs, F bytes) {
  std::size_t total = 0;
  for (const ParamSpec& p : specs) total += (bytes(p) + 255) / 256 * 256;
  return total;
}

// Drives one step of `micro` micro-batches of small gradients through the manager's own
// buffers (host device memory), clip at 1.
void simple_step(GradientManager& m, int micro) {
  m.begin_step(0.5f, false);
  for (int mb = 0; mb < micro; ++mb) {
    m.begin_backward(mb + 1 == micro);
    for (std::size_t i = m.config().params.size(); i-- > 0;) {
      const TensorView g = m.gradient(i);
      if (g.numel != 0) std::memset(g.data, 0x3c, g.bytes());  // a small finite value
      m.gradient_ready(i);
    }
    m.finish_backward();
  }
  (void)m.clip_grad_norm(1.0f);
  m.step();
  (void)m.report();
}

TEST(OffloadManager, MemoryReportsEveryByteFromTheDocumentedFormulas) {
  auto dev = device::make_host_device();
  const Scenario s;  // AdamW: master, exp_avg, exp_avg_sq
  ManagerConfig cfg = config_of(s, whole_model(), dev.get());
  cfg.ring_slots = 3;
  cfg.ring_slot_elements = 1000;  // rounded up to 1,024
  auto m = make_gradient_manager(cfg);
  load(*m, whole_model());
  const auto& specs = cfg.params;
  const std::size_t state = sum_views(specs, [](const ParamSpec& p) { return p.numel * 4; });
  const std::size_t grads =
      sum_views(specs, [](const ParamSpec& p) { return p.numel * dtype_size(p.grad_dtype); });
  const std::size_t computes = sum_views(specs, [](const ParamSpec& p) {
    return p.has_compute_weights ? p.numel * dtype_size(p.compute_dtype) : 0;
  });
  // The rings: 3 slots of 1,024 elements of the widest gradient dtype (f32: parameter 4)
  // for staging and fetch, of the widest compute dtype for upload (2 bytes: parameter 3's
  // f32 has no compute weights). Nothing else: no scratch (a held gradient is read as
  // its f32 widening, never widened into a buffer).
  const std::size_t ring = 3 * 1024;
  auto expect_kinds = [&](std::size_t acc, const char* when) {
    SCOPED_TRACE(when);
    const MemoryReport r = m->memory();
    EXPECT_EQ(r.kind("master").bytes, state);
    EXPECT_EQ(r.kind("exp_avg").bytes, state);
    EXPECT_EQ(r.kind("exp_avg_sq").bytes, state);
    EXPECT_EQ(r.kind("accumulator").bytes, acc);
    EXPECT_EQ(r.kind("staging").bytes, ring * 4);
    EXPECT_EQ(r.kind("fetch").bytes, ring * 4);
    EXPECT_EQ(r.kind("upload").bytes, ring * 2);
    for (const MemoryUse& k : r.kinds) EXPECT_NE(k.kind, "scratch");
    EXPECT_EQ(r.kind("speculation").bytes, 0u);
    std::size_t device = 0;
    for (const MemoryUse& k : r.kinds)
      if (k.device) device += k.bytes;
    EXPECT_EQ(device, grads + computes);  // the manager's gradient and compute buffers
    EXPECT_EQ(r.host_bytes, 3 * state + acc + ring * 10);
    EXPECT_EQ(r.host_peak, r.host_bytes);  // nothing transient outlives its call
  };
  expect_kinds(0, "constructed");
  simple_step(*m, 1);  // one micro-batch: no accumulator
  expect_kinds(0, "after a step of one micro-batch");
  simple_step(*m, 2);  // the first step that accumulates allocates them
  expect_kinds(state, "after a step of two micro-batches");
  simple_step(*m, 1);  // kept
  expect_kinds(state, "after another step of one micro-batch");
  m->close();
}

TEST(OffloadManager, AStepOfOneMicroBatchReadsItsGradientsAgainUntilStep) {
  auto dev = device::make_host_device();
  const Scenario s;
  ManagerConfig cfg = config_of(s, whole_model(), dev.get());
  for (ParamSpec& p : cfg.params) p.gradient_buffer = false;
  auto m = make_gradient_manager(cfg);
  load(*m, whole_model());
  std::vector<std::vector<std::uint8_t>> grads;
  for (const ParamSpec& p : cfg.params)
    grads.emplace_back(std::max<std::size_t>(1, p.numel * dtype_size(p.grad_dtype)), 0x3c);
  auto hand_over = [&](std::size_t i) {
    const ParamSpec& p = cfg.params[i];
    m->gradient_ready(i, ConstTensorView{grads[i].data(), p.numel, p.grad_dtype});
  };
  m->begin_step(0.5f, false);
  m->begin_backward(true);
  EXPECT_TRUE(m->gradients_read_by_step());
  for (std::size_t i = cfg.params.size(); i-- > 0;) hand_over(i);
  m->finish_backward();
  // Parameter 5 (70,000 elements) is read again by step(): not released before it.
  test_support::expect_error([&] { (void)m->gradient_released(5); }, Errc::invalid_argument,
                             "gradient_released");
  (void)m->gradient_released(0);  // no elements: nothing read again
  m->step();
  EXPECT_TRUE(m->gradient_released(5).complete());  // step()'s reads are done
  EXPECT_TRUE(m->report().stepped);
  // Two micro-batches: accumulated in host memory, released as they arrive.
  m->begin_step(0.5f, false);
  m->begin_backward(false);
  EXPECT_FALSE(m->gradients_read_by_step());
  for (std::size_t i = cfg.params.size(); i-- > 0;) hand_over(i);
  m->finish_backward();
  m->begin_backward(true);
  for (std::size_t i = cfg.params.size(); i-- > 0;) hand_over(i);
  EXPECT_FALSE(m->gradients_read_by_step());
  m->gradient_released(5).wait();
  m->finish_backward();
  m->step();
  EXPECT_TRUE(m->report().stepped);
  m->close();
}

}  // namespace
