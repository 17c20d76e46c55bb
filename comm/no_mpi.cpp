// The MPI entry points of a build without MPI: report that, never pretend.
#include "stepcore/comm.hpp"
#include "stepcore/error.hpp"

namespace stepcore::comm {

bool built_with_mpi() noexcept { return false; }

// Declared in comm_mpi.hpp, which needs <mpi.h>; repeated here.
std::unique_ptr<Communicator> make_mpi_communicator_from_handle(const void*,
                                                                std::chrono::milliseconds);
NcclUniqueId share_nccl_unique_id_from_handle(const void*, int);

std::unique_ptr<Communicator> make_mpi_communicator_from_handle(const void*,
                                                                std::chrono::milliseconds) {
  throw Error(Errc::not_supported, "comm", "stepcore was built without MPI (STEPCORE_MPI)");
}

NcclUniqueId share_nccl_unique_id_from_handle(const void*, int) {
  throw Error(Errc::not_supported, "comm", "stepcore was built without MPI (STEPCORE_MPI)");
}

}  // namespace stepcore::comm
