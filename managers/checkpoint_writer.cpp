// checkpoint::save (managers/checkpoint_file.hpp): the header validated and encoded
// (managers/checkpoint_format.hpp), then written atomically: a temporary file written in
// full, the payload's CRC folded on a helper thread meanwhile, the preamble rewritten with
// both checksums, fsync, rename over the path, the directory's fsync. The save faults of
// managers/testing.hpp are injected here.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>
#include <span>
#include <string_view>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>

#include "host/crc32c.hpp"
#include "managers/checkpoint_file.hpp"
#include "managers/testing.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail::checkpoint {

namespace {

// ---- the injected faults (managers/testing.hpp) -------------------------------------

/// The fault ScopedSaveFault set on this thread, if any.
struct ActiveFault {
  bool active = false;
  testing::SaveFaultKind kind = testing::SaveFaultKind::short_writes;
  std::uint64_t bytes = 0;
};
thread_local ActiveFault tl_fault;

bool fault_is(testing::SaveFaultKind kind) noexcept {
  return tl_fault.active && tl_fault.kind == kind;
}

[[noreturn]] void io_failure(const std::string& path, const std::string& what, int err) {
  throw Error(Errc::io_error, "path", path + ": " + what + ": " + std::strerror(err));
}

[[noreturn]] void refuse(const std::string& argument, const std::string& what) {
  throw Error(Errc::invalid_argument, argument, "checkpoint::save: " + argument + " " + what);
}

// ---- save: validation, encoding, the write loop ---------------------------------------

/// The header's bytes and the payload layout save writes.
struct Encoded {
  std::vector<std::byte> header;
  std::vector<std::uint64_t> offsets;  ///< [i * arrays + a], from the payload start
  std::uint64_t payload_length = 0;
};

/// Refuses (Errc::invalid_argument naming the field) a header the format cannot hold or
/// a reader would refuse, then encodes it and lays out the payload.
Encoded validate_and_encode(const Header& h) {
  if (h.version != kFormatVersion)
    refuse("header.version", "is " + std::to_string(h.version) + "; this build writes version " +
                                 std::to_string(kFormatVersion));
  if (h.optimizer.empty() || h.optimizer.size() > kMaxNameBytes)
    refuse("header.optimizer",
           "must be a name of 1 to " + std::to_string(kMaxNameBytes) + " bytes");
  if (h.slots.size() > kMaxSlots)
    refuse("header.slots", "has " + std::to_string(h.slots.size()) + " slots, more than " +
                               std::to_string(kMaxSlots));
  for (std::size_t s = 0; s < h.slots.size(); ++s) {
    if (h.slots[s].empty() || h.slots[s].size() > kMaxNameBytes)
      refuse(indexed("header.slots", s, ""),
             "must be a name of 1 to " + std::to_string(kMaxNameBytes) + " bytes");
    for (std::size_t t = 0; t < s; ++t)
      if (h.slots[t] == h.slots[s])
        refuse(indexed("header.slots", s, ""), quoted(h.slots[s]) + " names two slots");
  }
  if (h.hyper.size() > kMaxHyper)
    refuse("header.hyper", "has " + std::to_string(h.hyper.size()) +
                               " hyper-parameters, more than " + std::to_string(kMaxHyper));
  for (std::size_t k = 0; k < h.hyper.size(); ++k)
    if (h.hyper[k].name.empty() || h.hyper[k].name.size() > kMaxNameBytes)
      refuse(indexed("header.hyper", k, "name"),
             "must be a name of 1 to " + std::to_string(kMaxNameBytes) + " bytes");
  if (h.world_size < 1)
    refuse("header.world_size", "is " + std::to_string(h.world_size) + "; it must be >= 1");
  if (h.rank < 0 || h.rank >= h.world_size)
    refuse("header.rank",
           "is " + std::to_string(h.rank) + ", outside [0, " + std::to_string(h.world_size) + ")");
  if (h.library_version.size() > kMaxNameBytes)
    refuse("header.library_version", "is longer than " + std::to_string(kMaxNameBytes) + " bytes");
  if (h.groups.size() > kMaxRecords)
    refuse("header.groups", "has " + std::to_string(h.groups.size()) + " groups, more than " +
                                std::to_string(kMaxRecords));
  if (h.params.size() > kMaxRecords)
    refuse("header.params", "has " + std::to_string(h.params.size()) + " parameters, more than " +
                                std::to_string(kMaxRecords));
  for (std::size_t g = 0; g < h.groups.size(); ++g)
    if (h.groups[g].name.size() > kMaxNameBytes)
      refuse(indexed("header.groups", g, "name"),
             "is longer than " + std::to_string(kMaxNameBytes) + " bytes");
  std::unordered_map<std::string_view, std::size_t> seen;
  seen.reserve(h.params.size());
  for (std::size_t i = 0; i < h.params.size(); ++i) {
    const ParamRecord& p = h.params[i];
    if (p.name.size() > kMaxNameBytes)
      refuse(indexed("header.params", i, "name"),
             "is longer than " + std::to_string(kMaxNameBytes) + " bytes");
    if (p.group >= h.groups.size())
      refuse(indexed("header.params", i, "group"), "is " + std::to_string(p.group) +
                                                       ", but there are " +
                                                       std::to_string(h.groups.size()) + " groups");
    if (p.numel > std::numeric_limits<std::uint64_t>::max() / 4)
      refuse(indexed("header.params", i, "numel"), "is too large for a file");
    if (p.q8 && h.slots.empty())
      refuse(indexed("header.params", i, "q8"), "8-bit slots, but the optimizer has no slots");
    const auto [it, inserted] = seen.emplace(p.name, i);
    if (!inserted)
      refuse(indexed("header.params", i, "name"),
             quoted(p.name) + " is also the name of params[" + std::to_string(it->second) + "]");
  }

  const std::uint32_t arrays = h.arrays();
  Encoded e;
  std::vector<std::byte>& out = e.header;
  put_u32(out, h.saved_mode);
  put_u32(out, static_cast<std::uint32_t>(h.rank));
  put_u32(out, static_cast<std::uint32_t>(h.world_size));
  put_u64(out, h.layout_fingerprint);
  put_string(out, h.library_version);
  put_string(out, h.optimizer);
  put_u32(out, static_cast<std::uint32_t>(h.hyper.size()));
  for (const HyperRecord& r : h.hyper) {
    put_string(out, r.name);
    put_f64(out, r.value);
  }
  put_u32(out, static_cast<std::uint32_t>(h.slots.size()));
  for (const std::string& slot : h.slots) put_string(out, slot);
  put_u32(out, static_cast<std::uint32_t>(h.groups.size()));
  for (const GroupRecord& g : h.groups) {
    put_string(out, g.name);
    put_f64(out, g.lr);
    put_f64(out, g.weight_decay);
    put_f64(out, g.beta1);
    put_f64(out, g.beta2);
    put_f64(out, g.eps);
  }
  put_u32(out, static_cast<std::uint32_t>(h.params.size()));
  e.offsets.reserve(h.params.size() * arrays);
  std::uint64_t cursor = 0;
  for (std::size_t i = 0; i < h.params.size(); ++i) {
    const ParamRecord& p = h.params[i];
    put_string(out, p.name);
    put_u64(out, p.numel);
    put_u32(out, p.group);
    put_u32(out, std::bit_cast<std::uint32_t>(p.step));
    put_u32(out, p.q8 ? 1 : 0);  // its state: f32 or 8-bit slots
    for (std::uint32_t a = 0; a < arrays; ++a) {
      std::uint64_t offset;
      if (!align_up(cursor, &offset) ||
          __builtin_add_overflow(offset, array_shape(h, p, a).bytes(), &cursor))
        refuse("header.params", "add up to more bytes than a file can hold");
      put_u64(out, offset);
      e.offsets.push_back(offset);
    }
  }
  e.payload_length = cursor;
  return e;
}

/// The temporary file of one save: written through a buffer (small pieces) or directly
/// (large arrays) with every short write and EINTR retried; removed unless kept.
class TempFile {
 public:
  TempFile(std::string path, std::string temp) : path_(std::move(path)), temp_(std::move(temp)) {
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) io_failure(path_, "cannot create the temporary file " + temp_, errno);
    buffer_.reserve(kBufferBytes);
  }
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!keep_) ::unlink(temp_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  /// Appends `bytes` to the file (through the buffer when small).
  void append(std::span<const std::byte> bytes) {
    if (buffer_.size() + bytes.size() <= kBufferBytes) {
      buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
      return;
    }
    flush();
    if (bytes.size() < kBufferBytes / 2)
      buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
    else
      write_all(bytes, -1);
  }
  /// Appends `n` zero bytes (n < kPayloadAlignment).
  void append_zeros(std::size_t n) {
    static constexpr std::byte kZeros[kPayloadAlignment] = {};
    append(std::span<const std::byte>(kZeros, n));
  }
  void flush() {
    if (buffer_.empty()) return;
    write_all(buffer_, -1);
    buffer_.clear();
  }
  /// Writes `bytes` at file offset `offset` (the final preamble).
  void write_at(std::span<const std::byte> bytes, off_t offset) { write_all(bytes, offset); }

  void sync() {
    flush();
    int rc = fault_is(testing::SaveFaultKind::fsync_fails) ? (errno = EIO, -1) : ::fsync(fd_);
    if (rc != 0) io_failure(path_, "fsync of the temporary file " + temp_ + " failed", errno);
  }
  void close() {
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0)
      io_failure(path_, "close of the temporary file " + temp_ + " failed", errno);
  }
  /// The file stays: renamed into place, or left as a killed process would leave it.
  void keep() { keep_ = true; }
  const std::string& name() const noexcept { return temp_; }

 private:
  static constexpr std::size_t kBufferBytes = kWriteBufferBytes;

  /// One write call as the injected fault shapes it.
  ssize_t write_once(const std::byte* p, std::size_t n, off_t offset) {
    if (fault_is(testing::SaveFaultKind::short_writes)) {
      if (++calls_ % 5 == 0) {
        errno = EINTR;
        return -1;
      }
      n = std::min<std::size_t>(n, 3);
    } else if (fault_is(testing::SaveFaultKind::disk_full_after)) {
      if (written_ >= tl_fault.bytes) {
        errno = ENOSPC;
        return -1;
      }
      n = static_cast<std::size_t>(std::min<std::uint64_t>(n, tl_fault.bytes - written_));
    }
    const ssize_t r = offset < 0 ? ::write(fd_, p, n) : ::pwrite(fd_, p, n, offset);
    if (r > 0) written_ += static_cast<std::uint64_t>(r);
    return r;
  }
  void write_all(std::span<const std::byte> bytes, off_t offset) {
    const std::byte* p = bytes.data();
    std::size_t n = bytes.size();
    while (n > 0) {
      const ssize_t r = write_once(p, n, offset);
      if (r < 0) {
        if (errno == EINTR) continue;
        io_failure(path_, "write of the temporary file " + temp_ + " failed", errno);
      }
      if (r == 0) io_failure(path_, "write of the temporary file " + temp_ + " wrote nothing", EIO);
      p += r;
      n -= static_cast<std::size_t>(r);
      if (offset >= 0) offset += r;
    }
  }

  std::string path_, temp_;
  int fd_ = -1;
  bool keep_ = false;
  std::vector<std::byte> buffer_;
  std::uint64_t written_ = 0;  ///< bytes this save wrote (disk_full_after)
  std::uint64_t calls_ = 0;    ///< write calls (short_writes' EINTR)
};

std::string temp_name(const std::string& path) {
  static std::atomic<std::uint64_t> counter{0};
  return path + ".tmp-" + std::to_string(::getpid()) + "-" +
         std::to_string(counter.fetch_add(1, std::memory_order_relaxed));
}

std::string directory_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

/// The payload's CRC-32C folded on a helper thread while the calling thread writes: add()
/// hands over a span (large ones to the helper, small ones folded at once, in order),
/// wait() returns once every span handed over is folded (the caller may then reuse them).
/// Without a thread (none could be started) every span is folded at once.
class BackgroundCrc {
 public:
  BackgroundCrc() {
    try {
      thread_ = std::thread([this] { run(); });
    } catch (const std::system_error&) {
      // Folded on the caller's thread.
    }
  }
  ~BackgroundCrc() {
    if (!thread_.joinable()) return;
    {
      const std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  BackgroundCrc(const BackgroundCrc&) = delete;
  BackgroundCrc& operator=(const BackgroundCrc&) = delete;

  void add(std::span<const std::byte> bytes) {
    if (!thread_.joinable() || bytes.size() < kSmall) {
      wait();
      crc_ = crc32c(bytes, crc_);
      return;
    }
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return !busy_; });
      pending_ = bytes;
      busy_ = true;
    }
    cv_.notify_all();
  }
  void wait() {
    if (!thread_.joinable()) return;
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
  }
  std::uint32_t value() {
    wait();
    return crc_;
  }

 private:
  static constexpr std::size_t kSmall = std::size_t{1} << 20;

  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return busy_ || stop_; });
      if (busy_) {
        const std::span<const std::byte> bytes = pending_;
        lock.unlock();
        const std::uint32_t crc = crc32c(bytes, crc_);
        lock.lock();
        crc_ = crc;
        busy_ = false;
        cv_.notify_all();
      } else if (stop_) {
        return;
      }
    }
  }

  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::span<const std::byte> pending_;
  bool busy_ = false, stop_ = false;
  std::uint32_t crc_ = 0;  ///< the helper's while busy_, else the caller's
};

}  // namespace

// ---- save ----------------------------------------------------------------------------

void save(const std::string& path, const Header& header, const ArraySource& source) {
  if (path.empty()) refuse("path", "is empty");
  if (!source) refuse("source", "is empty");
  // Each array whole: the source's span as it gives it (its size checked by the writer).
  const RangeSource whole = [&](std::size_t i, std::size_t a, std::size_t,
                                std::size_t) -> std::span<const std::byte> { return source(i, a); };
  save(path, header, whole, std::numeric_limits<std::size_t>::max());
}

void save(const std::string& path, const Header& header, const RangeSource& source,
          std::size_t range_elements) {
  if (path.empty()) refuse("path", "is empty");
  if (!source) refuse("source", "is empty");
  if (range_elements == 0) refuse("range_elements", "is 0");
  const Encoded e = validate_and_encode(header);

  std::uint64_t payload_start;
  if (!align_up(kPreambleBytes + e.header.size(), &payload_start))
    refuse("header", "is too large");  // not reachable with the limits above

  TempFile file(path, temp_name(path));
  Preamble pre;
  pre.header_length = e.header.size();
  pre.payload_length = e.payload_length;
  file.append(encode_preamble(Preamble{0, 0, 0, 0, 0, 0}));  // rewritten once the CRCs are known
  file.append(e.header);
  file.append_zeros(payload_start - kPreambleBytes - e.header.size());
  pre.header_crc = crc32c(e.header);

  // The arrays are written where they are, range by range (large ones in one write
  // each) while the helper folds each into the checksum; before the source is asked
  // again (its spans are valid until then) the fold of the last one is waited for.
  static constexpr std::byte kZeros[kPayloadAlignment] = {};
  BackgroundCrc payload_crc;
  std::uint64_t cursor = 0;
  for (std::size_t i = 0; i < header.params.size(); ++i) {
    for (std::uint32_t a = 0; a < header.arrays(); ++a) {
      const ArrayShape shape = array_shape(header, header.params[i], a);
      const auto numel = static_cast<std::size_t>(shape.elements);
      const std::uint64_t offset = e.offsets[i * header.arrays() + a];
      const std::size_t pad = static_cast<std::size_t>(offset - cursor);
      payload_crc.add(std::span<const std::byte>(kZeros, pad));
      file.append_zeros(pad);
      // Every array is asked for at least once (an empty one as the range [0, 0)).
      std::size_t at = 0;
      do {
        const std::size_t count = std::min(range_elements, numel - at);
        payload_crc.wait();
        const std::span<const std::byte> values = source(i, a, at, count);
        if (values.size() != count * shape.width || (count > 0 && values.data() == nullptr))
          throw Error(
              Errc::invalid_argument, "source",
              "checkpoint::save: source(" + std::to_string(i) + ", " + std::to_string(a) +
                  (count == numel ? "" : ", " + std::to_string(at)) + ") gave " +
                  std::to_string(values.size()) + " bytes" +
                  (values.data() == nullptr ? " at a null pointer" : "") + "; " +
                  (count == numel ? "array " + array_name(header, header.params[i], a) + " of " +
                                        quoted(header.params[i].name) + " has "
                                  : "the range of " + quoted(header.params[i].name) + " has ") +
                  std::to_string(count * shape.width));
        payload_crc.add(values);
        file.append(values);
        at += count;
      } while (at < numel);
      cursor = offset + shape.bytes();
    }
  }
  pre.payload_crc = payload_crc.value();
  file.flush();
  file.write_at(encode_preamble(pre), 0);
  file.sync();
  file.close();

  if (fault_is(testing::SaveFaultKind::crash_before_rename)) {
    file.keep();
    throw Error(Errc::io_error, "path",
                path + ": simulated crash before the rename; " + file.name() + " is left in place");
  }
  if (::rename(file.name().c_str(), path.c_str()) != 0)
    io_failure(path, "rename of " + file.name() + " over it failed", errno);
  file.keep();

  const std::string dir = directory_of(path);
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0)
    io_failure(path, "written and renamed, but its directory " + dir + " cannot be opened to fsync",
               errno);
  const int sync_rc = ::fsync(dir_fd);
  const int sync_errno = errno;
  ::close(dir_fd);
  // EINVAL: the file system cannot sync a directory (it has nothing to make durable).
  if (sync_rc != 0 && sync_errno != EINVAL)
    io_failure(path, "written and renamed, but the fsync of its directory " + dir + " failed",
               sync_errno);
}

// ---- the save faults -----------------------------------------------------------------------

namespace testing {

ScopedSaveFault::ScopedSaveFault(SaveFaultKind kind, std::uint64_t bytes)
    : saved_active_(tl_fault.active), saved_kind_(tl_fault.kind), saved_bytes_(tl_fault.bytes) {
  tl_fault = {true, kind, bytes};
}

ScopedSaveFault::~ScopedSaveFault() { tl_fault = {saved_active_, saved_kind_, saved_bytes_}; }

}  // namespace testing

}  // namespace stepcore::detail::checkpoint
