// The host device (stepcore::device::make_host_device): every kernel entry point gives
// the CPU executor's and the reference's bits, copies on the worker queues are ordered
// by events, zero(), the compute queue waiting on a copy, validation, and queued errors
// (an injected copy failure) surfacing at the next synchronize or call without
// deadlocking the queues or the destructor.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "device/device_internal.hpp"
#include "device/host_device.hpp"
#include "device_cases.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/reference.hpp"

namespace {

using namespace stepcore;
using device::Device;
using device::Event;
using device::Queue;
using device::detail::inject_copy_failure;
using device_cases::Buffer;
using device_cases::error_code;

// Runs f on another thread; a hang past `limit` fails the whole test binary at once
// (a deadlock must not wait for ctest's timeout).
template <class F>
void expect_finishes(F f, std::chrono::seconds limit = std::chrono::seconds(60)) {
  std::promise<void> done;
  std::future<void> finished = done.get_future();
  std::thread t([&] {
    f();
    done.set_value();
  });
  if (finished.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr, "FATAL: deadlock: the call did not return within %llds\n",
                 static_cast<long long>(limit.count()));
    std::_Exit(1);
  }
  t.join();
}

// A closed gate: a manual event and its opener. A queue told to wait for it
// stalls until open(), so work queued behind it cannot fail before the test has queued
// everything it needs (a queued error is raised by the next call, which would race).
struct Gate {
  Event event = device::detail::make_manual_event();
  void open() const { device::detail::complete_manual_event(event); }
};

// Returns the message of the stepcore::Error f throws with `code` ("" and a failure if
// another or none is thrown).
template <class F>
std::string error_message(F&& f, Errc code) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no stepcore::Error was thrown";
  return "";
}

TEST(HostDevice, Basics) {
  auto dev = device::make_host_device();
  EXPECT_EQ(dev->name(), "host");
  EXPECT_EQ(dev->compute_stream(), nullptr);
  const Event e = dev->record(Queue::compute);
  ASSERT_FALSE(e.empty());
  EXPECT_TRUE(e.complete()) << "compute work runs inline";
  EXPECT_EQ(error_code([] { device::make_host_device(100); }), Errc::out_of_range);
  EXPECT_EQ(error_code([] { device::make_host_device(16); }), Errc::out_of_range);
}

TEST(HostDevice, MakeCudaDeviceWithoutADeviceIsNotSupported) {
  if (cuda::device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_EQ(error_code([] { device::make_cuda_device(0); }), Errc::not_supported);
}

TEST(HostDevice, EveryKernelMatchesTheExecutorAndTheReference) {
  for (int threads : {256, 64}) {
    SCOPED_TRACE("emulated threads " + std::to_string(threads));
    auto dev = device::make_host_device(threads);
    device_cases::kernels_match_reference(*dev, threads);
  }
}

TEST(HostDevice, EveryOptimizerUnitMatchesTheReference) {
  auto dev = device::make_host_device(64);
  device_cases::every_optimizer_unit_matches_the_reference(*dev);
}

TEST(HostDevice, ExactFallbackResolvesATie) {
  auto dev = device::make_host_device();
  device_cases::exact_fallback_resolves_a_tie(*dev);
}

TEST(HostDevice, CopiesAreOrderedByEvents) {
  auto dev = device::make_host_device();
  device_cases::copies_are_ordered_by_events(*dev);
}

TEST(HostDevice, ZeroOnEveryQueue) {
  auto dev = device::make_host_device();
  device_cases::zero_on_every_queue(*dev);
}

TEST(HostDevice, ComputeWaitsForCopies) {
  auto dev = device::make_host_device();
  device_cases::compute_waits_for_copies(*dev);
}

TEST(HostDevice, Validation) {
  auto dev = device::make_host_device();
  device_cases::validation(*dev);
  // Host memory from allocate_host() is not device memory for a kernel either.
  auto* h = static_cast<float*>(dev->allocate_host(4096));
  Buffer d_ws(*dev, 4096), d_partial(*dev, sizeof(NormPartial));
  const std::vector<TensorView> hv{{h, 1024, DType::f32}};
  EXPECT_EQ(error_code([&] {
              dev->scale_and_norm_partial(hv, 1.0f, d_partial.as<NormPartial>(), d_ws.as(), 4096);
            }),
            Errc::invalid_argument);
  // A tensor running past the end of its allocation.
  const std::vector<TensorView> past{{d_ws.as(), 1025, DType::f32}};
  EXPECT_EQ(error_code([&] {
              dev->scale_and_norm_partial(past, 1.0f, d_partial.as<NormPartial>(), d_ws.as(), 4096);
            }),
            Errc::out_of_range);
  dev->deallocate_host(h);
}

TEST(HostDevice, DeallocateWaitsForQueuedCopies) {
  auto dev = device::make_host_device();
  constexpr std::size_t kWords = std::size_t{1} << 22;
  const std::vector<std::uint32_t> p = device_cases::pattern(kWords, 3);
  void* d = dev->allocate(4 * kWords);
  dev->copy(Queue::h2d, d, p.data(), 4 * kWords);
  dev->synchronize();
  auto* h = static_cast<std::uint32_t*>(dev->allocate_host(4 * kWords));
  for (int i = 0; i < 4; ++i) dev->copy(Queue::d2h, h, d, 4 * kWords);
  dev->deallocate(d);  // must wait for the copies reading it
  EXPECT_EQ(std::memcmp(h, p.data(), 4 * kWords), 0);
  dev->deallocate_host(h);
}

TEST(HostDevice, InjectedCopyFailureSurfacesAtSynchronize) {
  auto dev = device::make_host_device();
  std::vector<std::uint8_t> src(4096, 0xab);
  std::vector<std::vector<std::uint8_t>> dst(5, std::vector<std::uint8_t>(4096, 0));
  Buffer d(*dev, src.data(), src.size());
  inject_copy_failure(*dev, Queue::d2h, 2);
  const Gate gate;
  dev->wait(Queue::d2h, gate.event);
  for (auto& h : dst) dev->copy(Queue::d2h, h.data(), d.as(), 4096);
  const Event e = dev->record(Queue::d2h);
  gate.open();
  const std::string what = error_message([&] { dev->synchronize(); }, Errc::internal);
  EXPECT_NE(what.find("injected copy failure"), std::string::npos) << what;
  EXPECT_TRUE(e.complete()) << "events complete after a failure";
  EXPECT_EQ(dst[0][0], 0xab);
  EXPECT_EQ(dst[1][0], 0xab);
  EXPECT_EQ(dst[2][0], 0) << "the failing copy writes nothing";
  EXPECT_EQ(dst[3][0], 0) << "work after the failure is skipped";
  EXPECT_EQ(dst[4][0], 0);
  // Raised once; the device then runs new work again.
  dev->synchronize();
  dev->copy(Queue::d2h, dst[4].data(), d.as(), 4096);
  dev->synchronize();
  EXPECT_EQ(dst[4][0], 0xab);
}

TEST(HostDevice, InjectedCopyFailureSurfacesAtSynchronizeOfAnEvent) {
  auto dev = device::make_host_device();
  std::vector<std::uint8_t> src(256, 1);
  Buffer d(*dev, 256);
  inject_copy_failure(*dev, Queue::h2d, 0);
  const Gate gate;
  dev->wait(Queue::h2d, gate.event);
  dev->copy(Queue::h2d, d.as(), src.data(), 256);
  const Event e = dev->record(Queue::h2d);
  gate.open();
  EXPECT_EQ(error_code([&] { dev->synchronize(e); }), Errc::internal);
  dev->synchronize(e);  // reported once
}

TEST(HostDevice, InjectedCopyFailureSurfacesAtTheNextCall) {
  auto dev = device::make_host_device();
  std::vector<std::uint8_t> host(256, 1);
  Buffer d(*dev, 256);
  inject_copy_failure(*dev, Queue::d2h, 0);
  const Gate gate;
  dev->wait(Queue::d2h, gate.event);
  dev->copy(Queue::d2h, host.data(), d.as(), 256);
  const Event e = dev->record(Queue::d2h);
  gate.open();
  while (!e.complete()) std::this_thread::yield();
  EXPECT_EQ(error_code([&] { dev->zero(Queue::h2d, d.as(), 256); }), Errc::internal);
  dev->zero(Queue::h2d, d.as(), 256);
  dev->synchronize();
}

// A failure another caller took first (here a device-wide synchronize) still reaches the
// owner of the lost copy: the first event recorded on its queue after it carries the
// error, even when recorded after the take, and raises it once; later events are clean.
TEST(HostDevice, TheEventAfterALostCopyCarriesItsErrorWhoeverTookTheFailure) {
  auto dev = device::make_host_device();
  std::vector<std::uint8_t> src(256, 7), dst(256, 0);
  Buffer d(*dev, src.data(), src.size());
  inject_copy_failure(*dev, Queue::d2h, 0);
  dev->copy(Queue::d2h, dst.data(), d.as(), 256);  // fails when the queue runs it
  EXPECT_EQ(error_code([&] { dev->synchronize(); }), Errc::internal) << "another caller";
  const Event owner = dev->record(Queue::d2h);  // recorded after the take
  const std::string what = error_message([&] { dev->synchronize(owner); }, Errc::internal);
  EXPECT_NE(what.find("injected copy failure"), std::string::npos) << what;
  EXPECT_EQ(dst[0], 0) << "the failed copy wrote nothing";
  dev->synchronize(owner);  // raised once
  dev->copy(Queue::d2h, dst.data(), d.as(), 256);
  dev->synchronize(dev->record(Queue::d2h));  // the queue runs new work, its events clean
  EXPECT_EQ(dst[0], 7);
}

// An event carrying a failure makes a queue told to wait for it report the failure at
// its own next event; once any event has raised the failure, the others stay quiet.
TEST(HostDevice, AQueueWaitingForAFailedEventReportsTheFailureOnce) {
  auto dev = device::make_host_device();
  std::vector<std::uint8_t> host(256, 9);
  Buffer a(*dev, 256), b(*dev, 256);
  inject_copy_failure(*dev, Queue::h2d, 0);
  const Gate gate;
  dev->wait(Queue::h2d, gate.event);
  dev->copy(Queue::h2d, a.as(), host.data(), 256);  // fails
  const Event loaded = dev->record(Queue::h2d);
  gate.open();
  EXPECT_EQ(error_code([&] { dev->synchronize(); }), Errc::internal) << "another caller";
  dev->wait(Queue::d2h, loaded);
  dev->copy(Queue::d2h, host.data(), b.as(), 256);
  const Event after = dev->record(Queue::d2h);
  EXPECT_EQ(error_code([&] { dev->synchronize(after); }), Errc::internal)
      << "work ordered after the lost copy";
  dev->synchronize(loaded);  // the failure has reached an event's owner: quiet now
  dev->synchronize();
}

// A caller told of a failure by a call naming the failed queue settles that queue: its
// next event is clean (the caller, who orders work there, already knows).
TEST(HostDevice, ACallOnTheFailedQueueThatRaisesSettlesIt) {
  auto dev = device::make_host_device();
  std::vector<std::uint8_t> host(256, 3);
  Buffer d(*dev, 256);
  inject_copy_failure(*dev, Queue::d2h, 0);
  const Gate gate;
  dev->wait(Queue::d2h, gate.event);
  dev->copy(Queue::d2h, host.data(), d.as(), 256);  // fails
  gate.open();
  // More copies on d2h until one raises the failure (those queued before it are lost
  // too: they run after the failed copy).
  for (bool raised = false; !raised; std::this_thread::yield()) {
    try {
      dev->copy(Queue::d2h, host.data(), d.as(), 256);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::internal);
      raised = true;
    }
  }
  dev->synchronize(dev->record(Queue::d2h));  // settled: nothing to raise
}

TEST(HostDevice, InjectedFailureOnTheComputeQueue) {
  auto dev = device::make_host_device();
  Buffer a(*dev, 64), b(*dev, 64);
  inject_copy_failure(*dev, Queue::compute, 1);
  dev->copy(Queue::compute, a.as(), b.as(), 64);  // succeeds
  dev->copy(Queue::compute, a.as(), b.as(), 64);  // fails, stored like queued work
  EXPECT_EQ(error_code([&] { dev->synchronize(); }), Errc::internal);
  EXPECT_EQ(error_code([&] { inject_copy_failure(*dev, Queue::d2h, -1); }), Errc::invalid_argument);
}

TEST(HostDevice, AFailedCopyDeadlocksNeitherWaitsNorTheDestructor) {
  // A queue waiting on an event recorded after the failed copy, more work behind it,
  // and no synchronize: the destructor drains, joins and returns without throwing.
  for (Queue failing : {Queue::d2h, Queue::h2d}) {
    const Queue other = failing == Queue::d2h ? Queue::h2d : Queue::d2h;
    auto dev = device::make_host_device();
    std::vector<std::uint8_t> host(1 << 20, 5);
    void* d = dev->allocate(host.size());  // freed by the destructor
    inject_copy_failure(*dev, failing, 0);
    const Gate gate;
    dev->wait(failing, gate.event);
    dev->copy(failing, d, host.data(), host.size());
    const Event after = dev->record(failing);
    dev->wait(other, after);
    dev->copy(other, host.data(), d, host.size());
    dev->wait(failing, dev->record(other));
    dev->copy(failing, d, host.data(), host.size());
    gate.open();
    Device* raw = dev.release();
    expect_finishes([raw] { delete raw; });
  }
  // The same, raising through synchronize() first, then freeing memory.
  auto dev = device::make_host_device();
  std::vector<std::uint8_t> host(4096, 5);
  void* d = dev->allocate(4096);
  inject_copy_failure(*dev, Queue::d2h, 0);
  const Gate gate;
  dev->wait(Queue::d2h, gate.event);
  dev->copy(Queue::d2h, host.data(), d, host.size());
  dev->wait(Queue::h2d, dev->record(Queue::d2h));
  dev->copy(Queue::h2d, d, host.data(), host.size());
  gate.open();
  expect_finishes([&] { EXPECT_EQ(error_code([&] { dev->synchronize(); }), Errc::internal); });
  dev->deallocate(d);
  expect_finishes([&] { dev.reset(); });
}

TEST(HostDevice, QueuesWaitForEvents) {
  auto dev = device::make_host_device();
  std::vector<std::uint8_t> host(4096, 3), back(4096, 0);
  Buffer d(*dev, host.size());
  const Gate gate;
  dev->wait(Queue::h2d, gate.event);
  dev->copy(Queue::h2d, d.as(), host.data(), host.size());
  const Event copied = dev->record(Queue::h2d);
  dev->wait(Queue::d2h, copied);
  dev->copy(Queue::d2h, back.data(), d.as(), back.size());
  const Event done = dev->record(Queue::d2h);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(copied.complete());
  EXPECT_FALSE(done.complete());
  gate.open();
  dev->synchronize(done);
  EXPECT_EQ(back, host);
  // The compute queue's wait blocks the caller until the event completes.
  const Gate gate2;
  std::thread opener([&gate2] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gate2.open();
  });
  dev->wait(Queue::compute, gate2.event);
  EXPECT_TRUE(gate2.event.complete());
  opener.join();
}

// The public HostEvent: incomplete until set() (from any thread, more than once), and a
// copy queue told to wait for it holds the work queued behind it until then.
TEST(HostDevice, AHostEventOrdersQueuedWork) {
  auto dev = device::make_host_device();
  const device::HostEvent written;
  const Event e = written.event();
  ASSERT_FALSE(e.empty());
  EXPECT_FALSE(e.complete());
  std::vector<std::uint8_t> host(4096, 7), back(4096, 0);
  Buffer d(*dev, host.size());
  dev->copy(Queue::h2d, d.as(), host.data(), host.size());
  dev->synchronize(dev->record(Queue::h2d));
  dev->wait(Queue::d2h, e);
  dev->copy(Queue::d2h, back.data(), d.as(), back.size());
  const Event read = dev->record(Queue::d2h);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(read.complete()) << "the read waits for the host event";
  std::thread setter([&written] { written.set(); });
  setter.join();
  dev->synchronize(read);
  EXPECT_EQ(back, host);
  EXPECT_TRUE(e.complete());
  written.set();  // again: no effect
  EXPECT_TRUE(e.complete());
}

TEST(HostDevice, EventsOfOneQueueCompleteInOrder) {
  auto dev = device::make_host_device();
  constexpr std::size_t kBytes = std::size_t{1} << 22;
  std::vector<std::uint8_t> host(kBytes, 9);
  Buffer d(*dev, kBytes);
  std::vector<Event> events;
  for (int i = 0; i < 8; ++i) {
    dev->copy(Queue::h2d, d.as(), host.data(), kBytes);
    events.push_back(dev->record(Queue::h2d));
  }
  dev->synchronize(events.back());
  for (const Event& e : events) EXPECT_TRUE(e.complete());
}

}  // namespace

namespace {

using device_cases::error_code;

TEST(HostDevice, AnyHostMemoryIsDeviceMemoryOnlyWhenAskedFor) {
  // allocated_only (the stand-in GPU) refuses a plain host pointer as a kernel argument,
  // naming it; any_host_memory (a CPU trainer's device) reads it, with the same result as
  // the reference.
  std::vector<std::uint16_t> g(100);
  for (std::size_t j = 0; j < g.size(); ++j)
    g[j] = stepcore::f32_to_bf16_bits(0.01f * static_cast<float>(j) - 0.3f);
  std::vector<float> want(g.size(), 0.0f);
  const stepcore::AccumulatePair ref{stepcore::f32_view(want.data(), want.size()),
                                     {g.data(), g.size(), stepcore::DType::bf16},
                                     true};
  stepcore::reference::accumulate(std::span(&ref, 1));
  for (auto memory : {stepcore::device::HostDeviceMemory::allocated_only,
                      stepcore::device::HostDeviceMemory::any_host_memory}) {
    auto dev = stepcore::device::make_host_device(32, memory);
    std::vector<float> acc(g.size(), 1.0f);
    const stepcore::AccumulatePair pair{stepcore::f32_view(acc.data(), acc.size()),
                                        {g.data(), g.size(), stepcore::DType::bf16},
                                        true};
    if (memory == stepcore::device::HostDeviceMemory::allocated_only) {
      EXPECT_EQ(error_code([&] { dev->accumulate(std::span(&pair, 1)); }),
                stepcore::Errc::invalid_argument);
      EXPECT_EQ(acc, std::vector<float>(g.size(), 1.0f)) << "written before the refusal";
    } else {
      dev->accumulate(std::span(&pair, 1));
      dev->synchronize();
      EXPECT_EQ(0, std::memcmp(acc.data(), want.data(), acc.size() * 4));
    }
  }
  EXPECT_EQ(error_code([] {
              stepcore::device::make_host_device(
                  32, static_cast<stepcore::device::HostDeviceMemory>(9));
            }),
            stepcore::Errc::invalid_argument);
}

}  // namespace

// The CUDA device's host-memory zero is a host callback whose argument the device owns
// (device::detail::HostZeroRecords): a captured CUDA graph runs the callback at every
// replay, so here the callback runs as replays would, several times on one record, with
// the buffer dirtied in between (under ASan a callback that freed its argument, as
// before, is a use after free at the second run).
TEST(HostZeroRecords, ACapturedZeroReplaysOnItsOwnRecord) {
  device::detail::HostZeroRecords records;
  std::vector<unsigned char> buf(1000, 0x5A);
  void* record = records.get(buf.data() + 100, 500);
  EXPECT_EQ(records.get(buf.data() + 100, 500), record) << "one record per range";
  for (int replay = 0; replay < 3; ++replay) {
    std::fill(buf.begin(), buf.end(), static_cast<unsigned char>(0x5A + replay));
    device::detail::HostZeroRecords::run(record);
    for (std::size_t k = 0; k < buf.size(); ++k)
      ASSERT_EQ(buf[k], k >= 100 && k < 600 ? 0 : 0x5A + replay)
          << "replay " << replay << ", byte " << k;
  }
  (void)records.get(buf.data(), 10);
  (void)records.get(buf.data() + 900, 100);
  EXPECT_EQ(records.size(), 3u);
  records.release(buf.data(), 600);  // the first two ranges start inside it
  EXPECT_EQ(records.size(), 1u);
}
