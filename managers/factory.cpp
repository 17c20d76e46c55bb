// make_gradient_manager: the trainer's one entry point, validating everything a mode
// needs before any memory is allocated, then building the mode's manager.
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "managers/factories.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

namespace stepcore {
namespace {

// Returns "0x..." for a stream handle, "null (the legacy default stream)" for null.
std::string stream_name(cudaStream_t s) {
  if (s == nullptr) return "null (the legacy default stream)";
  char buf[2 + 2 * sizeof(void*) + 1];
  std::snprintf(buf, sizeof buf, "%p", static_cast<void*>(s));
  return buf;
}

}  // namespace

std::unique_ptr<GradientManager> make_gradient_manager(ManagerConfig config) {
  if (config.device == nullptr)
    throw Error(Errc::null_pointer, "device", "every mode needs the device gradients come from");
  for (std::size_t i = 0; i < config.params.size(); ++i) {
    const ParamSpec& p = config.params[i];
    const std::string name = "params[" + std::to_string(i) + "]";
    if (!dtype_valid(p.grad_dtype)) throw Error(Errc::unsupported_dtype, name + ".grad_dtype", "");
    if (p.has_compute_weights && !dtype_valid(p.compute_dtype))
      throw Error(Errc::unsupported_dtype, name + ".compute_dtype", "");
  }
  if (config.comm != nullptr) {
    const bool host_device = config.device->compute_stream() == nullptr;
    const bool host_comm = config.comm->memory() == comm::MemorySpace::host;
    if (config.mode == OffloadMode::full ? !host_comm : host_comm != host_device)
      throw Error(Errc::invalid_argument, "comm",
                  std::string("a ") + std::string(config.comm->name()) +
                      " communicator cannot reduce this mode's norm partials (" +
                      (config.mode == OffloadMode::full
                           ? "full offload reduces host memory: use MPI or in-process)"
                           : "device modes reduce in the device's memory: a device-memory "
                             "communicator (NCCL, the Python binding's device callback) on a "
                             "CUDA device, a host communicator on the host device)"));
    // A device communicator reduces the partials the compute stream's kernels write and
    // read: on any other stream nothing orders the two, and the norm is silently wrong.
    if (!host_comm && config.comm->stream() != config.device->compute_stream())
      throw Error(Errc::invalid_argument, "comm",
                  "the " + std::string(config.comm->name()) + " communicator enqueues on stream " +
                      stream_name(config.comm->stream()) + ", not on " +
                      std::string(config.device->name()) + "'s compute stream " +
                      stream_name(config.device->compute_stream()) +
                      ": make the device on the communicator's stream "
                      "(device::make_cuda_device(ordinal, comm.stream())) or the communicator "
                      "on device.compute_stream()");
  }
  std::unique_ptr<ManagerImpl> impl = config.mode == OffloadMode::full
                                          ? detail::make_offload_gradient_manager(std::move(config))
                                          : detail::make_gpu_gradient_manager(std::move(config));
  return std::unique_ptr<GradientManager>(new GradientManager(std::move(impl)));
}

}  // namespace stepcore
