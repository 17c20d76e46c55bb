// The NCCL entry points of a build without NCCL (or without CUDA): report that.
#include "stepcore/comm_nccl.hpp"
#include "stepcore/error.hpp"

namespace stepcore::comm {

bool built_with_nccl() noexcept { return false; }

NcclUniqueId nccl_unique_id() {
  throw Error(Errc::not_supported, "", "stepcore was built without NCCL (STEPCORE_NCCL, CUDA)");
}

std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t, cudaStream_t,
                                                     std::chrono::milliseconds) {
  throw Error(Errc::not_supported, "comm", "stepcore was built without NCCL (STEPCORE_NCCL, CUDA)");
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId&, int, int, int,
                                                     cudaStream_t, std::chrono::milliseconds) {
  throw Error(Errc::not_supported, "id", "stepcore was built without NCCL (STEPCORE_NCCL, CUDA)");
}

}  // namespace stepcore::comm
