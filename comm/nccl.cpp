// The NCCL communicator: grouped in-place all-reduces on the caller's stream with no
// host synchronisation, host buffers staged through page-locked host memory and device
// scratch the communicator owns, errors read with ncclCommGetAsyncError, waits bounded
// by the timeout and ended with ncclCommAbort; teardown never waits for the stream.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm_internal.hpp"
#include "stepcore/comm_nccl.hpp"

static_assert(sizeof(ncclUniqueId) == sizeof(stepcore::comm::NcclUniqueId));

namespace stepcore::comm {

bool built_with_nccl() noexcept { return true; }

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(Errc::cuda_error, "", std::string(what) + ": " + cudaGetErrorString(e));
}

ncclDataType_t nccl_type(Word word) {
  switch (word) {
    case Word::u32:
      return ncclUint32;
    case Word::u64:
      return ncclUint64;
    case Word::f32:
      return ncclFloat32;
    case Word::f64:
      return ncclFloat64;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(Op op) { return op == Op::sum ? ncclSum : op == Op::max ? ncclMax : ncclMin; }

// Makes `device` current for the scope and restores the caller's device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device != previous_) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

// The smallest staging capacity (a norm partial with its check is 208 bytes; a
// layout check of a few hundred groups fits).
constexpr std::size_t kMinStagingBytes = 16 * 1024;

bool is_device_pointer(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error of an unknown pointer
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, bool owned,
                   std::chrono::milliseconds timeout)
      : Communicator(timeout), comm_(comm), stream_(stream), owned_(owned) {
    if (comm == nullptr) throw Error(Errc::null_pointer, "comm", "null ncclComm_t");
    check_nccl(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank", false);
    check_nccl(ncclCommCount(comm_, &size_), "ncclCommCount", false);
    check_nccl(ncclCommCuDevice(comm_, &device_), "ncclCommCuDevice", false);
  }

  // The transport first (a bounded finalize, else abort), then the staging buffers, so
  // that no device-synchronising free can wait for a hung collective.
  ~NcclCommunicator() override {
    release_transport();
    release_staging();
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  MemorySpace memory() const noexcept override { return MemorySpace::device; }
  std::string_view name() const noexcept override { return "nccl"; }
  cudaStream_t stream() const noexcept override { return stream_; }

  void all_reduce(void* data, std::size_t count, Word word, Op op) override {
    detail::validate_all_reduce(data, count, word, op);
    throw_if_failed();
    if (count == 0) return;
    const std::size_t bytes = count * detail::word_bytes(word);
    DeviceScope scope(device_);
    if (is_device_pointer(data)) {
      check_nccl(ncclAllReduce(data, data, count, nccl_type(word), nccl_op(op), comm_, stream_),
                 "ncclAllReduce");
      return;
    }
    // A host buffer (set-up calls such as validate_layout): staged through the
    // communicator's page-locked buffer, so that every copy is truly asynchronous and the
    // wait is synchronize()'s bounded poll; the caller's memory is written only after it.
    const Staging& s = staging(bytes);
    std::memcpy(s.host, data, bytes);
    enqueue(cudaMemcpyAsync(s.device, s.host, bytes, cudaMemcpyHostToDevice, stream_),
            "cudaMemcpyAsync (host to device)");
    check_nccl(
        ncclAllReduce(s.device, s.device, count, nccl_type(word), nccl_op(op), comm_, stream_),
        "ncclAllReduce");
    enqueue(cudaMemcpyAsync(s.host, s.device, bytes, cudaMemcpyDeviceToHost, stream_),
            "cudaMemcpyAsync (device to host)");
    synchronize();
    std::memcpy(data, s.host, bytes);
  }

  void all_reduce_partial(NormPartial* partial, LayoutCheck* check) override {
    if (partial == nullptr) throw Error(Errc::null_pointer, "partial", "null");
    throw_if_failed();
    DeviceScope scope(device_);
    if (is_device_pointer(partial)) {
      if (check != nullptr && !is_device_pointer(check))
        throw Error(Errc::invalid_argument, "check", "not device memory (the partial is)");
      enqueue_partial(partial, check);
      return;
    }
    if (check != nullptr && is_device_pointer(check))
      throw Error(Errc::invalid_argument, "check", "device memory (the partial is not)");
    // Host buffers: staged as in all_reduce (partial, then check, in one record).
    constexpr std::size_t kBytes = sizeof(NormPartial) + sizeof(LayoutCheck);
    const std::size_t bytes = check ? kBytes : sizeof(NormPartial);
    const Staging& s = staging(kBytes);
    auto* h = static_cast<unsigned char*>(s.host);
    auto* d = static_cast<unsigned char*>(s.device);
    std::memcpy(h, partial, sizeof *partial);
    if (check) std::memcpy(h + sizeof(NormPartial), check, sizeof *check);
    enqueue(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, stream_),
            "cudaMemcpyAsync (host to device)");
    enqueue_partial(reinterpret_cast<NormPartial*>(d),
                    check ? reinterpret_cast<LayoutCheck*>(d + sizeof(NormPartial)) : nullptr);
    enqueue(cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost, stream_),
            "cudaMemcpyAsync (device to host)");
    synchronize();
    std::memcpy(partial, h, sizeof *partial);
    if (check) std::memcpy(check, h + sizeof(NormPartial), sizeof *check);
  }

  void synchronize() override {
    throw_if_failed();
    DeviceScope scope(device_);
    cudaError_t cuda = cudaSuccess;
    ncclResult_t nccl = ncclSuccess;
    const bool done = detail::poll_until(std::chrono::steady_clock::now() + timeout(), [&] {
      if (ncclCommGetAsyncError(comm_, &nccl) != ncclSuccess) nccl = ncclInternalError;
      if (nccl != ncclSuccess && nccl != ncclInProgress) return true;
      cuda = cudaStreamQuery(stream_);
      if (cuda != cudaErrorNotReady) return true;
      // "Not ready" is recorded as the thread's last error; clear it so that a later
      // launch check (cudaGetLastError) does not report it. It is not sticky, and a
      // sticky error would have been returned by the query itself (reported below).
      cudaGetLastError();
      return false;
    });
    if (nccl != ncclSuccess && nccl != ncclInProgress)
      fail(Errc::nccl_error, std::string("asynchronous NCCL error: ") + ncclGetErrorString(nccl));
    if (!done)
      fail(Errc::timeout, "the stream's collectives did not complete within " +
                              detail::format_ms(timeout()) + " (rank " + std::to_string(rank_) +
                              "); the NCCL communicator was aborted");
    if (cuda != cudaSuccess)
      fail(Errc::cuda_error, std::string("cudaStreamQuery: ") + cudaGetErrorString(cuda));
  }

  void abort() noexcept override {
    failed_ = true;
    if (message_.empty()) {
      code_ = Errc::timeout;
      message_ = "the NCCL communicator was aborted by rank " + std::to_string(rank_);
    }
    if (!aborted_) {
      aborted_ = true;
      ncclCommAbort(comm_);
    }
  }

  bool failed() const noexcept override { return failed_; }

 private:
  // Digits, nan_count, inf_count: uint64 sum; max_abs_bits, approximate: uint32 max;
  // the check: uint64 max. One NCCL group: one collective for the transport.
  void enqueue_partial(NormPartial* d_partial, LayoutCheck* d_check) {
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t r =
        ncclAllReduce(d_partial, d_partial, detail::kSumWords, ncclUint64, ncclSum, comm_, stream_);
    if (r == ncclSuccess || r == ncclInProgress)
      r = ncclAllReduce(&d_partial->max_abs_bits, &d_partial->max_abs_bits, detail::kMaxU32Words,
                        ncclUint32, ncclMax, comm_, stream_);
    if ((r == ncclSuccess || r == ncclInProgress) && d_check != nullptr)
      r = ncclAllReduce(d_check, d_check, sizeof(LayoutCheck) / 8, ncclUint64, ncclMax, comm_,
                        stream_);
    const ncclResult_t end = ncclGroupEnd();
    check_nccl(r, "ncclAllReduce (norm partial)");
    check_nccl(end, "ncclGroupEnd");
  }

  // A page-locked host buffer and a device buffer of the same capacity, for host-staged
  // collectives. The device buffer comes from the stream-ordered allocator on the
  // communicator's stream where the device supports it (freed with cudaFreeAsync: no
  // device-wide synchronisation), else from cudaMalloc.
  struct Staging {
    void* host = nullptr;
    void* device = nullptr;
    std::size_t bytes = 0;
    bool stream_ordered = false;
  };

  // Returns staging of at least `bytes` (the current device is device_). A buffer that
  // is outgrown is retired, not freed: freeing may synchronise the device, which must
  // not happen outside the bounded waits; release_staging frees it with the others.
  const Staging& staging(std::size_t bytes) {
    if (bytes <= staging_.bytes) return staging_;
    retired_.reserve(retired_.size() + 1);  // so that nothing below throws after allocating
    Staging s;
    s.bytes = std::max({bytes, 2 * staging_.bytes, kMinStagingBytes});
    check_cuda(cudaMallocHost(&s.host, s.bytes), "cudaMallocHost");
    int pools = 0;
    if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device_) != cudaSuccess) {
      cudaGetLastError();
      pools = 0;
    }
    s.stream_ordered = pools != 0;
    const cudaError_t e = s.stream_ordered ? cudaMallocAsync(&s.device, s.bytes, stream_)
                                           : cudaMalloc(&s.device, s.bytes);
    if (e != cudaSuccess) {
      cudaFreeHost(s.host);  // never used by the device: nothing to wait for
      check_cuda(e, s.stream_ordered ? "cudaMallocAsync" : "cudaMalloc");
    }
    if (staging_.bytes != 0) retired_.push_back(staging_);
    staging_ = s;
    return staging_;
  }

  // Throws for a failed enqueue of a staged copy, marking the communicator failed:
  // copies already queued may still write the staging buffers, which must not be reused.
  void enqueue(cudaError_t e, const char* what) {
    if (e != cudaSuccess) fail(Errc::cuda_error, std::string(what) + ": " + cudaGetErrorString(e));
  }

  // Finalises the owned NCCL communicator, bounded by the timeout (aborting it if the
  // flush does not finish), or aborts it when the communicator failed.
  void release_transport() noexcept {
    if (!owned_ || aborted_) return;
    if (failed_) {
      ncclCommAbort(comm_);
      return;
    }
    ncclResult_t r = ncclCommFinalize(comm_);
    if (r == ncclInProgress || r == ncclSuccess) r = wait_not_in_progress();
    if (r == ncclSuccess)
      ncclCommDestroy(comm_);
    else
      ncclCommAbort(comm_);
  }

  // Frees the staging buffers once the transport is gone, without waiting for the
  // stream: stream-ordered device buffers with cudaFreeAsync; the others (whose free may
  // synchronise the device) only when the stream is idle. With work still queued (a
  // failed staged collective's copies may still write them, or a hung stream) they are
  // left allocated: a few KiB, rather than a teardown that never returns.
  void release_staging() noexcept {
    if (staging_.bytes == 0) return;
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device_) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    const cudaError_t query = cudaStreamQuery(stream_);
    if (query != cudaSuccess) cudaGetLastError();
    const bool idle = query == cudaSuccess;
    const auto release = [&](const Staging& s) {
      if (s.stream_ordered) {
        if (cudaFreeAsync(s.device, stream_) != cudaSuccess) cudaGetLastError();
      } else if (idle && cudaFree(s.device) != cudaSuccess) {
        cudaGetLastError();
      }
      if (idle && cudaFreeHost(s.host) != cudaSuccess) cudaGetLastError();
    };
    release(staging_);
    for (const Staging& s : retired_) release(s);
    staging_ = Staging{};
    retired_.clear();
    if (cudaSetDevice(previous) != cudaSuccess) cudaGetLastError();
  }

  // Waits while a nonblocking communicator reports ncclInProgress; returns the state.
  ncclResult_t wait_not_in_progress() {
    ncclResult_t state = ncclInProgress;
    detail::poll_until(std::chrono::steady_clock::now() + timeout(), [&] {
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
      return state != ncclInProgress;
    });
    return state;
  }

  // Throws (marking the communicator failed and aborting it) unless `r` is success; an
  // ncclInProgress of a nonblocking communicator is waited for, bounded by the timeout.
  void check_nccl(ncclResult_t r, const char* what, bool abort_on_error = true) {
    if (r == ncclInProgress) {
      r = wait_not_in_progress();
      if (r == ncclInProgress) {
        if (!abort_on_error) throw Error(Errc::timeout, "", std::string(what) + ": timed out");
        fail(Errc::timeout,
             std::string(what) + ": still in progress after " + detail::format_ms(timeout()));
      }
    }
    if (r == ncclSuccess) return;
    const std::string message = std::string(what) + ": " + ncclGetErrorString(r);
    if (!abort_on_error) throw Error(Errc::nccl_error, "comm", message);
    fail(Errc::nccl_error, message);
  }

  void throw_if_failed() const {
    if (failed_) throw Error(code_, "", message_);
  }

  [[noreturn]] void fail(Errc code, std::string message) {
    code_ = code;
    message_ = std::move(message);
    abort();
    throw Error(code_, "", message_);
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  bool owned_;
  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  bool failed_ = false;
  bool aborted_ = false;
  Errc code_ = Errc::timeout;
  std::string message_;
  Staging staging_;               // the buffers host-staged collectives use
  std::vector<Staging> retired_;  // outgrown buffers, freed by release_staging
};

}  // namespace

NcclUniqueId nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess)
    throw Error(Errc::nccl_error, "", std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
  NcclUniqueId out;
  std::memcpy(out.data(), &id, sizeof id);
  return out;
}

std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm, cudaStream_t stream,
                                                     std::chrono::milliseconds timeout) {
  if (comm == nullptr) throw Error(Errc::null_pointer, "comm", "null ncclComm_t");
  if (timeout.count() <= 0)
    throw Error(Errc::out_of_range, "timeout", "the collective timeout must be positive");
  return std::make_unique<NcclCommunicator>(comm, stream, false, timeout);
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int rank, int nranks,
                                                     int device, cudaStream_t stream,
                                                     std::chrono::milliseconds timeout) {
  if (nranks < 1) throw Error(Errc::out_of_range, "nranks", "must be >= 1");
  if (rank < 0 || rank >= nranks) throw Error(Errc::out_of_range, "rank", "must be in [0, nranks)");
  if (timeout.count() <= 0)
    throw Error(Errc::out_of_range, "timeout", "the collective timeout must be positive");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();
    devices = 0;
  }
  if (device < 0 || device >= devices)
    throw Error(
        Errc::out_of_range, "device",
        "no CUDA device " + std::to_string(device) + " (" + std::to_string(devices) + " present)");
  DeviceScope scope(device);
  ncclUniqueId nid;
  std::memcpy(&nid, id.data(), sizeof nid);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that a rank that never joins cannot hang the others
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, nid, rank, &config);
  if (r == ncclInProgress || (r == ncclSuccess && comm != nullptr)) {
    r = ncclInProgress;
    detail::poll_until(std::chrono::steady_clock::now() + timeout, [&] {
      if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) r = ncclInternalError;
      return r != ncclInProgress;
    });
  }
  if (r != ncclSuccess) {
    if (comm != nullptr) ncclCommAbort(comm);
    if (r == ncclInProgress)
      throw Error(
          Errc::timeout, "id",
          "ncclCommInitRankConfig: not every rank joined within " + detail::format_ms(timeout));
    throw Error(Errc::nccl_error, "id",
                std::string("ncclCommInitRankConfig: ") + ncclGetErrorString(r));
  }
  try {
    return std::make_unique<NcclCommunicator>(comm, stream, true, timeout);
  } catch (...) {
    ncclCommAbort(comm);
    throw;
  }
}

}  // namespace stepcore::comm
