// The in-process communicator: ranks are threads of one process that meet in a shared
// rendezvous; the last to arrive reduces every contribution in rank order.
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "comm/comm_internal.hpp"

namespace stepcore::comm {
namespace {

enum class Kind : std::uint8_t { words, partial };

// The state every rank of one group shares.
struct Rendezvous {
  explicit Rendezvous(int n) : size(n), contributions(n), arrived_mask(n, false), left(n, false) {}

  std::mutex mutex;
  std::condition_variable cv;
  const int size;
  std::uint64_t generation = 0;  // completed collectives
  int arrived = 0;
  // The current collective, as the first rank to arrive described it.
  Kind kind = Kind::words;
  std::size_t count = 0;
  Word word = Word::u64;
  Op op = Op::sum;
  std::vector<std::vector<std::byte>> contributions;
  std::vector<bool> arrived_mask;
  std::vector<std::byte> result;
  std::vector<bool> left;
  // Failure: every rank that calls or waits afterwards throws this.
  bool failed = false;
  Errc code = Errc::timeout;
  std::string message;

  void fail(Errc c, std::string m) {
    if (failed) return;
    failed = true;
    code = c;
    message = std::move(m);
    cv.notify_all();
  }
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Rendezvous> shared, int rank,
                        std::chrono::milliseconds timeout)
      : Communicator(timeout), shared_(std::move(shared)), rank_(rank) {}

  ~InProcessCommunicator() override {
    std::lock_guard lock(shared_->mutex);
    shared_->left[rank_] = true;
    if (shared_->arrived > 0)  // peers wait in a collective this rank will never join
      shared_->fail(Errc::timeout, "rank " + std::to_string(rank_) +
                                       " left the group while its peers waited in a collective");
    shared_->cv.notify_all();
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return shared_->size; }
  MemorySpace memory() const noexcept override { return MemorySpace::host; }
  std::string_view name() const noexcept override { return "in_process"; }

  void all_reduce(void* data, std::size_t count, Word word, Op op) override {
    detail::validate_all_reduce(data, count, word, op);
    collective(Kind::words, data, count * detail::word_bytes(word), count, word, op);
  }

  void all_reduce_partial(NormPartial* partial, LayoutCheck* check) override {
    if (partial == nullptr) throw Error(Errc::null_pointer, "partial", "null");
    detail::Record r = detail::pack(*partial, check);
    collective(Kind::partial, r.data(), sizeof r, detail::kRecordWords, Word::u64, Op::sum);
    detail::unpack(r, *partial, check);
  }

  void synchronize() override {
    std::lock_guard lock(shared_->mutex);
    if (shared_->failed) throw Error(shared_->code, "", shared_->message);
  }

  void abort() noexcept override {
    std::lock_guard lock(shared_->mutex);
    shared_->fail(Errc::timeout,
                  "rank " + std::to_string(rank_) + " aborted the in-process communicator");
  }

  bool failed() const noexcept override {
    std::lock_guard lock(shared_->mutex);
    return shared_->failed;
  }

 private:
  void collective(Kind kind, void* data, std::size_t bytes, std::size_t count, Word word, Op op) {
    auto& s = *shared_;
    std::unique_lock lock(s.mutex);
    if (s.failed) throw Error(s.code, "", s.message);
    for (int r = 0; r < s.size; ++r) {
      if (r != rank_ && s.left[r]) {
        s.fail(Errc::timeout, "rank " + std::to_string(r) +
                                  " left the group and cannot join rank " + std::to_string(rank_) +
                                  "'s collective");
        throw Error(s.code, "", s.message);
      }
    }
    if (s.arrived == 0) {
      s.kind = kind;
      s.count = count;
      s.word = word;
      s.op = op;
    } else if (s.kind != kind || s.count != count || s.word != word || s.op != op) {
      s.fail(Errc::invalid_argument,
             "rank " + std::to_string(rank_) + " called a different collective than its peers (" +
                 std::to_string(count) + " " + detail::word_name(word) + " " + detail::op_name(op) +
                 " vs " + std::to_string(s.count) + " " + detail::word_name(s.word) + " " +
                 detail::op_name(s.op) + ")");
      throw Error(s.code, "count", s.message);
    }
    const auto* in = static_cast<const std::byte*>(data);
    s.contributions[rank_].assign(in, in + bytes);
    s.arrived_mask[rank_] = true;
    const std::uint64_t generation = s.generation;
    if (++s.arrived == s.size) {
      reduce_in_rank_order(s);
      s.arrived = 0;
      s.arrived_mask.assign(s.size, false);
      ++s.generation;
      s.cv.notify_all();
    } else {
      const auto deadline = std::chrono::steady_clock::now() + timeout();
      const bool done =
          s.cv.wait_until(lock, deadline, [&] { return s.generation != generation || s.failed; });
      if (s.generation == generation) {
        if (!done) {
          std::string missing;
          for (int r = 0; r < s.size; ++r)
            if (!s.arrived_mask[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          s.fail(Errc::timeout, "rank(s) " + missing + " did not arrive within " +
                                    detail::format_ms(timeout()) + " (seen by rank " +
                                    std::to_string(rank_) + ")");
        }
        throw Error(s.code, "", s.message);
      }
    }
    // A zero-word all_reduce may pass a null `data` (and the result is then empty):
    // memcpy with a null pointer is undefined even for 0 bytes.
    if (bytes != 0) std::memcpy(data, s.result.data(), bytes);
  }

  static void reduce_in_rank_order(Rendezvous& s) {
    s.result = s.contributions[0];
    for (int r = 1; r < s.size; ++r) {
      if (s.kind == Kind::partial) {
        detail::combine(reinterpret_cast<std::uint64_t*>(s.result.data()),
                        reinterpret_cast<const std::uint64_t*>(s.contributions[r].data()));
      } else {
        detail::reduce_words(s.result.data(), s.contributions[r].data(), s.count, s.word, s.op);
      }
    }
  }

  std::shared_ptr<Rendezvous> shared_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_in_process_group(
    int size, std::chrono::milliseconds timeout) {
  if (size < 1) throw Error(Errc::out_of_range, "size", "a group needs at least one rank");
  if (timeout.count() <= 0)
    throw Error(Errc::out_of_range, "timeout", "the collective timeout must be positive");
  auto shared = std::make_shared<Rendezvous>(size);
  std::vector<std::unique_ptr<Communicator>> group;
  group.reserve(size);
  for (int r = 0; r < size; ++r)
    group.push_back(std::make_unique<InProcessCommunicator>(shared, r, timeout));
  return group;
}

}  // namespace stepcore::comm
