// GPU (label gpu): the NCCL communicator with one GPU (nranks = 1, from ncclCommInitAll
// and from a unique id). A device NormPartial is reduced on the caller's stream and
// finalised on the device (gpu::finalize_and_clip) to the reference's bits; host buffers
// are staged; the layout check survives the reduction unchanged; a communicator whose
// second rank never joins ends in Errc::timeout. With the stream held by a gate kernel
// (cuda_gate.hpp) as a hung collective would hold it: host-staged reductions end in
// Errc::timeout instead of blocking, teardown returns, and synchronize() leaves no
// "not ready" behind for a launch check. The factory refuses a communicator on another
// stream than the device's compute stream. Skips without a device.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "comm_cases.hpp"
#include "stepcore/comm_nccl.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/managers.hpp"

#if defined(STEPCORE_WITH_CUDA)
#include <cuda_runtime.h>
#include <nccl.h>

#include "cuda_gate.hpp"
#endif

namespace {

using namespace comm_cases;
using namespace std::chrono_literals;

#define SKIP_WITHOUT_DEVICE() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason()

#if defined(STEPCORE_WITH_CUDA)

struct OneGpu {
  ncclComm_t nccl = nullptr;
  cudaStream_t stream = nullptr;
  OneGpu() {
    int dev = 0;
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(ncclCommInitAll(&nccl, 1, &dev), ncclSuccess);
    EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  }
  ~OneGpu() {
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
    if (nccl) ncclCommDestroy(nccl);
  }
};

TEST(Nccl, DevicePartialIsReducedOnTheStreamAndFinalisedOnTheDevice) {
  SKIP_WITHOUT_DEVICE();
  OneGpu g;
  auto c = comm::make_nccl_communicator(g.nccl, g.stream, 30s);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->memory(), comm::MemorySpace::device);
  const Logical& l = logical_for(DType::f32);
  std::vector<ConstTensorView> all;
  for (const auto& t : l.tensors) all.push_back(t.slice(0, t.numel));
  const NormPartial partial = reference::norm_partial(all);
  const comm::LayoutCheck check = comm::make_layout_check(0xfeed);

  NormPartial* d_partial = nullptr;
  comm::LayoutCheck* d_check = nullptr;
  NormResult* d_result = nullptr;
  float* d_clip = nullptr;
  std::int32_t* d_found_inf = nullptr;
  ASSERT_EQ(cudaMalloc(&d_partial, sizeof *d_partial), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_check, sizeof *d_check), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_result, sizeof *d_result), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_clip, sizeof *d_clip), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_found_inf, sizeof *d_found_inf), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_partial, &partial, sizeof partial, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_check, &check, sizeof check, cudaMemcpyHostToDevice), cudaSuccess);

  c->all_reduce_partial(d_partial, d_check);  // enqueued, no host synchronisation
  gpu::finalize_and_clip(d_partial, 1.0f, d_result, d_clip, d_found_inf, g.stream);
  c->synchronize();

  NormPartial reduced;
  comm::LayoutCheck reduced_check;
  NormResult result;
  ASSERT_EQ(cudaMemcpy(&reduced, d_partial, sizeof reduced, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&reduced_check, d_check, sizeof reduced_check, cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&result, d_result, sizeof result, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(same_value(reduced, partial));
  EXPECT_EQ(std::memcmp(&reduced_check, &check, sizeof check), 0);
  EXPECT_NO_THROW(comm::check_reduced(reduced_check, 0xfeed));
  EXPECT_TRUE(same_result(result, l.expected));
  for (void* p :
       {static_cast<void*>(d_partial), static_cast<void*>(d_check), static_cast<void*>(d_result),
        static_cast<void*>(d_clip), static_cast<void*>(d_found_inf)})
    cudaFree(p);
}

TEST(Nccl, HostBuffersAreStagedForTheGlobalNorm) {
  SKIP_WITHOUT_DEVICE();
  OneGpu g;
  auto c = comm::make_nccl_communicator(g.nccl, g.stream, 30s);
  for (const auto& [name, scenario] : scenarios()) {
    SCOPED_TRACE(name);
    check_scenario(*c, scenario, DType::bf16);
  }
  const auto [r, exact_calls] = tie_norm(*c);
  EXPECT_EQ(r.norm, 16777216.0f);
  EXPECT_EQ(exact_calls, 1);
  double d = 2.5;
  c->all_reduce(&d, 1, comm::Word::f64, comm::Op::max);
  EXPECT_EQ(d, 2.5);
}

TEST(Nccl, OwnedCommunicatorFromAUniqueId) {
  SKIP_WITHOUT_DEVICE();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  {
    auto c = comm::make_nccl_communicator(comm::nccl_unique_id(), 0, 1, 0, stream, 60s);
    std::uint64_t* d = nullptr;
    ASSERT_EQ(cudaMalloc(&d, 8), cudaSuccess);
    const std::uint64_t v = 42;
    ASSERT_EQ(cudaMemcpy(d, &v, 8, cudaMemcpyHostToDevice), cudaSuccess);
    c->all_reduce(d, 1, comm::Word::u64, comm::Op::sum);
    c->synchronize();
    std::uint64_t out = 0;
    ASSERT_EQ(cudaMemcpy(&out, d, 8, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(out, 42u);
    cudaFree(d);
  }
  cudaStreamDestroy(stream);
}

TEST(Nccl, ARankThatNeverJoinsIsATimeout) {
  SKIP_WITHOUT_DEVICE();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const auto start = std::chrono::steady_clock::now();
  try {
    comm::make_nccl_communicator(comm::nccl_unique_id(), 0, 2, 0, stream, 2s);
    ADD_FAILURE() << "a two-rank communicator with one rank was created";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::timeout) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  cudaStreamDestroy(stream);
}

// ---- a stream held by a gate, as by a hung collective ------------------------------

using Clock = std::chrono::steady_clock;
constexpr auto kTimeout = 300ms;  // the communicators' collective timeout
constexpr auto kSlack = 2s;       // what a bounded wait may take beyond it
constexpr auto kWatchdog = kTimeout + kSlack;

// A non-blocking stream with a gate on it. Members are destroyed in reverse: the gate
// (opened, the stream synchronised) before the stream.
struct GatedStream {
  cudaStream_t stream = nullptr;
  std::unique_ptr<cuda_gate::Gate> gate;
  GatedStream() {
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    gate = std::make_unique<cuda_gate::Gate>();
  }
  ~GatedStream() {
    gate.reset();
    cudaStreamDestroy(stream);
  }
};

// Returns a one-rank owned communicator on `stream` with the short collective timeout.
// Created with a long one: initialisation is polled against the timeout too, and a first
// NCCL initialisation can take longer than kTimeout.
std::unique_ptr<comm::Communicator> one_rank_on(cudaStream_t stream) {
  auto c = comm::make_nccl_communicator(comm::nccl_unique_id(), 0, 1, 0, stream, 60s);
  c->set_timeout(kTimeout);
  return c;
}

// Returns how long `call` took.
Clock::duration time_of(const std::function<void()>& call) {
  const auto start = Clock::now();
  call();
  return Clock::now() - start;
}

long long ms(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

// A host-staged collective on a held stream must end in Errc::timeout within the
// timeout (the old staging copied into pageable memory, which blocks until the held
// work completes: the watchdog then opened the gate and the call "succeeded").
void expect_staged_timeout(const char* what,
                           const std::function<void(comm::Communicator&)>& collective) {
  SCOPED_TRACE(what);
  GatedStream g;
  // Declared after g, so destroyed first: once the test has opened the gate.
  std::unique_ptr<comm::Communicator> c;
  c = one_rank_on(g.stream);
  collective(*c);  // a staged collective on the open stream: allocates the staging
  g.gate->close(g.stream, kWatchdog);
  Errc code = Errc::internal;
  bool threw = false;
  const auto took = time_of([&] {
    try {
      collective(*c);
    } catch (const Error& e) {
      threw = true;
      code = e.code();
    }
  });
  const bool by_watchdog = g.gate->opened_by_watchdog();
  g.gate->open();
  EXPECT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);
  EXPECT_FALSE(g.gate->expired_on_device());
  EXPECT_TRUE(threw) << "returned after " << ms(took) << " ms without an error";
  EXPECT_EQ(code, Errc::timeout);
  EXPECT_LT(took, kTimeout + kSlack) << ms(took) << " ms";
  EXPECT_FALSE(by_watchdog) << "the call blocked until the watchdog opened the gate";
  EXPECT_TRUE(c->failed());
  c.reset();
}

TEST(NcclGate, HostStagedReductionsTimeOutOnAHeldStream) {
  SKIP_WITHOUT_DEVICE();
  expect_staged_timeout("all_reduce of a host buffer", [](comm::Communicator& c) {
    std::uint64_t words[3] = {1, 2, 3};
    c.all_reduce(words, 3, comm::Word::u64, comm::Op::sum);
    EXPECT_EQ(words[2], 3u);  // one rank: unchanged (checked when the call returns)
  });
  expect_staged_timeout("all_reduce_partial of host buffers", [](comm::Communicator& c) {
    NormPartial partial;
    partial.digits[0] = 7;
    comm::LayoutCheck check = comm::make_layout_check(0xfeed);
    c.all_reduce_partial(&partial, &check);
    EXPECT_EQ(partial.digits[0], 7u);
    EXPECT_NO_THROW(comm::check_reduced(check, 0xfeed));
  });
}

// Teardown with the stream held must not free with a device-wide synchronisation before
// the transport is finalised or aborted, nor wait for the stream at all. Three variants
// tell the causes apart: a caller's ncclComm_t (the destructor does not touch it: only
// our frees run), an owned communicator with nothing of NCCL's behind the gate (a
// bounded finalize too), and one with a device all_reduce behind the gate (NCCL's own
// finalize/abort could wait for the stream as well: then only this variant fails).
TEST(NcclGate, TeardownReturnsWhileTheStreamIsHeld) {
  SKIP_WITHOUT_DEVICE();
  struct Variant {
    const char* name;
    bool owned;
    bool collective_behind_gate;
  };
  for (const Variant& v :
       {Variant{"a caller's ncclComm_t", false, false},
        Variant{"an owned communicator", true, false},
        Variant{"an owned communicator, all_reduce behind the gate", true, true}}) {
    SCOPED_TRACE(v.name);
    GatedStream g;
    std::uint64_t* d = nullptr;
    ASSERT_EQ(cudaMalloc(&d, sizeof *d), cudaSuccess);
    ASSERT_EQ(cudaMemset(d, 0, sizeof *d), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ncclComm_t nccl = nullptr;
    if (!v.owned) {
      int dev = 0;
      ASSERT_EQ(ncclCommInitAll(&nccl, 1, &dev), ncclSuccess);
    }
    {
      auto c =
          v.owned ? one_rank_on(g.stream) : comm::make_nccl_communicator(nccl, g.stream, kTimeout);
      double x = 2.5;  // a host-staged collective first: the communicator owns staging memory
      c->all_reduce(&x, 1, comm::Word::f64, comm::Op::max);
      EXPECT_EQ(x, 2.5);
      g.gate->close(g.stream, kWatchdog);
      if (v.collective_behind_gate) c->all_reduce(d, 1, comm::Word::u64, comm::Op::sum);
      const auto took = time_of([&] { c.reset(); });
      EXPECT_LT(took, kTimeout + kSlack) << ms(took) << " ms";
      EXPECT_FALSE(g.gate->opened_by_watchdog()) << "teardown blocked until the watchdog opened";
    }
    g.gate->open();
    EXPECT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);
    EXPECT_FALSE(g.gate->expired_on_device());
    if (nccl != nullptr) EXPECT_EQ(ncclCommDestroy(nccl), ncclSuccess);
    cudaFree(d);
  }
}

TEST(NcclGate, SynchronizeLeavesNoNotReadyForALaunchCheck) {
  SKIP_WITHOUT_DEVICE();
  GatedStream g;
  auto c = comm::make_nccl_communicator(comm::nccl_unique_id(), 0, 1, 0, g.stream, 30s);
  cudaGetLastError();  // start clean: only what synchronize() leaves is checked
  g.gate->close(g.stream, 5s);
  std::thread opener([&] {
    std::this_thread::sleep_for(50ms);
    g.gate->open();
  });
  Clock::duration took{};
  try {
    took = time_of([&] { c->synchronize(); });  // polls the held stream: "not ready"
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
  }
  opener.join();
  EXPECT_GE(took, 40ms) << "synchronize() did not wait for the gate";
  EXPECT_FALSE(g.gate->opened_by_watchdog());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// A two-parameter manager config (mode none) over communicator `c`.
ManagerConfig two_param_config(comm::Communicator& c) {
  ManagerConfig cfg;
  cfg.mode = OffloadMode::none;
  cfg.params = {ParamSpec{"w", 4096, DType::bf16}, ParamSpec{"b", 33, DType::f32}};
  cfg.comm = &c;
  return cfg;
}

TEST(NcclGate, FactoryRequiresTheCommunicatorOnTheComputeStream) {
  SKIP_WITHOUT_DEVICE();
  GatedStream g;  // the gate stays open: only the stream is used
  auto c = one_rank_on(g.stream);
  EXPECT_EQ(c->stream(), g.stream);
  ManagerConfig cfg = two_param_config(*c);
  {
    auto own = device::make_cuda_device(0);  // its own compute stream
    cfg.device = own.get();
    try {
      make_gradient_manager(cfg);
      ADD_FAILURE() << "an NCCL communicator on another stream was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_EQ(e.argument(), "comm");
      EXPECT_NE(std::string(e.what()).find("make_cuda_device"), std::string::npos) << e.what();
    }
  }
  auto same = device::make_cuda_device(0, g.stream);
  cfg.device = same.get();
  std::unique_ptr<GradientManager> m;
  EXPECT_NO_THROW(m = make_gradient_manager(cfg));
  if (m) m->close();
  EXPECT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);
}

// Defect 2 on the device: the manager's collective sits behind a held stream (the gate
// stands in for a peer that never arrives). clip_grad_norm must raise Errc::timeout
// within about the communicator's timeout, not block in an event wait; close() returns.
TEST(NcclGate, TheManagersWaitsAreBoundedByTheCommunicatorsTimeout) {
  SKIP_WITHOUT_DEVICE();
  GatedStream g;
  auto c = one_rank_on(g.stream);
  auto dev = device::make_cuda_device(0, g.stream);
  ManagerConfig cfg = two_param_config(*c);
  cfg.device = dev.get();
  auto m = make_gradient_manager(cfg);
  m->begin_step(1.0f, false);
  m->begin_backward(true);
  g.gate->close(g.stream, kWatchdog);  // everything after this on the stream is held
  m->finish_backward();
  Errc code = Errc::internal;
  const auto took = time_of([&] {
    try {
      (void)m->clip_grad_norm(1.0f);
      ADD_FAILURE() << "clip_grad_norm returned while its collective was held";
    } catch (const Error& e) {
      code = e.code();
    }
  });
  EXPECT_EQ(code, Errc::timeout);
  EXPECT_LT(took, kTimeout + kSlack) << ms(took) << " ms";
  EXPECT_FALSE(g.gate->opened_by_watchdog());
  g.gate->open();
  EXPECT_THROW(m->close(), Error);  // the stored error, once
}

#else

TEST(Nccl, NeedsCuda) { GTEST_SKIP() << "stepcore was built without CUDA"; }

#endif

TEST(Nccl, Arguments) {
  if (!comm::built_with_nccl()) GTEST_SKIP() << "stepcore was built without NCCL";
  try {
    comm::make_nccl_communicator(nullptr, nullptr);
    ADD_FAILURE() << "accepted a null ncclComm_t";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::null_pointer);
  }
  try {
    comm::make_nccl_communicator(comm::NcclUniqueId{}, 1, 1, 0, nullptr);
    ADD_FAILURE() << "accepted rank 1 of 1";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::out_of_range);
  }
}

}  // namespace
