// The checkpoint file of one rank (docs/checkpoint.md): the encoder and the atomic
// writer (temporary file, fsync, rename, directory fsync; the CRC on a helper thread),
// the verifying parser (a pure function over the file's bytes: every length, offset and
// checksum checked before anything is returned), File's one-pass reader (pieces read,
// checksummed and value-scanned on several threads), the compatibility check, and the
// fault hooks (managers/testing.hpp).
#include "managers/checkpoint_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cinttypes>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string_view>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>

#include "host/crc32c.hpp"
#include "managers/optimizer.hpp"
#include "managers/testing.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail::checkpoint {

static_assert(std::endian::native == std::endian::little,
              "the payload's floats are written and mapped as little-endian bytes");
static_assert(sizeof(float) == 4 && std::numeric_limits<float>::is_iec559);

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

/// ScopedReadHook's read size (0: none set) and call, on this thread.
thread_local std::size_t tl_read_chunk = 0;
thread_local std::function<void(std::size_t)> tl_read_hook;

// ---- small helpers -------------------------------------------------------------------

/// Bytes in the binary header of the smallest group and parameter records: what a
/// count must fit in before anything is reserved for it.
constexpr std::uint64_t kMinGroupRecordBytes = 4 + 5 * 8;
constexpr std::uint64_t min_param_record_bytes(std::uint32_t arrays) {
  return 4 + 8 + 4 + 4 + std::uint64_t{8} * arrays;
}

/// Returns `x` rounded up to a multiple of kPayloadAlignment; false when that overflows.
bool align_up(std::uint64_t x, std::uint64_t* out) {
  std::uint64_t sum;
  if (__builtin_add_overflow(x, kPayloadAlignment - 1, &sum)) return false;
  *out = sum & ~(kPayloadAlignment - 1);
  return true;
}

std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08" PRIX32, v);
  return buf;
}

std::string number(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string indexed(const char* list, std::size_t i, const char* field) {
  return std::string(list) + "[" + std::to_string(i) + "]" + (field[0] ? "." : "") + field;
}

std::string quoted(const std::string& s) { return "'" + s + "'"; }

[[noreturn]] void corrupt(const std::string& name, const std::string& what) {
  throw Error(Errc::corrupt_file, "path", name + ": " + what);
}

[[noreturn]] void io_failure(const std::string& path, const std::string& what, int err) {
  throw Error(Errc::io_error, "path", path + ": " + what + ": " + std::strerror(err));
}

[[noreturn]] void refuse(const std::string& argument, const std::string& what) {
  throw Error(Errc::invalid_argument, argument, "checkpoint::save: " + argument + " " + what);
}

// ---- the little-endian encoding -------------------------------------------------------

void put_u32(std::vector<std::byte>& out, std::uint32_t v) {
  for (int b = 0; b < 4; ++b) out.push_back(static_cast<std::byte>(v >> (8 * b)));
}
void put_u64(std::vector<std::byte>& out, std::uint64_t v) {
  for (int b = 0; b < 8; ++b) out.push_back(static_cast<std::byte>(v >> (8 * b)));
}
void put_f64(std::vector<std::byte>& out, double v) {
  put_u64(out, std::bit_cast<std::uint64_t>(v));
}
void put_string(std::vector<std::byte>& out, const std::string& s) {
  put_u32(out, static_cast<std::uint32_t>(s.size()));
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  out.insert(out.end(), p, p + s.size());
}

std::uint32_t get_u32(const std::byte* p) {
  std::uint32_t v = 0;
  for (int b = 0; b < 4; ++b) v |= std::uint32_t{std::to_integer<std::uint8_t>(p[b])} << (8 * b);
  return v;
}
std::uint64_t get_u64(const std::byte* p) {
  std::uint64_t v = 0;
  for (int b = 0; b < 8; ++b) v |= std::uint64_t{std::to_integer<std::uint8_t>(p[b])} << (8 * b);
  return v;
}

/// The fixed preamble, as written and as read.
struct Preamble {
  std::uint32_t version = kFormatVersion;
  std::uint32_t reserved = 0;
  std::uint64_t header_length = 0;
  std::uint64_t payload_length = 0;
  std::uint32_t header_crc = 0;
  std::uint32_t payload_crc = 0;
};

std::vector<std::byte> encode_preamble(const Preamble& p) {
  std::vector<std::byte> out;
  out.reserve(kPreambleBytes);
  for (char c : kMagic) out.push_back(static_cast<std::byte>(c));
  put_u32(out, p.version);
  put_u32(out, p.reserved);
  put_u64(out, p.header_length);
  put_u64(out, p.payload_length);
  put_u32(out, p.header_crc);
  put_u32(out, p.payload_crc);
  return out;
}

/// Reads the binary header front to back; every read checks the bytes left first and
/// names the field (list[index].field) it could not read.
class HeaderReader {
 public:
  HeaderReader(std::span<const std::byte> bytes, const std::string& name)
      : bytes_(bytes), name_(name) {}

  std::size_t left() const noexcept { return bytes_.size() - pos_; }
  std::size_t position() const noexcept { return pos_; }

  std::uint32_t u32(const char* list, std::size_t i, const char* field) {
    const std::byte* p = take(4, list, i, field);
    return get_u32(p);
  }
  std::uint64_t u64(const char* list, std::size_t i, const char* field) {
    const std::byte* p = take(8, list, i, field);
    return get_u64(p);
  }
  double f64(const char* list, std::size_t i, const char* field) {
    return std::bit_cast<double>(u64(list, i, field));
  }
  std::string string(const char* list, std::size_t i, const char* field) {
    const std::uint32_t length = u32(list, i, field);
    if (length > kMaxNameBytes)
      corrupt(name_, "header field " + label(list, i, field) + " is " + std::to_string(length) +
                         " bytes long, more than the limit of " + std::to_string(kMaxNameBytes));
    const std::byte* p = take(length, list, i, field);
    return std::string(reinterpret_cast<const char*>(p), length);
  }

 private:
  static std::string label(const char* list, std::size_t i, const char* field) {
    return list[0] ? indexed(list, i, field) : std::string(field);
  }
  const std::byte* take(std::size_t n, const char* list, std::size_t i, const char* field) {
    if (n > left())
      corrupt(name_, "the header ends inside " + label(list, i, field) + " (" + std::to_string(n) +
                         " bytes needed at header byte " + std::to_string(pos_) + ", " +
                         std::to_string(left()) + " left)");
    const std::byte* p = bytes_.data() + pos_;
    pos_ += n;
    return p;
  }

  std::span<const std::byte> bytes_;
  const std::string& name_;
  std::size_t pos_ = 0;
};

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
    for (std::uint32_t a = 0; a < arrays; ++a) {
      std::uint64_t offset;
      if (!align_up(cursor, &offset) || __builtin_add_overflow(offset, p.numel * 4, &cursor))
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
  static constexpr std::size_t kBufferBytes = std::size_t{1} << 20;

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

std::span<const std::byte> bytes_of(std::span<const float> floats) { return std::as_bytes(floats); }

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

  // The arrays are written where they are (large ones in one write each) while the
  // helper folds each into the checksum; before the source is asked again (its spans
  // are valid until then) the fold of the last one is waited for.
  static constexpr std::byte kZeros[kPayloadAlignment] = {};
  BackgroundCrc payload_crc;
  std::uint64_t cursor = 0;
  for (std::size_t i = 0; i < header.params.size(); ++i) {
    const std::uint64_t numel = header.params[i].numel;
    for (std::uint32_t a = 0; a < header.arrays(); ++a) {
      const std::uint64_t offset = e.offsets[i * header.arrays() + a];
      const std::size_t pad = static_cast<std::size_t>(offset - cursor);
      payload_crc.add(std::span<const std::byte>(kZeros, pad));
      file.append_zeros(pad);
      payload_crc.wait();
      const std::span<const float> values = source(i, a);
      if (values.size() != numel || (numel > 0 && values.data() == nullptr))
        throw Error(Errc::invalid_argument, "source",
                    "checkpoint::save: source(" + std::to_string(i) + ", " + std::to_string(a) +
                        ") gave " + std::to_string(values.size()) + " floats" +
                        (values.data() == nullptr ? " at a null pointer" : "") + "; parameter " +
                        quoted(header.params[i].name) + " has " + std::to_string(numel));
      payload_crc.add(bytes_of(values));
      file.append(bytes_of(values));
      cursor = offset + numel * 4;
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

// ---- parse -----------------------------------------------------------------------------

namespace {

/// Reads version 1's fields before the groups: the optimizer as a number (0 AdamW with a
/// formula, 3 arrays; 1 SignSGD, 1 array), as the version 2 header that means the same.
void read_v1_prefix(HeaderReader& r, Header& h, const std::string& name) {
  const std::uint32_t optimizer = r.u32("", 0, "optimizer");
  const std::uint32_t formula = r.u32("", 0, "formula");
  h.saved_mode = r.u32("", 0, "saved_mode");
  const std::uint32_t arrays = r.u32("", 0, "arrays");
  h.rank = static_cast<std::int32_t>(r.u32("", 0, "rank"));
  h.world_size = static_cast<std::int32_t>(r.u32("", 0, "world_size"));
  h.layout_fingerprint = r.u64("", 0, "layout_fingerprint");
  h.library_version = r.string("", 0, "library_version");
  if (arrays != 1 && arrays != 3)
    corrupt(name, "the header says " + std::to_string(arrays) +
                      " arrays per parameter; a version 1 file holds 1 (SignSGD) or 3 (AdamW)");
  if (optimizer == 0) {
    // Version 1 wrote AdamW without amsgrad and maximize (it had neither).
    h.optimizer = "adamw";
    h.hyper = {{"formula", static_cast<double>(formula)}, {"amsgrad", 0.0}, {"maximize", 0.0}};
  } else if (optimizer == 1) {
    h.optimizer = "sign_sgd";
  } else {
    corrupt(name, "the header names optimizer " + std::to_string(optimizer) +
                      "; version 1 has 0 (adamw) and 1 (sign_sgd)");
  }
  h.slots.clear();
  if (arrays == 3) h.slots = {"exp_avg", "exp_avg_sq"};
}

/// Reads version 2's fields before the groups.
void read_v2_prefix(HeaderReader& r, Header& h, const std::string& name) {
  h.saved_mode = r.u32("", 0, "saved_mode");
  h.rank = static_cast<std::int32_t>(r.u32("", 0, "rank"));
  h.world_size = static_cast<std::int32_t>(r.u32("", 0, "world_size"));
  h.layout_fingerprint = r.u64("", 0, "layout_fingerprint");
  h.library_version = r.string("", 0, "library_version");
  h.optimizer = r.string("", 0, "optimizer");
  if (h.optimizer.empty()) corrupt(name, "the header's optimizer name is empty");
  const std::uint32_t hyper = r.u32("", 0, "hyper-parameter count");
  if (hyper > kMaxHyper)
    corrupt(name, "the header says " + std::to_string(hyper) +
                      " hyper-parameters, more than the limit of " + std::to_string(kMaxHyper));
  h.hyper.resize(hyper);
  for (std::uint32_t k = 0; k < hyper; ++k) {
    h.hyper[k].name = r.string("hyper", k, "name");
    h.hyper[k].value = r.f64("hyper", k, "value");
  }
  const std::uint32_t slots = r.u32("", 0, "slot count");
  if (slots > kMaxSlots)
    corrupt(name, "the header says " + std::to_string(slots) + " state slots, more than the " +
                      "limit of " + std::to_string(kMaxSlots));
  h.slots.resize(slots);
  for (std::uint32_t s = 0; s < slots; ++s) {
    h.slots[s] = r.string("slots", s, "");
    if (h.slots[s].empty()) corrupt(name, indexed("slots", s, "") + " is an empty name");
    for (std::uint32_t t = 0; t < s; ++t)
      if (h.slots[t] == h.slots[s])
        corrupt(name, indexed("slots", s, "") + " " + quoted(h.slots[s]) + " is also slots[" +
                          std::to_string(t) + "]");
  }
}

}  // namespace

ParsedFile parse_header(std::span<const std::byte> header_bytes, std::uint64_t payload_length,
                        const std::string& name, std::uint32_t version) {
  ParsedFile out;
  Header& h = out.header;
  HeaderReader r(header_bytes, name);
  h.version = version;
  if (version == kFormatVersion1)
    read_v1_prefix(r, h, name);
  else if (version == kFormatVersion)
    read_v2_prefix(r, h, name);
  else
    corrupt(name, "format version " + std::to_string(version) + ", this build reads " +
                      std::to_string(kFormatVersion1) + " and " + std::to_string(kFormatVersion));
  const std::uint32_t arrays = h.arrays();
  if (h.world_size < 1 || h.rank < 0 || h.rank >= h.world_size)
    corrupt(name, "the header says rank " + std::to_string(h.rank) + " of world size " +
                      std::to_string(h.world_size));

  const std::uint32_t group_count = r.u32("", 0, "group count");
  if (group_count > kMaxRecords || group_count * kMinGroupRecordBytes > r.left())
    corrupt(name, "the header says " + std::to_string(group_count) +
                      " groups, more than its remaining " + std::to_string(r.left()) +
                      " bytes can hold (or than the limit of " + std::to_string(kMaxRecords) + ")");
  h.groups.resize(group_count);
  for (std::uint32_t g = 0; g < group_count; ++g) {
    GroupRecord& rec = h.groups[g];
    rec.name = r.string("groups", g, "name");
    rec.lr = r.f64("groups", g, "lr");
    rec.weight_decay = r.f64("groups", g, "weight_decay");
    rec.beta1 = r.f64("groups", g, "beta1");
    rec.beta2 = r.f64("groups", g, "beta2");
    rec.eps = r.f64("groups", g, "eps");
  }

  const std::uint32_t param_count = r.u32("", 0, "parameter count");
  if (param_count > kMaxRecords || param_count * min_param_record_bytes(arrays) > r.left())
    corrupt(name, "the header says " + std::to_string(param_count) +
                      " parameters, more than its remaining " + std::to_string(r.left()) +
                      " bytes can hold (or than the limit of " + std::to_string(kMaxRecords) + ")");
  h.params.resize(param_count);
  out.array_offsets.resize(std::size_t{param_count} * arrays);
  for (std::uint32_t i = 0; i < param_count; ++i) {
    ParamRecord& p = h.params[i];
    p.name = r.string("params", i, "name");
    p.numel = r.u64("params", i, "numel");
    p.group = r.u32("params", i, "group");
    p.step = std::bit_cast<float>(r.u32("params", i, "step"));
    if (p.group >= group_count)
      corrupt(name, indexed("params", i, "group") + " is " + std::to_string(p.group) +
                        ", but the " + "file has " + std::to_string(group_count) + " groups");
    if (p.numel > std::numeric_limits<std::uint64_t>::max() / 4)
      corrupt(name, indexed("params", i, "numel") + " is " + std::to_string(p.numel) +
                        ": its bytes overflow 64 bits");
    const std::uint64_t bytes = p.numel * 4;
    for (std::uint32_t a = 0; a < arrays; ++a) {
      const std::uint64_t offset = r.u64("params", i, "array offset");
      const std::string array = indexed("params", i, "") + " array " + std::to_string(a);
      if (offset % kPayloadAlignment != 0)
        corrupt(name, array + " is at payload offset " + std::to_string(offset) +
                          ", not a multiple of " + std::to_string(kPayloadAlignment));
      std::uint64_t end;
      if (__builtin_add_overflow(offset, bytes, &end) || end > payload_length)
        corrupt(name, array + " (" + std::to_string(bytes) + " bytes at payload offset " +
                          std::to_string(offset) + ") runs past the end of the " +
                          std::to_string(payload_length) + "-byte payload");
      out.array_offsets[std::size_t{i} * arrays + a] = offset;
    }
  }
  if (r.left() != 0)
    corrupt(name,
            std::to_string(r.left()) + " unread bytes follow the last parameter in the header");

  // Names are unique.
  std::unordered_map<std::string_view, std::uint32_t> seen;
  seen.reserve(param_count);
  for (std::uint32_t i = 0; i < param_count; ++i) {
    const auto [it, inserted] = seen.emplace(h.params[i].name, i);
    if (!inserted)
      corrupt(name, indexed("params", i, "name") + " " + quoted(h.params[i].name) +
                        " is also the name of params[" + std::to_string(it->second) + "]");
  }

  // No two (non-empty) arrays overlap: sorted by offset, each ends before the next starts.
  struct Extent {
    std::uint64_t begin, end;
    std::size_t index;  // i * arrays + a
  };
  std::vector<Extent> extents;
  extents.reserve(out.array_offsets.size());
  for (std::size_t k = 0; k < out.array_offsets.size(); ++k) {
    const std::uint64_t bytes = h.params[k / arrays].numel * 4;
    if (bytes > 0) extents.push_back({out.array_offsets[k], out.array_offsets[k] + bytes, k});
  }
  std::sort(extents.begin(), extents.end(), [](const Extent& x, const Extent& y) {
    return x.begin != y.begin ? x.begin < y.begin : x.index < y.index;
  });
  for (std::size_t k = 1; k < extents.size(); ++k) {
    const Extent& prev = extents[k - 1];
    const Extent& next = extents[k];
    if (next.begin < prev.end) {
      auto label = [&](const Extent& x) {
        return indexed("params", x.index / arrays, "") + " array " +
               std::to_string(x.index % arrays) + " (payload bytes [" + std::to_string(x.begin) +
               ", " + std::to_string(x.end) + "))";
      };
      corrupt(name, label(next) + " overlaps " + label(prev));
    }
  }
  return out;
}

namespace {

/// Everything parse verifies but the payload's checksum, reading only the bytes before
/// the payload (`bytes` is the whole file's extent; the payload need not be read yet).
/// Returns the parsed header and sets `payload_crc` to the checksum the preamble records.
ParsedFile parse_prefix(std::span<const std::byte> bytes, const std::string& name,
                        std::uint32_t* payload_crc_wanted) {
  if (bytes.size() < kPreambleBytes)
    corrupt(name, bytes.empty() ? std::string("the file is empty")
                                : "the file is " + std::to_string(bytes.size()) +
                                      " bytes, shorter than the " + std::to_string(kPreambleBytes) +
                                      "-byte preamble (truncated)");
  if (std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0)
    corrupt(name, "not a stepcore checkpoint (the magic is not \"STEPCKPT\")");
  Preamble pre;
  pre.version = get_u32(bytes.data() + 8);
  pre.reserved = get_u32(bytes.data() + 12);
  pre.header_length = get_u64(bytes.data() + 16);
  pre.payload_length = get_u64(bytes.data() + 24);
  pre.header_crc = get_u32(bytes.data() + 32);
  pre.payload_crc = get_u32(bytes.data() + 36);
  if (pre.version != kFormatVersion && pre.version != kFormatVersion1)
    corrupt(name, "format version " + std::to_string(pre.version) + ", this build reads " +
                      std::to_string(kFormatVersion1) + " and " + std::to_string(kFormatVersion));
  if (pre.reserved != 0)
    corrupt(name, "the reserved preamble field is " + hex32(pre.reserved) + ", not 0");

  const std::uint64_t size = bytes.size();
  if (pre.header_length > size - kPreambleBytes)
    corrupt(name, "the header length " + std::to_string(pre.header_length) +
                      " runs past the end of the " + std::to_string(size) + "-byte file");
  std::uint64_t payload_start, file_end;
  if (!align_up(kPreambleBytes + pre.header_length, &payload_start) ||
      __builtin_add_overflow(payload_start, pre.payload_length, &file_end) || file_end != size)
    corrupt(name, "the header length " + std::to_string(pre.header_length) +
                      " and the payload length " + std::to_string(pre.payload_length) +
                      " do not add up to the file's " + std::to_string(size) +
                      " bytes (truncated?)");

  const std::span<const std::byte> header = bytes.subspan(kPreambleBytes, pre.header_length);
  const std::span<const std::byte> padding = bytes.subspan(
      kPreambleBytes + pre.header_length, payload_start - kPreambleBytes - pre.header_length);
  if (std::any_of(padding.begin(), padding.end(), [](std::byte b) { return b != std::byte{0}; }))
    corrupt(name, "the padding between the header and the payload is not zero");
  const std::uint32_t header_crc = crc32c(header);
  if (header_crc != pre.header_crc)
    corrupt(name, "header checksum mismatch (CRC-32C " + hex32(header_crc) +
                      ", the preamble says " + hex32(pre.header_crc) + ")");
  ParsedFile out = parse_header(header, pre.payload_length, name, pre.version);
  out.payload_start = payload_start;
  *payload_crc_wanted = pre.payload_crc;
  return out;
}

/// Throws Errc::corrupt_file unless the payload's checksum `got` is the one recorded.
void check_payload_crc(std::uint32_t got, std::uint32_t wanted, const std::string& name) {
  if (got != wanted)
    corrupt(name, "payload checksum mismatch (CRC-32C " + hex32(got) + ", the preamble says " +
                      hex32(wanted) + ")");
}

}  // namespace

ParsedFile parse(std::span<const std::byte> bytes, const std::string& name) {
  std::uint32_t wanted = 0;
  ParsedFile out = parse_prefix(bytes, name, &wanted);
  check_payload_crc(crc32c(bytes.subspan(out.payload_start)), wanted, name);
  return out;
}

// ---- File ------------------------------------------------------------------------------

// The file is read into memory, never mapped: a mapping whose file another process
// truncates raises SIGBUS at the next access, which would kill the host process; a read
// that finds the file shorter than it was is an Errc::io_error instead.
//
// One pass over the bytes: the calling thread reads the preamble and header and verifies
// them; then several threads read the payload in pieces, each folding its piece's CRC
// and scanning its values (when asked) right after reading it, while it is in cache.
// Nothing is handed out before every piece is read and the combined checksum compared.
struct File::Impl {
  std::byte* bytes = nullptr;  ///< the whole file (null for an empty file)
  std::size_t length = 0;
  std::size_t mapped = 0;  ///< bytes of the anonymous mapping holding `bytes`
  ParsedFile parsed;
  /// Per array ([i * arrays + a]): 1 when the value scan found nothing wrong.
  std::vector<unsigned char> clean;
  ~Impl() {
    if (bytes != nullptr) ::munmap(bytes, mapped);
  }
};

namespace {

/// Bytes per piece of the payload a reader thread reads and then checks, and per step of
/// those checks (the CRC and the value scan both read a step while it is in cache).
constexpr std::size_t kReadPiece = std::size_t{4} << 20;
constexpr std::size_t kCheckStep = std::size_t{256} << 10;
/// The most threads that read one file.
constexpr unsigned kMaxReaders = 4;

/// ScopedReadHook's settings, taken from the opening thread and shared by its readers
/// (the hook is called under `mu`, one call at a time).
struct ReadControl {
  std::size_t chunk = std::size_t{1} << 30;
  const std::function<void(std::size_t)>* hook = nullptr;
  std::mutex mu;
};

/// Reads bytes [from, to) of fd into out + from; throws Errc::io_error naming the path when
/// the file ends early (it was truncated meanwhile) or a read fails.
void read_range(int fd, std::byte* out, std::size_t from, std::size_t to, std::size_t length,
                const std::string& path, ReadControl& control) {
  std::size_t done = from;
  while (done < to) {
    if (control.hook != nullptr) {
      const std::lock_guard lock(control.mu);
      (*control.hook)(done);
    }
    const std::size_t want = std::min<std::size_t>(to - done, control.chunk);
    const ssize_t got = ::pread(fd, out + done, want, static_cast<off_t>(done));
    if (got < 0) {
      if (errno == EINTR) continue;
      io_failure(path, "cannot read", errno);
    }
    if (got == 0)
      throw Error(Errc::io_error, "path",
                  path + ": the file ended at byte " + std::to_string(done) + " of " +
                      std::to_string(length) + " while being read (changed meanwhile?)");
    done += static_cast<std::size_t>(got);
  }
}

/// Returns true when no word of `words` is NaN or Inf (nor, with non_negative, below
/// -0): one branch-free pass the compiler vectorises.
bool values_clean(const std::uint32_t* words, std::size_t n, bool non_negative) noexcept {
  std::uint32_t bad = 0;
  if (non_negative)
    for (std::size_t j = 0; j < n; ++j)
      bad |= static_cast<std::uint32_t>((words[j] & 0x7F800000u) == 0x7F800000u) |
             static_cast<std::uint32_t>(words[j] > 0x80000000u);
  else
    for (std::size_t j = 0; j < n; ++j)
      bad |= static_cast<std::uint32_t>((words[j] & 0x7F800000u) == 0x7F800000u);
  return bad == 0;
}

/// The payload's one pass: pieces read by several threads at once (each takes the next
/// piece), each piece's CRC folded and its values scanned right after its read; the
/// pieces' CRCs combine in file order at the end (crc32c_combine).
class PayloadReader {
 public:
  PayloadReader(int fd, std::byte* bytes, const ParsedFile& parsed, std::size_t length,
                const std::string& path, bool scan, std::vector<unsigned char>* clean)
      : fd_(fd),
        bytes_(bytes),
        start_(static_cast<std::size_t>(parsed.payload_start)),
        length_(length),
        path_(path),
        clean_(clean) {
    control_.chunk = tl_read_chunk != 0 ? tl_read_chunk : control_.chunk;
    control_.hook = tl_read_hook ? &tl_read_hook : nullptr;
    pieces_ = (length_ - start_ + kReadPiece - 1) / kReadPiece;
    crcs_.assign(pieces_, 0);
    if (!scan) return;
    const Header& h = parsed.header;
    clean->assign(parsed.array_offsets.size(), 1);
    const std::uint32_t arrays = h.arrays();
    for (std::size_t k = 0; k < parsed.array_offsets.size(); ++k) {
      const std::uint64_t bytes = h.params[k / arrays].numel * 4;
      const std::size_t a = k % arrays;
      if (bytes > 0)
        extents_.push_back({parsed.array_offsets[k], parsed.array_offsets[k] + bytes, k,
                            a != 0 && slot_non_negative(h.slots[a - 1])});
    }
    // parse checked that no two overlap: sorted by start, they are disjoint.
    std::sort(extents_.begin(), extents_.end(),
              [](const Extent& x, const Extent& y) { return x.begin < y.begin; });
  }

  /// Reads and checks the whole payload (this thread and up to kMaxReaders - 1 more) and
  /// returns its CRC-32C; rethrows the first reader's error.
  std::uint32_t run() {
    const unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
    const std::size_t helpers = std::min<std::size_t>(std::min(hardware, kMaxReaders), pieces_);
    std::vector<std::thread> threads;
    for (std::size_t t = 1; t < helpers; ++t) {
      try {
        threads.emplace_back([this] { work(); });
      } catch (const std::system_error&) {
        break;  // fewer threads: the others take more pieces
      }
    }
    work();
    for (std::thread& t : threads) t.join();
    if (error_) std::rethrow_exception(error_);
    std::uint32_t crc = 0;
    for (std::size_t k = 0; k < pieces_; ++k) {
      const std::size_t from = start_ + k * kReadPiece;
      crc = crc32c_combine(crc, crcs_[k], std::min(length_, from + kReadPiece) - from);
    }
    return crc;
  }

 private:
  struct Extent {
    std::uint64_t begin, end;  // payload offsets
    std::size_t index;         // i * arrays + a
    bool non_negative;         // a slot that is never negative
  };

  void work() noexcept {
    for (;;) {
      if (failed_.load(std::memory_order_relaxed)) return;
      const std::size_t k = next_.fetch_add(1, std::memory_order_relaxed);
      if (k >= pieces_) return;
      const std::size_t from = start_ + k * kReadPiece;
      const std::size_t to = std::min(length_, from + kReadPiece);
      try {
        read_range(fd_, bytes_, from, to, length_, path_, control_);
      } catch (...) {
        const std::lock_guard lock(error_mu_);
        if (!error_) error_ = std::current_exception();
        failed_.store(true, std::memory_order_relaxed);
        return;
      }
      std::uint32_t crc = 0;
      for (std::size_t at = from; at < to; at += kCheckStep) {
        const std::size_t end = std::min(to, at + kCheckStep);
        crc = crc32c(std::span<const std::byte>(bytes_ + at, end - at), crc);
        scan(at - start_, end - start_);
      }
      crcs_[k] = crc;
    }
  }

  /// Scans the values of the arrays in payload bytes [from, to).
  void scan(std::uint64_t from, std::uint64_t to) noexcept {
    // The first array ending after `from`: arrays are disjoint, so ends are sorted too.
    auto it = std::upper_bound(extents_.begin(), extents_.end(), from,
                               [](std::uint64_t x, const Extent& e) { return x < e.end; });
    for (; it != extents_.end() && it->begin < to; ++it) {
      const std::uint64_t b = std::max(from, it->begin), e = std::min(to, it->end);
      // Arrays start at multiples of 64 and steps at multiples of kCheckStep from the
      // 64-aligned payload start: b and e bound whole floats in the page-aligned buffer.
      const std::byte* p = bytes_ + start_ + b;
      if (!values_clean(reinterpret_cast<const std::uint32_t*>(p), (e - b) / 4, it->non_negative))
        std::atomic_ref<unsigned char>((*clean_)[it->index]).store(0, std::memory_order_relaxed);
    }
  }

  int fd_;
  std::byte* bytes_;
  std::size_t start_, length_, pieces_ = 0;
  const std::string& path_;
  std::vector<unsigned char>* clean_;
  std::vector<Extent> extents_;
  std::vector<std::uint32_t> crcs_;  ///< each piece's CRC-32C, written by its reader
  ReadControl control_;
  std::atomic<std::size_t> next_{0};
  std::atomic<bool> failed_{false};
  std::mutex error_mu_;
  std::exception_ptr error_;
};

}  // namespace

File::File(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
File::~File() = default;
File::File(File&&) noexcept = default;
File& File::operator=(File&&) noexcept = default;

File File::open(const std::string& path, bool scan_values) {
  // O_NONBLOCK: a FIFO at `path` is refused below instead of blocking the open.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) io_failure(path, "cannot open", errno);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) io_failure(path, "cannot stat", errno);
  if (S_ISDIR(st.st_mode)) io_failure(path, "cannot read", EISDIR);
  if (!S_ISREG(st.st_mode)) throw Error(Errc::io_error, "path", path + ": not a regular file");
  auto impl = std::make_unique<Impl>();
  if (st.st_size == 0) {
    impl->parsed = parse({}, path);  // throws: an empty file
    return File(std::move(impl));
  }
  if (static_cast<std::uint64_t>(st.st_size) > std::numeric_limits<std::size_t>::max() / 2)
    throw Error(Errc::io_error, "path", path + ": too large to read");
  const std::size_t length = static_cast<std::size_t>(st.st_size);
  // Anonymous memory in whole 2 MiB pages where the kernel has them (fewer faults than
  // 4 KiB pages); page-aligned, so every array is 64-byte aligned as floats need.
  constexpr std::size_t kHuge = std::size_t{2} << 20;
  const std::size_t mapped = (length + kHuge - 1) / kHuge * kHuge;
  void* mem = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED)
    throw Error(Errc::io_error, "path",
                path + ": cannot allocate " + std::to_string(length) + " bytes to read it");
#ifdef MADV_HUGEPAGE
  ::madvise(mem, mapped, MADV_HUGEPAGE);  // a hint
#endif
  impl->bytes = static_cast<std::byte*>(mem);
  impl->mapped = mapped;
  impl->length = length;
  std::byte* const bytes = impl->bytes;
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);  // a hint: read front to back

  // The preamble and header first (their lengths come from the preamble), verified
  // before the payload is read.
  ReadControl control;
  control.chunk = tl_read_chunk != 0 ? tl_read_chunk : control.chunk;
  control.hook = tl_read_hook ? &tl_read_hook : nullptr;
  const std::span<const std::byte> whole(bytes, length);
  std::size_t prefix = std::min<std::size_t>(length, kPreambleBytes);
  read_range(fd, bytes, 0, prefix, length, path, control);
  if (prefix == kPreambleBytes) {
    const std::uint64_t header_length = get_u64(bytes + 16);
    std::uint64_t start;
    if (header_length <= length - kPreambleBytes &&
        align_up(kPreambleBytes + header_length, &start) && start <= length)
      prefix = static_cast<std::size_t>(start);
    else
      prefix = length;  // parse_prefix refuses it; read it all to say so as parse would
    read_range(fd, bytes, kPreambleBytes, prefix, length, path, control);
  }
  std::uint32_t payload_crc_wanted = 0;
  impl->parsed = parse_prefix(whole, path, &payload_crc_wanted);

  PayloadReader reader(fd, bytes, impl->parsed, length, path, scan_values, &impl->clean);
  const std::uint32_t payload_crc = reader.run();
  // Pieces are read in any order: a file cut (or grown) meanwhile is refused even when
  // every piece was read before the cut.
  if (::fstat(fd, &st) != 0) io_failure(path, "cannot stat", errno);
  if (static_cast<std::uint64_t>(st.st_size) != length)
    throw Error(Errc::io_error, "path",
                path + ": the file changed size from " + std::to_string(length) + " to " +
                    std::to_string(st.st_size) + " bytes while being read");
  check_payload_crc(payload_crc, payload_crc_wanted, path);
  return File(std::move(impl));
}

bool File::values_clean(std::size_t i, std::size_t a) const noexcept {
  const std::size_t k = i * impl_->parsed.header.arrays() + a;
  return k < impl_->clean.size() && impl_->clean[k] != 0;
}

const Header& File::header() const noexcept { return impl_->parsed.header; }

std::span<const float> File::array(std::size_t i, std::size_t a) const {
  const Header& h = impl_->parsed.header;
  if (i >= h.params.size())
    throw Error(Errc::out_of_range, "i",
                "checkpoint::File::array: parameter " + std::to_string(i) + " of " +
                    std::to_string(h.params.size()));
  if (a >= h.arrays())
    throw Error(Errc::out_of_range, "a",
                "checkpoint::File::array: array " + std::to_string(a) + " of " +
                    std::to_string(h.arrays()));
  const std::byte* base =
      impl_->bytes + impl_->parsed.payload_start + impl_->parsed.array_offsets[i * h.arrays() + a];
  return {reinterpret_cast<const float*>(base), static_cast<std::size_t>(h.params[i].numel)};
}

// ---- check_compatible -------------------------------------------------------------------

namespace {

[[noreturn]] void differs(Errc code, const std::string& field, const std::string& in_file,
                          const std::string& mine, const std::string& path) {
  throw Error(
      code, "checkpoint." + field,
      "checkpoint." + field + ": " + in_file + " in " + path + ", " + mine + " in this manager");
}

bool same_bits(double x, double y) {
  return std::bit_cast<std::uint64_t>(x) == std::bit_cast<std::uint64_t>(y);
}

}  // namespace

void check_compatible(const Header& file, const Header& mine, const std::string& path) {
  using std::to_string;
  const Errc bad = Errc::invalid_argument;
  if (file.optimizer != mine.optimizer)
    differs(bad, "optimizer", quoted(file.optimizer), quoted(mine.optimizer), path);
  if (file.slots != mine.slots) {
    auto list = [](const std::vector<std::string>& names) {
      std::string out;
      for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
      return "state slots [" + out + "]";
    };
    differs(bad, "slots", list(file.slots), list(mine.slots), path);
  }
  // Every hyper-parameter either records must be in the other, with the same bits.
  auto find = [](const Header& h, const std::string& name) -> const HyperRecord* {
    for (const HyperRecord& r : h.hyper)
      if (r.name == name) return &r;
    return nullptr;
  };
  for (const HyperRecord& m : mine.hyper) {
    const HyperRecord* f = find(file, m.name);
    if (f == nullptr) differs(bad, "hyper." + m.name, "not recorded", number(m.value), path);
    if (!same_bits(f->value, m.value))
      differs(bad, "hyper." + m.name, number(f->value), number(m.value), path);
  }
  for (const HyperRecord& f : file.hyper)
    if (find(mine, f.name) == nullptr)
      differs(bad, "hyper." + f.name, number(f.value),
              "no such hyper-parameter of " + mine.optimizer, path);
  if (file.groups.size() != mine.groups.size())
    differs(Errc::size_mismatch, "groups", to_string(file.groups.size()) + " groups",
            to_string(mine.groups.size()), path);
  for (std::size_t g = 0; g < file.groups.size(); ++g) {
    const GroupRecord& f = file.groups[g];
    const GroupRecord& m = mine.groups[g];
    if (f.name != m.name)
      differs(bad, indexed("groups", g, "name"), quoted(f.name), quoted(m.name), path);
    if (!same_bits(f.beta1, m.beta1))
      differs(bad, indexed("groups", g, "beta1"), number(f.beta1), number(m.beta1), path);
    if (!same_bits(f.beta2, m.beta2))
      differs(bad, indexed("groups", g, "beta2"), number(f.beta2), number(m.beta2), path);
    if (!same_bits(f.eps, m.eps))
      differs(bad, indexed("groups", g, "eps"), number(f.eps), number(m.eps), path);
  }
  if (file.rank != mine.rank)
    differs(bad, "rank", to_string(file.rank), to_string(mine.rank), path);
  if (file.world_size != mine.world_size)
    differs(bad, "world_size", to_string(file.world_size), to_string(mine.world_size), path);
  if (file.layout_fingerprint != mine.layout_fingerprint)
    differs(bad, "layout_fingerprint", to_string(file.layout_fingerprint),
            to_string(mine.layout_fingerprint), path);
  if (file.params.size() != mine.params.size())
    differs(Errc::size_mismatch, "params", to_string(file.params.size()) + " parameters",
            to_string(mine.params.size()), path);
  for (std::size_t i = 0; i < file.params.size(); ++i) {
    const ParamRecord& f = file.params[i];
    const ParamRecord& m = mine.params[i];
    if (f.name != m.name)
      differs(bad, indexed("params", i, "name"), quoted(f.name), quoted(m.name), path);
    if (f.numel != m.numel)
      differs(Errc::size_mismatch, indexed("params", i, "numel"), to_string(f.numel),
              to_string(m.numel), path);
    if (f.group != m.group)
      differs(bad, indexed("params", i, "group"), to_string(f.group), to_string(m.group), path);
  }
}

// ---- the fault hooks ---------------------------------------------------------------------

namespace testing {

ScopedSaveFault::ScopedSaveFault(SaveFaultKind kind, std::uint64_t bytes)
    : saved_active_(tl_fault.active), saved_kind_(tl_fault.kind), saved_bytes_(tl_fault.bytes) {
  tl_fault = {true, kind, bytes};
}

ScopedSaveFault::~ScopedSaveFault() { tl_fault = {saved_active_, saved_kind_, saved_bytes_}; }

ScopedReadHook::ScopedReadHook(std::size_t chunk_bytes,
                               std::function<void(std::size_t offset)> before_read)
    : saved_chunk_(tl_read_chunk), saved_hook_(std::move(tl_read_hook)) {
  tl_read_chunk = chunk_bytes;
  tl_read_hook = std::move(before_read);
}

ScopedReadHook::~ScopedReadHook() {
  tl_read_chunk = saved_chunk_;
  tl_read_hook = std::move(saved_hook_);
}

}  // namespace testing

}  // namespace stepcore::detail::checkpoint
