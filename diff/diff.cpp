// diff_inputs: pairing by key, statuses, one compare_arrays call for every comparable
// pair, and the first divergence.
#include "diff/diff.hpp"

#include <sched.h>

#include <cstring>
#include <map>
#include <tuple>

namespace stepcore::diff {

namespace {

using PairKey = std::tuple<std::int64_t, std::int64_t, std::string, std::string>;

PairKey key_of(const Item& item) {
  return {item.step.value_or(0), item.rank.value_or(0), item.point.value_or(""), item.name};
}

TensorResult result_of(const Item& item) {
  TensorResult r;
  r.step = item.step;
  r.rank = item.rank;
  r.point = item.point;
  r.name = item.name;
  r.key = item.key;
  r.shards = item.shards;
  return r;
}

std::uint64_t element_bits(const Item& item, std::uint64_t index) {
  const std::size_t size = dtype_size(item.tensor->dtype);
  std::uint64_t bits = 0;  // little-endian storage, little-endian host
  std::memcpy(&bits, item.data + index * size, size);
  return bits;
}

}  // namespace

std::string_view status_name(Status s) {
  static constexpr std::array<std::string_view, kStatusCount> names{
      "identical",    "within_tolerance", "different",     "missing_in_a",
      "missing_in_b", "shape_mismatch",   "dtype_mismatch"};
  return names[static_cast<std::size_t>(s)];
}

int default_threads() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return 1;
}

DiffResult diff_inputs(const Input& a, const Input& b, const DiffOptions& options) {
  DiffResult out;
  out.kind = a.kind;
  std::map<PairKey, std::size_t> in_b;
  for (std::size_t j = 0; j < b.items.size(); ++j) in_b.emplace(key_of(b.items[j]), j);
  std::vector<bool> matched(b.items.size(), false);

  struct Compared {
    std::size_t result;
    const Item* a;
    const Item* b;
  };
  std::vector<Compared> compared;
  std::vector<ArrayPair> arrays;
  for (const Item& ia : a.items) {
    TensorResult r = result_of(ia);
    r.a = *ia.tensor;
    const auto it = in_b.find(key_of(ia));
    if (it == in_b.end()) {
      r.status = Status::missing_in_b;
    } else {
      const Item& ib = b.items[it->second];
      matched[it->second] = true;
      r.b = *ib.tensor;
      if (ia.tensor->dtype != ib.tensor->dtype) {
        r.status = Status::dtype_mismatch;
      } else if (ia.tensor->shape != ib.tensor->shape) {
        r.status = Status::shape_mismatch;
      } else {
        compared.push_back({out.tensors.size(), &ia, &ib});
        arrays.push_back({ia.tensor->dtype, ia.data, ib.data, ia.tensor->elements});
      }
    }
    out.tensors.push_back(std::move(r));
  }
  for (std::size_t j = 0; j < b.items.size(); ++j) {
    if (matched[j]) continue;
    TensorResult r = result_of(b.items[j]);
    r.b = *b.items[j].tensor;
    r.status = Status::missing_in_a;
    out.tensors.push_back(std::move(r));
  }

  const std::vector<ElementStats> stats = compare_arrays(arrays, options.threads);
  for (std::size_t k = 0; k < compared.size(); ++k) {
    TensorResult& r = out.tensors[compared[k].result];
    const ElementStats& s = stats[k];
    r.stats = s;
    if (s.differing == 0) {
      r.status = Status::identical;
    } else if (options.max_ulps && dtype_has_ulps(r.a->dtype) && s.class_differences() == 0 &&
               s.max_ulps <= *options.max_ulps) {
      r.status = Status::within_tolerance;
    } else {
      r.status = Status::different;
    }
    if (s.first_index) {
      r.a_bits = element_bits(*compared[k].a, *s.first_index);
      r.b_bits = element_bits(*compared[k].b, *s.first_index);
    }
  }
  for (std::size_t i = 0; i < out.tensors.size(); ++i) {
    const Status st = out.tensors[i].status;
    ++out.counts[static_cast<std::size_t>(st)];
    if (!out.first_divergence && st != Status::identical && st != Status::within_tolerance)
      out.first_divergence = i;
  }
  return out;
}

}  // namespace stepcore::diff
