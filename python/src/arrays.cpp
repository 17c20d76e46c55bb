// The array and stream arguments of stepcore._core (arrays.hpp): the DLPack C exchange API
// (DLPack 1.x, declared here from its published layout), nanobind's ndarray as the
// fallback, and the CUDA stream protocol.
#include "arrays.hpp"

#include <nanobind/ndarray.h>

#include <array>
#include <atomic>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stepcore::python {

namespace {

// ---- the DLPack C exchange API (dlpack.h, version 1.x), only what is read -----------------

struct DlDevice {
  std::int32_t type;  // kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13
  std::int32_t id;
};
struct DlDataType {
  std::uint8_t code;  // kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DlTensor {
  void* data;
  DlDevice device;
  std::int32_t ndim;
  DlDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements; null: compact row-major
  std::uint64_t byte_offset;
};
struct DlVersion {
  std::uint32_t major;
  std::uint32_t minor;
};
struct DlExchangeHeader {
  DlVersion version;
  DlExchangeHeader* prev_api;
};
struct DlExchangeApi {
  DlExchangeHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, DlTensor* out);
  int (*current_work_stream)(std::int32_t device_type, std::int32_t device_id, void** out_stream);
};

constexpr std::int32_t kDlCpu = 1;
constexpr std::int32_t kDlCuda = 2;
constexpr std::int32_t kDlCudaHost = 3;
constexpr std::int32_t kDlCudaManaged = 13;
constexpr std::uint8_t kDlInt = 0;
constexpr std::uint8_t kDlUInt = 1;
constexpr std::uint8_t kDlFloat = 2;
constexpr std::uint8_t kDlBfloat = 4;

std::atomic<std::uint64_t> g_exchange_imports{0};

// Returns the exchange API of `type` (nullptr when it has none usable), cached per type.
// The GIL serialises callers; a cached type is kept alive (its address is the key).
const DlExchangeApi* exchange_api_of(PyTypeObject* type) {
  struct Entry {
    PyTypeObject* type;
    const DlExchangeApi* api;
  };
  static std::array<Entry, 8> cache{};
  static std::size_t used = 0;
  static std::size_t last = 0;  // most calls ask for the type the previous call asked for
  if (used != 0 && cache[last].type == type) return cache[last].api;
  for (std::size_t k = 0; k < used; ++k)
    if (cache[k].type == type) {
      last = k;
      return cache[k].api;
    }
  const DlExchangeApi* api = nullptr;
  PyObject* capsule =
      PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (capsule == nullptr) {
    PyErr_Clear();
  } else {
    if (PyCapsule_IsValid(capsule, "dlpack_exchange_api")) {
      const auto* a =
          static_cast<const DlExchangeApi*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
      // Major version 1 has this table layout; a later major may walk prev_api to one.
      for (const DlExchangeHeader* h = a != nullptr ? &a->header : nullptr; h != nullptr;
           h = h->prev_api)
        if (h->version.major == 1) {
          const auto* v1 = reinterpret_cast<const DlExchangeApi*>(h);
          if (v1->dltensor_from_py_object_no_sync != nullptr) api = v1;
          break;
        }
    }
    PyErr_Clear();
    Py_DECREF(capsule);  // the table itself is static in its framework (the protocol's rule)
  }
  if (used < cache.size()) {
    Py_INCREF(reinterpret_cast<PyObject*>(type));
    last = used;
    cache[used++] = Entry{type, api};
  }
  return api;
}

[[noreturn]] void bad_array(bool type_error, const ArgName& name, const std::string& why) {
  const std::string msg =
      "stepcore: " + std::string(type_error ? "unsupported_dtype" : "invalid_argument") + " in '" +
      name.str() + "': " + why;
  if (type_error) throw nb::type_error(msg.c_str());
  throw nb::value_error(msg.c_str());
}

DType dtype_of(std::uint8_t code, std::uint8_t bits, std::uint16_t lanes, const ArgName& name) {
  if (lanes == 1) {
    if (code == kDlFloat && bits == 32) return DType::f32;
    if (code == kDlFloat && bits == 16) return DType::f16;
    if (code == kDlBfloat && bits == 16) return DType::bf16;
  }
  bad_array(true, name,
            "dtype (code " + std::to_string(code) + ", " + std::to_string(bits) +
                " bits) is not float32, bfloat16 or float16");
}

// An imported array whose memory kind and C-contiguity were checked, its dtype not yet.
struct Imported {
  void* data;
  std::size_t numel;
  DlDataType dtype;
  int device_id;
};

// The one check of every array: memory kind, then C-contiguity (an empty array has any
// strides, a dimension of extent 1 any stride); the caller checks the dtype next.
template <class Shape, class Stride>
Imported checked(void* data, std::int32_t device_type, std::int32_t device_id, std::size_t ndim,
                 Shape shape, Stride stride, DlDataType dtype, const ArgName& name, Memory memory) {
  const bool host = device_type == kDlCpu || device_type == kDlCudaHost;
  const bool cuda = device_type == kDlCuda || device_type == kDlCudaManaged;
  if (memory == Memory::cpu && !host)
    bad_array(false, name,
              "must be CPU memory (device type " + std::to_string(device_type) +
                  "); the CPU engine reads and writes host memory");
  if (memory == Memory::cuda && !cuda)
    bad_array(false, name,
              "must be CUDA device memory (device type " + std::to_string(device_type) +
                  "); the GPU launchers read and write device memory");
  if (memory == Memory::any && !host && !cuda)
    bad_array(false, name,
              "must be CPU or CUDA memory (device type " + std::to_string(device_type) + ")");
  std::size_t numel = 1;
  for (std::size_t d = 0; d < ndim; ++d) numel *= static_cast<std::size_t>(shape(d));
  std::int64_t expect = 1;
  for (std::size_t d = ndim; d-- > 0 && numel != 0;) {
    if (shape(d) != 1 && stride(d) != expect)
      bad_array(false, name,
                "must be C-contiguous (dimension " + std::to_string(d) + " has stride " +
                    std::to_string(stride(d)) + ", not " + std::to_string(expect) + ")");
    expect *= static_cast<std::int64_t>(shape(d));
  }
  return Imported{data, numel, dtype, device_id};
}

// The check of an array nanobind imported (DLPack's __dlpack__ or the buffer protocol).
template <class A>
Imported from_ndarray(const A& a, const ArgName& name, Memory memory) {
  const nb::dlpack::dtype d = a.dtype();
  return checked(
      const_cast<void*>(static_cast<const void*>(a.data())), a.device_type(), a.device_id(),
      a.ndim(), [&](std::size_t k) { return static_cast<std::int64_t>(a.shape(k)); },
      [&](std::size_t k) { return a.stride(k); }, DlDataType{d.code, d.bits, d.lanes}, name,
      memory);
}

// Returns the array `h` after the memory and contiguity checks: through its type's C
// exchange API when it has one, else nanobind's ndarray (refusing read-only arrays for
// Access::write); TypeError naming `name` for an object that is not an array.
Imported imported(nb::handle h, const ArgName& name, Memory memory, Access access) {
  if (const DlExchangeApi* api = exchange_api_of(Py_TYPE(h.ptr()))) {
    DlTensor t;
    if (api->dltensor_from_py_object_no_sync(h.ptr(), &t) == 0) {
      g_exchange_imports.fetch_add(1, std::memory_order_relaxed);
      void* data = static_cast<char*>(t.data) + t.byte_offset;
      const auto ndim = static_cast<std::size_t>(t.ndim < 0 ? 0 : t.ndim);
      const std::int64_t* shape = t.shape;
      const std::int64_t* strides = t.strides;
      if (strides == nullptr) {  // compact row-major: contiguous by definition
        return checked(
            data, t.device.type, t.device.id, ndim, [&](std::size_t d) { return shape[d]; },
            [&](std::size_t d) {
              std::int64_t s = 1;
              for (std::size_t k = d + 1; k < ndim; ++k) s *= shape[k];
              return s;
            },
            t.dtype, name, memory);
      }
      return checked(
          data, t.device.type, t.device.id, ndim, [&](std::size_t d) { return shape[d]; },
          [&](std::size_t d) { return strides[d]; }, t.dtype, name, memory);
    }
    PyErr_Clear();  // not describable by DLPack: the fallback below reports it
  }
  if (access == Access::write) {
    nb::ndarray<> a;
    if (nb::try_cast(h, a)) return from_ndarray(a, name, memory);
    nb::ndarray<nb::ro> ro;
    if (nb::try_cast(h, ro)) bad_array(false, name, "is read-only; this argument is written");
  } else {
    nb::ndarray<nb::ro> a;
    if (nb::try_cast(h, a)) return from_ndarray(a, name, memory);
  }
  bad_array(true, name,
            "a " + std::string(nb::type_name(h.type()).c_str()) +
                " is not an array stepcore can read (DLPack or the buffer protocol, in CPU or "
                "CUDA memory)");
}

// Returns the Dtypes bit of a DLPack dtype (0 for one no buffer takes).
unsigned dtype_bit(DlDataType t) {
  if (t.lanes != 1) return 0;
  if (t.code == kDlFloat && t.bits == 32) return kF32;
  if (t.code == kDlFloat && t.bits == 64) return kF64;
  if (t.code == kDlInt && t.bits == 32) return kI32;
  if (t.code == kDlInt && t.bits == 64) return kI64;
  if (t.code == kDlUInt && t.bits == 8) return kU8;
  return 0;
}

// Returns "float32, int64 or uint8": the names of the bits in `dtypes`.
std::string dtype_names(unsigned dtypes) {
  static const std::pair<unsigned, const char*> names[] = {
      {kF32, "float32"}, {kF64, "float64"}, {kI32, "int32"}, {kI64, "int64"}, {kU8, "uint8"}};
  std::vector<const char*> in;
  for (const auto& [bit, n] : names)
    if ((dtypes & bit) != 0) in.push_back(n);
  std::string out;
  for (std::size_t k = 0; k < in.size(); ++k)
    out += std::string(k == 0 ? "" : (k + 1 == in.size() ? " or " : ", ")) + in[k];
  return out;
}

}  // namespace

std::string ArgName::str() const {
  return index < 0 ? std::string(base) : std::string(base) + "[" + std::to_string(index) + "]";
}

ArrayArg array_arg(nb::handle h, ArgName name, Memory memory, Access access) {
  const Imported a = imported(h, name, memory, access);
  const DType t = dtype_of(a.dtype.code, a.dtype.bits, a.dtype.lanes, name);
  return ArrayArg{TensorView{a.data, a.numel, t}, a.device_id};
}

BufferArg buffer_arg(nb::handle h, ArgName name, Memory memory, Access access, unsigned dtypes) {
  const Imported a = imported(h, name, memory, access);
  const std::size_t item = (static_cast<std::size_t>(a.dtype.bits) * a.dtype.lanes + 7) / 8;
  if (dtypes != kAnyDtype && (dtype_bit(a.dtype) & dtypes) == 0)
    bad_array(true, name,
              "dtype (code " + std::to_string(a.dtype.code) + ", " + std::to_string(a.dtype.bits) +
                  " bits) is not " + dtype_names(dtypes));
  const auto address = reinterpret_cast<std::uintptr_t>(a.data);
  if (item > 1 && (item & (item - 1)) == 0 && address % item != 0)
    bad_array(false, name,
              "starts at an address that is not a multiple of its element size (" +
                  std::to_string(item) + " bytes)");
  return BufferArg{a.data, a.numel, item, a.device_id};
}

std::uintptr_t stream_address(nb::handle stream) {
  if (stream.is_none()) return 0;
  nb::handle s = stream;
  nb::object held;
  if (nb::hasattr(stream, "__cuda_stream__")) {
    held = stream.attr("__cuda_stream__")();
    nb::tuple t;
    if (!nb::try_cast(held, t) || t.size() != 2)
      throw nb::type_error(
          "stepcore: invalid_argument in 'stream': __cuda_stream__() must return a "
          "(version, address) tuple");
    long version = -1;
    if (!nb::try_cast(t[0], version) || version != 0)
      throw nb::type_error(
          "stepcore: invalid_argument in 'stream': __cuda_stream__() version must be 0");
    held = nb::borrow(t[1]);
    s = held;
  }
  if (!PyLong_Check(s.ptr()) || PyBool_Check(s.ptr()))
    throw nb::type_error(("stepcore: invalid_argument in 'stream': a " +
                          std::string(nb::type_name(stream.type()).c_str()) +
                          " is not a CUDA stream (an int address, an object with "
                          "__cuda_stream__, or None)")
                             .c_str());
  const unsigned long long v = PyLong_AsUnsignedLongLong(s.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    throw nb::value_error(
        "stepcore: out_of_range in 'stream': the address is negative or wider than 64 bits");
  }
  return static_cast<std::uintptr_t>(v);
}

namespace {

// Returns the DLPack device (type, id) `h` reports through __dlpack_device__(), or
// {kDlCpu, 0} for an object that reports none (not an array: its check refuses it later).
DlDevice dlpack_device(nb::handle h) {
  if (!nb::hasattr(h, "__dlpack_device__")) return DlDevice{kDlCpu, 0};
  const nb::object d = h.attr("__dlpack_device__")();
  nb::tuple t;
  std::int32_t type = 0, id = 0;
  if (!nb::try_cast(d, t) || t.size() != 2 || !nb::try_cast(t[0], type) || !nb::try_cast(t[1], id))
    return DlDevice{kDlCpu, 0};
  return DlDevice{type, id};
}

// Returns torch's current CUDA stream of device `id` when `h` is a torch tensor (torch is
// then imported), else nothing.
std::optional<cudaStream_t> torch_current_stream(nb::handle h, std::int32_t id) {
  PyObject* torch = PyImport_GetModule(nb::str("torch").ptr());
  if (torch == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  const nb::object t = nb::steal(torch);
  if (!nb::isinstance(h, t.attr("Tensor"))) return std::nullopt;
  const nb::object s = t.attr("cuda").attr("current_stream")(id).attr("cuda_stream");
  return reinterpret_cast<cudaStream_t>(stream_address(s));
}

}  // namespace

cudaStream_t stream_arg(nb::handle stream, nb::handle producer) {
  if (!stream.is_none() || !producer.is_valid() || producer.is_none())
    return reinterpret_cast<cudaStream_t>(stream_address(stream));  // None: nothing to launch
  // None: the current stream of the producer's framework on its device.
  if (const DlExchangeApi* api = exchange_api_of(Py_TYPE(producer.ptr()))) {
    DlTensor t;
    if (api->dltensor_from_py_object_no_sync(producer.ptr(), &t) == 0) {
      if (t.device.type != kDlCuda && t.device.type != kDlCudaManaged)
        return nullptr;  // not device memory: the array checks refuse it, naming it
      void* current = nullptr;
      if (api->current_work_stream != nullptr &&
          api->current_work_stream(t.device.type, t.device.id, &current) == 0)
        return static_cast<cudaStream_t>(current);
    }
    PyErr_Clear();
  }
  // No C exchange API to ask: torch's current stream for a torch tensor; never the legacy
  // default stream in place of a framework's current one.
  const DlDevice d = dlpack_device(producer);
  if (d.type != kDlCuda && d.type != kDlCudaManaged) return nullptr;  // refused later
  if (const std::optional<cudaStream_t> s = torch_current_stream(producer, d.id)) return *s;
  throw nb::value_error(("stepcore: invalid_argument in 'stream': None, but the first array "
                         "(a " +
                         std::string(nb::type_name(producer.type()).c_str()) +
                         " in CUDA memory) reports no current stream (its type has no DLPack "
                         "C exchange API): pass 'stream' (an int cudaStream_t address or an "
                         "object with __cuda_stream__)")
                            .c_str());
}

int device_ordinal(const std::string& device, const char* name) {
  if (device == "host") return -1;
  const std::string digits = device.rfind("cuda:", 0) == 0 ? device.substr(5) : std::string();
  if (digits.empty() || digits.size() > 4 ||
      digits.find_first_not_of("0123456789") != std::string::npos)
    throw nb::value_error(("stepcore: invalid_argument in '" + std::string(name) + "': '" + device +
                           "': expected 'host' or 'cuda:N'")
                              .c_str());
  return std::stoi(digits);
}

cudaStream_t trainer_stream(nb::handle stream) {
  const std::uintptr_t a = stream_address(stream);
  return reinterpret_cast<cudaStream_t>(a == 0 ? std::uintptr_t{1} : a);
}

std::uint64_t exchange_imports() noexcept {
  return g_exchange_imports.load(std::memory_order_relaxed);
}

}  // namespace stepcore::python
