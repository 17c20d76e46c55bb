// checkpoint::File (managers/checkpoint_file.hpp): the verified reader. The file is read
// into memory through the library's file reader (host/file_reader.hpp), never mapped: a
// mapping whose file another process truncates raises SIGBUS at the next access, which
// would kill the host process; a read that finds the file shorter than it was is an
// Errc::io_error instead.
//
// One pass over the bytes: the calling thread reads the preamble and header and verifies
// them (parse_prefix); then several threads read the payload in pieces, each folding its
// piece's CRC and scanning its values (when asked) right after reading it, while it is in
// cache. Nothing is handed out before every piece is read and the combined checksum
// compared.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "host/crc32c.hpp"
#include "host/file_reader.hpp"
#include "managers/checkpoint_file.hpp"
#include "managers/optimizer.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail::checkpoint {

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

class PayloadReader {
 public:
  PayloadReader(const FileReader& file, std::byte* bytes, const ParsedFile& parsed, bool scan,
                std::vector<unsigned char>* clean)
      : file_(file),
        bytes_(bytes),
        start_(static_cast<std::size_t>(parsed.payload_start)),
        length_(static_cast<std::size_t>(file.size())),
        clean_(clean) {
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
        file_.read(bytes_, from, to);
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

  const FileReader& file_;
  std::byte* bytes_;
  std::size_t start_, length_, pieces_ = 0;
  std::vector<unsigned char>* clean_;
  std::vector<Extent> extents_;
  std::vector<std::uint32_t> crcs_;  ///< each piece's CRC-32C, written by its reader
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
  const FileReader file(path);  // io_error: cannot open, a directory, not a regular file
  auto impl = std::make_unique<Impl>();
  if (file.size() == 0) {
    impl->parsed = parse({}, path);  // throws: an empty file
    return File(std::move(impl));
  }
  if (file.size() > std::numeric_limits<std::size_t>::max() / 2)
    throw Error(Errc::io_error, "path", path + ": too large to read");
  const std::size_t length = static_cast<std::size_t>(file.size());
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

  // The preamble and header first (their lengths come from the preamble), verified
  // before the payload is read.
  const std::span<const std::byte> whole(bytes, length);
  std::size_t prefix = std::min<std::size_t>(length, kPreambleBytes);
  file.read(bytes, 0, prefix);
  if (prefix == kPreambleBytes) {
    const std::uint64_t header_length = decode_preamble(bytes).header_length;
    std::uint64_t start;
    if (header_length <= length - kPreambleBytes &&
        align_up(kPreambleBytes + header_length, &start) && start <= length)
      prefix = static_cast<std::size_t>(start);
    else
      prefix = length;  // parse_prefix refuses it; read it all to say so as parse would
    file.read(bytes, kPreambleBytes, prefix);
  }
  std::uint32_t payload_crc_wanted = 0;
  impl->parsed = parse_prefix(whole, path, &payload_crc_wanted);

  PayloadReader reader(file, bytes, impl->parsed, scan_values, &impl->clean);
  const std::uint32_t payload_crc = reader.run();
  // Pieces are read in any order: a file cut (or grown) meanwhile is refused even when
  // every piece was read before the cut.
  file.check_size();
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

}  // namespace stepcore::detail::checkpoint
