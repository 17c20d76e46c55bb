// Unit: the kernels' block bodies for block-wise 8-bit state (kernels/q8_bodies.hpp,
// docs/numerics.md 8f) on the CPU executor and through the host device's optimizer_step,
// against the reference bit for bit after every step of ten: AdamW's three formulas and
// Adam, amsgrad, f32 and bf16 gradients, a compute output, boundary sizes, tensors across
// a kernel block's chunk, one of about 10^6 elements, and many launches; and the refusals (no
// codebooks, a 16-bit param, an optimizer without 8-bit state), raised before anything is written.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "device/host_device.hpp"
#include "isa_list.hpp"
#include "kernels/plans.hpp"
#include "q8_configs.hpp"
#include "q8_sets.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/optim.hpp"

namespace {

using namespace stepcore::testing_support::q8;  // NOLINT: the shared 8-bit sets
using stepcore::AdamWFormula;
using stepcore::Errc;
using stepcore::Error;
using stepcore::GradientRead;
using stepcore::OptimizerConfig;
using stepcore::OptimizerDeviceArgs;
using stepcore::testing_support::by_profile;
namespace gpu = stepcore::gpu;
namespace detail = stepcore::detail;

// Sizes around the vector width, the 8-bit block and a kernel block's chunk
// (gpu::kBlockElements), f32 params (the device path's), f32 and bf16 gradients.
std::vector<TensorSpec> device_specs() {
  std::vector<TensorSpec> specs;
  const std::size_t chunk = gpu::kBlockElements;
  const std::size_t sizes[] = {0,    1,    31,   33,   255,       256,        257,
                               1023, 1025, 4095, 4097, chunk - 1, chunk + 257};
  int k = 0;
  for (std::size_t n : sizes)
    specs.push_back({n, DType::f32, (k++ % 2) ? DType::bf16 : DType::f32, false});
  specs.push_back({777, DType::f32, DType::f32, true});
  return specs;
}

// The executor's and the unit's plan of one step (limits low: several launches).
template <class Opt>
void emulated_step(std::vector<OptimizerTensor>& v, const typename Opt::Config& c,
                   GradientRead read, const std::vector<double>& table,
                   const std::vector<std::uint32_t>& books) {
  const auto plan = gpu::make_optimizer_plan<Opt>(v, c, 5, 3);
  OptimizerDeviceArgs d;
  d.scale = &read.scale;
  d.clip = &read.clip;
  d.table = table.data();
  d.q8_codebooks = books.data();
  gpu::emulate::optimizer_step<Opt>(plan, d, 256);
}

template <class Config>
void run_executor_against_reference(const Q8Set& set, const Config& c, int steps,
                                    const std::string& what) {
  using Opt = typename detail::UnitForConfig<Config, detail::AllUnits>::type;
  const std::vector<double> table = gpu::make_optimizer_table(OptimizerConfig{c});
  const std::vector<std::uint32_t> books = gpu::q8_codebooks();
  Q8Set want = set;
  Q8Set got = set;
  for (int s = 1; s <= steps; ++s) {
    // The device reads the gradient in its own dtype (the f32 read form is the host's).
    const GradientRead read{1.0f / 3.0f, 0.7f, false};
    fill_grads(want, s);
    fill_grads(got, s);
    auto wv = want.views();
    reference_step(wv, c, read);
    auto gv = got.views();
    emulated_step<Opt>(gv, c, read, table, books);
    expect_same(got, want, what + " step " + std::to_string(s));
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(KernelQ8, AdamWBlockBodiesOnTheExecutorEqualTheReference) {
  const int steps = by_profile(10, 3, "3 steps");
  for (const AdamWConfig& c : stepcore::testing_support::q8_adamw_configs()) {
    run_executor_against_reference(make_set(device_specs(), c), c, steps, q8_config_name(c));
    if (HasFatalFailure()) return;
  }
}

TEST(KernelQ8, AdamBlockBodiesOnTheExecutorEqualTheReference) {
  const int steps = by_profile(10, 3, "3 steps");
  for (const AdamConfig& c : adam_configs()) {
    run_executor_against_reference(make_set(device_specs(), c), c, steps, q8_config_name(c));
    if (HasFatalFailure()) return;
  }
}

// A tensor of about 10^6 elements (16 kernel blocks' chunks, the last one short) beside
// small ones, in launches of few blocks: every formula's rule, three steps.
TEST(KernelQ8, AMillionElementsAcrossLaunchesEqualTheReference) {
  const std::vector<TensorSpec> specs = {{1000003, DType::f32, DType::f32, false},
                                         {4097, DType::f32, DType::bf16, false}};
  for (const AdamWConfig& c : stepcore::testing_support::q8_adamw_configs()) {
    if (c.amsgrad) continue;
    run_executor_against_reference(make_set(specs, c), c, by_profile(3, 1, "1 step"),
                                   q8_config_name(c) + " 10^6");
    if (HasFatalFailure()) return;
  }
}

// The host device's optimizer_step (the managers' device path): the tensors, counters,
// read scalars, table and codebooks in its memory; found-inf writes nothing.
TEST(KernelQ8, TheHostDeviceStepsEightBitSlotsAsTheReference) {
  auto dev =
      stepcore::device::make_host_device(256, stepcore::device::HostDeviceMemory::any_host_memory);
  AdamWConfig c = stepcore::testing_support::q8_adamw_configs()[1];  // torch, decay, two slots
  const std::vector<double> table = gpu::make_optimizer_table(OptimizerConfig{c});
  const std::vector<std::uint32_t> books = gpu::q8_codebooks();
  const Q8Set set = make_set(device_specs(), c);
  Q8Set want = set, got = set;
  float scale = 0.5f, clip = 1.0f;
  std::int32_t found_inf = 0;
  for (int s = 1; s <= 3; ++s) {
    fill_grads(want, s);
    fill_grads(got, s);
    auto wv = want.views();
    reference_step(wv, c, GradientRead{scale, clip, false});
    auto gv = got.views();
    OptimizerDeviceArgs d{&scale, &clip, &found_inf, nullptr, table.data(), books.data()};
    dev->optimizer_step(gv, OptimizerConfig{c}, d);
    dev->synchronize();
    expect_same(got, want, "host device step " + std::to_string(s));
    if (HasFatalFailure()) return;
  }
  found_inf = 1;
  const Q8Set before = got;
  fill_grads(got, 9);
  auto gv = got.views();
  dev->optimizer_step(
      gv, OptimizerConfig{c},
      OptimizerDeviceArgs{&scale, &clip, &found_inf, nullptr, table.data(), books.data()});
  dev->synchronize();
  Q8Set expect = before;
  fill_grads(expect, 9);
  expect_same(got, expect, "a found-inf step");
}

TEST(KernelQ8, RefusalsNameTheArgumentAndWriteNothing) {
  auto dev =
      stepcore::device::make_host_device(256, stepcore::device::HostDeviceMemory::any_host_memory);
  const AdamWConfig c = stepcore::testing_support::q8_adamw_configs()[1];
  const std::vector<double> table = gpu::make_optimizer_table(OptimizerConfig{c});
  const std::vector<std::uint32_t> books = gpu::q8_codebooks();
  float scale = 1.0f, clip = 1.0f;
  Q8Set set = make_set({{300, DType::f32, DType::f32, false}}, c);
  fill_grads(set, 1);
  const Q8Set before = set;
  auto expect_refused = [&](auto&& call, Errc code, const std::string& arg) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected a refusal naming " << arg;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_EQ(e.argument(), arg) << e.what();
    }
    dev->synchronize();
    expect_same(set, before, "refused: " + arg);
  };
  auto v = set.views();
  expect_refused(
      [&] {
        dev->optimizer_step(v, OptimizerConfig{c},
                            OptimizerDeviceArgs{&scale, &clip, nullptr, nullptr, table.data()});
      },
      Errc::null_pointer, "d.q8_codebooks");
  expect_refused(
      [&] {
        gpu::emulate::optimizer_step<detail::AdamW>(
            gpu::make_optimizer_plan<detail::AdamW>(v, c),
            OptimizerDeviceArgs{&scale, &clip, nullptr, nullptr, table.data()});
      },
      Errc::null_pointer, "d.q8_codebooks");
  stepcore::SgdConfig sgd;
  sgd.momentum = 0.9;
  auto one = set.views();
  one[0].q8[1] = Q8Slot{};
  expect_refused(
      [&] {
        dev->optimizer_step(
            one, OptimizerConfig{sgd},
            OptimizerDeviceArgs{&scale, &clip, nullptr, nullptr, nullptr, books.data()});
      },
      Errc::unsupported_dtype, "tensors[0].q8[0]");
  std::vector<std::uint16_t> p16(300);
  auto half = set.views();
  half[0].param = TensorView{p16.data(), 300, DType::bf16};
  expect_refused(
      [&] {
        dev->optimizer_step(
            half, OptimizerConfig{c},
            OptimizerDeviceArgs{&scale, &clip, nullptr, nullptr, table.data(), books.data()});
      },
      Errc::unsupported_dtype, "tensors[0].param");
}

}  // namespace
