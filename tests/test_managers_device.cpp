// GPU (label gpu): the managers' differential test on CUDA device 0 — modes none (eager
// and lazy), optimizer and full against the independent reference simulation, bit for
// bit after every step, also with a schedule over two groups, the trainer's own gradient
// buffers, and 8-bit state. Skips without a device.
#include <gtest/gtest.h>

#include "managers_cases.hpp"
#include "stepcore/cuda_host.hpp"

namespace {

using namespace managers_cases;

TEST(ManagersDevice, ThreeModesGiveTheReferenceBitsOnACudaDevice) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  make_device = [] { return device::make_cuda_device(0); };
  for (DType d : {DType::bf16, DType::f32})
    for (OptimizerConfig opt : std::vector<OptimizerConfig>{AdamWConfig{}, SignSgdConfig{}})
      for (std::optional<float> mn : {std::optional<float>{}, std::optional<float>{0.05f}})
        for (bool overlap : {false, true}) {
          if (overlap && mn) continue;
          const Case c{d, opt, mn, Flow::rl, overlap};
          SCOPED_TRACE(c.label());
          const auto want = run_reference(c);
          expect_same(run_mode(OffloadMode::none, c), want, "none");
          expect_same(run_mode(OffloadMode::none, c, /*lazy=*/true), want, "none (lazy scale)");
          expect_same(run_mode(OffloadMode::optimizer, c), want, "optimizer");
          expect_same(run_mode(OffloadMode::full, c), want, "full");
          if (HasFatalFailure()) return;
        }
}

TEST(ManagersDevice, ScheduledGroupsAndCallerGradientsGiveTheReferenceBitsOnACudaDevice) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  make_device = [] { return device::make_cuda_device(0); };
  for (bool overlap : {false, true}) {
    Case c{DType::bf16, AdamWConfig{},
           overlap ? std::optional<float>{} : std::optional<float>{0.05f}, Flow::rl, overlap};
    c.schedule = true;
    c.steps = 12;
    const auto want = run_reference(c);
    c.caller_gradients = true;  // the trainer's buffers, poisoned once released
    SCOPED_TRACE(c.label());
    expect_same(run_mode(OffloadMode::none, c), want, "none");
    expect_same(run_mode(OffloadMode::optimizer, c), want, "optimizer");
    expect_same(run_mode(OffloadMode::full, c), want, "full");
    if (HasFatalFailure()) return;
  }
}

TEST(ManagersDevice, EightBitStateGivesTheReferenceBitsOnACudaDevice) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  make_device = [] { return device::make_cuda_device(0); };
  for (AdamWFormula formula : {AdamWFormula::torch, AdamWFormula::torchao})
    for (bool overlap : {false, true}) {
      Case c{DType::bf16, AdamWConfig{}, std::optional<float>{}, Flow::rl, overlap};
      c.formula = formula;
      c.q8 = true;
      c.min_8bit_size = 1;  // every parameter but the empty one, tails of 1-255 elements
      c.steps = 6;
      c.max_norm_of = [](int s) -> std::optional<float> {
        return s % 3 == 1 ? std::optional<float>(0.05f) : std::nullopt;
      };
      c.speculation = Speculation::always;
      SCOPED_TRACE(c.label());
      const auto want = run_reference(c);
      expect_same(run_mode(OffloadMode::none, c), want, "none");
      expect_same(run_mode(OffloadMode::optimizer, c), want, "optimizer");
      expect_same(run_mode(OffloadMode::full, c), want, "full");
      if (HasFatalFailure()) return;
    }
}

}  // namespace
