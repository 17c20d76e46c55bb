// The full-offload manager's bounded waits, on the host device with a short wait bound
// (and the host device's own: Event::wait_for, its waits that block the caller): a
// gradient whose `written` event never completes (as when an FSDP peer dies mid
// reduce-scatter and the trainer's stream never reaches the event) makes the worker's
// wait for its copy time out with Errc::timeout naming the parameter and the bound; the
// manager is failed (every later hook raises that error), load_checkpoint refuses to
// recover while the copy is still stuck and recovers once it moves, after which the run
// gives the bits of a run that never stalled; close() and the destructor of a stuck
// manager return (the error once, then nothing).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "device/host_device.hpp"
#include "expect_error.hpp"
#include "managers_cases.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

namespace {

using namespace managers_cases;
using clock_type = std::chrono::steady_clock;

// The test devices' wait_timeout: short, yet far above any real copy of the test's model
// on a loaded or sanitized machine.
constexpr std::chrono::milliseconds kBound{1000};
constexpr std::size_t kStuck = 4;  // the parameter whose event never completes

// A full-offload manager of the test model on `dev`, its masters loaded.
std::unique_ptr<GradientManager> make(device::Device& dev) {
  Build b;
  b.mode = OffloadMode::full;
  return make_manager(b, Case{}, dev);
}

// The stream's options with parameter kStuck's first gradient of step `step` handed over
// after `held`.
StreamOptions held_at(int step, const device::Event& held) {
  StreamOptions o;
  o.max_norm = 0.05f;
  o.first_step = step;
  o.steps = 1;
  o.written = [step, held](int s, int micro, std::size_t i) {
    return s == step && micro == 0 && i == kStuck ? held : device::Event{};
  };
  return o;
}

// Runs f, which must throw the manager's timeout: Errc::timeout naming a parameter's
// gradient copy and the bound. Returns its message.
template <class F>
std::string expect_timeout(F&& f, const char* what) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::timeout) << what << ": " << e.what();
    EXPECT_EQ(e.argument().rfind("params[", 0), 0u) << what << ": " << e.argument();
    EXPECT_NE(e.argument().find("].gradient"), std::string::npos) << what << ": " << e.argument();
    EXPECT_NE(std::string(e.what()).find("within 1000 ms"), std::string::npos) << e.what();
    return e.what();
  }
  ADD_FAILURE() << what << " did not throw";
  return {};
}

TEST(OffloadTimeout, EventWaitForIsBoundedOnTheHostDevice) {
  const device::Event held = device::detail::make_manual_event();
  const auto start = clock_type::now();
  EXPECT_FALSE(held.wait_for(std::chrono::milliseconds(20)));
  EXPECT_GE(clock_type::now() - start, std::chrono::milliseconds(20));
  EXPECT_TRUE(device::Event{}.wait_for(std::chrono::milliseconds(0)));
  device::detail::complete_manual_event(held);
  EXPECT_TRUE(held.wait_for(std::chrono::milliseconds(0)));
  // A queue waiting for it holds the events recorded behind it.
  auto dev = device::make_host_device(32, device::HostDeviceMemory::allocated_only, kBound);
  EXPECT_EQ(dev->wait_timeout(), kBound);
  EXPECT_EQ(device::make_host_device()->wait_timeout(), comm::kDefaultTimeout);
  const device::Event gate = device::detail::make_manual_event();
  dev->wait(device::Queue::d2h, gate);
  const device::Event behind = dev->record(device::Queue::d2h);
  EXPECT_FALSE(behind.wait_for(std::chrono::milliseconds(20)));
  // The waits that block the caller (compute runs inline; wait_on) are bounded too.
  test_support::expect_error([&] { dev->wait(device::Queue::compute, gate); }, Errc::timeout, "e");
  test_support::expect_error([&] { dev->wait_on(nullptr, gate); }, Errc::timeout, "e");
  device::detail::complete_manual_event(gate);
  EXPECT_TRUE(behind.wait_for(kBound * 50));
  EXPECT_NO_THROW(dev->wait(device::Queue::compute, gate));
  test_support::expect_error(
      [] {
        (void)device::make_host_device(32, device::HostDeviceMemory::allocated_only,
                                       std::chrono::milliseconds(0));
      },
      Errc::out_of_range, "wait_timeout");
}

TEST(OffloadTimeout, AStuckCopyFailsTheManagerAndLoadCheckpointRecovers) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("stepcore-timeout-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "full.ckpt").string();

  // The run that never stalls: steps 0..2.
  StreamOptions o;
  o.max_norm = 0.05f;
  auto clean_dev = device::make_host_device();
  auto clean = make(*clean_dev);
  const std::vector<StepRecord> want = run_stream(*clean, *clean_dev, o);
  clean->close();

  auto dev = device::make_host_device(256, device::HostDeviceMemory::allocated_only, kBound);
  auto m = make(*dev);
  o.steps = 1;
  (void)run_stream(*m, *dev, o);
  m->save_checkpoint(path);
  const device::Event held = device::detail::make_manual_event();
  const std::string first =
      expect_timeout([&] { (void)run_stream(*m, *dev, held_at(1, held)); }, "the stalled step");
  // Failed: every later hook raises the same error.
  EXPECT_EQ(expect_timeout([&] { m->synchronize(); }, "synchronize"), first);
  EXPECT_EQ(expect_timeout([&] { (void)m->report(); }, "report"), first);
  EXPECT_EQ(expect_timeout([&] { m->begin_step(1.0f, false); }, "begin_step"), first);
  // Still stuck: recovery waits for the copy queues up to the bound and stays failed.
  EXPECT_EQ(expect_timeout([&] { m->load_checkpoint(path); }, "load_checkpoint while stuck"),
            first);
  EXPECT_EQ(expect_timeout([&] { m->synchronize(); }, "synchronize"), first);
  // The stall ends (the trainer's stream moves again): recovery, then the clean run's bits.
  device::detail::complete_manual_event(held);
  m->load_checkpoint(path);
  o.first_step = 1;
  o.steps = 2;
  const std::vector<StepRecord> got = run_stream(*m, *dev, o);
  EXPECT_NO_THROW(m->close());
  expect_same(got, std::vector<StepRecord>(want.begin() + 1, want.end()),
              "recovered run vs one that never stalled");
  fs::remove_all(dir);
}

TEST(OffloadTimeout, CloseAndTheDestructorOfAStuckManagerReturn) {
  for (bool destroy : {false, true}) {
    SCOPED_TRACE(destroy ? "destructor" : "close");
    auto dev = device::make_host_device(256, device::HostDeviceMemory::allocated_only, kBound);
    const device::Event held = device::detail::make_manual_event();
    {
      auto m = make(*dev);
      (void)run_stream(*m, *dev, StreamOptions{});
      // A gradient handed over behind the held event, then straight to close: the worker's
      // wait for its copy times out, and close does not wait for the stuck queue again.
      m->begin_step(1.0f, false);
      m->begin_backward(true);
      m->gradient_ready(kStuck, held);
      const auto start = clock_type::now();
      if (destroy) {
        m.reset();  // never throws
      } else {
        const std::string error = expect_timeout([&] { m->close(); }, "close");
        EXPECT_NE(error.find("parameter 'p4'"), std::string::npos) << error;
        EXPECT_NO_THROW(m->close());
      }
      EXPECT_LT(clock_type::now() - start, kBound * 50);
    }
    // The device outlives the manager; its queue runs again before it goes (the host
    // device's destruction runs what is queued).
    device::detail::complete_manual_event(held);
  }
}

}  // namespace
