// make_gradient_manager's communicator checks and the device managers' bounded waits
// (CPU): a device-memory communicator must enqueue on the device's compute stream, and a
// manager must wait on it (with its timeout) before trusting anything behind a
// collective. A fake "CUDA" device (the host device with a
// made-up non-null compute stream) and a fake device-memory communicator with a stream
// of its own: refused with Errc::invalid_argument naming "comm" before any allocation;
// on the same stream the check passes and the manager is built and steps. Host
// communicators report no stream.
#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "forwarding_device.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

namespace {

using namespace stepcore;

cudaStream_t fake_stream(std::uintptr_t value) { return reinterpret_cast<cudaStream_t>(value); }

// The host device, forwarding every call, except that it claims a compute stream (so
// the factory takes it for a CUDA device); counts allocations.
class FakeCudaDevice final : public test_support::ForwardingDevice {
 public:
  explicit FakeCudaDevice(cudaStream_t compute) : compute_(compute) {}
  std::string_view name() const noexcept override { return "fake-cuda"; }
  cudaStream_t compute_stream() const noexcept override { return compute_; }

 private:
  cudaStream_t compute_;
};

// One rank in device memory on `stream`: every reduction is the identity (in place, as
// one rank's NCCL all-reduce), so the device's memory being host memory is harmless.
// With `dead_peer`, a collective is "enqueued" but never completes, as with NCCL when a
// peer died: synchronize() waits out the timeout and fails (Errc::timeout, aborted).
class FakeDeviceComm final : public comm::Communicator {
 public:
  explicit FakeDeviceComm(cudaStream_t stream, bool dead_peer = false,
                          std::chrono::milliseconds timeout = std::chrono::seconds(10))
      : Communicator(timeout), stream_(stream), dead_peer_(dead_peer) {}
  int rank() const noexcept override { return 0; }
  int size() const noexcept override { return 1; }
  comm::MemorySpace memory() const noexcept override { return comm::MemorySpace::device; }
  std::string_view name() const noexcept override { return "fake_nccl"; }
  cudaStream_t stream() const noexcept override { return stream_; }
  void all_reduce(void*, std::size_t, comm::Word, comm::Op) override { ++collectives_; }
  void all_reduce_partial(NormPartial*, comm::LayoutCheck*) override {
    if (failed_) throw Error(Errc::timeout, "", "aborted");
    ++collectives_;
    pending_ = dead_peer_;
  }
  void synchronize() override {
    ++synchronizes_;
    if (failed_) throw Error(Errc::timeout, "", "aborted");
    if (!pending_) return;
    std::this_thread::sleep_for(timeout());
    failed_ = true;
    throw Error(Errc::timeout, "", "the peer never arrived (fake)");
  }
  void abort() noexcept override { failed_ = true; }
  bool failed() const noexcept override { return failed_; }
  int collectives() const noexcept { return collectives_; }
  int synchronizes() const noexcept { return synchronizes_; }

 private:
  cudaStream_t stream_;
  bool dead_peer_ = false;
  bool pending_ = false;
  int collectives_ = 0;
  int synchronizes_ = 0;
  bool failed_ = false;
};

ManagerConfig config_on(device::Device& dev, comm::Communicator& c) {
  ManagerConfig cfg;
  cfg.mode = OffloadMode::none;
  cfg.params = {ParamSpec{"w", 1000, DType::bf16}, ParamSpec{"b", 17, DType::f32}};
  cfg.device = &dev;
  cfg.comm = &c;
  cfg.layout_fingerprint = 7;
  return cfg;
}

TEST(Factory, RefusesADeviceCommunicatorOnAnotherStream) {
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    FakeCudaDevice dev(fake_stream(0x10));
    FakeDeviceComm c(fake_stream(0x20));
    ManagerConfig cfg = config_on(dev, c);
    cfg.mode = mode;
    try {
      make_gradient_manager(cfg);
      ADD_FAILURE() << "a communicator on another stream was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_EQ(e.argument(), "comm");
      const std::string what = e.what();
      for (const char* part :
           {"fake_nccl", "fake-cuda", "0x20", "0x10", "make_cuda_device", "compute_stream()"})
        EXPECT_NE(what.find(part), std::string::npos) << part << " missing from: " << what;
    }
    EXPECT_EQ(dev.allocations(), 0) << "the factory allocated before refusing";
    EXPECT_EQ(c.collectives(), 0);
  }
  // The legacy default stream (null) is another stream too.
  FakeCudaDevice dev(fake_stream(0x10));
  FakeDeviceComm c(nullptr);
  try {
    make_gradient_manager(config_on(dev, c));
    ADD_FAILURE() << "a communicator on the legacy default stream was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_EQ(e.argument(), "comm");
    EXPECT_NE(std::string(e.what()).find("legacy default stream"), std::string::npos) << e.what();
  }
}

TEST(Factory, AcceptsADeviceCommunicatorOnTheComputeStream) {
  FakeCudaDevice dev(fake_stream(0x10));
  FakeDeviceComm c(fake_stream(0x10));
  std::unique_ptr<GradientManager> m;
  ASSERT_NO_THROW(m = make_gradient_manager(config_on(dev, c)));
  EXPECT_GT(dev.allocations(), 0);
  // A step through the identity reduction: the communicator is used.
  m->begin_step(1.0f, false);
  m->begin_backward(true);
  m->finish_backward();
  EXPECT_EQ(m->clip_grad_norm(1.0f), 0.0f);  // no gradient arrived: zero accumulators
  m->step();
  EXPECT_GT(c.collectives(), 0);
  m->close();
}

// A dead peer behind a device-memory collective: every host wait of the device manager
// must go through the communicator's bounded wait, so clip_grad_norm (and report,
// without clipping) raises Errc::timeout within about the timeout instead of returning
// a norm from a partial that was never reduced, or hanging in an event wait with NCCL.
// The manager then stays failed, and close() returns.
TEST(GpuManagerWaits, ADeadPeerIsATimeoutNotAHangOrANorm) {
  for (const bool clip : {true, false}) {
    SCOPED_TRACE(clip ? "clip_grad_norm" : "report");
    FakeCudaDevice dev(fake_stream(0x10));
    FakeDeviceComm c(fake_stream(0x10), /*dead_peer=*/true, std::chrono::milliseconds(200));
    auto m = make_gradient_manager(config_on(dev, c));
    m->begin_step(1.0f, false);
    m->begin_backward(true);
    m->finish_backward();
    const auto t0 = std::chrono::steady_clock::now();
    try {
      if (clip) {
        (void)m->clip_grad_norm(1.0f);
      } else {
        m->step();
        (void)m->report();
      }
      ADD_FAILURE() << "a collective whose peer died was trusted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::timeout) << e.what();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s, 5.0);
    EXPECT_GT(c.synchronizes(), 0);
    EXPECT_THROW(m->begin_step(1.0f, false), Error) << "the manager stays failed";
    EXPECT_THROW(m->close(), Error);  // raises the stored error once, returns
  }
}

TEST(Factory, HostCommunicatorsHaveNoStream) {
  auto group = comm::make_in_process_group(2);
  for (const auto& c : group) EXPECT_EQ(c->stream(), nullptr);
}

}  // namespace
