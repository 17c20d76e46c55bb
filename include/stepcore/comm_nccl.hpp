// The NCCL communicator: device buffers, a caller's CUDA stream, and either a caller's
// ncclComm_t or one created from a unique id. Free of CUDA and NCCL headers: the
// handles are the libraries' opaque pointer types, declared here as they declare them.
#pragma once

#include <chrono>
#include <memory>

#include "stepcore/comm.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/determinism.hpp"  // the levels named in "Determinism:" lines

struct ncclComm;
typedef struct ncclComm* ncclComm_t;  // NOLINT: the same typedef as <nccl.h>

namespace stepcore::comm {

/// Returns a fresh NCCL unique id (ncclGetUniqueId) for one rank to hand to the others
/// (e.g. share_nccl_unique_id in comm_mpi.hpp). Throws Errc::not_supported without
/// NCCL, Errc::nccl_error.
NcclUniqueId nccl_unique_id();

/// Returns a communicator over the caller's `comm`, issuing collectives on `stream`
/// (not owned: the caller destroys both — except after abort() or a failure, which
/// call ncclCommAbort and so free the NCCL communicator). Device
/// memory. Collectives are enqueued without host synchronisation; synchronize()
/// waits for the stream up to the timeout, reading ncclCommGetAsyncError, and aborts
/// the NCCL communicator on a timeout (Errc::timeout) or an error (Errc::nccl_error).
/// Host buffers are staged through page-locked memory the communicator owns, waited for
/// by the same bounded poll. `stream` must outlive the communicator (stream() returns
/// it; its teardown frees staging memory on it without waiting). Throws
/// Errc::not_supported without NCCL. Determinism: bitwise, as every communicator's norm.
std::unique_ptr<Communicator> make_nccl_communicator(
    ncclComm_t comm, cudaStream_t stream, std::chrono::milliseconds timeout = kDefaultTimeout);

/// Returns a communicator that owns a new NCCL communicator of `nranks` ranks
/// created from `id` on CUDA device `device` (nonblocking initialisation, polled
/// against the timeout: a rank that never joins gives Errc::timeout), issuing
/// collectives on `stream` (as above). Destroying it destroys (or, once failed or when
/// the flush exceeds the timeout, aborts) the NCCL communicator. Throws out_of_range
/// for a bad rank/nranks/device, not_supported without NCCL, nccl_error, cuda_error,
/// timeout.
std::unique_ptr<Communicator> make_nccl_communicator(
    const NcclUniqueId& id, int rank, int nranks, int device, cudaStream_t stream,
    std::chrono::milliseconds timeout = kDefaultTimeout);

}  // namespace stepcore::comm
