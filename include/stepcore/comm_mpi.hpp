// The MPI communicator (host buffers over a caller's MPI_Comm) and the MPI way to hand
// an NCCL unique id to every rank. The one public header that includes <mpi.h>.
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>

#include "stepcore/comm.hpp"
#include "stepcore/determinism.hpp"  // the levels named in "Determinism:" lines

namespace stepcore::comm {

/// The opaque-handle forms of the two functions below, which they call: `mpi_comm`
/// points to an MPI_Comm (null: Errc::null_pointer naming "comm"), so the library
/// itself is built without a consumer's <mpi.h>. They exist in every build and throw
/// Errc::not_supported without MPI.
std::unique_ptr<Communicator> make_mpi_communicator_from_handle(const void* mpi_comm,
                                                                std::chrono::milliseconds timeout);
NcclUniqueId share_nccl_unique_id_from_handle(const void* mpi_comm, int root);

/// Returns a communicator over a duplicate of `comm` (collective over `comm`: every
/// rank calls it; MPI must be initialised). Host memory. Collectives are nonblocking
/// MPI calls polled against the timeout: a peer that does not arrive in time gives
/// Errc::timeout and marks the communicator failed (the pending request cannot be
/// cancelled in MPI: it and its buffer are kept until it completes, and released
/// when the communicator is destroyed). MPI errors give Errc::mpi_error. Determinism:
/// bitwise (integer reductions are exact, so the norm is independent of MPI's algorithm).
inline std::unique_ptr<Communicator> make_mpi_communicator(
    MPI_Comm comm, std::chrono::milliseconds timeout = kDefaultTimeout) {
  return make_mpi_communicator_from_handle(&comm, timeout);
}

/// Collective over `comm`: rank `root` creates an NCCL unique id (ncclGetUniqueId) and
/// broadcasts it; every rank returns the same bytes, ready for make_nccl_communicator.
/// Throws Errc::not_supported without MPI or NCCL, Errc::mpi_error / nccl_error.
inline NcclUniqueId share_nccl_unique_id(MPI_Comm comm, int root = 0) {
  return share_nccl_unique_id_from_handle(&comm, root);
}

}  // namespace stepcore::comm
