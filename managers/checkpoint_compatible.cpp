// checkpoint::check_compatible (managers/checkpoint_file.hpp): whether a file's header can
// be loaded by a manager, field by field, the first difference named.
#include <bit>
#include <cinttypes>
#include <cstdio>
#include <string>

#include "managers/checkpoint_file.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail::checkpoint {

namespace {

std::string number(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

[[noreturn]] void differs(Errc code, const std::string& field, const std::string& in_file,
                          const std::string& mine, const std::string& path) {
  throw Error(
      code, "checkpoint." + field,
      "checkpoint." + field + ": " + in_file + " in " + path + ", " + mine + " in this manager");
}

bool same_bits(double x, double y) {
  return std::bit_cast<std::uint64_t>(x) == std::bit_cast<std::uint64_t>(y);
}

}  // namespace

void check_compatible(const Header& file, const Header& mine, const std::string& path) {
  using std::to_string;
  const Errc bad = Errc::invalid_argument;
  if (file.optimizer != mine.optimizer)
    differs(bad, "optimizer", quoted(file.optimizer), quoted(mine.optimizer), path);
  if (file.slots != mine.slots) {
    auto list = [](const std::vector<std::string>& names) {
      std::string out;
      for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
      return "state slots [" + out + "]";
    };
    differs(bad, "slots", list(file.slots), list(mine.slots), path);
  }
  // Every hyper-parameter either records must be in the other, with the same bits.
  auto find = [](const Header& h, const std::string& name) -> const HyperRecord* {
    for (const HyperRecord& r : h.hyper)
      if (r.name == name) return &r;
    return nullptr;
  };
  for (const HyperRecord& m : mine.hyper) {
    const HyperRecord* f = find(file, m.name);
    if (f == nullptr) differs(bad, "hyper." + m.name, "not recorded", number(m.value), path);
    if (!same_bits(f->value, m.value))
      differs(bad, "hyper." + m.name, number(f->value), number(m.value), path);
  }
  for (const HyperRecord& f : file.hyper)
    if (find(mine, f.name) == nullptr)
      differs(bad, "hyper." + f.name, number(f.value),
              "no such hyper-parameter of " + mine.optimizer, path);
  if (file.groups.size() != mine.groups.size())
    differs(Errc::size_mismatch, "groups", to_string(file.groups.size()) + " groups",
            to_string(mine.groups.size()), path);
  for (std::size_t g = 0; g < file.groups.size(); ++g) {
    const GroupRecord& f = file.groups[g];
    const GroupRecord& m = mine.groups[g];
    if (f.name != m.name)
      differs(bad, indexed("groups", g, "name"), quoted(f.name), quoted(m.name), path);
    if (!same_bits(f.beta1, m.beta1))
      differs(bad, indexed("groups", g, "beta1"), number(f.beta1), number(m.beta1), path);
    if (!same_bits(f.beta2, m.beta2))
      differs(bad, indexed("groups", g, "beta2"), number(f.beta2), number(m.beta2), path);
    if (!same_bits(f.eps, m.eps))
      differs(bad, indexed("groups", g, "eps"), number(f.eps), number(m.eps), path);
  }
  if (file.rank != mine.rank)
    differs(bad, "rank", to_string(file.rank), to_string(mine.rank), path);
  if (file.world_size != mine.world_size)
    differs(bad, "world_size", to_string(file.world_size), to_string(mine.world_size), path);
  if (file.layout_fingerprint != mine.layout_fingerprint)
    differs(bad, "layout_fingerprint", to_string(file.layout_fingerprint),
            to_string(mine.layout_fingerprint), path);
  if (file.params.size() != mine.params.size())
    differs(Errc::size_mismatch, "params", to_string(file.params.size()) + " parameters",
            to_string(mine.params.size()), path);
  for (std::size_t i = 0; i < file.params.size(); ++i) {
    const ParamRecord& f = file.params[i];
    const ParamRecord& m = mine.params[i];
    if (f.name != m.name)
      differs(bad, indexed("params", i, "name"), quoted(f.name), quoted(m.name), path);
    if (f.numel != m.numel)
      differs(Errc::size_mismatch, indexed("params", i, "numel"), to_string(f.numel),
              to_string(m.numel), path);
    if (f.group != m.group)
      differs(bad, indexed("params", i, "group"), to_string(f.group), to_string(m.group), path);
    if (f.q8 != m.q8)  // a state's storage is kept as saved: never requantized or widened
      differs(bad, indexed("params", i, "state"), f.q8 ? "8-bit slots" : "f32 slots",
              m.q8 ? "8-bit slots (q8_state)" : "f32 slots", path);
  }
}

}  // namespace stepcore::detail::checkpoint
