// Unit: the speculation of overlapped steps (docs/managers.md, "With overlap:
// speculate, then commit or roll back"), on the host device. Every comparison is with an
// independent run: the same stream without overlap (the serial run) and manager_model
// (stepcore::reference alone), never the speculating code with itself.
//
// * Bits: a 20-step stream mixing unclipped, clipped and non-finite steps, in every mode
//   (none, none with lazy scale, optimizer, full with 1 and 3 engine threads), AdamW
//   (torch) and SignSGD, bf16 and f32 gradients, under each policy and budgets of no
//   chunk, one chunk (sized from the ParamSpecs by the documented formula; one byte less
//   admits none) and all: the state after every step is the serial run's and the model's,
//   and the report's counts follow the budget.
// * Ranks: the stream over 2 and 4 in-process ranks, a NaN on one rank only: every rank
//   holds its slice of the one-rank serial run, and skips the whole step with the others.
// * The decision arriving while a speculated chunk is still being stepped (full: a chunk
//   of 3 M elements posted by the final gradient; modes none and optimizer: the device's
//   download queue held behind a gate until after the decision was called).
// * Memory: full offload's rollback space stays within the budget (resident set).
// * Bad input: the policy and budget in the configuration, parse_speculation, a second
//   clip_grad_norm and one after step() with overlap.
// * Failures while chunks are speculated: an injected copy failure (every mode) and an
//   engine exception (full): the manager stays failed, the model's compute weights are
//   as the previous step left them, full offload's live state too, and a new manager
//   continues from the checkpoint saved before the step.
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "device/host_device.hpp"
#include "expect_error.hpp"
#include "forwarding_device.hpp"
#include "managers_cases.hpp"
#include "sanitized.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

namespace {

using namespace managers_cases;
using device::Queue;
using test_support::expect_error;

// ---- The mixed stream --------------------------------------------------------------------

constexpr int kSteps = 20;
// 8 parameters of 1531 elements (not a multiple of 64: every saved array is padded to 256
// bytes), chunk_elements 3062: four chunks of two parameters, the same bytes in every
// mode; groups "decay" and "no_decay" (parameters 1 and 5) split chunks 0 and 2.
const std::vector<std::size_t> kSpecSizes(8, 1531);
constexpr std::size_t kSpecChunk = 3062;
constexpr float kBig = 1e6f;     // clip_grad_norm that does not clip (coefficient 1)
constexpr float kSmall = 1e-5f;  // clips every step of the stream

// Each step's decision: no clip_grad_norm, a large max_norm, a small one; steps 4, 9 and
// 14 carry a NaN (one each of the three kinds).
enum class Kind { none, big, small };
constexpr Kind kKinds[kSteps] = {Kind::none, Kind::big,   Kind::small, Kind::none, Kind::none,
                                 Kind::none, Kind::small, Kind::small, Kind::big,  Kind::small,
                                 Kind::none, Kind::big,   Kind::small, Kind::none, Kind::big,
                                 Kind::none, Kind::small, Kind::big,   Kind::none, Kind::small};
constexpr int kNanSteps[] = {4, 9, 14};

std::optional<float> mixed_max_norm(int step) {
  switch (kKinds[static_cast<std::size_t>(step) % kSteps]) {
    case Kind::big:
      return kBig;
    case Kind::small:
      return kSmall;
    case Kind::none:
      break;
  }
  return std::nullopt;
}

bool is_nan_step(int s) {
  for (int n : kNanSteps)
    if (n == s) return true;
  return false;
}

// A poison in step s at (micro, param) of the flow's plan where that parameter has a
// gradient: the preferred micro-batch (-1: the last), from the preferred parameter on.
Poison poison_in(Flow flow, int s, std::size_t params, int micro, std::size_t param,
                 int rank = -1) {
  const StepPlan plan = plan_step(flow, s, params, 1);
  const int mb = micro < 0 ? plan.micro_batches - 1 : std::min(micro, plan.micro_batches - 1);
  for (std::size_t k = 0; k < params; ++k) {
    const std::size_t i = (param + k) % params;
    if (plan.has_grad[static_cast<std::size_t>(mb)][i]) return {s, mb, i, rank};
  }
  return {s, mb, param, rank};
}

// The mixed case: 20 steps, the max_norm of each, NaNs in steps 4 (the final micro-batch
// of the last parameter: the first chunk speculated), 9 (the first micro-batch) and 14
// (the final micro-batch of parameter 0: the last chunk).
Case mixed_case(DType d, OptimizerConfig opt, Flow flow,
                AdamWFormula formula = AdamWFormula::torch) {
  Case c;
  c.grad_dtype = d;
  c.optimizer = opt;
  c.flow = flow;
  c.formula = formula;
  c.steps = kSteps;
  c.sizes = kSpecSizes;
  c.chunk = kSpecChunk;
  c.max_norm_of = mixed_max_norm;
  const std::size_t n = c.sizes.size();
  c.poisons = {poison_in(flow, 4, n, -1, n - 1), poison_in(flow, 9, n, 0, 2),
               poison_in(flow, 14, n, -1, 0)};
  return c;
}

// The mode variants of the bits tests.
struct Variant {
  std::string label;
  OffloadMode mode;
  bool lazy;
  int threads;
};
const std::vector<Variant> kVariants = {{"none", OffloadMode::none, false, 2},
                                        {"none (lazy scale)", OffloadMode::none, true, 2},
                                        {"optimizer", OffloadMode::optimizer, false, 2},
                                        {"full (1 thread)", OffloadMode::full, false, 1},
                                        {"full (3 threads)", OffloadMode::full, false, 3}};

// Runs the case's stream through a manager of the variant on a fresh host device.
std::vector<StepRecord> run_variant(const Variant& v, const Case& c,
                                    comm::Communicator* comm = nullptr,
                                    const std::vector<StreamParam>* shard = nullptr,
                                    const std::vector<std::size_t>* offsets = nullptr) {
  auto dev = make_device();
  Build b;
  b.mode = v.mode;
  b.lazy = v.lazy;
  b.threads = v.threads;
  b.comm = comm;
  b.shard = shard;
  b.offsets = offsets;
  auto m = make_manager(b, c, *dev);
  auto rec = run_stream(*m, *dev, stream_options(c, offsets, 0, -1, comm ? comm->rank() : 0));
  m->close();
  return rec;
}

// Expects every bit the trainer observes to agree, step by step: clip_grad_norm's result,
// the effective scale, the report's norm, coefficient, skipped and stepped, the step
// counters and every parameter's master, moments and compute weights. Not the counts.
void expect_bits(const std::vector<StepRecord>& got, const std::vector<StepRecord>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t s = 0; s < got.size(); ++s) {
    const std::string at = what + ", step " + std::to_string(s);
    EXPECT_EQ(got[s].norm_bits, want[s].norm_bits) << at << ": clip_grad_norm's result";
    EXPECT_EQ(got[s].scale_bits, want[s].scale_bits) << at << ": effective scale";
    EXPECT_EQ(got[s].report_norm_bits, want[s].report_norm_bits) << at << ": report norm";
    EXPECT_EQ(got[s].clip_bits, want[s].clip_bits) << at << ": clip coefficient";
    EXPECT_EQ(got[s].skipped, want[s].skipped) << at << ": skipped";
    EXPECT_EQ(got[s].stepped, want[s].stepped) << at << ": stepped";
    EXPECT_EQ(got[s].steps, want[s].steps) << at << ": step counters";
    ASSERT_EQ(got[s].state.size(), want[s].state.size()) << at;
    for (std::size_t i = 0; i < got[s].state.size(); ++i)
      ASSERT_TRUE(got[s].state[i] == want[s].state[i])
          << at << ", parameter " << i << ": master|moments|compute bits differ";
  }
}

// ---- Budgets ------------------------------------------------------------------------------

std::size_t align256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// The rollback space chunk [first, last) takes (docs/managers.md, "The mechanism per
// mode"), from the ParamSpecs alone: every state array (master; AdamW: exp_avg and
// exp_avg_sq) of 4 B/element from a 256-byte boundary, and each parameter's compute
// weights from a 256-byte boundary (full offload: pinned host memory); modes none and
// optimizer add the step counters (AdamW: 4 B per parameter, one range). (Mode optimizer
// saves the chunk's host block: masters, then moments, each view 256-aligned: the same sum.)
std::size_t rollback_bytes_of(OffloadMode mode, OptimizerConfig opt,
                              const std::vector<ParamSpec>& specs, std::size_t first,
                              std::size_t last) {
  const bool adamw = is_adamw(opt);
  std::size_t bytes = 0;
  for (std::size_t i = first; i < last; ++i)
    bytes += (adamw ? 3 : 1) * align256(specs[i].numel * sizeof(float));
  if (adamw && last > first && mode != OffloadMode::full)
    bytes += align256(sizeof(float) * (last - first));
  for (std::size_t i = first; i < last; ++i)
    if (specs[i].has_compute_weights)
      bytes += align256(specs[i].numel * dtype_size(specs[i].compute_dtype));
  return bytes;
}

// The device staging full offload gives speculated chunk [first, last)'s compute weights
// (ManagerConfig::speculation_device_bytes): each parameter's from a 256-byte boundary.
std::size_t staging_bytes_of(const std::vector<ParamSpec>& specs, std::size_t first,
                             std::size_t last) {
  std::size_t bytes = 0;
  for (std::size_t i = first; i < last; ++i)
    if (specs[i].has_compute_weights)
      bytes += align256(specs[i].numel * dtype_size(specs[i].compute_dtype));
  return bytes;
}

// The budget of exactly one chunk of the case in `mode`: every chunk of the mixed model
// takes the same bytes (asserted), so this admits one chunk and never two.
std::int64_t one_chunk_budget(OffloadMode mode, const Case& c) {
  const std::vector<ParamSpec> specs = param_specs(case_model(c));
  std::size_t lo = SIZE_MAX, hi = 0;
  for (const auto& [first, last] : manager_model::chunks_of(specs, c.chunk)) {
    const std::size_t b = rollback_bytes_of(mode, c.optimizer, specs, first, last);
    lo = std::min(lo, b);
    hi = std::max(hi, b);
  }
  EXPECT_EQ(lo, hi) << "the test model's chunks should take the same bytes";
  return static_cast<std::int64_t>(hi);
}

enum class Budget { none, under_one, one, all };
const char* budget_name(Budget b) {
  switch (b) {
    case Budget::none:
      return "budget 0";
    case Budget::under_one:
      return "budget one chunk - 1 byte";
    case Budget::one:
      return "budget one chunk";
    case Budget::all:
      return "budget kAllChunks";
  }
  return "?";
}

// The report's counts under a budget, against the model's (which assumes every chunk
// fits): all: the model's; 0 or less than a chunk: none; one chunk: one in the steps where
// the policy speculates, committed or rolled back as the model's chunks are.
void expect_counts(const std::vector<StepRecord>& got, const std::vector<StepRecord>& model,
                   Budget budget, const std::string& what) {
  ASSERT_EQ(got.size(), model.size());
  for (std::size_t s = 0; s < got.size(); ++s) {
    const std::string at = what + ", step " + std::to_string(s);
    const StepRecord& g = got[s];
    const StepRecord& w = model[s];
    EXPECT_EQ(g.committed + g.rolled_back, g.speculated) << at;
    switch (budget) {
      case Budget::all:
        EXPECT_EQ(g.speculated, w.speculated) << at << ": speculated";
        EXPECT_EQ(g.committed, w.committed) << at << ": committed";
        EXPECT_EQ(g.rolled_back, w.rolled_back) << at << ": rolled back";
        break;
      case Budget::none:
      case Budget::under_one:
        EXPECT_EQ(g.speculated, 0u) << at << ": speculated";
        break;
      case Budget::one:
        EXPECT_EQ(g.speculated, w.speculated > 0 ? 1u : 0u) << at << ": speculated";
        EXPECT_EQ(g.committed, w.committed > 0 ? 1u : 0u) << at << ": committed";
        EXPECT_EQ(g.rolled_back, w.rolled_back > 0 ? 1u : 0u) << at << ": rolled back";
        break;
    }
  }
}

// The stream does what it is for: clipped and unclipped steps, whole steps skipped (no
// parameter changes), and, speculating always, commits and rollbacks.
void expect_mixed(const std::vector<StepRecord>& want, const std::vector<StepRecord>& always) {
  std::size_t commits = 0, rollbacks = 0;
  for (int s = 0; s < kSteps; ++s) {
    const auto su = static_cast<std::size_t>(s);
    const float clip = std::bit_cast<float>(want[su].clip_bits);
    if (is_nan_step(s)) {
      ASSERT_TRUE(want[su].skipped) << "step " << s;
      ASSERT_EQ(want[su].state, want[su - 1].state) << "step " << s << " changed the state";
    } else {
      ASSERT_FALSE(want[su].skipped) << "step " << s;
      if (kKinds[su] == Kind::small) ASSERT_LT(clip, 1.0f) << "step " << s << " does not clip";
      if (kKinds[su] != Kind::small) ASSERT_EQ(clip, 1.0f) << "step " << s << " clips";
    }
    commits += always[su].committed;
    rollbacks += always[su].rolled_back;
  }
  ASSERT_GT(commits, 0u);
  ASSERT_GT(rollbacks, 0u);
}

TEST(Speculation, TwentyMixedStepsGiveTheSerialAndReferenceBitsInEveryModePolicyAndBudget) {
  const auto t0 = std::chrono::steady_clock::now();
  for (DType d : {DType::bf16, DType::f32})
    for (OptimizerConfig opt : std::vector<OptimizerConfig>{AdamWConfig{}, SignSgdConfig{}}) {
      // bf16: every parameter gets a gradient in each of 3 micro-batches; f32: the RL flow
      // (varying micro-batches, parameters without gradients: chunks posted by the final
      // finish_backward).
      const Case serial = mixed_case(d, opt, d == DType::bf16 ? Flow::sft : Flow::rl);
      SCOPED_TRACE(serial.label());
      const auto want = run_reference(serial);
      std::vector<std::vector<StepRecord>> models;  // the counts of each policy
      for (Speculation policy : {Speculation::always, Speculation::never, Speculation::automatic}) {
        Case c = serial;
        c.overlap = true;
        c.speculation = policy;
        models.push_back(run_reference(c));
        expect_bits(models.back(), want, "the model with overlap");  // overlap changes no bit
      }
      expect_mixed(want, models[0]);
      if (HasFatalFailure()) return;
      for (const Variant& v : kVariants) {
        const auto serial_run = run_variant(v, serial);
        expect_bits(serial_run, want, v.label + " serial vs the reference");
        if (HasFatalFailure()) return;
        std::size_t p = 0;
        for (Speculation policy :
             {Speculation::always, Speculation::never, Speculation::automatic}) {
          const auto& model = models[p++];
          const std::int64_t one = one_chunk_budget(v.mode, serial);
          std::vector<std::pair<Budget, std::int64_t>> budgets = {
              {Budget::none, 0}, {Budget::one, one}, {Budget::all, ManagerConfig::kAllChunks}};
          if (policy == Speculation::always) budgets.push_back({Budget::under_one, one - 1});
          // Full offload, speculating always: device staging of every chunk, of one chunk
          // (the others upload after the commit), and of every chunk the one-chunk budget
          // admits.
          std::vector<std::int64_t> stagings = {0};
          if (v.mode == OffloadMode::full && policy == Speculation::always) {
            const std::vector<ParamSpec> specs = param_specs(case_model(serial));
            const auto first = manager_model::chunks_of(specs, serial.chunk).front();
            stagings.push_back(ManagerConfig::kAllChunks);
            stagings.push_back(
                static_cast<std::int64_t>(staging_bytes_of(specs, first.first, first.second)));
          }
          for (const auto& [budget, bytes] : budgets)
            for (std::int64_t staging : stagings) {
              if (staging != 0 && budget != Budget::all && budget != Budget::one) continue;
              Case c = serial;
              c.overlap = true;
              c.speculation = policy;
              c.speculation_bytes = bytes;
              c.speculation_device_bytes = staging;
              const std::string what =
                  v.label + ", " + std::string(speculation_name(policy)) + ", " +
                  budget_name(budget) +
                  (staging != 0 ? ", device staging " + std::to_string(staging) : "");
              const auto got = run_variant(v, c);
              expect_bits(got, serial_run, what + " vs serial");
              expect_bits(got, want, what + " vs the reference");
              expect_counts(got, model, budget, what);
              if (HasFatalFailure() || HasFailure()) return;
            }
        }
      }
    }
  std::printf(
      "[ speculation ] 4 streams x 5 variants x 10 budgets/policies (full: + 4 device stagings) of "
      "20 steps: %.1f s\n",
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// ---- Ranks -----------------------------------------------------------------------------

// The mixed stream (AdamW native: element-wise, so a shard's update is the slice of the
// whole's) sharded over `ranks` in-process ranks, with step 4's NaN on rank 1 only, step
// 14's on the last rank only and step 9's on every rank.
Case sharded_case(int ranks) {
  Case c = mixed_case(DType::bf16, AdamWConfig{}, Flow::sft, AdamWFormula::native);
  c.chunk = 700;  // several chunks on every rank
  c.poisons = {{4, 2, 3, 1}, {9, 0, 2, -1}, {14, 2, 0, ranks - 1}};
  return c;
}

// Expects rank r's records to hold its slice of the whole serial run (expect_shard_of),
// its report to be the whole run's, a poisoned step to leave every parameter of the rank
// as it was and be skipped, and the counts to follow the policy as the model's do.
void expect_rank(const std::vector<StepRecord>& got, const std::vector<StepRecord>& whole,
                 const std::vector<StepRecord>& model, const Sharding& sh, int r,
                 const std::vector<StreamParam>& m) {
  expect_shard_of(got, whole, m, sh, r, 2);
  for (std::size_t s = 0; s < got.size(); ++s) {
    const std::string at = "rank " + std::to_string(r) + " step " + std::to_string(s);
    EXPECT_EQ(got[s].report_norm_bits, whole[s].report_norm_bits) << at;
    EXPECT_EQ(got[s].clip_bits, whole[s].clip_bits) << at;
    EXPECT_EQ(got[s].stepped, whole[s].stepped) << at;
    if (is_nan_step(static_cast<int>(s))) {
      EXPECT_TRUE(got[s].skipped) << at;
      EXPECT_FALSE(got[s].stepped) << at;
      EXPECT_TRUE(got[s].state == got[s - 1].state) << at << ": a skipped step changed a parameter";
      EXPECT_EQ(got[s].steps, got[s - 1].steps) << at;
    }
    // Every rank has chunks of its own: it speculates where the policy does, and keeps or
    // restores them all as the (global) decision says.
    EXPECT_EQ(got[s].speculated > 0, model[s].speculated > 0) << at;
    EXPECT_EQ(got[s].committed, model[s].committed > 0 ? got[s].speculated : 0u) << at;
    EXPECT_EQ(got[s].rolled_back, model[s].rolled_back > 0 ? got[s].speculated : 0u) << at;
  }
}

TEST(Speculation, ShardedOverInProcessRanksEveryRankHoldsItsSliceOfTheSerialRun) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int ranks : {2, 4}) {
    const Case c0 = sharded_case(ranks);
    const std::vector<StreamParam> model = case_model(c0);
    // The one-rank serial run: every poison on its one rank.
    Case whole_case = c0;
    for (Poison& p : whole_case.poisons) p.rank = -1;
    const auto whole = run_variant(kVariants[0], whole_case);
    expect_bits(whole, run_reference(whole_case), "the one-rank serial run vs the reference");
    if (HasFatalFailure()) return;
    const Sharding sh = shard_model(model, ranks);
    for (int r : {1, ranks - 1})  // the one-rank NaNs land in a non-empty shard
      ASSERT_GT(sh.shards[static_cast<std::size_t>(r)][r == 1 ? 3 : 0].numel, 0u);
    for (const Variant& v : {kVariants[0], kVariants[1], kVariants[2], kVariants[4]})
      for (Speculation policy : {Speculation::always, Speculation::automatic}) {
        Case c = c0;
        c.overlap = true;
        c.speculation = policy;
        const auto counts = run_reference(c);
        SCOPED_TRACE(std::to_string(ranks) + " ranks, " + v.label + ", " +
                     std::string(speculation_name(policy)));
        std::vector<std::vector<StepRecord>> got(static_cast<std::size_t>(ranks));
        const auto errors = test_support::on_ranks(ranks, [&](int r, comm::Communicator& comm) {
          const auto ru = static_cast<std::size_t>(r);
          got[ru] = run_variant(v, c, &comm, &sh.shards[ru], &sh.offsets[ru]);
        });
        for (int r = 0; r < ranks; ++r) {
          ASSERT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
          expect_rank(got[static_cast<std::size_t>(r)], whole, counts, sh, r, model);
        }
        if (HasFailure()) return;
      }
  }
  std::printf("[ speculation ] sharded runs: %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// ---- Long steps through a small ring -----------------------------------------------------

// Long steps: 22 parameters of mixed sizes (0, 1, 63, 255, 257, 1000 and 3000 elements:
// several pieces of a 256-element ring slot, or several parameters to a slot) in chunks
// of at most 2,000 elements (14 chunks); full offload's rings of 2 slots of 256
// elements. 10 steps of the mixed max_norm (commits, rollbacks) with a NaN in step 4, in
// every mode, without overlap and with it (speculating every chunk; full offload also
// with device staging): the reference's bits after every step. Flows: one micro-batch per
// step (full offload holds the gradients on the device and reads them again: no
// accumulator), RL (1 to 4 micro-batches, parameters without gradients: the first step of
// several allocates the accumulators), SFT; caller-owned gradient buffers, poisoned once
// released (step() releases the held ones). On the host device the step reads the held
// gradients in place; on a device it cannot read (a forwarding device) through the fetch
// ring.
TEST(Speculation, LongStepsThroughARingOfTwoGiveTheReferenceBitsInEveryMode) {
  const std::vector<std::size_t> sizes = {3000, 1,    257, 0,   1000, 63,  255,  3000,
                                          1,    1000, 257, 63,  255,  0,   3000, 1000,
                                          257,  1,    63,  255, 1000, 3000};
  for (Flow flow : {Flow::rl_single, Flow::rl, Flow::sft}) {
    Case c;
    c.grad_dtype = DType::bf16;
    c.optimizer = AdamWConfig{};
    c.flow = flow;
    c.steps = 10;
    c.sizes = sizes;
    c.chunk = 2000;
    c.max_norm_of = mixed_max_norm;
    c.caller_gradients = true;
    c.ring_slots = 2;
    c.ring_slot_elements = 256;
    c.poisons = {poison_in(flow, 4, sizes.size(), -1, 7)};
    SCOPED_TRACE(c.label());
    const auto want = run_reference(c);
    for (const Variant& v : kVariants) {
      expect_bits(run_variant(v, c), want, v.label + " without overlap");
      if (HasFatalFailure()) return;
      Case o = c;
      o.overlap = true;
      o.speculation = Speculation::always;
      expect_bits(run_variant(v, o), want, v.label + " with overlap");
      if (HasFatalFailure()) return;
      if (v.mode != OffloadMode::full) continue;
      o.speculation_device_bytes = ManagerConfig::kAllChunks;
      expect_bits(run_variant(v, o), want, v.label + " with overlap and device staging");
      if (HasFatalFailure()) return;
    }
    // Full offload on a device whose memory the CPU does not read in place (the host
    // device behind a forwarding layer): a holding step's gradients come back through
    // the fetch ring's copies, with and without overlap.
    for (bool overlap : {false, true}) {
      test_support::ForwardingDevice fwd;
      Case o = c;
      o.overlap = overlap;
      o.speculation = Speculation::always;
      Build b;
      b.mode = OffloadMode::full;
      b.threads = 2;
      auto m = make_manager(b, o, fwd);
      const auto rec = run_stream(*m, fwd, stream_options(o, nullptr, 0, -1, 0));
      m->close();
      expect_bits(rec, want,
                  std::string("full through the fetch ring") + (overlap ? " with overlap" : ""));
      if (HasFatalFailure()) return;
    }
  }
}

// ---- A simple trainer for the tests below --------------------------------------------

// Drives steps of two micro-batches: parameter i's gradient in (step, micro) is the
// stream's value (seed 7) in its grad dtype, written into the manager's buffer on the
// compute queue; optionally a NaN in one parameter's first element of the final
// micro-batch. The host buffer is reused (no allocation while a step runs).
class Trainer {
 public:
  Trainer(GradientManager& m, device::Device& dev) : m_(m), dev_(dev) {
    std::size_t most = 1;
    for (const ParamSpec& p : m.config().params)
      most = std::max(most, p.numel * dtype_size(p.grad_dtype));
    host_.resize(most);
  }
  std::function<void()> before_final_backward;                 // after the first micro-batch
  std::function<void(int micro, std::size_t i)> before_ready;  // the gradient is written
  std::function<void()> before_decision;                       // after the final finish_backward

  // Runs one step; returns the seconds the decision (clip_grad_norm, step) took.
  double step(int s, bool overlap, std::optional<float> max_norm,
              std::optional<std::size_t> nan_param = {}) {
    const auto& params = m_.config().params;
    m_.begin_step(1.0f / 512.0f, overlap);
    for (int mb = 0; mb < 2; ++mb) {
      if (mb == 1 && before_final_backward) before_final_backward();
      m_.begin_backward(mb == 1);
      for (std::size_t i = params.size(); i-- > 0;) {  // backward: last parameter first
        const TensorView g = m_.gradient(i);
        if (g.numel != 0) {
          make_gradient(7, s, mb, i, 0, g.numel, g.dtype, host_.data());
          if (mb == 1 && nan_param == i) {
            const float nan = std::numeric_limits<float>::quiet_NaN();
            const std::uint16_t h = 0x7FC0;
            if (g.dtype == DType::f32)
              std::memcpy(host_.data(), &nan, 4);
            else
              std::memcpy(host_.data(), &h, 2);
          }
          dev_.copy(Queue::compute, g.data, host_.data(), g.bytes());
          dev_.synchronize(dev_.record(Queue::compute));
        }
        if (before_ready) before_ready(mb, i);
        m_.gradient_ready(i);
      }
      m_.finish_backward();
    }
    if (before_decision) before_decision();
    const auto t0 = std::chrono::steady_clock::now();
    if (max_norm) (void)m_.clip_grad_norm(*max_norm);
    m_.step();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  GradientManager& m_;
  device::Device& dev_;
  std::vector<std::uint8_t> host_;
};

// Every parameter's master|moments|compute bytes and step counter.
struct State {
  std::vector<std::vector<std::uint8_t>> bytes;
  std::vector<float> steps;
  bool operator==(const State&) const = default;
};

State read_state(GradientManager& m) {
  const bool adamw = is_adamw(m.config().optimizer);
  State st;
  for (std::size_t i = 0; i < m.config().params.size(); ++i) {
    const ParamSpec& p = m.config().params[i];
    std::vector<float> master(p.numel), ea(adamw ? p.numel : 0), eas(adamw ? p.numel : 0);
    std::vector<std::uint8_t> compute(p.has_compute_weights ? p.numel * dtype_size(p.compute_dtype)
                                                            : 0);
    m.read_parameter(i, master, ea, eas, compute);
    std::vector<std::uint8_t> b((master.size() + ea.size() + eas.size()) * 4 + compute.size());
    std::size_t at = 0;
    for (const auto* v : {&master, &ea, &eas}) {
      if (!v->empty()) std::memcpy(b.data() + at, v->data(), v->size() * 4);
      at += v->size() * 4;
    }
    if (!compute.empty()) std::memcpy(b.data() + at, compute.data(), compute.size());
    st.bytes.push_back(std::move(b));
    st.steps.push_back(m.step_count(i));
  }
  return st;
}

// A manager of `mode` over parameters of `sizes` (bf16 gradients and compute weights, one
// group), loaded with the stream's initial masters.
ManagerConfig simple_config(OffloadMode mode, device::Device& dev,
                            const std::vector<std::size_t>& sizes, std::size_t chunk,
                            OptimizerConfig opt = AdamWConfig{}) {
  ManagerConfig cfg;
  cfg.mode = mode;
  cfg.optimizer = optimizer_of(opt, AdamWFormula::torch);
  for (std::size_t i = 0; i < sizes.size(); ++i)
    cfg.params.push_back(ParamSpec{"p" + std::to_string(i), sizes[i], DType::bf16, DType::bf16});
  cfg.chunk_elements = chunk;
  cfg.device = &dev;
  cfg.engine.threads = 2;
  cfg.speculation = Speculation::always;
  return cfg;
}

void load_initial(GradientManager& m) {
  for (std::size_t i = 0; i < m.config().params.size(); ++i) {
    std::vector<float> init(m.config().params[i].numel);
    for (std::size_t j = 0; j < init.size(); ++j) init[j] = initial_master(i, j);
    m.load_parameter(i, init);
  }
}

// The steps of the decision tests: commit (no clip), roll back (clipped), skip (a NaN in
// parameter `nan_param`), commit (max_norm that does not clip).
struct Plan {
  std::optional<float> max_norm;
  bool nan;
};
constexpr Plan kDecisions[] = {
    {std::nullopt, false}, {1e-6f, false}, {std::nullopt, true}, {1e6f, false}};

// ---- The decision while a speculated chunk is still being stepped ------------------------

// Full offload: parameter 0 has 3 M elements, a chunk of its own, and is the last to get
// its final gradient (backward runs from the last parameter): its gradient_ready posts
// the chunk's accumulation and speculative step (3 M elements of AdamW) to the worker.
// Its device-to-host gradient copy is held behind a gate (the worker's accumulation
// waits for that copy), and clip_grad_norm / step() are called at once; the gate opens
// from another thread 20 ms into the decision, so the decision is always waiting while
// the chunk is still to be stepped. Bits: the serial run's after every step.
TEST(Speculation, FullOffloadDecisionWhileTheLastChunkIsStillBeingSteppedGivesTheSerialBits) {
  const std::vector<std::size_t> sizes = {3u << 20, 1000, 1000, 1000};
  for (int threads : {1, 3}) {
    SCOPED_TRACE(std::to_string(threads) + " engine threads");
    auto dev_s = device::make_host_device();
    auto dev_o = device::make_host_device();
    ManagerConfig cs = simple_config(OffloadMode::full, *dev_s, sizes, 1u << 20);
    ManagerConfig co = simple_config(OffloadMode::full, *dev_o, sizes, 1u << 20);
    cs.engine.threads = co.engine.threads = threads;
    // The gate below stalls the copy queue until the decision: a staging ring smaller
    // than the step would (by design) hold backward at a full ring, so this ring holds
    // the whole step (4 slots of 1 Mi elements: parameter 0 fills 3, the rest 1).
    co.ring_slots = 4;
    co.ring_slot_elements = 1u << 20;
    auto serial = make_gradient_manager(cs);
    auto spec = make_gradient_manager(co);
    load_initial(*serial);
    load_initial(*spec);
    Trainer ts(*serial, *dev_s), to(*spec, *dev_o);
    device::Event gate;
    std::thread opener;
    std::chrono::steady_clock::time_point opened_at;
    to.before_ready = [&](int micro, std::size_t i) {
      if (micro != 1 || i != 0) return;
      gate = device::detail::make_manual_event();
      dev_o->wait(Queue::d2h, gate);  // parameter 0's final gradient copy waits for it
    };
    to.before_decision = [&] {
      opener = std::thread([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        opened_at = std::chrono::steady_clock::now();
        device::detail::complete_manual_event(gate);
      });
    };
    for (int s = 0; s < static_cast<int>(std::size(kDecisions)); ++s) {
      const Plan& p = kDecisions[s];
      const std::optional<std::size_t> nan = p.nan ? std::optional<std::size_t>{0} : std::nullopt;
      (void)ts.step(s, false, p.max_norm, nan);
      double decision = 0.0;
      try {
        decision = to.step(s, true, p.max_norm, nan);
      } catch (...) {
        if (opener.joinable()) opener.join();
        throw;
      }
      const auto returned = std::chrono::steady_clock::now();
      opener.join();
      EXPECT_LE(opened_at, returned) << "the decision returned before the held chunk was stepped";
      const StepReport rs = serial->report(), ro = spec->report();
      std::printf(
          "[ speculation ] full, %d threads, step %d: the decision took %.1f ms "
          "(speculated %zu, committed %zu, rolled back %zu)\n",
          threads, s, decision * 1e3, ro.chunks_speculated, ro.chunks_committed,
          ro.chunks_rolled_back);
      EXPECT_EQ(ro.chunks_speculated, 2u) << "step " << s;
      EXPECT_EQ(ro.chunks_committed, s == 0 || s == 3 ? 2u : 0u) << "step " << s;
      EXPECT_EQ(ro.skipped, p.nan) << "step " << s;
      EXPECT_EQ(rs.skipped, p.nan) << "step " << s;
      EXPECT_EQ(std::bit_cast<std::uint32_t>(ro.norm.norm),
                std::bit_cast<std::uint32_t>(rs.norm.norm));
      EXPECT_EQ(std::bit_cast<std::uint32_t>(ro.clip_coefficient),
                std::bit_cast<std::uint32_t>(rs.clip_coefficient));
      ASSERT_TRUE(read_state(*spec) == read_state(*serial)) << "step " << s;
    }
    serial->close();
    spec->close();
  }
}

// Modes none and optimizer: on the host device the compute queue runs inline, but the
// copy queues are threads. Before the final backward the download queue (d2h) is held
// behind a gate, so mode optimizer's downloads of each speculated chunk's stepped block
// (and the rollback's restore after them) are still queued when clip_grad_norm / step()
// are called; the gate opens from another thread while the decision waits. Bits: the
// serial run's after every step. (Three chunks: the ring's three slots, so no upload of
// the final backward waits for a held download.)
TEST(Speculation, DeviceModesDecisionWhileSpeculatedDownloadsAreQueuedGivesTheSerialBits) {
  const std::vector<std::size_t> sizes(6, 1531);
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer})
    for (OptimizerConfig opt : std::vector<OptimizerConfig>{AdamWConfig{}, SignSgdConfig{}}) {
      SCOPED_TRACE(std::string(offload_mode_name(mode)) + " " + std::string(optimizer_name(opt)));
      auto dev_s = device::make_host_device();
      auto dev_o = device::make_host_device();
      auto serial = make_gradient_manager(simple_config(mode, *dev_s, sizes, 3062, opt));
      auto spec = make_gradient_manager(simple_config(mode, *dev_o, sizes, 3062, opt));
      load_initial(*serial);
      load_initial(*spec);
      Trainer ts(*serial, *dev_s), to(*spec, *dev_o);
      device::Event gate;
      std::thread opener;
      std::chrono::steady_clock::time_point opened_at;
      to.before_final_backward = [&] {
        gate = device::detail::make_manual_event();
        dev_o->wait(Queue::d2h, gate);
      };
      to.before_decision = [&] {
        opener = std::thread([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          opened_at = std::chrono::steady_clock::now();
          device::detail::complete_manual_event(gate);
        });
      };
      for (int s = 0; s < static_cast<int>(std::size(kDecisions)); ++s) {
        const Plan& p = kDecisions[s];
        const std::optional<std::size_t> nan = p.nan ? std::optional<std::size_t>{0} : std::nullopt;
        (void)ts.step(s, false, p.max_norm, nan);
        double decision = 0.0;
        try {
          decision = to.step(s, true, p.max_norm, nan);
        } catch (...) {
          if (opener.joinable()) opener.join();
          throw;
        }
        const auto returned = std::chrono::steady_clock::now();
        opener.join();
        EXPECT_LE(opened_at, returned) << "the decision returned before the held queue ran";
        const StepReport rs = serial->report(), ro = spec->report();
        (void)decision;
        EXPECT_EQ(ro.chunks_speculated, 3u) << "step " << s;
        EXPECT_EQ(ro.skipped, p.nan) << "step " << s;
        EXPECT_EQ(std::bit_cast<std::uint32_t>(ro.norm.norm),
                  std::bit_cast<std::uint32_t>(rs.norm.norm));
        EXPECT_EQ(std::bit_cast<std::uint32_t>(ro.clip_coefficient),
                  std::bit_cast<std::uint32_t>(rs.clip_coefficient));
        ASSERT_TRUE(read_state(*spec) == read_state(*serial)) << "step " << s;
      }
      serial->close();
      spec->close();
    }
}

// ---- Memory ---------------------------------------------------------------------------

// Returns a /proc/self/status field in KiB ("VmRSS", "VmHWM").
long status_kib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stol(line.substr(key.size()));
  return -1;
}

// Resets VmHWM to the current resident set (Linux: "5" into clear_refs).
bool reset_peak() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

// Full offload, 6 parameters of 2^20 elements (AdamW: 12 MiB of state per chunk, 72 MiB
// in all), budget B = 23 MiB (a third, less 1 MiB: not a multiple of a page or of a
// chunk, so one chunk fits): after one serial warm-up step, the peak resident set over
// four overlapped steps (commit, rollback, skip, commit) grows by at most
// B * 1.05 + 2 MiB + a page per chunk over the resident set before them, and by at most
// that more than with budget 0. The allowance: the rollback space is one mapping rounded
// up to a 2 MiB (huge) page, each chunk's spares start on 256-byte boundaries inside it
// (a partly used page at most per chunk); the steps' own bookkeeping (tasks, partials)
// is what the budget-0 run measures. The spares of the chunk B admits are written by its
// out-of-place steps: the growth is at least 90% of its 12 MiB, so the measurement sees
// them.
TEST(Speculation, FullOffloadRollbackSpaceStaysWithinTheBudget) {
#if STEPCORE_TEST_SANITIZED
  GTEST_SKIP() << "the sanitizers' shadow memory makes the resident set meaningless";
#endif
  if (!reset_peak() || status_kib("VmHWM") < 0) GTEST_SKIP() << "no VmHWM reset here";
  const std::vector<std::size_t> sizes(6, std::size_t{1} << 20);
  const std::int64_t chunk_bytes = 12ll << 20;
  const std::int64_t budget = 23ll << 20;
  const long page_kib = sysconf(_SC_PAGESIZE) / 1024;
  auto grow_kib = [&](std::int64_t bytes) {
    auto dev = device::make_host_device();
    ManagerConfig cfg = simple_config(OffloadMode::full, *dev, sizes, std::size_t{1} << 20);
    cfg.speculation_bytes = bytes;
    auto m = make_gradient_manager(cfg);
    load_initial(*m);
    Trainer t(*m, *dev);
    (void)t.step(0, false, 1e-6f);  // warm-up: the engine's threads, the worker, the trainer
    (void)m->report();
    const long before = status_kib("VmRSS");
    EXPECT_TRUE(reset_peak());
    for (int s = 1; s <= static_cast<int>(std::size(kDecisions)); ++s) {
      const Plan& p = kDecisions[s - 1];
      (void)t.step(s, true, p.max_norm, p.nan ? std::optional<std::size_t>{3} : std::nullopt);
      const StepReport r = m->report();
      EXPECT_EQ(r.chunks_speculated, static_cast<std::size_t>(bytes / chunk_bytes)) << "step " << s;
    }
    const long peak = status_kib("VmHWM");
    m->close();
    std::printf("[ speculation ] budget %lld MiB: resident %ld KiB before, peak %+ld KiB\n",
                static_cast<long long>(bytes >> 20), before, peak - before);
    return peak - before;
  };
  const long without = grow_kib(0);
  const long with = grow_kib(budget);
  const long budget_kib = static_cast<long>(budget / 1024);
  const long allowance_kib = 2048 + 6 * page_kib;
  EXPECT_LE(with, budget_kib * 105 / 100 + allowance_kib);
  EXPECT_LE(with - std::max(without, 0l), budget_kib * 105 / 100 + allowance_kib);
  EXPECT_GE(with - without, static_cast<long>(chunk_bytes / 1024) * 9 / 10)
      << "the spares were not written";
}

// ---- Bad input ----------------------------------------------------------------------------

TEST(Speculation, BadPoliciesAndBudgetsAreRefusedNamingTheField) {
  EXPECT_EQ(parse_speculation("always"), Speculation::always);
  EXPECT_EQ(parse_speculation("never"), Speculation::never);
  EXPECT_EQ(parse_speculation("auto"), Speculation::automatic);
  for (Speculation p : {Speculation::always, Speculation::never, Speculation::automatic})
    EXPECT_EQ(parse_speculation(speculation_name(p)), p);
  for (const char* bad : {"Auto", "", "sometimes", "automatic", "always ", "NEVER"}) {
    expect_error([&] { (void)parse_speculation(bad); }, Errc::invalid_argument, "speculation");
    try {
      (void)parse_speculation(bad);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("always, never, auto"), std::string::npos) << e.what();
    }
  }
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    auto dev = device::make_host_device();
    for (std::int64_t bytes : {std::int64_t{-2}, std::int64_t{-1000}, std::int64_t{INT64_MIN}}) {
      ManagerConfig cfg = config_of(mode, *dev);
      cfg.speculation_bytes = bytes;
      expect_error([&] { (void)make_gradient_manager(cfg); }, Errc::out_of_range,
                   "speculation_bytes");
    }
    for (std::int64_t bytes : {std::int64_t{-2}, std::int64_t{INT64_MIN}}) {
      ManagerConfig cfg = config_of(mode, *dev);
      cfg.speculation_device_bytes = bytes;
      expect_error([&] { (void)make_gradient_manager(cfg); }, Errc::out_of_range,
                   "speculation_device_bytes");
    }
    if (mode != OffloadMode::full)  // their rollback space is on the device already
      for (std::int64_t bytes : {std::int64_t{1}, ManagerConfig::kAllChunks}) {
        ManagerConfig cfg = config_of(mode, *dev);
        cfg.speculation_device_bytes = bytes;
        expect_error([&] { (void)make_gradient_manager(cfg); }, Errc::invalid_argument,
                     "speculation_device_bytes");
      }
    for (int bad : {3, 7, 255}) {
      ManagerConfig cfg = config_of(mode, *dev);
      cfg.speculation = static_cast<Speculation>(bad);
      expect_error([&] { (void)make_gradient_manager(cfg); }, Errc::invalid_argument,
                   "speculation");
    }
    // Borderline values are accepted: none, one byte (less than any chunk: none fits, even
    // where the reservation is rounded up to a page), every chunk, more than every chunk
    // needs (only that is reserved).
    for (std::int64_t bytes :
         {std::int64_t{0}, std::int64_t{1}, ManagerConfig::kAllChunks, std::int64_t{INT64_MAX}}) {
      ManagerConfig cfg = config_of(mode, *dev);
      cfg.speculation_bytes = bytes;
      cfg.speculation = Speculation::always;
      const std::size_t chunks = manager_model::chunks_of(cfg.params, cfg.chunk_elements).size();
      auto m = make_gradient_manager(cfg);
      m->begin_step(0.5f, true);
      m->begin_backward(true);
      m->finish_backward();  // no gradients: every chunk is complete here
      m->step();
      const StepReport r = m->report();
      EXPECT_TRUE(r.stepped);
      EXPECT_EQ(r.chunks_speculated, bytes == 0 || bytes == 1 ? 0u : chunks) << bytes;
      m->close();
    }
  }
}

// A second clip_grad_norm in an overlapped step, and one after its step(), are refused
// naming "clip_grad_norm" and change nothing: the effective scale stays, and the state
// after the step is that of the same step with one clip_grad_norm (another manager).
TEST(Speculation, ClipTwiceOrAfterStepWithOverlapIsRefusedAndChangesNothing) {
  const std::vector<std::size_t> sizes(6, 1531);
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full})
    for (float first : {1e-6f, 1e6f}) {  // the first clip rolls back / commits
      SCOPED_TRACE(std::string(offload_mode_name(mode)) + " max_norm " + std::to_string(first));
      auto dev_a = device::make_host_device();
      auto dev_b = device::make_host_device();
      auto a = make_gradient_manager(simple_config(mode, *dev_a, sizes, 3062));
      auto b = make_gradient_manager(simple_config(mode, *dev_b, sizes, 3062));
      load_initial(*a);
      load_initial(*b);
      Trainer ta(*a, *dev_a), tb(*b, *dev_b);
      (void)ta.step(0, true, first);
      tb.before_decision = [&] {
        const float norm = b->clip_grad_norm(first);
        const float scale = b->effective_gradient_scale();
        for (float again : {first, 0.5f, 1e9f})
          expect_error([&] { (void)b->clip_grad_norm(again); }, Errc::invalid_argument,
                       "clip_grad_norm");
        expect_error([&] { (void)b->clip_grad_norm(-1.0f); }, Errc::invalid_argument,
                     "clip_grad_norm");
        EXPECT_EQ(b->effective_gradient_scale(), scale);
        EXPECT_FALSE(std::isnan(norm));
      };
      (void)tb.step(0, true, std::nullopt);  // the clip was called in before_decision
      const float scale = b->effective_gradient_scale();
      EXPECT_EQ(std::bit_cast<std::uint32_t>(scale),
                std::bit_cast<std::uint32_t>(a->effective_gradient_scale()));
      const State after = read_state(*b);
      EXPECT_TRUE(after == read_state(*a)) << "a refused clip changed the step";
      expect_error([&] { (void)b->clip_grad_norm(first); }, Errc::invalid_argument,
                   "clip_grad_norm");
      EXPECT_EQ(b->effective_gradient_scale(), scale);
      EXPECT_TRUE(read_state(*b) == after) << "a refused clip after step() changed the state";
      const StepReport ra = a->report(), rb = b->report();
      EXPECT_EQ(rb.chunks_speculated, ra.chunks_speculated);
      EXPECT_EQ(rb.chunks_committed, ra.chunks_committed);
      a->close();
      b->close();
    }
}

// ---- Failures during speculation -------------------------------------------------------

// The host device with a copy failure: once armed, the first device-to-device copy on the
// compute queue after an optimizer step was enqueued throws (as an enqueueing call of a
// real device fails) — in modes none and optimizer, the copy of the second
// speculated chunk's step counters into its rollback space, after the first chunk was
// stepped into its own.
class FailingCopyDevice final : public test_support::ForwardingDevice {
 public:
  void arm() {
    armed_ = true;
    stepped_ = false;
  }
  bool fired() const noexcept { return fired_; }
  void* allocate(std::size_t bytes) override {
    void* p = ForwardingDevice::allocate(bytes);
    ranges_.push_back({static_cast<const char*>(p), bytes});
    return p;
  }
  void copy(Queue q, void* dst, const void* src, std::size_t bytes) override {
    if (armed_ && stepped_ && q == Queue::compute && is_device(dst) && is_device(src)) {
      armed_ = false;
      fired_ = true;
      throw Error(Errc::internal, "copy", "injected copy failure (test device)");
    }
    ForwardingDevice::copy(q, dst, src, bytes);
  }
  void optimizer_step(std::span<const OptimizerTensor> t, const OptimizerConfig& c,
                      const OptimizerDeviceArgs& d) override {
    ForwardingDevice::optimizer_step(t, c, d);
    stepped_ = true;
  }

 private:
  bool is_device(const void* p) const {
    const char* c = static_cast<const char*>(p);
    for (const auto& [base, n] : ranges_)
      if (c >= base && c < base + n) return true;
    return false;
  }
  std::vector<std::pair<const char*, std::size_t>> ranges_;
  bool armed_ = false, stepped_ = false, fired_ = false;
};

// The model's compute weights in the trainer's storage (ParamSpec::compute_into), so the
// test can read them after the manager failed.
struct ModelWeights {
  device::Device& dev;
  std::vector<void*> mem;
  ModelWeights(device::Device& d, ManagerConfig& cfg) : dev(d) {
    for (ParamSpec& p : cfg.params) {
      mem.push_back(dev.allocate(p.numel * 2));
      p.compute_into = {mem.back(), p.numel, DType::bf16};
    }
  }
  ~ModelWeights() {
    for (void* p : mem) dev.deallocate(p);
  }
  std::vector<std::vector<std::uint8_t>> read(const ManagerConfig& cfg) const {
    std::vector<std::vector<std::uint8_t>> out;
    for (std::size_t i = 0; i < mem.size(); ++i) {
      out.emplace_back(cfg.params[i].numel * 2);
      std::memcpy(out.back().data(), mem[i], out.back().size());  // host device memory
    }
    return out;
  }
};

// Everything a failed manager must do: `failure` was raised by the step; every later call
// raises an Error of the same code again (the manager stays failed); close() reports it
// once, then is a no-op.
void expect_stays_failed(GradientManager& m, Errc code) {
  std::vector<float> buf(m.config().params[0].numel);
  const std::vector<std::function<void()>> calls = {
      [&] { (void)m.report(); },
      [&] { m.begin_step(1.0f, true); },
      [&] { m.synchronize(); },
      [&] { (void)m.step_count(0); },
      [&] { m.read_parameter(0, buf, {}, {}, {}); },
      [&] { m.save_checkpoint("/tmp/stepcore-speculation-never-written"); },
      [&] { (void)m.report(); }};
  for (const auto& call : calls) {
    try {
      call();
      ADD_FAILURE() << "a failed manager accepted a call";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
    }
  }
  try {
    m.close();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
  }
  EXPECT_NO_THROW(m.close());
}

// Runs a failing overlapped step: `arm` sets the failure up; the step (a NaN-free step
// that would commit) must raise an Error. Checks what docs/managers.md ("Failures")
// promises: the manager stays failed; the model's compute weights (the trainer's
// storage) are as the previous step left them; where the state is host memory (modes
// full and optimizer) the live state too (read through host_state's views taken before
// the step: speculation writes only the rollback space, a failed step commits nothing);
// and a new manager that loads the checkpoint saved before the step holds exactly its
// state and continues from it as a manager that never failed.
void failing_step(OffloadMode mode, device::Device& dev,
                  const std::function<void(GradientManager&)>& arm, Errc code,
                  const std::string& what, const std::string& path) {
  const std::vector<std::size_t> sizes(6, 1531);  // chunks {0,1} {2,3} {4,5}
  ManagerConfig cfg = simple_config(mode, dev, sizes, 3062);
  ModelWeights weights(dev, cfg);
  auto m = make_gradient_manager(cfg);
  load_initial(*m);
  Trainer t(*m, dev);
  (void)t.step(0, true, std::nullopt);  // one speculated step that commits
  (void)m->report();
  const State before = read_state(*m);
  m->save_checkpoint(path);
  std::vector<std::vector<float>> live_before;  // the live host arrays, where they are
  std::vector<GradientManager::HostState> live;
  if (mode != OffloadMode::none)
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      live.push_back(m->host_state(i));
      for (auto s :
           {live.back().master, live.back().slot("exp_avg"), live.back().slot("exp_avg_sq")})
        live_before.emplace_back(s.begin(), s.end());
    }
  const auto weights_before = weights.read(cfg);
  arm(*m);
  bool raised = false;
  try {
    (void)t.step(1, true, std::nullopt);
    (void)m->report();
  } catch (const Error& e) {
    raised = true;
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
  ASSERT_TRUE(raised) << "the failure was not raised";
  dev.synchronize();  // (the host device raised its error once: the queues are idle)
  EXPECT_TRUE(weights.read(cfg) == weights_before) << "the model's compute weights changed";
  if (mode != OffloadMode::none) {
    std::size_t k = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i)
      for (auto s : {live[i].master, live[i].slot("exp_avg"), live[i].slot("exp_avg_sq")}) {
        EXPECT_TRUE(std::vector<float>(s.begin(), s.end()) == live_before[k])
            << "parameter " << i << ": the live state changed";
        ++k;
      }
  }
  expect_stays_failed(*m, code);

  // A new manager from the checkpoint: the state before the failed step, and the same
  // next step as a manager that never failed (loaded from the same file).
  auto fresh_dev = device::make_host_device();
  auto restored = make_gradient_manager(simple_config(mode, *fresh_dev, sizes, 3062));
  restored->load_checkpoint(path);
  EXPECT_TRUE(read_state(*restored) == before) << "the checkpoint does not restore the state";
  auto other_dev = device::make_host_device();
  auto serial = make_gradient_manager(simple_config(OffloadMode::none, *other_dev, sizes, 3062));
  serial->load_checkpoint(path);
  Trainer tr(*restored, *fresh_dev), ts(*serial, *other_dev);
  (void)tr.step(1, true, 1e-6f);
  (void)ts.step(1, false, 1e-6f);
  EXPECT_TRUE(read_state(*restored) == read_state(*serial));
  restored->close();
  serial->close();
  std::remove(path.c_str());
}

std::string temp_path(const std::string& what) {
  return "/tmp/stepcore-speculation-" + std::to_string(::getpid()) + "-" + what + ".stepcore";
}

// (a) A copy fails while chunks are speculated. Full offload: the device-to-host copy of
// parameter 0's final gradient, after chunks {4,5} and {2,3} were posted for speculation
// (the host device's injected failure, raised when its queue runs it). Modes none and
// optimizer: the counters' copy into the rollback space of the second chunk speculated
// ({2,3}), after {4,5} was stepped into its own (its compute weights to staging).
TEST(Speculation, ACopyFailureWhileChunksAreSpeculatedLeavesTheManagerFailedAndRestorable) {
  {
    SCOPED_TRACE("full");
    auto dev = device::make_host_device();
    failing_step(
        OffloadMode::full, *dev,
        [&](GradientManager&) {
          // Step 1: six copies in the first micro-batch, then 5, 4, 3, 2, 1 in the final
          // one before parameter 0's.
          device::detail::inject_copy_failure(*dev, Queue::d2h, 6 + 5);
        },
        Errc::internal, "injected copy failure", temp_path("full-copy"));
  }
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    FailingCopyDevice dev;
    failing_step(
        mode, dev, [&](GradientManager&) { dev.arm(); }, Errc::internal, "injected copy failure",
        temp_path(std::string(offload_mode_name(mode)) + "-copy"));
    EXPECT_TRUE(dev.fired());
  }
}

// (b) The engine throws in full offload during a speculative step: parameter 5 (chunk
// {4,5}, the first speculated) was imported with the step counter 2^24, which the
// import accepts and the engine's AdamW refuses (a counter must stay below 2^24) — the
// exception comes from the worker's out-of-place step into the chunk's spare.
TEST(Speculation, AnEngineExceptionDuringASpeculativeStepLeavesTheManagerFailedAndRestorable) {
  auto dev = device::make_host_device();
  failing_step(
      OffloadMode::full, *dev,
      [&](GradientManager& m) {
        std::vector<float> master(1531), ea(1531), eas(1531);
        m.read_parameter(5, master, ea, eas, {});
        m.import_parameter(5, master, ea, eas, 16777216.0f);
      },
      Errc::out_of_range, "step counter", temp_path("full-engine"));
}

}  // namespace
