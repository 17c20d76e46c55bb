// stepcore._core.plan_model: the memory planner (stepcore/plan.hpp) for stepcore.plan_memory,
// thin: the model arrives as a count, (name, shape, dtype) records, or a Hugging Face
// config (a path or JSON text) — stepcore/_plan.py turns ints, lists, dicts and torch
// modules into these and checks their types; every size, shard and byte is the library's.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "memory_dict.hpp"
#include "stepcore/dtype.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/plan.hpp"

namespace nb = nanobind;
using namespace stepcore;

namespace {

DType dtype_named(const std::string& s, const std::string& name) {
  if (s == "f32") return DType::f32;
  if (s == "bf16") return DType::bf16;
  if (s == "f16") return DType::f16;
  throw Error(Errc::unsupported_dtype, name, "'" + s + "': expected f32, bf16 or f16");
}

using Shapes = std::vector<std::tuple<std::string, std::vector<std::uint64_t>, std::string>>;
using Model = std::variant<std::uint64_t, Shapes>;

}  // namespace

void bind_plan(nb::module_& m) {
  m.def(
      "plan_model",
      [](const std::string& kind, const nb::object& model, const std::string& mode,
         const std::string& optimizer,
         const std::vector<std::pair<std::string, std::variant<double, std::string>>>& hyper,
         std::uint64_t ranks, std::uint64_t ranks_per_node, std::uint64_t micro_batches,
         bool overlap, const std::string& speculation, std::int64_t speculation_bytes,
         std::int64_t speculation_device_bytes, std::int64_t ring_slots,
         std::uint64_t ring_slot_elements, std::uint64_t chunk_elements,
         const std::string& checkpoint, std::optional<std::uint64_t> host_memory,
         std::optional<std::uint64_t> gpu_memory, std::optional<std::string> dtype,
         bool trainer_buffers, bool q8_state, std::uint64_t min_8bit_size) {
        ModelPlanRequest r;
        const std::optional<DType> dt =
            dtype ? std::optional<DType>(dtype_named(*dtype, "dtype")) : std::nullopt;
        if (kind == "count") {
          r.model = model_of_count(nb::cast<std::uint64_t>(model), dt.value_or(DType::bf16));
        } else if (kind == "shapes") {
          const Shapes shapes = nb::cast<Shapes>(model);
          for (std::size_t i = 0; i < shapes.size(); ++i) {
            const auto& [name, shape, d] = shapes[i];
            r.model.push_back(
                ModelParam{name, shape, dtype_named(d, "model[" + std::to_string(i) + "].dtype")});
          }
        } else {  // "hf_path", "hf_json"
          const DecoderConfig c = kind == "hf_path"
                                      ? read_decoder_config(nb::cast<std::string>(model))
                                      : parse_decoder_config(nb::cast<std::string>(model), "model");
          r.model = decoder_params(c);
          if (dt)
            for (ModelParam& p : r.model) p.dtype = *dt;
        }
        std::vector<OptimizerField> fields;
        for (const auto& [k, v] : hyper) fields.push_back({k, v});
        ManagerConfig& c = r.manager;
        c.mode = parse_offload_mode(mode);
        c.optimizer = make_optimizer_config(optimizer, fields);
        c.speculation = parse_speculation(speculation);
        c.speculation_bytes = speculation_bytes;
        c.speculation_device_bytes = speculation_device_bytes;
        c.ring_slots = ring_slots;
        c.ring_slot_elements = static_cast<std::size_t>(ring_slot_elements);
        c.chunk_elements = static_cast<std::size_t>(chunk_elements);
        c.q8_state = q8_state;
        c.min_8bit_size = static_cast<std::size_t>(min_8bit_size);
        r.trainer_buffers = trainer_buffers;
        r.ranks = ranks;
        r.ranks_per_node = ranks_per_node;
        r.options.micro_batches = static_cast<std::size_t>(micro_batches);
        r.options.overlap = overlap;
        r.options.checkpoint = parse_checkpoint_phase(checkpoint);
        r.host_memory = host_memory;
        r.gpu_memory = gpu_memory;
        const ModelPlan p = plan_model(r);
        nb::dict d = memory_dict(p.rank);
        d["model_params"] = p.model_params;
        d["params_per_rank"] = p.params_per_rank;
        d["tensors"] = p.tensors;
        d["node_host_peak"] = p.node_host_peak;
        d["fits_host"] = p.fits_host ? nb::cast(*p.fits_host) : nb::none();
        d["fits_gpu"] = p.fits_gpu ? nb::cast(*p.fits_gpu) : nb::none();
        return d;
      },
      nb::arg("kind"), nb::arg("model"), nb::arg("mode"), nb::arg("optimizer"), nb::arg("hyper"),
      nb::arg("ranks"), nb::arg("ranks_per_node"), nb::arg("micro_batches"), nb::arg("overlap"),
      nb::arg("speculation"), nb::arg("speculation_bytes"), nb::arg("speculation_device_bytes"),
      nb::arg("ring_slots"), nb::arg("ring_slot_elements"), nb::arg("chunk_elements"),
      nb::arg("checkpoint"), nb::arg("host_memory").none(), nb::arg("gpu_memory").none(),
      nb::arg("dtype").none(), nb::arg("trainer_buffers"), nb::arg("q8_state") = false,
      nb::arg("min_8bit_size") = ManagerConfig{}.min_8bit_size,
      "plan_model (stepcore/plan.hpp) of a model given as kind 'count' (an int), 'shapes' "
      "([(name, shape, dtype)]), 'hf_path' or 'hf_json' (a config.json's path or text): rank "
      "0's bytes by kind ('<kind>' host, '<kind>@device'; bytes and peak), the totals, the "
      "model's and rank's parameters, the node's host peak and whether it fits.");
}
