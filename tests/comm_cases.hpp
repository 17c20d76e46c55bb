// The global-norm test cases shared by the in-process (test_comm.cpp) and MPI
// (test_comm_mpi.cpp) suites: one logical set of gradient tensors, generated the same
// way in every process, laid out over P ranks in many ways (FSDP even, uneven, flat,
// an empty rank, per-parameter, HSDP, tensor-parallel replication, expert and pipeline
// parallelism); each layout must give the single-process reference's bits on every rank.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "stepcore/comm.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/reference.hpp"

namespace comm_cases {

using namespace stepcore;
using comm::Communicator;
using comm::GroupLayout;
using comm::GroupPlacement;
using comm::NormLayout;

/// One logical (unsharded) gradient tensor.
struct Tensor {
  DType dtype = DType::f32;
  std::size_t numel = 0;
  std::vector<unsigned char> bytes;

  const void* at(std::size_t i) const { return bytes.data() + i * dtype_size(dtype); }
  ConstTensorView slice(std::size_t begin, std::size_t end) const {
    return {end > begin ? at(begin) : nullptr, end - begin, dtype};
  }
};

/// The logical gradient set and its single-process reference norm.
struct Logical {
  std::vector<Tensor> tensors;
  NormResult expected;
};

/// Returns the sizes the issue asks for (0, 1, 31-33, 127-129, 1023-1025,
/// 65535-65537) and a few seeded random ones.
inline std::vector<std::size_t> sharding_sizes(std::uint64_t seed = 6) {
  std::vector<std::size_t> sizes = {0,   1,    31,   32,   33,    127,   128,
                                    129, 1023, 1024, 1025, 65535, 65536, 65537};
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 4; ++i) sizes.push_back(rng() % 100000);
  return sizes;
}

/// Returns tensors of `dtype` with values over many binades (the same bits in every
/// process for the same seed) and their reference norm.
inline Logical make_logical(DType dtype, std::uint64_t seed,
                            const std::vector<std::size_t>& sizes) {
  Logical l;
  std::mt19937_64 rng(seed);
  for (std::size_t n : sizes) {
    Tensor t{dtype, n, std::vector<unsigned char>(n * dtype_size(dtype))};
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t u = rng();
      const double mantissa = 1.0 + static_cast<double>(u >> 40) / 16777216.0;  // [1, 2)
      const int exponent = static_cast<int>((u >> 8) % 33) - 20;                // 2^-20 .. 2^12
      float x = static_cast<float>(std::ldexp(mantissa, exponent));
      if (u & 1) x = -x;
      if (dtype == DType::bf16) {
        const std::uint16_t b = f32_to_bf16_bits(x);
        std::memcpy(&t.bytes[2 * i], &b, 2);
      } else {
        std::memcpy(&t.bytes[4 * i], &x, 4);
      }
    }
    l.tensors.push_back(std::move(t));
  }
  std::vector<ConstTensorView> all;
  for (const auto& t : l.tensors) all.push_back(t.slice(0, t.numel));
  l.expected = finalize(reference::norm_partial(all));
  return l;
}

/// A rank's layout and the storage its views point into (replica copies).
struct RankView {
  NormLayout layout;
  std::vector<std::vector<unsigned char>> owned;
};

/// Returns a copy of `view` in storage owned by `rv`; with `poison` the copy holds
/// NaNs instead (a replica that must not count).
inline ConstTensorView copy_of(RankView& rv, const ConstTensorView& view, bool poison) {
  if (view.numel == 0) return view;
  auto& buf = rv.owned.emplace_back(view.bytes());
  if (poison) {
    for (std::size_t i = 0; i < view.numel; ++i) {
      if (view.dtype == DType::bf16) {
        const std::uint16_t nan = 0x7FC0;
        std::memcpy(&buf[2 * i], &nan, 2);
      } else {
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::memcpy(&buf[4 * i], &nan, 4);
      }
    }
  } else {
    std::memcpy(buf.data(), view.data, view.bytes());
  }
  return {buf.data(), view.numel, view.dtype};
}

/// Returns the [begin, end) of shard `s` of `n` elements over `k` even shards.
inline std::pair<std::size_t, std::size_t> even_shard(std::size_t n, int k, int s) {
  const std::size_t per = (n + k - 1) / k;
  const std::size_t b = std::min(n, per * s);
  return {b, std::min(n, b + per)};
}

/// Returns k + 1 sorted cut points of [0, n] chosen by `seed` (empty shards allowed).
inline std::vector<std::size_t> random_cuts(std::size_t n, int k, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::size_t> cuts = {0, n};
  for (int i = 1; i < k; ++i) cuts.push_back(n == 0 ? 0 : rng() % (n + 1));
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

inline GroupLayout group(std::string name, std::uint64_t numel, int shards, int replicas = 1) {
  return {std::move(name), numel, shards, replicas};
}

using Scenario = std::function<RankView(const Logical&, int P, int r)>;

/// Returns every layout scenario, by name.
inline std::vector<std::pair<std::string, Scenario>> scenarios() {
  std::vector<std::pair<std::string, Scenario>> s;
  // FSDP, each tensor sharded evenly over all ranks.
  s.emplace_back("fsdp_even", [](const Logical& l, int P, int r) {
    RankView rv;
    for (std::size_t t = 0; t < l.tensors.size(); ++t) {
      const auto& x = l.tensors[t];
      const auto [b, e] = even_shard(x.numel, P, r);
      const ConstTensorView v = x.slice(b, e);
      rv.layout.add(group("t" + std::to_string(t), x.numel, P), {r, 0}, {&v, 1});
    }
    return rv;
  });
  // FSDP with seeded random cut points per tensor (many empty and tiny shards).
  s.emplace_back("fsdp_uneven", [](const Logical& l, int P, int r) {
    RankView rv;
    for (std::size_t t = 0; t < l.tensors.size(); ++t) {
      const auto& x = l.tensors[t];
      const auto cuts = random_cuts(x.numel, P, 1000 * t + P);
      const ConstTensorView v = x.slice(cuts[r], cuts[r + 1]);
      rv.layout.add(group("t" + std::to_string(t), x.numel, P), {r, 0}, {&v, 1});
    }
    return rv;
  });
  // FSDP flat parameter: one group over the concatenation, cut unevenly.
  s.emplace_back("fsdp_flat", [](const Logical& l, int P, int r) {
    RankView rv;
    std::size_t total = 0;
    for (const auto& x : l.tensors) total += x.numel;
    const auto cuts = random_cuts(total, P, 77 + P);
    std::vector<ConstTensorView> local;
    std::size_t offset = 0;
    for (const auto& x : l.tensors) {
      const std::size_t b = std::clamp(cuts[r], offset, offset + x.numel);
      const std::size_t e = std::clamp(cuts[r + 1], offset, offset + x.numel);
      if (e > b) local.push_back(x.slice(b - offset, e - offset));
      offset += x.numel;
    }
    rv.layout.add(group("flat", total, P), {r, 0}, local);
    return rv;
  });
  // The last rank holds an empty shard of every tensor.
  s.emplace_back("fsdp_empty_rank", [](const Logical& l, int P, int r) {
    RankView rv;
    const int holders = P > 1 ? P - 1 : 1;
    for (std::size_t t = 0; t < l.tensors.size(); ++t) {
      const auto& x = l.tensors[t];
      ConstTensorView v{nullptr, 0, x.dtype};
      if (r < holders) {
        const auto [b, e] = even_shard(x.numel, holders, r);
        v = x.slice(b, e);
      }
      rv.layout.add(group("t" + std::to_string(t), x.numel, P), {r, 0}, {&v, 1});
    }
    return rv;
  });
  // Per-parameter placement: tensor t lives whole on rank t % P.
  s.emplace_back("per_parameter", [](const Logical& l, int P, int r) {
    RankView rv;
    for (std::size_t t = 0; t < l.tensors.size(); ++t) {
      const auto& x = l.tensors[t];
      const bool mine = static_cast<int>(t % P) == r;
      const ConstTensorView v = mine ? x.slice(0, x.numel) : x.slice(0, 0);
      rv.layout.add(group("t" + std::to_string(t), x.numel, P), {r, 0}, {&v, 1});
    }
    return rv;
  });
  // HSDP: R replicas of an S-way sharding; replicas > 0 hold NaNs that must not count.
  s.emplace_back("hsdp", [](const Logical& l, int P, int r) {
    RankView rv;
    const int R = P == 1 ? 1 : (P % 2 == 0 ? 2 : P);
    const int S = P / R;
    const int replica = r / S, shard = r % S;
    for (std::size_t t = 0; t < l.tensors.size(); ++t) {
      const auto& x = l.tensors[t];
      const auto [b, e] = even_shard(x.numel, S, shard);
      const ConstTensorView v = copy_of(rv, x.slice(b, e), replica > 0);
      rv.layout.add(group("t" + std::to_string(t), x.numel, S, R), {shard, replica}, {&v, 1});
    }
    return rv;
  });
  // Tensor-parallel replicated parameters: every rank holds the whole tensor.
  s.emplace_back("tp_replicated", [](const Logical& l, int P, int r) {
    RankView rv;
    for (std::size_t t = 0; t < l.tensors.size(); ++t) {
      const auto& x = l.tensors[t];
      const ConstTensorView v = copy_of(rv, x.slice(0, x.numel), r > 0);
      rv.layout.add(group("t" + std::to_string(t), x.numel, 1, P), {0, r}, {&v, 1});
    }
    return rv;
  });
  // Expert parallelism: even tensors are dense (sharded over all ranks); odd tensors
  // are experts spread over an EP group and sharded (or replicated) over the DP ranks.
  for (const bool replicated : {false, true}) {
    s.emplace_back(replicated ? "expert_parallel_replicated" : "expert_parallel_sharded",
                   [replicated](const Logical& l, int P, int r) {
                     RankView rv;
                     const int ep = P % 2 == 0 ? 2 : P;
                     const int dp = P / ep;
                     const int ep_rank = r % ep, dp_rank = r / ep;
                     int expert = 0;
                     for (std::size_t t = 0; t < l.tensors.size(); ++t) {
                       const auto& x = l.tensors[t];
                       const std::string name = "t" + std::to_string(t);
                       if (t % 2 == 0) {
                         const auto [b, e] = even_shard(x.numel, P, r);
                         const ConstTensorView v = x.slice(b, e);
                         rv.layout.add(group(name, x.numel, P), {r, 0}, {&v, 1});
                         continue;
                       }
                       const bool held = expert++ % ep == ep_rank;
                       const GroupLayout g =
                           replicated ? group(name, x.numel, 1, dp) : group(name, x.numel, dp, 1);
                       if (!held) {
                         rv.layout.add_absent(g);
                       } else if (replicated) {
                         const ConstTensorView v = copy_of(rv, x.slice(0, x.numel), dp_rank > 0);
                         rv.layout.add(g, {0, dp_rank}, {&v, 1});
                       } else {
                         const auto [b, e] = even_shard(x.numel, dp, dp_rank);
                         const ConstTensorView v = x.slice(b, e);
                         rv.layout.add(g, {dp_rank, 0}, {&v, 1});
                       }
                     }
                     return rv;
                   });
  }
  // Pipeline parallelism: stage s holds tensors t % stages == s, FSDP within a stage.
  s.emplace_back("pipeline", [](const Logical& l, int P, int r) {
    RankView rv;
    const int stages = P % 2 == 0 ? 2 : P;
    const int per_stage = P / stages;
    const int stage = r / per_stage, shard = r % per_stage;
    for (std::size_t t = 0; t < l.tensors.size(); ++t) {
      const auto& x = l.tensors[t];
      const GroupLayout g = group("t" + std::to_string(t), x.numel, per_stage);
      if (static_cast<int>(t % stages) != stage) {
        rv.layout.add_absent(g);
        continue;
      }
      const auto [b, e] = even_shard(x.numel, per_stage, shard);
      const ConstTensorView v = x.slice(b, e);
      rv.layout.add(g, {shard, 0}, {&v, 1});
    }
    return rv;
  });
  return s;
}

/// A parametrised layout test: scenarios()[index] with gradients of `dtype`.
struct ScenarioParam {
  std::size_t index;
  DType dtype;
};

inline void PrintTo(const ScenarioParam& p, std::ostream* os) {
  *os << "scenario " << p.index << ", " << dtype_name(p.dtype);
}

/// Returns every scenario crossed with f32 and bf16.
inline std::vector<ScenarioParam> all_params() {
  std::vector<ScenarioParam> p;
  const std::size_t n = scenarios().size();
  for (std::size_t i = 0; i < n; ++i)
    for (DType d : {DType::f32, DType::bf16}) p.push_back({i, d});
  return p;
}

/// Returns the logical set for a dtype (built once per process).
inline const Logical& logical_for(DType dtype) {
  static const Logical f32 = make_logical(DType::f32, 61, sharding_sizes());
  static const Logical bf16 = make_logical(DType::bf16, 62, sharding_sizes());
  return dtype == DType::bf16 ? bf16 : f32;
}

inline ::testing::AssertionResult same_result(const NormResult& a, const NormResult& b) {
  const auto fa = std::bit_cast<std::uint32_t>(a.norm), fb = std::bit_cast<std::uint32_t>(b.norm);
  const auto ma = std::bit_cast<std::uint32_t>(a.max_abs),
             mb = std::bit_cast<std::uint32_t>(b.max_abs);
  if (fa == fb && ma == mb && a.finite == b.finite && a.nan_count == b.nan_count &&
      a.inf_count == b.inf_count && a.needs_exact == b.needs_exact)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << std::hex << "norm 0x" << fa << " vs 0x" << fb << ", max_abs 0x" << ma << " vs 0x" << mb
         << std::dec << ", finite " << a.finite << " vs " << b.finite << ", nan " << a.nan_count
         << " vs " << b.nan_count << ", inf " << a.inf_count << " vs " << b.inf_count
         << ", needs_exact " << a.needs_exact << " vs " << b.needs_exact;
}

/// Returns true on every rank when every rank holds the same result bits (collective).
inline bool same_on_every_rank(Communicator& c, const NormResult& r) {
  std::uint64_t w[6] = {std::bit_cast<std::uint32_t>(r.norm),
                        std::bit_cast<std::uint32_t>(r.max_abs),
                        r.finite,
                        r.nan_count,
                        r.inf_count,
                        r.needs_exact};
  std::uint64_t hi[6], lo[6];
  for (int i = 0; i < 6; ++i) {
    hi[i] = w[i];
    lo[i] = ~w[i];
  }
  c.all_reduce(hi, 6, comm::Word::u64, comm::Op::max);
  c.all_reduce(lo, 6, comm::Word::u64, comm::Op::max);
  for (int i = 0; i < 6; ++i)
    if (hi[i] != w[i] || lo[i] != ~w[i]) return false;
  return true;
}

/// An engine per calling thread (ranks of the in-process group are threads): one
/// worker each, so that P ranks do not oversubscribe the machine P-fold.
inline const cpu::Engine& engine() {
  thread_local const cpu::Engine e{cpu::EngineConfig{std::nullopt, 1, {}}};
  return e;
}

/// Runs scenario `s` on this rank and checks the result against the reference.
inline void check_scenario(Communicator& c, const Scenario& s, DType dtype) {
  const Logical& l = logical_for(dtype);
  RankView rv = s(l, c.size(), c.rank());
  comm::validate_layout(c, rv.layout);
  const NormResult r = comm::global_norm(c, rv.layout, engine());
  EXPECT_TRUE(same_result(r, l.expected)) << "rank " << c.rank() << " of " << c.size();
  EXPECT_TRUE(same_on_every_rank(c, r)) << "rank " << c.rank();
}

/// The rounding-tie set {2^24, 2^12, 2^12, 1}: S = (2^24 + 1)^2, so the exact norm
/// 2^24 + 1 is halfway between two floats and rounds (half to even) to 2^24. An
/// approximate partial can never certify it: global_norm must take the exact pass.
/// Returns the norm on this rank and how many exact partials this rank computed.
inline std::pair<NormResult, int> tie_norm(Communicator& c) {
  static const float values[4] = {16777216.0f, 4096.0f, 4096.0f, 1.0f};
  const auto [b, e] = even_shard(4, c.size(), c.rank());
  const ConstTensorView v{e > b ? values + b : nullptr, e - b, DType::f32};
  NormLayout layout;
  layout.add(group("tie", 4, c.size()), {c.rank(), 0}, {&v, 1});
  int exact_calls = 0;
  const NormResult r =
      comm::global_norm(c, layout, [&](std::span<const ConstTensorView> t, cpu::NormMode mode) {
        NormPartial p = reference::norm_partial(t);
        if (mode == cpu::NormMode::exact)
          ++exact_calls;
        else
          p.approximate = 1;  // as a fast path's partial: S within 2^-40 (here exact)
        return p;
      });
  return {r, exact_calls};
}

}  // namespace comm_cases
