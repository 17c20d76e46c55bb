// Test hooks of the host layer (internal, not installed): FileReader's reads in small
// pieces with a call before each, where a test truncates the file as another process
// could (the checkpoint loader's and the comparer's truncation tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace stepcore::detail::testing {

/// While alive, a FileReader opened on this thread reads `chunk_bytes` at a time (> 0)
/// and calls `before_read(offset)` before each read, whichever thread reads; the
/// previous hook, if any, is back afterwards.
class ScopedReadHook {
 public:
  ScopedReadHook(std::size_t chunk_bytes, std::function<void(std::uint64_t offset)> before_read);
  ~ScopedReadHook();
  ScopedReadHook(const ScopedReadHook&) = delete;
  ScopedReadHook& operator=(const ScopedReadHook&) = delete;

 private:
  std::size_t saved_chunk_;
  std::function<void(std::uint64_t)> saved_hook_;
};

}  // namespace stepcore::detail::testing
