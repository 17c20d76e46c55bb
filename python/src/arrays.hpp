// How stepcore._core reads an array argument, for every entry point: through the DLPack C
// exchange API of the object's type when it has one (torch >= 2.9: a C call, no Python
// call, no allocation, ~30 ns), else through nanobind's ndarray (DLPack's __dlpack__ or
// the buffer protocol: numpy, older torch). One check (memory kind, C-contiguity, dtype)
// names the argument ("params[3]"); the name string is built only for the error.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "stepcore/cuda.hpp"
#include "stepcore/dtype.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::python {

namespace nb = nanobind;

/// An argument's name for messages: `base` alone (index < 0) or base[index].
struct ArgName {
  const char* base;
  std::ptrdiff_t index = -1;
  std::string str() const;
};

/// The memory an entry point reads and writes.
enum class Memory { cpu, cuda };

/// Whether an entry point writes the array (a read-only numpy array is refused) or only
/// reads it.
enum class Access { read, write };

/// A checked array argument: its stepcore view and, for CUDA memory, its device ordinal.
struct ArrayArg {
  TensorView view;
  int device_id = 0;
};

/// Returns the view of the array `h` in `memory`, C-contiguous, f32/bf16/f16, or throws
/// TypeError (not an array, or a dtype stepcore does not know) or ValueError (wrong memory,
/// not contiguous, read-only for Access::write) naming `name`. The view is valid while `h`
/// is alive and unresized.
ArrayArg array_arg(nb::handle h, ArgName name, Memory memory, Access access);

/// Returns a CUDA stream argument: None (the legacy default stream, or `producer`'s current
/// stream when it is an array whose framework reports one), an int (the cudaStream_t's
/// address; 0 is the legacy default stream), or an object with __cuda_stream__ (the CUDA
/// stream protocol: a (version, address) tuple, version 0); else TypeError naming 'stream'.
cudaStream_t stream_arg(nb::handle stream, nb::handle producer = nb::handle());

/// Returns stream_arg's address as an int (for the tests of the stream protocol).
std::uintptr_t stream_address(nb::handle stream);

/// Returns how many array imports went through the C exchange API so far (the tests check
/// that torch tensors take it).
std::uint64_t exchange_imports() noexcept;

}  // namespace stepcore::python
