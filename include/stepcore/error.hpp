// The one exception type of the public API, with a code and the argument at fault.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace stepcore {

/// What went wrong. Every public entry point validates all arguments before it
/// writes anything; an Error therefore means no buffer was changed, except for
/// the codes marked "runtime" which report failures after work has started.
enum class Errc : std::uint8_t {
  invalid_argument = 1,  ///< a value out of its documented range (e.g. beta1 >= 1)
  null_pointer,          ///< a null pointer with a non-zero element count
  size_mismatch,         ///< element counts that must agree do not
  unsupported_dtype,     ///< a dtype the operation does not accept
  overlap,               ///< an output overlaps another buffer of the call
  non_finite,            ///< a hyper-parameter or scalar is NaN or infinite
  out_of_range,          ///< a count or index beyond a documented limit
  not_supported,         ///< the build or machine lacks a feature (e.g. no CUDA)
  cuda_error,            ///< runtime: a CUDA call failed
  nccl_error,            ///< runtime: an NCCL call failed
  mpi_error,             ///< runtime: an MPI call failed
  timeout,               ///< runtime: a peer or a copy did not arrive in time
  internal,              ///< runtime: a broken invariant (a bug; please report)
  io_error,              ///< runtime: a file could not be read, written, synced or renamed
  corrupt_file,          ///< a file is not what it claims (truncated, bad checksum, bad layout)
  comm_error,            ///< runtime: a caller-provided communicator's collective failed
};

/// Returns a stable lower-case name for `c` ("size_mismatch", ...).
std::string_view errc_name(Errc c) noexcept;

/// The exception thrown at the public boundary.
class Error : public std::runtime_error {
 public:
  /// `argument` names the parameter at fault, e.g. "tensors[3].grad".
  Error(Errc code, std::string argument, const std::string& message);

  /// Returns the error's code.
  Errc code() const noexcept { return code_; }
  /// Returns the name of the argument at fault (may be empty for runtime errors).
  const std::string& argument() const noexcept { return argument_; }

 private:
  Errc code_;
  std::string argument_;
};

}  // namespace stepcore
