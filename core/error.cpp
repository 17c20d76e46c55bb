// stepcore::Error and the names of its codes.
#include "stepcore/error.hpp"

namespace stepcore {

std::string_view errc_name(Errc c) noexcept {
  switch (c) {
    case Errc::invalid_argument:
      return "invalid_argument";
    case Errc::null_pointer:
      return "null_pointer";
    case Errc::size_mismatch:
      return "size_mismatch";
    case Errc::unsupported_dtype:
      return "unsupported_dtype";
    case Errc::overlap:
      return "overlap";
    case Errc::non_finite:
      return "non_finite";
    case Errc::out_of_range:
      return "out_of_range";
    case Errc::not_supported:
      return "not_supported";
    case Errc::cuda_error:
      return "cuda_error";
    case Errc::nccl_error:
      return "nccl_error";
    case Errc::mpi_error:
      return "mpi_error";
    case Errc::timeout:
      return "timeout";
    case Errc::internal:
      return "internal";
    case Errc::io_error:
      return "io_error";
    case Errc::corrupt_file:
      return "corrupt_file";
    case Errc::comm_error:
      return "comm_error";
  }
  return "unknown";
}

namespace {
std::string format(Errc code, const std::string& argument, const std::string& message) {
  std::string s = "stepcore: ";
  s += errc_name(code);
  if (!argument.empty()) {
    s += " in '";
    s += argument;
    s += "'";
  }
  s += ": ";
  s += message;
  return s;
}
}  // namespace

Error::Error(Errc code, std::string argument, const std::string& message)
    : std::runtime_error(format(code, argument, message)),
      code_(code),
      argument_(std::move(argument)) {}

}  // namespace stepcore
