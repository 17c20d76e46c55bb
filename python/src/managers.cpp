// stepcore._core's gradient managers and NUMA placement: the public C++ managers
// (make_gradient_manager) driven from Python, on the host device or a CUDA device the
// binding creates, with parameters and groups given as dicts (unknown keys refused),
// buffers returned as DLPack arrays without copies, and the GIL released around every
// call that runs kernels or waits. Their communicators: communicators.cpp.
#include "stepcore/managers.hpp"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "arrays.hpp"  // this extension's one checker of array and stream arguments
#include "memory_dict.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/device.hpp"
#include "stepcore/dtype.hpp"
#include "stepcore/error.hpp"
#include "stepcore/numa.hpp"
#include "stepcore/tensor.hpp"

namespace nb = nanobind;
using namespace stepcore;

namespace {

[[noreturn]] void bad(const std::string& name, const std::string& why) {
  throw nb::value_error(("stepcore: invalid_argument in '" + name + "': " + why).c_str());
}

DType parse_dtype(const std::string& s, const std::string& name) {
  if (s == "f32" || s == "float32") return DType::f32;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "f16" || s == "float16") return DType::f16;
  throw nb::type_error(
      ("stepcore: unsupported_dtype in '" + name + "': '" + s + "': expected f32, bf16 or f16")
          .c_str());
}

// Reads the dict `d` (named `name`) into fields by key; a key no field takes is refused.
template <class Fields>
void read_dict(const nb::dict& d, const std::string& name, Fields&& fields) {
  std::set<std::string> taken;
  fields([&](const char* key, auto& field) {
    taken.insert(key);
    if (!d.contains(key)) return;
    using T = std::decay_t<decltype(field)>;
    if (!nb::try_cast(d[key], field)) bad(name + "." + key, "has the wrong type");
    (void)sizeof(T);
  });
  for (auto [k, v] : d) {
    const std::string key = nb::cast<std::string>(k);
    if (!taken.count(key)) bad(name + "." + key, "is not a field of " + name);
  }
}

// An array-API object (__dlpack__) over `v` (device memory of `dev`: CPU for the host device),
// owned by `owner` (the Python manager), without a copy.
nb::ndarray<nb::array_api> array_of(const ConstTensorView& v, bool cuda, int ordinal,
                                    nb::handle owner) {
  const std::size_t shape[1] = {v.numel};
  nb::dlpack::dtype t;
  t.lanes = 1;
  t.bits = static_cast<std::uint8_t>(8 * dtype_size(v.dtype));
  t.code = static_cast<std::uint8_t>(v.dtype == DType::bf16 ? nb::dlpack::dtype_code::Bfloat
                                                            : nb::dlpack::dtype_code::Float);
  return nb::ndarray<nb::array_api>(const_cast<void*>(v.data), 1, shape, owner, nullptr, t,
                                    cuda ? nb::device::cuda::value : nb::device::cpu::value,
                                    ordinal);
}

// An array-API object over `n` host bytes (an 8-bit slot's codes) owned by `owner`.
nb::ndarray<nb::array_api> codes_of(const std::uint8_t* data, std::size_t n, nb::handle owner) {
  const std::size_t shape[1] = {n};
  nb::dlpack::dtype t;
  t.lanes = 1;
  t.bits = 8;
  t.code = static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt);
  return nb::ndarray<nb::array_api>(const_cast<std::uint8_t*>(data), 1, shape, owner, nullptr, t,
                                    nb::device::cpu::value, 0);
}

// A manager with the device it runs on (made by the binding) and its communicator.
struct PyManager {
  std::unique_ptr<device::Device> dev;
  std::unique_ptr<GradientManager> m;
  nb::object comm_owner;               // keeps the Python communicator alive
  std::vector<nb::object> keep_alive;  // the compute_into arrays the manager writes
  bool cuda = false;
  int ordinal = 0;
};

// A device event for Python (stepcore._core.Event): a manager's (record_on,
// gradient_released) or a HostEvent the caller sets (Event.host()).
struct PyEvent {
  device::Event event;
  std::optional<device::HostEvent> host;  // set by set(); empty for the devices' events
};

// The caller's stream of a manager's record_on/wait_on: on CUDA an int address or an object
// with __cuda_stream__ (0: the legacy default stream), None the device's compute stream; on
// the host device only None (its callers have no stream: the library refuses others).
cudaStream_t caller_stream(const PyManager& p, nb::handle stream) {
  if (stream.is_none()) return p.cuda ? p.dev->compute_stream() : nullptr;
  const std::uintptr_t a = python::stream_address(stream);
  return reinterpret_cast<cudaStream_t>(a == 0 && p.cuda ? std::uintptr_t{1} : a);
}

// The event argument `name` (an Event, or None: an empty event, complete).
device::Event event_arg(nb::handle h, const char* name) {
  if (h.is_none()) return {};
  PyEvent* e = nullptr;
  if (!nb::try_cast(h, e) || e == nullptr)
    throw nb::type_error(("stepcore: invalid_argument in '" + std::string(name) + "': a " +
                          std::string(nb::type_name(h.type()).c_str()) +
                          " is not a stepcore._core.Event (or None)")
                             .c_str());
  return e->event;
}

// The checked view of an array argument in the manager's device memory (CPU memory for
// the host device, CUDA memory for a CUDA device), named `name`.
TensorView device_view(const PyManager& p, nb::handle h, const char* name, python::Access access) {
  return python::array_arg(h, python::ArgName{name},
                           p.cuda ? python::Memory::cuda : python::Memory::cpu, access)
      .view;
}

}  // namespace

// python/src/communicators.cpp: Communicator, the callback communicators, in-process groups.
void bind_communicators(nb::module_& m);

void bind_managers(nb::module_& m) {
  bind_communicators(m);

  auto placement_dict = [](const numa::Placement& p) {
    nb::dict d;
    d["numa_node"] = p.numa_node;
    d["cpus"] = p.cpus;
    d["threads"] = p.threads();
    d["bound"] = p.bound;
    d["oversubscribed"] = p.oversubscribed;
    d["reason"] = p.reason;
    return d;
  };
  m.def(
      "numa_placement",
      [placement_dict](const std::vector<std::string>& rank_gpus, int local_rank) {
        const numa::Topology topo = numa::Topology::live();
        return placement_dict(topo.place(rank_gpus, local_rank));
      },
      nb::arg("rank_gpus"), nb::arg("local_rank"),
      "Where local rank `local_rank` runs, rank i driving GPU rank_gpus[i] (PCI bus ids): "
      "{'numa_node', 'cpus', 'threads', 'bound', 'oversubscribed', 'reason'} (hwloc).");
  m.def(
      "numa_place_on_node",
      [placement_dict](int node, int index, int sharers) {
        return placement_dict(numa::Topology::live().place_on_node(node, index, sharers));
      },
      nb::arg("node"), nb::arg("index"), nb::arg("sharers"),
      "The share of NUMA node `node` for the index-th of `sharers` ranks (runs without a GPU).");
  m.def("local_rank_from_env", &numa::local_rank_from_env, nb::arg("fallback") = 0,
        "LOCAL_RANK (torchrun), else OMPI_COMM_WORLD_LOCAL_RANK, else fallback.");
  m.def("local_world_size_from_env", &numa::local_world_size_from_env, nb::arg("fallback") = 1,
        "LOCAL_WORLD_SIZE, else OMPI_COMM_WORLD_LOCAL_SIZE, else fallback.");

  nb::class_<PyEvent>(m, "Event",
                      "A point in a device's work (device.hpp's Event): a manager's "
                      "record_on(stream) or gradient_released(i), or Event.host().")
      .def_static(
          "host",
          [] {
            PyEvent e;
            e.host.emplace();
            e.event = e.host->event();
            return e;
          },
          "A HostEvent: complete once set() is called (any thread). Queues told to wait "
          "for it (gradient_ready's `written`) hold the work behind it until then.")
      .def(
          "complete", [](const PyEvent& e) { return e.event.complete(); },
          "True once the work before the event is done (never blocks).")
      .def(
          "wait",
          [](const PyEvent& e) {
            nb::gil_scoped_release r;
            e.event.wait();
          },
          "Blocks the calling thread until the event is complete.")
      .def(
          "set",
          [](const PyEvent& e) {
            if (!e.host)
              throw nb::value_error(
                  "stepcore: invalid_argument in 'event': only an Event.host() is set by the "
                  "caller; a device's events complete with its work");
            e.host->set();
          },
          "Completes an Event.host() and wakes its waiters.");

  nb::class_<PyManager>(m, "GradientManager",
                        "A gradient manager (managers.hpp) on its own device: 'host' or 'cuda:N'.")
      .def(
          "__init__",
          [](PyManager* self, const std::string& mode, const std::vector<nb::dict>& params,
             const std::string& optimizer, std::optional<nb::dict> hyper,
             std::optional<std::vector<nb::dict>> groups, std::size_t chunk_elements,
             const std::string& device, nb::object comm, std::uint64_t layout_fingerprint,
             int threads, std::optional<std::string> isa, std::vector<int> cpus, int numa_node,
             bool lazy_gpu_scale, nb::handle stream, const std::string& speculation,
             std::int64_t speculation_bytes, std::int64_t speculation_device_bytes,
             std::int64_t ring_slots, std::size_t ring_slot_elements, bool q8_state,
             std::size_t min_8bit_size) {
            ManagerConfig c;
            c.mode = parse_offload_mode(mode);
            // The optimizer by name, its hyper-parameters by field name (numbers, flags as
            // bools, a formula as its name); the library names a bad one.
            std::vector<OptimizerField> fields;
            if (hyper)
              for (auto [k, v] : *hyper) {
                const std::string key = nb::cast<std::string>(k);
                if (nb::isinstance<nb::str>(v))
                  fields.push_back({key, nb::cast<std::string>(v)});
                else if (nb::isinstance<nb::bool_>(v) || nb::isinstance<nb::int_>(v) ||
                         nb::isinstance<nb::float_>(v))
                  fields.push_back({key, nb::cast<double>(v)});
                else
                  throw nb::type_error(("stepcore: invalid_argument in '" + optimizer + "." + key +
                                        "': a number, a bool or (formula) a name")
                                           .c_str());
              }
            c.optimizer = make_optimizer_config(optimizer, fields);
            if (groups)
              for (std::size_t g = 0; g < groups->size(); ++g) {
                ParamGroup pg;
                read_dict((*groups)[g], "groups[" + std::to_string(g) + "]", [&](auto&& f) {
                  f("name", pg.name);
                  f("lr", pg.lr);
                  f("weight_decay", pg.weight_decay);
                  f("beta1", pg.beta1);
                  f("beta2", pg.beta2);
                  f("eps", pg.eps);
                });
                c.groups.push_back(pg);
              }
            auto pm = std::make_unique<PyManager>();
            const int ordinal = python::device_ordinal(device, "device");
            if (ordinal < 0) {  // a CPU trainer: its CPU tensors count as device memory
              pm->dev = device::make_host_device(256, device::HostDeviceMemory::any_host_memory);
            } else {
              pm->ordinal = ordinal;
              // The trainer's stream as the compute stream, None new streams of the
              // manager's own.
              pm->dev = device::make_cuda_device(
                  pm->ordinal, stream.is_none() ? nullptr : python::trainer_stream(stream));
              pm->cuda = true;
            }
            for (std::size_t i = 0; i < params.size(); ++i) {
              ParamSpec p;
              std::string grad_dtype = "bf16", compute_dtype = "bf16";
              nb::object compute_into = nb::none();
              const std::string name = "params[" + std::to_string(i) + "]";
              read_dict(params[i], name, [&](auto&& f) {
                f("name", p.name);
                f("numel", p.numel);
                f("grad_dtype", grad_dtype);
                f("compute_dtype", compute_dtype);
                f("has_compute_weights", p.has_compute_weights);
                f("counts_toward_norm", p.counts_toward_norm);
                f("group", p.group);
                f("gradient_buffer", p.gradient_buffer);
                f("compute_into", compute_into);
              });
              p.grad_dtype = parse_dtype(grad_dtype, name + ".grad_dtype");
              p.compute_dtype = parse_dtype(compute_dtype, name + ".compute_dtype");
              if (!compute_into.is_none()) {  // the model's storage: kept alive by the manager
                const std::string field = name + ".compute_into";
                p.compute_into =
                    device_view(*pm, compute_into, field.c_str(), python::Access::write);
                pm->keep_alive.push_back(compute_into);
              }
              c.params.push_back(std::move(p));
            }
            c.chunk_elements = chunk_elements;
            c.layout_fingerprint = layout_fingerprint;
            c.engine.threads = threads;
            if (isa) c.engine.isa = cpu::parse_isa(*isa);
            c.engine.cpus = std::move(cpus);
            c.numa_node = numa_node;
            c.lazy_gpu_scale = lazy_gpu_scale;
            c.speculation = parse_speculation(speculation);
            c.speculation_bytes = speculation_bytes;
            c.speculation_device_bytes = speculation_device_bytes;
            c.ring_slots = ring_slots;
            c.ring_slot_elements = ring_slot_elements;
            c.q8_state = q8_state;
            c.min_8bit_size = min_8bit_size;
            c.device = pm->dev.get();
            if (!comm.is_none()) {
              c.comm = nb::cast<comm::Communicator*>(comm);
              pm->comm_owner = comm;
            }
            pm->m = make_gradient_manager(std::move(c));
            new (self) PyManager(std::move(*pm));
          },
          nb::arg("mode"), nb::arg("params"), nb::kw_only(), nb::arg("optimizer") = "adamw",
          nb::arg("hyper") = nb::none(), nb::arg("groups") = nb::none(),
          nb::arg("chunk_elements") = std::size_t{16} << 20, nb::arg("device") = "host",
          nb::arg("comm") = nb::none(), nb::arg("layout_fingerprint") = 0, nb::arg("threads") = 0,
          nb::arg("isa") = nb::none(), nb::arg("cpus") = std::vector<int>{},
          nb::arg("numa_node") = -1, nb::arg("lazy_gpu_scale") = false,
          nb::arg("stream").none() = nb::none(), nb::arg("speculation") = "auto",
          nb::arg("speculation_bytes") = ManagerConfig::kAllChunks,
          nb::arg("speculation_device_bytes") = 0,
          nb::arg("ring_slots") = ManagerConfig::kDefaultRing,
          nb::arg("ring_slot_elements") = ManagerConfig{}.ring_slot_elements,
          nb::arg("q8_state") = false, nb::arg("min_8bit_size") = ManagerConfig{}.min_8bit_size)
      .def(
          "q8_parameter", [](const PyManager& p, std::size_t i) { return p.m->q8_parameter(i); },
          nb::arg("i"), "Whether parameter i's state slots are 8-bit (codes, absmax) pairs.")
      .def_prop_ro("mode",
                   [](const PyManager& p) { return std::string(offload_mode_name(p.m->mode())); })
      .def_prop_ro("group_count", [](const PyManager& p) { return p.m->group_count(); })
      .def_prop_ro(
          "state_slot_names",
          [](const PyManager& p) {
            std::vector<std::string> out;
            for (std::string_view n : p.m->state_slot_names()) out.emplace_back(n);
            return out;
          },
          "The optimizer's state slots beside each master, in its order (e.g. exp_avg, "
          "exp_avg_sq; momentum_buffer; sum; none for sign_sgd).")
      .def_prop_ro(
          "counts_steps",
          [](const PyManager& p) { return optimizer_counts_steps(p.m->config().optimizer); },
          "Whether the optimizer keeps a step counter per parameter.")
      .def("group_index",
           [](const PyManager& p, const std::string& n) { return p.m->group_index(n); })
      .def(
          "set_hyperparameters",
          [](PyManager& p, std::size_t g, double lr, double weight_decay) {
            p.m->set_hyperparameters(g, {lr, weight_decay});
          },
          nb::arg("group"), nb::arg("lr"), nb::arg("weight_decay"))
      .def(
          "load_parameter",
          [](PyManager& p, std::size_t i,
             const nb::ndarray<nb::ro, float, nb::device::cpu>& master) {
            const std::span<const float> s(master.data(), master.size());
            nb::gil_scoped_release r;
            p.m->load_parameter(i, s);
          },
          nb::arg("i"), nb::arg("master"))
      .def(
          "import_parameter",
          [](PyManager& p, std::size_t i, const nb::ndarray<nb::ro, float, nb::device::cpu>& master,
             std::optional<nb::dict> state, float step) {
            const std::span<const float> m0(master.data(), master.size());
            // The slots by name: the names live in `names` while the call runs.
            std::vector<std::string> names;
            using F32 = nb::ndarray<nb::ro, float, nb::device::cpu, nb::c_contig>;
            using U8 = nb::ndarray<nb::ro, std::uint8_t, nb::device::cpu, nb::c_contig>;
            std::vector<F32> arrays, maxima;
            std::vector<U8> codes;
            if (state)
              for (auto [k, v] : *state) {
                names.push_back(nb::cast<std::string>(k));
                const std::string where = "state." + names.back();
                F32 a, b;
                U8 c;
                // f32 values, or an 8-bit slot's (codes, absmax) pair (q8_parameter).
                if (nb::isinstance<nb::tuple>(v) && nb::len(v) == 2 &&
                    nb::try_cast(v[nb::int_(0)], c) && nb::try_cast(v[nb::int_(1)], b)) {
                  codes.push_back(c);
                  maxima.push_back(b);
                  arrays.emplace_back();
                  continue;
                }
                if (!nb::try_cast(v, a))
                  throw nb::type_error(("stepcore: unsupported_dtype in '" + where +
                                        "': a contiguous float32 CPU array, or (uint8 codes, "
                                        "float32 absmax) for an 8-bit slot")
                                           .c_str());
                arrays.push_back(a);
                codes.emplace_back();
                maxima.emplace_back();
              }
            std::vector<SlotIn> slots;
            for (std::size_t k = 0; k < names.size(); ++k)
              slots.push_back({names[k], std::span<const float>(arrays[k].data(), arrays[k].size()),
                               std::span<const std::uint8_t>(codes[k].data(), codes[k].size()),
                               std::span<const float>(maxima[k].data(), maxima[k].size())});
            nb::gil_scoped_release r;
            p.m->import_parameter(i, m0, slots, step);
          },
          nb::arg("i"), nb::arg("master"), nb::arg("state") = nb::none(), nb::arg("step") = 0.0f,
          "Sets parameter i's master, its state slots (a dict: every one of state_slot_names "
          "by name) and step counter.")
      .def(
          "begin_step",
          [](PyManager& p, float scale, bool overlap) {
            nb::gil_scoped_release r;
            p.m->begin_step(scale, overlap);
          },
          nb::arg("gradient_scale"), nb::arg("overlap_optimizer") = false)
      .def(
          "begin_backward",
          [](PyManager& p, bool final_backward) {
            nb::gil_scoped_release r;
            p.m->begin_backward(final_backward);
          },
          nb::arg("final_backward"))
      .def(
          "gradient",
          [](nb::handle self, std::size_t i) {
            PyManager& p = nb::cast<PyManager&>(self);
            return array_of(p.m->gradient(i), p.cuda, p.ordinal, self);
          },
          nb::arg("i"), "The manager's gradient buffer of parameter i (no copy; device memory).")
      .def(
          "record_on",
          [](PyManager& p, nb::handle stream) {
            const cudaStream_t s = caller_stream(p, stream);
            PyEvent e;
            e.event = p.dev->record_on(s);
            return e;
          },
          nb::arg("stream").none() = nb::none(),
          "An event recorded now on the caller's stream (CUDA: an int address or an object "
          "with __cuda_stream__, e.g. torch's current stream; None: the manager's compute "
          "stream), from the device's pool of events: gradient_ready's `written`. On the host "
          "device (stream None) a complete event: its callers' writes are done.")
      .def(
          "gradient_ready",
          [](PyManager& p, std::size_t i, nb::handle grad, nb::handle written) {
            const device::Event w = event_arg(written, "written");
            if (grad.is_none()) {
              nb::gil_scoped_release r;
              p.m->gradient_ready(i, w);
              return;
            }
            const TensorView v = device_view(p, grad, "grad", python::Access::read);
            nb::gil_scoped_release r;
            p.m->gradient_ready(i, ConstTensorView(v), w);
          },
          nb::arg("i"), nb::arg("grad").none() = nb::none(), nb::arg("written").none() = nb::none(),
          "Parameter i's gradient of this micro-batch is complete once `written` (an Event: "
          "record_on(the stream that wrote it); None: written in order on the compute stream) "
          "is: in the manager's buffer, or in `grad` (the caller's, never written; reusable "
          "once released). The manager's reads wait for `written` on the device.")
      .def(
          "gradient_released",
          [](PyManager& p, std::size_t i) {
            PyEvent e;
            e.event = p.m->gradient_released(i);
            return e;
          },
          nb::arg("i"),
          "The event after which parameter i's last gradient buffer may be reused (complete "
          "before its first gradient_ready): wait_on(stream, it) orders the stream's later "
          "writes (or its allocator's reuse of the buffer) after the manager's reads.")
      .def(
          "wait_on",
          [](PyManager& p, nb::handle stream, nb::handle event) {
            const cudaStream_t s = caller_stream(p, stream);
            const device::Event e = event_arg(event, "event");
            nb::gil_scoped_release r;
            p.dev->wait_on(s, e);
          },
          nb::arg("stream").none(), nb::arg("event"),
          "Makes the caller's stream wait for `event` before its later work (CUDA: no host "
          "synchronisation); on the host device (stream None) blocks until it is complete.")
      .def(
          "gradient_released_wait",
          [](PyManager& p, std::size_t i) {
            const device::Event e = p.m->gradient_released(i);
            nb::gil_scoped_release r;
            p.dev->synchronize(e);
          },
          nb::arg("i"), "Blocks until parameter i's last gradient buffer may be reused.")
      .def("finish_backward",
           [](PyManager& p) {
             nb::gil_scoped_release r;
             p.m->finish_backward();
           })
      .def(
          "clip_grad_norm",
          [](PyManager& p, float max_norm) {
            nb::gil_scoped_release r;
            return p.m->clip_grad_norm(max_norm);
          },
          nb::arg("max_norm"))
      .def("step",
           [](PyManager& p) {
             nb::gil_scoped_release r;
             p.m->step();
           })
      .def("report",
           [](PyManager& p) {
             StepReport rep;
             {
               nb::gil_scoped_release r;
               rep = p.m->report();
             }
             nb::dict d;
             d["stepped"] = rep.stepped;
             d["skipped"] = rep.skipped;
             d["chunks_speculated"] = rep.chunks_speculated;
             d["chunks_committed"] = rep.chunks_committed;
             d["chunks_rolled_back"] = rep.chunks_rolled_back;
             d["exposed_seconds"] = rep.exposed_seconds;
             d["staging_wait_seconds"] = rep.staging_wait_seconds;
             d["norm"] = rep.norm.norm;
             d["finite"] = rep.norm.finite;
             d["clip_coefficient"] = rep.clip_coefficient;
             return d;
           })
      .def(
          "memory", [](const PyManager& p) { return memory_dict(p.m->memory()); },
          "Every byte the manager holds by kind ('<kind>' host, '<kind>@device'), now and at "
          "its peak, and the totals (GradientManager::memory()).")
      .def_prop_ro("gradients_read_by_step",
                   [](const PyManager& p) { return p.m->gradients_read_by_step(); })
      .def_prop_ro("effective_gradient_scale",
                   [](const PyManager& p) { return p.m->effective_gradient_scale(); })
      .def(
          "compute_weights",
          [](nb::handle self, std::size_t i) {
            PyManager& p = nb::cast<PyManager&>(self);
            return array_of(p.m->compute_weights(i), p.cuda, p.ordinal, self);
          },
          nb::arg("i"), "Parameter i's compute weights (no copy; valid after report()).")
      .def(
          "read_parameter",
          [](PyManager& p, std::size_t i) {
            const ParamSpec& s = p.m->config().params[i];
            const std::vector<std::string_view>& names = p.m->state_slot_names();
            std::vector<float> master(s.numel);
            const bool q8 = p.m->q8_parameter(i);
            std::vector<std::vector<float>> slots(names.size(),
                                                  std::vector<float>(q8 ? 0 : s.numel));
            std::vector<std::vector<float>> maxima(names.size(),
                                                   std::vector<float>(q8 ? q8_blocks(s.numel) : 0));
            std::vector<std::vector<std::uint8_t>> codes(
                names.size(), std::vector<std::uint8_t>(q8 ? s.numel : 0));
            std::vector<SlotOut> named;
            for (std::size_t k = 0; k < names.size(); ++k)
              named.push_back({names[k], slots[k], codes[k], maxima[k]});
            std::vector<std::uint8_t> compute(
                s.has_compute_weights ? s.numel * dtype_size(s.compute_dtype) : 0);
            {
              nb::gil_scoped_release r;
              p.m->read_parameter(i, master, named, compute);
            }
            auto out = [](std::vector<float> v) {
              auto* data = new std::vector<float>(std::move(v));
              nb::capsule owner(
                  data, [](void* q) noexcept { delete static_cast<std::vector<float>*>(q); });
              const std::size_t shape[1] = {data->size()};
              return nb::ndarray<nb::numpy, float>(data->data(), 1, shape, owner);
            };
            auto out_codes = [](std::vector<std::uint8_t> v) {
              auto* data = new std::vector<std::uint8_t>(std::move(v));
              nb::capsule owner(data, [](void* q) noexcept {
                delete static_cast<std::vector<std::uint8_t>*>(q);
              });
              const std::size_t shape[1] = {data->size()};
              return nb::ndarray<nb::numpy, std::uint8_t>(data->data(), 1, shape, owner);
            };
            nb::dict state;
            for (std::size_t k = 0; k < names.size(); ++k) {
              const nb::str key(names[k].data(), names[k].size());
              if (q8)
                state[key] =
                    nb::make_tuple(out_codes(std::move(codes[k])), out(std::move(maxima[k])));
              else
                state[key] = out(std::move(slots[k]));
            }
            return nb::make_tuple(
                out(std::move(master)), state,
                nb::bytes(reinterpret_cast<const char*>(compute.data()), compute.size()));
          },
          nb::arg("i"), "Copies of parameter i's (master, {slot name: state slot}, compute bytes).")
      .def("step_count", [](PyManager& p, std::size_t i) { return p.m->step_count(i); })
      .def(
          "host_state",
          [](nb::handle self, std::size_t i) {
            PyManager& p = nb::cast<PyManager&>(self);
            const GradientManager::HostState h = p.m->host_state(i);
            auto view = [&](std::span<const float> s) -> nb::object {
              if (s.data() == nullptr && s.empty()) return nb::none();
              return nb::cast(
                  array_of(ConstTensorView(s.data(), s.size(), DType::f32), false, 0, self));
            };
            nb::dict slots;
            if (h.master.data() != nullptr)  // mode none: no views
              for (const auto& s : h.slots)
                slots[nb::str(s.name.data(), s.name.size())] =
                    s.codes.data() == nullptr
                        ? view(s.values)
                        : nb::make_tuple(codes_of(s.codes.data(), s.codes.size(), self),
                                         view(s.absmax));
            return nb::make_tuple(view(h.master), slots);
          },
          nb::arg("i"),
          "Views (no copy) of parameter i's host-resident state as (master, {slot name: slot}) "
          "(modes optimizer, full; (None, {}) in mode none), valid until the next call that "
          "starts work or changes state.")
      .def(
          "save_checkpoint",
          [](PyManager& p, const std::string& path) {
            nb::gil_scoped_release r;
            p.m->save_checkpoint(path);
          },
          nb::arg("path"))
      .def(
          "load_checkpoint",
          [](PyManager& p, const std::string& path) {
            nb::gil_scoped_release r;
            p.m->load_checkpoint(path);
          },
          nb::arg("path"))
      .def("synchronize",
           [](PyManager& p) {
             nb::gil_scoped_release r;
             p.m->synchronize();
           })
      .def("close", [](PyManager& p) {
        nb::gil_scoped_release r;
        p.m->close();
      });
}
