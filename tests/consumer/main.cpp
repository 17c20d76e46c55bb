// An installed stepcore as a consumer uses it: the CPU engine's scale_ and norm on a
// small tensor against the scalar reference, bit for bit, and what the build contains.
// Includes every installed header, so each must stand alone in the install tree.
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <vector>

#include "stepcore/comm.hpp"
#include "stepcore/config.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/determinism.hpp"
#include "stepcore/device.hpp"
#include "stepcore/dtype.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/host_slab.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/numa.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"
#include "stepcore/tensor.hpp"
#include "stepcore/version.hpp"
#if CONSUMER_NCCL
#include "stepcore/comm_nccl.hpp"
#endif
#if CONSUMER_DIFF
#include <sstream>

#include "stepcore/diff.hpp"
#endif
#if defined(CONSUMER_MPI)
#include "stepcore/comm_mpi.hpp"
#endif

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "consumer: FAILED: %s\n", what);
    ++failures;
  }
}

}  // namespace

int main() {
  using namespace stepcore;
  char version[32];
  std::snprintf(version, sizeof version, "%d.%d.%d", STEPCORE_VERSION_MAJOR, STEPCORE_VERSION_MINOR,
                STEPCORE_VERSION_PATCH);
  expect(std::strcmp(version, CONSUMER_VERSION) == 0,
         "STEPCORE_VERSION_* match the package version");
  expect(std::strcmp(STEPCORE_VERSION_STRING, CONSUMER_VERSION) == 0, "STEPCORE_VERSION_STRING");
  expect(cuda::built_with_cuda() == bool(CONSUMER_EXPECT_CUDA),
         "cuda::built_with_cuda() agrees with stepcore_cuda_FOUND");

  // Values of many magnitudes and both signs, some exactly representable, some not.
  std::vector<float> engine_data(3001);
  for (std::size_t i = 0; i < engine_data.size(); ++i)
    engine_data[i] = (static_cast<float>(i % 37) - 18.0f) * 0.37f + static_cast<float>(i) * 1e-3f;
  std::vector<float> reference_data = engine_data;

  cpu::Engine engine;
  const TensorView engine_view = f32_view(engine_data.data(), engine_data.size());
  const TensorView reference_view = f32_view(reference_data.data(), reference_data.size());
  engine.scale_(std::span<const TensorView>(&engine_view, 1), 0.3f);
  reference::scale_(std::span<const TensorView>(&reference_view, 1), 0.3f);
  expect(std::memcmp(engine_data.data(), reference_data.data(),
                     engine_data.size() * sizeof(float)) == 0,
         "Engine::scale_ equals reference::scale_ bit for bit");

  const ConstTensorView engine_const = engine_view;
  const ConstTensorView reference_const = reference_view;
  const NormResult fast = engine.norm(std::span<const ConstTensorView>(&engine_const, 1));
  const NormResult exact =
      finalize(reference::norm_partial(std::span<const ConstTensorView>(&reference_const, 1)));
  expect(std::bit_cast<std::uint32_t>(fast.norm) == std::bit_cast<std::uint32_t>(exact.norm),
         "Engine::norm equals finalize(reference::norm_partial) bit for bit");
  expect(fast.finite && fast.norm > 0.0f, "the norm is finite and positive");

  // Partials combine through the public entry points (the digit arithmetic is internal):
  // the reference's partial merged with a copy is S doubled, so the norm grows by sqrt(2)
  // up to one rounding; a digit holding 2^32 more normalises into the next one, same S.
  const NormPartial once =
      reference::norm_partial(std::span<const ConstTensorView>(&reference_const, 1));
  NormPartial doubled = once;
  merge(doubled, once);
  const float twice = finalize(doubled).norm;
  expect(twice > exact.norm * 1.4142f && twice < exact.norm * 1.4143f,
         "merge adds partials: the norm of S + S is sqrt(2) times the norm of S");
  NormPartial carried = doubled;  // normalised by merge: every digit below 2^32
  int top = kNormDigits - 1;
  while (top > 1 && carried.digits[top] == 0) --top;
  carried.digits[top] -= 1;  // 2^(32 top) moved down a digit: S unchanged, not normalised
  carried.digits[top - 1] += std::uint64_t{1} << 32;
  expect(doubled.digits[top] != 0 && normalize(carried) && same_value(carried, doubled) &&
             carried.digits[top - 1] == doubled.digits[top - 1],
         "normalize propagates carries, keeping S");

  // Errors cross the library boundary as stepcore::Error.
  bool threw = false;
  try {
    engine.scale_(std::span<const TensorView>(&engine_view, 1), -1.0f);
  } catch (const Error&) {
    threw = true;
  }
  expect(threw, "a bad scale throws stepcore::Error");

#if CONSUMER_NCCL
  // Links (not called: that needs a GPU).
  std::unique_ptr<comm::Communicator> (*nccl_entry)(
      ncclComm_t, cudaStream_t, std::chrono::milliseconds) = &comm::make_nccl_communicator;
  expect(nccl_entry != nullptr, "the NCCL communicator links");
#endif
#if CONSUMER_DIFF
  // The comparer: its usage, and a missing input refused naming it (exit status 2).
  {
    std::ostringstream out, err;
    const char* help[] = {"stepcore-diff", "--help"};
    expect(diff::run(2, help, out, err) == 0 && out.str().find("usage:") != std::string::npos,
           "stepcore-diff --help through diff::run");
    const char* missing[] = {"stepcore-diff", "/nonexistent/a", "/nonexistent/b"};
    expect(diff::run(3, missing, out, err) == 2 &&
               err.str().find("/nonexistent/a") != std::string::npos,
           "diff::run refuses a missing input, naming it");
  }
#endif
#if defined(CONSUMER_MPI)
  // Links and compiles against <mpi.h> through stepcore::mpi (not called: needs MPI_Init).
  auto mpi_entry = &comm::make_mpi_communicator;
  expect(mpi_entry != nullptr, "the MPI communicator links");
#endif

  std::printf(
      "consumer: stepcore %s (isa %s, cuda %d), scale_ and norm match the reference: norm %a\n",
      STEPCORE_VERSION_STRING, std::string(engine.isa_name()).c_str(), int(cuda::built_with_cuda()),
      static_cast<double>(fast.norm));
  return failures == 0 ? 0 : 1;
}
