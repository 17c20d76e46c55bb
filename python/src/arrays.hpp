// How stepcore._core reads an array argument, for every entry point: through the DLPack C
// exchange API of the object's type when it has one (torch >= 2.9: a C call, no Python
// call, no allocation, ~30 ns), else through nanobind's ndarray (DLPack's __dlpack__ or
// the buffer protocol: numpy, older torch). One check (memory kind, C-contiguity, dtype)
// names the argument ("params[3]"); the name string is built only for the error. The GPU
// launchers' other device buffers (scalars, tables, partials, workspaces) come through the
// same import and checks, with their own dtypes (buffer_arg).
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "stepcore/cuda_host.hpp"
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

/// The memory an entry point reads and writes (any: either, for calls that read only shapes).
enum class Memory { cpu, cuda, any };

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

/// Element types a buffer argument may have (a bit mask: Dtypes{} | ...); kAnyDtype takes
/// every dtype DLPack describes (a workspace of raw bytes).
enum Dtypes : unsigned {
  kF32 = 1u << 0,
  kF64 = 1u << 1,
  kI32 = 1u << 2,
  kI64 = 1u << 3,
  kU8 = 1u << 4,
  kAnyDtype = ~0u,
};

/// A checked buffer argument: start, elements, element size in bytes, device ordinal.
struct BufferArg {
  void* data = nullptr;
  std::size_t numel = 0;
  std::size_t item_bytes = 0;
  int device_id = 0;
  /// Returns the buffer's size in bytes.
  std::size_t bytes() const noexcept { return numel * item_bytes; }
};

/// Returns the buffer `h` (memory, C-contiguity and read-only checked as array_arg does)
/// whose dtype is one of `dtypes` and whose start is aligned to its element size, or
/// throws TypeError (dtype) or ValueError naming `name`. Sizes are the caller's to check.
BufferArg buffer_arg(nb::handle h, ArgName name, Memory memory, Access access, unsigned dtypes);

/// Returns a CUDA stream argument: an int (the cudaStream_t's address; 0 is the legacy
/// default stream), an object with __cuda_stream__ (the CUDA stream protocol: a (version,
/// address) tuple, version 0), or None: the current stream of `producer`'s framework on its
/// device (through its type's DLPack C exchange API; torch's torch.cuda.current_stream for
/// a torch tensor without one). None with a producer in CUDA memory that reports no current
/// stream raises ValueError naming 'stream' (never the legacy stream in its place); None
/// without a producer (nothing to launch) or with one in host memory (its check refuses it
/// next) is the legacy default stream. Anything else: TypeError naming 'stream'.
cudaStream_t stream_arg(nb::handle stream, nb::handle producer = nb::handle());

/// Returns stream_arg's address as an int (for the tests of the stream protocol).
std::uintptr_t stream_address(nb::handle stream);

/// Returns the CUDA ordinal of a device argument "cuda:N", or -1 for "host"; anything else
/// raises ValueError naming `name`.
int device_ordinal(const std::string& device, const char* name);

/// Returns the compute stream a CUDA trainer names (an address or an object with
/// __cuda_stream__; 0 names the legacy default stream, cudaStreamLegacy).
cudaStream_t trainer_stream(nb::handle stream);

/// Returns how many array imports went through the C exchange API so far (the tests check
/// that torch tensors take it).
std::uint64_t exchange_imports() noexcept;

}  // namespace stepcore::python
