// Layouts of gradient groups over ranks, their collective validation, and the global
// norm: local exact-or-certified partials reduced exactly, the same result everywhere.
#include "comm/global_norm.hpp"

#include <exception>
#include <string>
#include <vector>

#include "comm/comm_internal.hpp"
#include "core/superaccumulator.hpp"
#include "core/validate.hpp"
#include "stepcore/cpu.hpp"

namespace stepcore::comm {
namespace {

// FNV-1a over the canonical encoding, then a full-avalanche finish (splitmix64's).
constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ull;
constexpr std::uint64_t kFnvPrime = 0x100000001b3ull;

std::uint64_t hash_bytes(std::uint64_t h, const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnvPrime;
  return h;
}

std::uint64_t hash_u64(std::uint64_t h, std::uint64_t v) {
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
  return hash_bytes(h, b, 8);
}

std::uint64_t finish(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::string group_arg(const std::string& name, const char* field) {
  return "group '" + name + "'." + field;
}

// Returns (rank + 1) << 8 | code: the LayoutCheck failure word of a local error.
std::uint64_t failure_word(int rank, Errc code) {
  return (static_cast<std::uint64_t>(rank) + 1) << 8 | static_cast<std::uint64_t>(code);
}

// One reduction of this rank's partial (computed by `compute`) with the layout check.
// A local failure is reported to every rank through the check before it is rethrown.
template <class Compute>
NormPartial reduce_local(Communicator& comm, std::uint64_t fingerprint, Compute&& compute) {
  NormPartial partial;
  LayoutCheck check = make_layout_check(fingerprint);
  std::exception_ptr local_error;
  try {
    partial = compute();
    if (!::stepcore::detail::normalize_digits(partial.digits))
      throw Error(Errc::internal, "partial", "the local partial overflows its digits");
  } catch (const Error& e) {
    local_error = std::current_exception();
    check.failure = failure_word(comm.rank(), e.code());
  } catch (...) {
    local_error = std::current_exception();
    check.failure = failure_word(comm.rank(), Errc::internal);
  }
  if (local_error) partial = NormPartial{};
  comm.all_reduce_partial(&partial, &check);
  if (local_error) std::rethrow_exception(local_error);
  check_reduced(check, fingerprint);
  return partial;
}

}  // namespace

void NormLayout::add(const GroupLayout& group, GroupPlacement placement,
                     std::span<const ConstTensorView> local) {
  add_group(group, true, placement, local);
}

void NormLayout::add_absent(const GroupLayout& group) { add_group(group, false, {}, {}); }

void NormLayout::add_group(const GroupLayout& group, bool present, GroupPlacement placement,
                           std::span<const ConstTensorView> local) {
  // Validate everything first: nothing is added on bad input.
  if (group.name.empty())
    throw Error(Errc::invalid_argument, "group.name", "a group needs a non-empty name");
  for (const auto& g : groups_)
    if (g.layout.name == group.name)
      throw Error(Errc::invalid_argument, "group.name",
                  "the layout already has a group named '" + group.name + "'");
  if (group.num_shards < 1)
    throw Error(Errc::out_of_range, group_arg(group.name, "num_shards"), "must be >= 1");
  if (group.num_replicas < 1)
    throw Error(Errc::out_of_range, group_arg(group.name, "num_replicas"), "must be >= 1");
  std::uint64_t local_numel = 0;
  if (present) {
    if (placement.shard_index < 0 || placement.shard_index >= group.num_shards)
      throw Error(Errc::out_of_range, group_arg(group.name, "shard_index"),
                  "must be in [0, num_shards)");
    if (placement.replica_index < 0 || placement.replica_index >= group.num_replicas)
      throw Error(Errc::out_of_range, group_arg(group.name, "replica_index"),
                  "must be in [0, num_replicas)");
    ::stepcore::detail::validate_norm(local, GradientRead{});
    for (const auto& t : local) local_numel += t.numel;
    if (local_numel > group.logical_numel)
      throw Error(Errc::size_mismatch, group_arg(group.name, "local"),
                  "the shard holds " + std::to_string(local_numel) + " elements, the group " +
                      std::to_string(group.logical_numel));
  }

  groups_.push_back({group, present, placement, local_numel});
  if (present && placement.replica_index == 0)
    counted_.insert(counted_.end(), local.begin(), local.end());
  std::uint64_t h = groups_.size() == 1 ? kFnvOffset : state_;
  h = hash_u64(h, group.name.size());
  h = hash_bytes(h, group.name.data(), group.name.size());
  h = hash_u64(h, group.logical_numel);
  h = hash_u64(h, static_cast<std::uint64_t>(group.num_shards));
  h = hash_u64(h, static_cast<std::uint64_t>(group.num_replicas));
  state_ = h;
  fingerprint_ = finish(h ^ groups_.size());
}

void validate_layout(Communicator& comm, const NormLayout& layout) {
  const std::uint64_t fp = layout.fingerprint();
  // 1. The same global description everywhere (a fixed-size collective, so a rank with
  //    another group count cannot desynchronise the next one).
  reduce_local(comm, fp, [] { return NormPartial{}; });
  // 2. The shards add up, group by group. The place k = replica * num_shards + shard of
  //    each holder must be 0 .. N-1 once each (N = num_shards * num_replicas): checked
  //    through the count, sum and sum of squares of k (catches any repeated place but
  //    contrived permutations).
  constexpr std::size_t kWords = 6;
  const auto& groups = layout.groups_;
  if (groups.empty()) return;
  std::vector<std::uint64_t> sums(kWords * groups.size(), 0);
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const auto& g = groups[i];
    if (!g.present) continue;
    const bool first_replica = g.placement.replica_index == 0;
    const auto k = static_cast<std::uint64_t>(g.placement.replica_index) *
                       static_cast<std::uint64_t>(g.layout.num_shards) +
                   static_cast<std::uint64_t>(g.placement.shard_index);
    std::uint64_t* s = &sums[kWords * i];
    s[0] = first_replica ? g.local_numel : 0;
    s[1] = g.local_numel;
    s[2] = 1;
    s[3] = first_replica ? 1 : 0;
    s[4] = k;
    s[5] = k * k;
  }
  comm.all_reduce(sums.data(), sums.size(), Word::u64, Op::sum);
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const auto& l = groups[i].layout;
    const std::uint64_t* s = &sums[kWords * i];
    const auto shards = static_cast<std::uint64_t>(l.num_shards);
    const auto replicas = static_cast<std::uint64_t>(l.num_replicas);
    const unsigned __int128 n = static_cast<unsigned __int128>(shards) * replicas;
    const auto sum_k = static_cast<std::uint64_t>(n * (n - 1) / 2);
    const auto sum_k2 = static_cast<std::uint64_t>((n - 1) * n * (2 * n - 1) / 6);
    std::string problem;
    if (s[2] != static_cast<std::uint64_t>(n) || s[3] != shards)
      problem = std::to_string(s[2]) + " ranks hold a part (" + std::to_string(s[3]) +
                " of replica 0), expected num_shards * num_replicas = " +
                std::to_string(shards * replicas) + " (" + std::to_string(shards) + ")";
    else if (s[4] != sum_k || s[5] != sum_k2)
      problem = "two ranks claim the same (shard_index, replica_index)";
    else if (s[0] != l.logical_numel)
      problem = "the shards of replica 0 hold " + std::to_string(s[0]) + " elements, not " +
                std::to_string(l.logical_numel);
    else if (s[1] != l.logical_numel * replicas)
      problem = "all replicas hold " + std::to_string(s[1]) + " elements, not num_replicas * " +
                std::to_string(l.logical_numel);
    if (!problem.empty())
      throw Error(Errc::invalid_argument, "layout", "group '" + l.name + "': " + problem);
  }
}

NormResult detail::global_norm(Communicator& comm, std::uint64_t fingerprint,
                               std::span<const ConstTensorView> tensors,
                               const LocalPartialFn& local) {
  if (!local) throw Error(Errc::null_pointer, "local", "an empty partial function");
  NormPartial reduced =
      reduce_local(comm, fingerprint, [&] { return local(tensors, NormMode::fast); });
  NormResult result = finalize(reduced);
  if (!result.needs_exact) return result;
  // Every rank sees the same reduced partial, so every rank takes this branch.
  reduced = reduce_local(comm, fingerprint, [&] {
    NormPartial p = local(tensors, NormMode::exact);
    if (p.approximate != 0)
      throw Error(Errc::internal, "local", "NormMode::exact returned an approximate partial");
    return p;
  });
  result = finalize(reduced);
  if (result.needs_exact)
    throw Error(Errc::internal, "", "an exact reduced partial could not be finalised");
  return result;
}

NormResult global_norm(Communicator& comm, const NormLayout& layout, const LocalPartialFn& local) {
  return detail::global_norm(comm, layout.fingerprint(), layout.counted_tensors(), local);
}

NormResult global_norm(Communicator& comm, const NormLayout& layout, const cpu::Engine& engine,
                       GradientRead read) {
  return global_norm(comm, layout, [&](std::span<const ConstTensorView> tensors, NormMode mode) {
    return engine.norm_partial(tensors, read, mode);
  });
}

}  // namespace stepcore::comm
