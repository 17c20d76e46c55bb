// The MPI communicator: nonblocking collectives on a duplicate of the caller's
// communicator, polled against a deadline, and a one-word confirmation after each, so
// that a rank never returns a result its peers gave up on.
#include <mpi.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm_internal.hpp"
#include "stepcore/comm_mpi.hpp"
#include "stepcore/comm_nccl.hpp"

namespace stepcore::comm {

bool built_with_mpi() noexcept { return true; }

namespace {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

void check_mpi(int code, const char* what) {
  if (code != MPI_SUCCESS)
    throw Error(Errc::mpi_error, "", std::string(what) + ": " + mpi_error_string(code));
}

MPI_Datatype mpi_type(Word word) {
  switch (word) {
    case Word::u32:
      return MPI_UINT32_T;
    case Word::u64:
      return MPI_UINT64_T;
    case Word::f32:
      return MPI_FLOAT;
    case Word::f64:
      return MPI_DOUBLE;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(Op op) { return op == Op::sum ? MPI_SUM : op == Op::max ? MPI_MAX : MPI_MIN; }

// The user-defined reduction of norm records (one record is one datatype element, so
// MPI never splits it): sums on the first kSumWords words, max on the rest.
void record_op(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<std::uint64_t*>(inout);
  const auto* b = static_cast<const std::uint64_t*>(in);
  for (int i = 0; i < *len; ++i)
    detail::combine(a + i * detail::kRecordWords, b + i * detail::kRecordWords);
}

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm user, std::chrono::milliseconds timeout) : Communicator(timeout) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized || mpi_finalized())
      throw Error(Errc::mpi_error, "comm", "MPI is not initialised (or already finalised)");
    if (user == MPI_COMM_NULL) throw Error(Errc::null_pointer, "comm", "MPI_COMM_NULL");
    check_mpi(MPI_Comm_dup(user, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    check_mpi(
        MPI_Type_contiguous(static_cast<int>(detail::kRecordWords), MPI_UINT64_T, &record_type_),
        "MPI_Type_contiguous");
    check_mpi(MPI_Type_commit(&record_type_), "MPI_Type_commit");
    check_mpi(MPI_Op_create(&record_op, 1, &record_op_), "MPI_Op_create");
  }

  ~MpiCommunicator() override {
    if (mpi_finalized()) return;  // nothing may be called any more
    // Pending requests of timed-out collectives cannot be cancelled or freed (MPI 3.1,
    // 5.12): keep their buffers alive unless they have completed by now.
    for (auto& p : abandoned_) {
      int done = 0;
      if (MPI_Test(&p.request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) continue;
      (void)p.buffer.release();  // still in use by MPI: intentionally leaked
    }
    MPI_Op_free(&record_op_);
    MPI_Type_free(&record_type_);
    MPI_Comm_free(&comm_);  // deferred by MPI until pending operations complete
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  MemorySpace memory() const noexcept override { return MemorySpace::host; }
  std::string_view name() const noexcept override { return "mpi"; }

  void all_reduce(void* data, std::size_t count, Word word, Op op) override {
    detail::validate_all_reduce(data, count, word, op);
    if (count > static_cast<std::size_t>(INT32_MAX))
      throw Error(Errc::out_of_range, "count", "more than 2^31 - 1 words");
    const std::size_t bytes = count * detail::word_bytes(word);
    run(data, bytes, static_cast<int>(count), mpi_type(word), mpi_op(op), "MPI_Iallreduce");
  }

  void all_reduce_partial(NormPartial* partial, LayoutCheck* check) override {
    if (partial == nullptr) throw Error(Errc::null_pointer, "partial", "null");
    detail::Record r = detail::pack(*partial, check);
    run(r.data(), sizeof r, 1, record_type_, record_op_, "MPI_Iallreduce (norm record)");
    detail::unpack(r, *partial, check);
  }

  void synchronize() override { throw_if_failed(); }

  void abort() noexcept override {
    if (!failed_) {
      failed_ = true;
      message_ = "the MPI communicator was aborted by rank " + std::to_string(rank_);
      code_ = Errc::timeout;
    }
  }

  bool failed() const noexcept override { return failed_; }

 private:
  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    std::unique_ptr<std::byte[]> buffer;
  };

  void throw_if_failed() const {
    if (failed_) throw Error(code_, "", message_);
  }

  [[noreturn]] void fail(Errc code, std::string message) {
    failed_ = true;
    code_ = code;
    message_ = std::move(message);
    throw Error(code_, "", message_);
  }

  // Starts a nonblocking collective on a private copy of the buffer; returns false
  // (keeping the request and its buffer) when it does not complete in time.
  bool start_and_wait(Pending& p, int count, MPI_Datatype type, MPI_Op op,
                      std::chrono::steady_clock::time_point deadline, const char* what) {
    const int rc = MPI_Iallreduce(MPI_IN_PLACE, p.buffer.get(), count, type, op, comm_, &p.request);
    if (rc != MPI_SUCCESS) fail(Errc::mpi_error, std::string(what) + ": " + mpi_error_string(rc));
    int mpi_rc = MPI_SUCCESS;
    const bool done = detail::poll_until(deadline, [&] {
      int flag = 0;
      mpi_rc = MPI_Test(&p.request, &flag, MPI_STATUS_IGNORE);
      return mpi_rc != MPI_SUCCESS || flag != 0;
    });
    if (mpi_rc != MPI_SUCCESS)
      fail(Errc::mpi_error, std::string(what) + ": " + mpi_error_string(mpi_rc));
    return done;
  }

  // The collective, then a one-word max of "did anyone time out": a rank that timed out
  // contributes 1 to the confirmation without waiting, so a late peer completes both
  // (and throws) instead of returning a result the others abandoned, and every pending
  // request completes once the late rank arrives.
  void run(void* data, std::size_t bytes, int count, MPI_Datatype type, MPI_Op op,
           const char* what) {
    throw_if_failed();
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    Pending main{MPI_REQUEST_NULL, std::make_unique<std::byte[]>(bytes > 0 ? bytes : 1)};
    if (bytes > 0) std::memcpy(main.buffer.get(), data, bytes);
    const bool arrived = start_and_wait(main, count, type, op, deadline, what);

    Pending confirm{MPI_REQUEST_NULL, std::make_unique<std::byte[]>(sizeof(std::uint64_t))};
    const std::uint64_t timed_out = arrived ? 0 : 1;
    std::memcpy(confirm.buffer.get(), &timed_out, sizeof timed_out);
    if (!arrived) {
      const int rc = MPI_Iallreduce(MPI_IN_PLACE, confirm.buffer.get(), 1, MPI_UINT64_T, MPI_MAX,
                                    comm_, &confirm.request);
      abandoned_.push_back(std::move(main));
      if (rc == MPI_SUCCESS) abandoned_.push_back(std::move(confirm));
      fail(Errc::timeout, std::string(what) + ": not every rank arrived within " +
                              detail::format_ms(timeout()) + " (seen by rank " +
                              std::to_string(rank_) + ")");
    }
    // A fresh deadline: the confirmation only waits for peers that just completed.
    const auto confirm_deadline = std::chrono::steady_clock::now() + timeout();
    if (!start_and_wait(confirm, 1, MPI_UINT64_T, MPI_MAX, confirm_deadline,
                        "MPI_Iallreduce (confirmation)")) {
      abandoned_.push_back(std::move(confirm));
      fail(Errc::timeout, std::string(what) + ": a peer did not confirm within " +
                              detail::format_ms(timeout()) + " (seen by rank " +
                              std::to_string(rank_) + ")");
    }
    std::uint64_t any_timed_out = 0;
    std::memcpy(&any_timed_out, confirm.buffer.get(), sizeof any_timed_out);
    if (any_timed_out != 0)
      fail(Errc::timeout, std::string(what) + ": a peer timed out waiting for this rank (" +
                              std::to_string(rank_) + "), which arrived after " +
                              detail::format_ms(timeout()));
    if (bytes > 0) std::memcpy(data, main.buffer.get(), bytes);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Datatype record_type_ = MPI_DATATYPE_NULL;
  MPI_Op record_op_ = MPI_OP_NULL;
  int rank_ = 0;
  int size_ = 1;
  bool failed_ = false;
  Errc code_ = Errc::timeout;
  std::string message_;
  std::vector<Pending> abandoned_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator_from_handle(const void* mpi_comm,
                                                                std::chrono::milliseconds timeout) {
  if (mpi_comm == nullptr) throw Error(Errc::null_pointer, "comm", "null");
  if (timeout.count() <= 0)
    throw Error(Errc::out_of_range, "timeout", "the collective timeout must be positive");
  return std::make_unique<MpiCommunicator>(*static_cast<const MPI_Comm*>(mpi_comm), timeout);
}

NcclUniqueId share_nccl_unique_id_from_handle(const void* mpi_comm, int root) {
  if (mpi_comm == nullptr) throw Error(Errc::null_pointer, "comm", "null");
  const MPI_Comm comm = *static_cast<const MPI_Comm*>(mpi_comm);
  int size = 0;
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  if (root < 0 || root >= size) throw Error(Errc::out_of_range, "root", "not a rank of comm");
  int rank = 0;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  NcclUniqueId id{};
  // The root's failure must not leave its peers in the broadcast: it sends its error
  // code (0: none) first.
  unsigned char code = 0;
  std::string root_error;
  if (rank == root) {
    try {
      id = nccl_unique_id();
    } catch (const Error& e) {
      code = static_cast<unsigned char>(e.code());
      root_error = e.what();
    }
  }
  check_mpi(MPI_Bcast(&code, 1, MPI_UNSIGNED_CHAR, root, comm), "MPI_Bcast");
  if (code != 0)
    throw Error(static_cast<Errc>(code), "root",
                rank == root ? root_error : "the root rank could not create an NCCL unique id");
  check_mpi(MPI_Bcast(id.data(), static_cast<int>(id.size()), MPI_UNSIGNED_CHAR, root, comm),
            "MPI_Bcast");
  return id;
}

}  // namespace stepcore::comm
