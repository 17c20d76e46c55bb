// Test hooks of the checkpoint writer (internal, not installed): tests make save() meet
// the failures a real disk and a real crash produce (short writes and EINTR, a full disk,
// a failing fsync, a kill between fsync and rename) and check what is left on disk.
// load_checkpoint calls a hook between its verifying and importing passes (where a test
// rewrites or truncates the file, as another process could).
// File::open's reads in small pieces with a call between them (where a test truncates the
// file, as another process could) are host/testing.hpp's ScopedReadHook.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace stepcore::detail::checkpoint::testing {

/// The failure a ScopedSaveFault injects into every checkpoint::save on its thread.
enum class SaveFaultKind : std::uint8_t {
  /// Every write call writes at most 3 bytes, and every fifth fails with EINTR: the
  /// writer must still produce a correct file.
  short_writes,
  /// Once `bytes` bytes of the save were written, writes fail with ENOSPC.
  disk_full_after,
  /// The save stops after the temporary file's fsync and close, before the rename, as if
  /// the process were killed: it throws Errc::io_error ("simulated crash") and leaves the
  /// temporary file in place.
  crash_before_rename,
  /// The temporary file's fsync fails with EIO.
  fsync_fails,
};

/// Injects `kind` into checkpoint::save on this thread while alive (the previous fault,
/// if any, is back afterwards). `bytes`: disk_full_after's budget, counted per save.
class ScopedSaveFault {
 public:
  explicit ScopedSaveFault(SaveFaultKind kind, std::uint64_t bytes = 0);
  ~ScopedSaveFault();
  ScopedSaveFault(const ScopedSaveFault&) = delete;
  ScopedSaveFault& operator=(const ScopedSaveFault&) = delete;

 private:
  bool saved_active_;
  SaveFaultKind saved_kind_;
  std::uint64_t saved_bytes_;
};

/// While alive, GradientManager::load_checkpoint on this thread calls `between(path)`
/// once its verifying pass accepted the file, before its importing pass reads it again;
/// the previous hook, if any, is back afterwards.
class ScopedBetweenPassesHook {
 public:
  explicit ScopedBetweenPassesHook(std::function<void(const std::string& path)> between);
  ~ScopedBetweenPassesHook();
  ScopedBetweenPassesHook(const ScopedBetweenPassesHook&) = delete;
  ScopedBetweenPassesHook& operator=(const ScopedBetweenPassesHook&) = delete;

 private:
  std::function<void(const std::string&)> saved_;
};

}  // namespace stepcore::detail::checkpoint::testing
