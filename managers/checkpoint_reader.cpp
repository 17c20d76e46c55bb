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
//
// The streamed load's two passes (verify, import_pass) read the file front to back through
// a ring of kLoadPieces buffers of kLoadPieceBytes: helper threads read the next pieces
// while the calling thread checks (or hands over) the current one, so a load holds a few
// pieces of the file whatever its size. The first pass records each block's CRC-32C (a
// block is a piece of the payload); the second checks every block against it before it
// hands over a value, so that what is imported is what was verified.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <condition_variable>
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

/// One non-empty array of a file: where it lies in the payload, and how its values are
/// scanned.
struct Extent {
  std::uint64_t begin, end;  // payload offsets
  std::size_t index;         // i * arrays + a
  bool non_negative;         // a slot that is never negative, or block maxima
  std::uint32_t width;       // bytes per element: 4 (f32, scanned), 1 (codes: any byte)
};

/// The file's non-empty arrays, sorted by where they start (parse checked that no two
/// overlap: their ends are sorted too).
std::vector<Extent> extents_of(const ParsedFile& parsed) {
  const Header& h = parsed.header;
  const std::uint32_t arrays = h.arrays();
  std::vector<Extent> extents;
  for (std::size_t k = 0; k < parsed.array_offsets.size(); ++k) {
    const ArrayShape shape =
        array_shape(h, h.params[k / arrays], static_cast<std::uint32_t>(k % arrays));
    const bool non_negative =
        shape.absmax ||
        (shape.slot >= 0 &&
         slot_non_negative(h.optimizer, h.slots[static_cast<std::size_t>(shape.slot)]));
    if (shape.bytes() > 0)
      extents.push_back({parsed.array_offsets[k], parsed.array_offsets[k] + shape.bytes(), k,
                         non_negative, shape.width});
  }
  std::sort(extents.begin(), extents.end(),
            [](const Extent& x, const Extent& y) { return x.begin < y.begin; });
  return extents;
}

/// Calls fn(extent, b, e) for each array's part [b, e) in payload bytes [from, to), in
/// order. Arrays start at multiples of 64 and pieces at multiples of 4 from the 64-aligned
/// payload start: b and e bound whole floats (of an f32 array).
template <class Fn>
void for_each_part(const std::vector<Extent>& extents, std::uint64_t from, std::uint64_t to,
                   Fn&& fn) {
  // The first array ending after `from`.
  auto it = std::upper_bound(extents.begin(), extents.end(), from,
                             [](std::uint64_t x, const Extent& e) { return x < e.end; });
  for (; it != extents.end() && it->begin < to; ++it)
    fn(*it, std::max(from, it->begin), std::min(to, it->end));
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
    clean->assign(parsed.array_offsets.size(), 1);
    extents_ = extents_of(parsed);
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
    for_each_part(extents_, from, to, [&](const Extent& x, std::uint64_t b, std::uint64_t e) {
      if (x.width != 4) return;                  // codes: every byte is a code
      const std::byte* p = bytes_ + start_ + b;  // in the page-aligned buffer
      if (!values_clean(reinterpret_cast<const std::uint32_t*>(p), (e - b) / 4, x.non_negative))
        std::atomic_ref<unsigned char>((*clean_)[x.index]).store(0, std::memory_order_relaxed);
    });
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
  const std::size_t preamble = std::min<std::size_t>(length, kPreambleBytes);
  file.read(bytes, 0, preamble);
  const auto prefix = static_cast<std::size_t>(prefix_bytes({bytes, preamble}, length));
  file.read(bytes, preamble, prefix);
  std::uint32_t payload_crc_wanted = 0;
  impl->parsed = parse_prefix(whole.first(prefix), length, path, &payload_crc_wanted);

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

std::span<const std::byte> File::bytes(std::size_t i, std::size_t a) const {
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
  return {base, static_cast<std::size_t>(
                    array_shape(h, h.params[i], static_cast<std::uint32_t>(a)).bytes())};
}

std::span<const float> File::array(std::size_t i, std::size_t a) const {
  const std::span<const std::byte> b = bytes(i, a);
  const Header& h = impl_->parsed.header;
  if (array_shape(h, h.params[i], static_cast<std::uint32_t>(a)).width != 4)
    throw Error(Errc::invalid_argument, "a",
                "checkpoint::File::array: array " + std::to_string(a) + " of parameter " +
                    std::to_string(i) + " holds 8-bit codes (File::bytes reads it)");
  return {reinterpret_cast<const float*>(b.data()), b.size() / 4};
}

// ---- the streamed load ------------------------------------------------------------------

namespace {

/// Bytes [from, to) of a file, read in order in pieces of kLoadPieceBytes into a ring of
/// kLoadPieces buffers: up to kLoadPieces - 1 helper threads read the pieces after the one
/// the caller holds (without threads, the caller reads each piece when it asks for it).
class PieceRing {
 public:
  PieceRing(const ByteSource& file, std::uint64_t from, std::uint64_t to)
      : file_(file), from_(from), to_(to) {
    pieces_ = static_cast<std::size_t>((to - from + kLoadPieceBytes - 1) / kLoadPieceBytes);
    const std::size_t buffers = std::min<std::size_t>(kLoadPieces, pieces_);
    slots_.resize(buffers);
    for (Slot& s : slots_)  // floats: every piece starts at a multiple of 4 from `from`
      s.memory.resize(std::min<std::uint64_t>(to - from, kLoadPieceBytes) / 4 + 1);
    const unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
    const std::size_t helpers =
        std::min<std::size_t>({buffers > 0 ? buffers - 1 : 0, hardware, kLoadPieces - 1});
    for (std::size_t t = 0; t < helpers; ++t) {
      try {
        threads_.emplace_back([this] { work(); });
      } catch (const std::system_error&) {
        break;  // fewer threads read ahead
      }
    }
  }
  ~PieceRing() {
    {
      const std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  PieceRing(const PieceRing&) = delete;
  PieceRing& operator=(const PieceRing&) = delete;

  /// Releases the piece returned last and returns the next one, its file offset in `*at`
  /// (empty after the last); rethrows the error of its read.
  std::span<const std::byte> next(std::uint64_t* at) {
    std::unique_lock lock(mu_);
    if (holding_) {
      holding_ = false;
      ++released_;
      cv_.notify_all();
    }
    const std::size_t k = released_;
    if (k >= pieces_) return {};
    Slot& slot = slots_[k % slots_.size()];
    if (threads_.empty()) {
      lock.unlock();
      read_into(slot, k);
      lock.lock();
    } else {
      cv_.wait(lock, [&] { return slot.piece == k; });
    }
    if (slot.error) std::rethrow_exception(slot.error);
    holding_ = true;
    *at = begin(k);
    return {reinterpret_cast<const std::byte*>(slot.memory.data()),
            static_cast<std::size_t>(end(k) - begin(k))};
  }

 private:
  static constexpr std::size_t kNone = ~std::size_t{0};
  struct Slot {
    std::vector<float> memory;
    std::size_t piece = kNone;  ///< the piece it holds, once read
    std::exception_ptr error;   ///< that read's error
  };

  std::uint64_t begin(std::size_t k) const { return from_ + std::uint64_t{k} * kLoadPieceBytes; }
  std::uint64_t end(std::size_t k) const { return std::min(to_, begin(k) + kLoadPieceBytes); }

  /// Reads piece k into `slot` (its previous piece released), recording the outcome.
  void read_into(Slot& slot, std::size_t k) {
    std::exception_ptr error;
    try {
      file_.read(reinterpret_cast<std::byte*>(slot.memory.data()), begin(k), end(k));
    } catch (...) {
      error = std::current_exception();
    }
    const std::lock_guard lock(mu_);
    slot.piece = k;
    slot.error = error;
    if (error) stop_ = true;  // no more pieces are claimed; the caller meets it at k
  }

  /// A helper: claims the next piece once its buffer is free (the piece kLoadPieces
  /// before it released), reads it, and so on.
  void work() noexcept {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] {
        return stop_ || claimed_ >= pieces_ || claimed_ < released_ + slots_.size();
      });
      if (stop_ || claimed_ >= pieces_) return;
      const std::size_t k = claimed_++;
      lock.unlock();
      read_into(slots_[k % slots_.size()], k);
      cv_.notify_all();
      lock.lock();
    }
  }

  const ByteSource& file_;
  std::uint64_t from_, to_;
  std::size_t pieces_ = 0;
  std::vector<Slot> slots_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::size_t claimed_ = 0;   ///< pieces claimed by the helpers
  std::size_t released_ = 0;  ///< pieces the caller is done with
  bool holding_ = false;      ///< the caller holds piece released_
  bool stop_ = false;
};

/// Returns the index of the first of `n` words that is NaN or Inf (or, with non_negative,
/// below -0); n when there is none.
std::size_t first_bad_word(const std::uint32_t* words, std::size_t n, bool non_negative) noexcept {
  if (values_clean(words, n, non_negative)) return n;
  for (std::size_t j = 0; j < n; ++j)
    if ((words[j] & 0x7F800000u) == 0x7F800000u || (non_negative && words[j] > 0x80000000u))
      return j;
  return n;
}

[[noreturn]] void changed(const std::string& name, const std::string& what) {
  throw Error(Errc::corrupt_file, "path",
              name + ": " + what + " changed between the load's verifying and importing passes");
}

}  // namespace

ByteSource source_of(const FileReader& file) {
  ByteSource source;
  source.size = file.size();
  source.read = [&file](std::byte* dst, std::uint64_t from, std::uint64_t to) {
    file.read_to(dst, from, to);
  };
  source.check_size = [&file] { file.check_size(); };
  return source;
}

Verified verify(const ByteSource& file, const std::string& name) {
  Verified v;
  v.size = file.size;
  // The preamble, then the header (its length from the preamble), verified first.
  std::vector<std::byte> prefix(static_cast<std::size_t>(std::min(file.size, kPreambleBytes)));
  if (!prefix.empty()) file.read(prefix.data(), 0, prefix.size());
  const std::uint64_t wanted = prefix_bytes(prefix, file.size);
  if (wanted > prefix.size()) {
    const std::size_t had = prefix.size();
    prefix.resize(static_cast<std::size_t>(wanted));
    file.read(prefix.data() + had, had, wanted);
  }
  std::uint32_t payload_crc_wanted = 0;
  v.parsed = parse_prefix(prefix, file.size, name, &payload_crc_wanted);
  v.prefix_crc = crc32c(prefix);
  prefix = {};

  // The payload, piece by piece: each block's CRC (folded into the payload's), and its
  // values scanned for each array's first bad one (pieces come in order: the first found
  // is the array's first).
  const std::vector<Extent> extents = extents_of(v.parsed);
  v.first_bad.assign(v.parsed.array_offsets.size(), Verified::kClean);
  v.first_bad_value.assign(v.parsed.array_offsets.size(), 0.0f);
  const std::uint64_t start = v.parsed.payload_start;
  std::uint32_t payload_crc = 0;
  PieceRing ring(file, start, file.size);
  std::uint64_t at = 0;
  for (std::span<const std::byte> piece = ring.next(&at); !piece.empty(); piece = ring.next(&at)) {
    std::uint32_t crc = 0;
    for (std::size_t step = 0; step < piece.size(); step += kCheckStep) {
      const std::span<const std::byte> part =
          piece.subspan(step, std::min(kCheckStep, piece.size() - step));
      crc = crc32c(part, crc);
      const std::uint64_t from = at - start + step;
      for_each_part(extents, from, from + part.size(),
                    [&](const Extent& x, std::uint64_t b, std::uint64_t e) {
                      if (v.first_bad[x.index] != Verified::kClean || x.width != 4) return;
                      const auto* words =
                          reinterpret_cast<const std::uint32_t*>(part.data() + (b - from));
                      const std::size_t n = static_cast<std::size_t>(e - b) / 4;
                      const std::size_t j = first_bad_word(words, n, x.non_negative);
                      if (j == n) return;
                      v.first_bad[x.index] = (b - x.begin) / 4 + j;
                      v.first_bad_value[x.index] = std::bit_cast<float>(words[j]);
                    });
    }
    v.block_crcs.push_back(crc);
    payload_crc = crc32c_combine(payload_crc, crc, piece.size());
  }
  // A file cut (or grown) meanwhile is refused even when every piece was read before.
  if (file.check_size) file.check_size();
  check_payload_crc(payload_crc, payload_crc_wanted, name);
  return v;
}

void import_pass(const ByteSource& file, const Verified& v, const std::string& name,
                 const RangeSink& take) {
  if (file.check_size) file.check_size();  // io_error: shrank or grew since verify
  if (file.size != v.size) changed(name, "its size");
  const std::uint64_t start = v.parsed.payload_start;
  {
    PieceRing ring(file, 0, start);
    std::uint32_t crc = 0;
    std::uint64_t at = 0;
    for (std::span<const std::byte> p = ring.next(&at); !p.empty(); p = ring.next(&at))
      crc = crc32c(p, crc);
    if (crc != v.prefix_crc) changed(name, "its header");
  }
  const std::vector<Extent> extents = extents_of(v.parsed);
  const std::uint32_t arrays = v.parsed.header.arrays();
  PieceRing ring(file, start, v.size);
  std::uint64_t at = 0;
  std::size_t k = 0;
  for (std::span<const std::byte> piece = ring.next(&at); !piece.empty();
       piece = ring.next(&at), ++k) {
    if (k >= v.block_crcs.size() || crc32c(piece) != v.block_crcs[k])
      changed(name, "payload block " + std::to_string(k) + " (file bytes [" + std::to_string(at) +
                        ", " + std::to_string(at + piece.size()) + "))");
    const std::uint64_t from = at - start;
    for_each_part(
        extents, from, from + piece.size(), [&](const Extent& x, std::uint64_t b, std::uint64_t e) {
          take(x.index / arrays, x.index % arrays, (b - x.begin) / x.width,
               piece.subspan(static_cast<std::size_t>(b - from), static_cast<std::size_t>(e - b)));
        });
  }
}

}  // namespace stepcore::detail::checkpoint
