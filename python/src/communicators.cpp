// stepcore._core's communicators: the Communicator base class, the callback communicators
// whose collectives call a Python function (host copies, or the device's own words in
// place), and in-process groups; the gradient managers (managers.cpp) take them as `comm`.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "arrays.hpp"    // the device and stream arguments
#include "partials.hpp"  // the norm partial's struct layout
#include "stepcore/comm.hpp"
#include "stepcore/error.hpp"
#include "stepcore/norm.hpp"

namespace nb = nanobind;
using namespace stepcore;

namespace {

[[noreturn]] void bad(const std::string& name, const std::string& why) {
  throw nb::value_error(("stepcore: invalid_argument in '" + name + "': " + why).c_str());
}

// A communicator whose collectives call a Python function all_reduce(array, op), which
// reduces the array in place over the ranks with op "sum", "max" or "min" (e.g.
// torch.distributed.all_reduce), in one of two hand-offs:
// - Handoff::host_copy (make_callback_communicator; host memory): a numpy array of int64
//   words (unsigned words SUM identically mod 2^64; MAX/MIN of unsigned words are taken on
//   the words with their top bit flipped, which orders them as signed) or float64/float32;
//   a norm partial travels as one SUM and one MAX call over a host record.
// - Handoff::in_place (make_device_callback_communicator; the device's memory): the
//   words themselves as a DLPack array (CUDA memory of the device, or host memory), typed
//   uint64/uint32/float64/float32: max/min compare unsigned words as unsigned. A norm
//   partial travels as three calls: the uint64 sum words, the uint32 max pair, the check
//   (partials.hpp). On a CUDA device the function enqueues on stream() and may return
//   before the words are reduced; nothing here waits on the host.
// Called with the GIL from whichever thread the manager runs its collective on; a Python
// exception marks the communicator failed (Errc::comm_error).
class CallbackCommunicator final : public comm::Communicator {
 public:
  enum class Handoff : std::uint8_t { host_copy, in_place };

  CallbackCommunicator(int rank, int size, nb::object all_reduce, Handoff handoff,
                       comm::MemorySpace memory, cudaStream_t stream, int device_ordinal)
      : Communicator(comm::kDefaultTimeout),
        rank_(rank),
        size_(size),
        fn_(std::move(all_reduce)),
        handoff_(handoff),
        memory_(memory),
        stream_(stream),
        ordinal_(device_ordinal) {}

  ~CallbackCommunicator() override {
    nb::gil_scoped_acquire gil;
    fn_.reset();
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  comm::MemorySpace memory() const noexcept override { return memory_; }
  std::string_view name() const noexcept override {
    return handoff_ == Handoff::in_place ? "device_callback" : "callback";
  }
  cudaStream_t stream() const noexcept override { return stream_; }

  void all_reduce(void* data, std::size_t count, comm::Word word, comm::Op op) override {
    check_usable();
    if (count == 0) return;
    if (data == nullptr) throw Error(Errc::null_pointer, "data", "null with a count above 0");
    if (handoff_ == Handoff::in_place) {
      in_place(data, count, word, op);
      return;
    }
    switch (word) {
      case comm::Word::u64:
        reduce_u64(static_cast<std::uint64_t*>(data), count, op);
        return;
      case comm::Word::u32: {
        std::vector<std::uint64_t> w(static_cast<const std::uint32_t*>(data),
                                     static_cast<const std::uint32_t*>(data) + count);
        reduce_u64(w.data(), count, op);
        for (std::size_t k = 0; k < count; ++k)
          static_cast<std::uint32_t*>(data)[k] = static_cast<std::uint32_t>(w[k]);
        return;
      }
      case comm::Word::f32:
        call(data, count, nb::dlpack::dtype_code::Float, 32, op);
        return;
      case comm::Word::f64:
        call(data, count, nb::dlpack::dtype_code::Float, 64, op);
        return;
    }
  }

  void all_reduce_partial(NormPartial* partial, comm::LayoutCheck* check) override {
    check_usable();
    if (partial == nullptr) throw Error(Errc::null_pointer, "partial", "null");
    if (handoff_ == Handoff::in_place) {
      // The struct in place: digits, nan and inf counts summed as uint64; max_abs_bits and
      // approximate maxed as uint32; the check's three uint64 words maxed.
      in_place(partial, python::kStructSumWords, comm::Word::u64, comm::Op::sum);
      in_place(&partial->max_abs_bits, 2, comm::Word::u32, comm::Op::max);
      if (check != nullptr)
        in_place(check, sizeof(comm::LayoutCheck) / 8, comm::Word::u64, comm::Op::max);
      return;
    }
    std::uint64_t sum[kNormDigits + 2];
    for (int k = 0; k < kNormDigits; ++k) sum[k] = partial->digits[k];
    sum[kNormDigits] = partial->nan_count;
    sum[kNormDigits + 1] = partial->inf_count;
    std::uint64_t max[5] = {partial->max_abs_bits, partial->approximate, 0, 0, 0};
    const std::size_t nmax = check != nullptr ? 5 : 2;
    if (check != nullptr) {
      max[2] = check->fingerprint;
      max[3] = check->inverse;
      max[4] = check->failure;
    }
    reduce_u64(sum, kNormDigits + 2, comm::Op::sum);
    reduce_u64(max, nmax, comm::Op::max);
    for (int k = 0; k < kNormDigits; ++k) partial->digits[k] = sum[k];
    partial->nan_count = sum[kNormDigits];
    partial->inf_count = sum[kNormDigits + 1];
    partial->max_abs_bits = static_cast<std::uint32_t>(max[0]);
    partial->approximate = static_cast<std::uint32_t>(max[1]);
    if (check != nullptr) {
      check->fingerprint = max[2];
      check->inverse = max[3];
      check->failure = max[4];
    }
  }

  // The collectives are the callback's (torch's process group and its timeout): nothing
  // of this communicator's is outstanding.
  void synchronize() override { check_usable(); }
  void abort() noexcept override { failed_ = true; }
  bool failed() const noexcept override { return failed_; }

 private:
  void check_usable() const {
    if (failed_)
      throw Error(Errc::comm_error, "comm",
                  "the communicator failed earlier (a collective raised)");
  }

  // In place over the ranks; MAX/MIN through the sign-flip order (see the class comment).
  void reduce_u64(std::uint64_t* w, std::size_t count, comm::Op op) {
    const bool order = op != comm::Op::sum;
    constexpr std::uint64_t kTop = std::uint64_t{1} << 63;
    if (order)
      for (std::size_t k = 0; k < count; ++k) w[k] ^= kTop;
    call(w, count, nb::dlpack::dtype_code::Int, 64, op);
    if (order)
      for (std::size_t k = 0; k < count; ++k) w[k] ^= kTop;
  }

  // The words at `data` handed over as they are, typed by `word`, in memory().
  void in_place(void* data, std::size_t count, comm::Word word, comm::Op op) {
    const bool integer = word == comm::Word::u32 || word == comm::Word::u64;
    const int bits = word == comm::Word::u32 || word == comm::Word::f32 ? 32 : 64;
    call(data, count, integer ? nb::dlpack::dtype_code::UInt : nb::dlpack::dtype_code::Float, bits,
         op);
  }

  void call(void* data, std::size_t count, nb::dlpack::dtype_code code, int bits, comm::Op op) {
    nb::gil_scoped_acquire gil;
    try {
      nb::dlpack::dtype t;
      t.code = static_cast<std::uint8_t>(code);
      t.bits = static_cast<std::uint8_t>(bits);
      t.lanes = 1;
      const std::size_t shape[1] = {count};
      const char* name = op == comm::Op::sum ? "sum" : op == comm::Op::max ? "max" : "min";
      // A view, not a copy (nanobind copies an owner-less array it converts by default):
      // the callback reduces these very words.
      if (handoff_ == Handoff::host_copy) {
        nb::ndarray<nb::numpy> a(data, 1, shape, nb::handle(), nullptr, t);
        fn_(nb::cast(a, nb::rv_policy::reference), name);
      } else {
        const bool cuda = memory_ == comm::MemorySpace::device;
        nb::ndarray<nb::array_api> a(data, 1, shape, nb::handle(), nullptr, t,
                                     cuda ? nb::device::cuda::value : nb::device::cpu::value,
                                     cuda ? ordinal_ : 0);
        fn_(nb::cast(a, nb::rv_policy::reference), name);
      }
    } catch (nb::python_error& e) {
      failed_ = true;
      const std::string what =
          std::string(nb::type_name(e.type()).c_str()) + ": " + nb::str(e.value()).c_str();
      throw Error(Errc::comm_error, "comm", "the all_reduce callback raised " + what);
    }
  }

  int rank_, size_;
  nb::object fn_;
  Handoff handoff_;
  comm::MemorySpace memory_;
  cudaStream_t stream_;
  int ordinal_;
  std::atomic<bool> failed_{false};
};

}  // namespace

void bind_communicators(nb::module_& m) {
  nb::class_<comm::Communicator>(m, "Communicator",
                                 "One rank of a group that all-reduces (comm.hpp).")
      .def_prop_ro("rank", &comm::Communicator::rank)
      .def_prop_ro("size", &comm::Communicator::size)
      .def_prop_ro("name", [](const comm::Communicator& c) { return std::string(c.name()); })
      .def("abort", &comm::Communicator::abort);

  m.def(
      "make_callback_communicator",
      [](int rank, int size, nb::object all_reduce) {
        if (size < 1) bad("size", "must be >= 1");
        if (rank < 0 || rank >= size) bad("rank", "must be in [0, size)");
        if (!PyCallable_Check(all_reduce.ptr())) bad("all_reduce", "must be callable");
        comm::Communicator* c = new CallbackCommunicator(rank, size, std::move(all_reduce),
                                                         CallbackCommunicator::Handoff::host_copy,
                                                         comm::MemorySpace::host, nullptr, 0);
        return nb::cast(c, nb::rv_policy::take_ownership);
      },
      nb::arg("rank"), nb::arg("size"), nb::arg("all_reduce"),
      "Returns a host-memory communicator whose collectives call all_reduce(array, op): reduce "
      "the numpy array in place over the ranks with op 'sum', 'max' or 'min' (e.g. "
      "torch.distributed.all_reduce on a gloo group); the array is valid only during the call. "
      "The norm travels as int64 words, so any transport combines it exactly.");

  m.def(
      "make_device_callback_communicator",
      [](int rank, int size, nb::object all_reduce, const std::string& device, nb::handle stream) {
        if (size < 1) bad("size", "must be >= 1");
        if (rank < 0 || rank >= size) bad("rank", "must be in [0, size)");
        if (!PyCallable_Check(all_reduce.ptr())) bad("all_reduce", "must be callable");
        const int ordinal = python::device_ordinal(device, "device");
        if (ordinal < 0 && !stream.is_none())
          bad("stream", "the host device has no streams: pass None");
        if (ordinal >= 0 && stream.is_none())
          bad("stream",
              "a CUDA device's communicator enqueues on the manager's compute stream: pass "
              "it (the manager's `stream`, e.g. torch.cuda.current_stream())");
        comm::Communicator* c = new CallbackCommunicator(
            rank, size, std::move(all_reduce), CallbackCommunicator::Handoff::in_place,
            ordinal < 0 ? comm::MemorySpace::host : comm::MemorySpace::device,
            ordinal < 0 ? nullptr : python::trainer_stream(stream), ordinal < 0 ? 0 : ordinal);
        return nb::cast(c, nb::rv_policy::take_ownership);
      },
      nb::arg("rank"), nb::arg("size"), nb::arg("all_reduce"), nb::kw_only(),
      nb::arg("device") = "host", nb::arg("stream").none() = nb::none(),
      "Returns a communicator of the device's memory (device 'host': host memory; 'cuda:N': "
      "that GPU's, enqueued on `stream`, the manager's compute stream) for modes none and "
      "optimizer, whose collectives call all_reduce(array, op): reduce the DLPack array in "
      "place over the ranks with op 'sum', 'max' or 'min', the array being the manager's own "
      "words (uint64, uint32: max and min compare them as unsigned; float64, float32). On a "
      "CUDA device the callback enqueues on `stream` (e.g. torch.distributed.all_reduce "
      "under torch.cuda.stream) and need not wait; the array is valid for the manager's "
      "lifetime. The norm travels as integer words, so any transport combines it exactly.");

  m.def(
      "make_in_process_group",
      [](int size, double timeout_s) {
        auto group = comm::make_in_process_group(
            size, std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000)));
        nb::list out;
        for (auto& c : group) out.append(nb::cast(c.release(), nb::rv_policy::take_ownership));
        return out;
      },
      nb::arg("size"), nb::arg("timeout_s") = 60.0,
      "Returns `size` communicators of one group in this process, one per thread (rank i is "
      "element i): for tests and single-process multi-worker setups.");
}
