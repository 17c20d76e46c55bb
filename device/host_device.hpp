// Test hooks of the host device (internal; tests include it through the src/ path).
#pragma once

#include "stepcore/device.hpp"

namespace stepcore::device::detail {

/// Makes a later copy on queue `q` of `host_device` (from make_host_device) fail: after
/// `after_n_copies` further copy() calls on `q` succeed, the next one throws
/// Errc::internal "injected copy failure" when its queue runs it (no byte is written),
/// and the error surfaces as any queued work's error does. Throws Errc::invalid_argument
/// for another kind of device or a negative count.
void inject_copy_failure(Device& host_device, Queue q, int after_n_copies);

/// Returns an event that completes only when complete_manual_event() is called on it.
/// A queue told to wait() for it stalls until then: tests hold a queue this way while
/// they enqueue work behind it, since a queued failure may otherwise be raised by any
/// enqueueing call after it happens (any device's wait() accepts it; on Queue::compute
/// of the host device the wait blocks the caller).
Event make_manual_event();
/// Completes an event from make_manual_event() (waking its waiters); throws
/// Errc::invalid_argument for any other event.
void complete_manual_event(const Event& e);

}  // namespace stepcore::device::detail
