// stepcore-demo's bitwise cross-check: copying the state for the reference, finding
// the first differing element of a buffer, and the "bitwise:" line of a checked step.
#include "cross_check.hpp"

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace stepcore_demo {

namespace {

/// Returns "" when tensor slices of `a` and `b` (padding included) hold the same
/// bytes, else the first difference: "<what> <tensor>[<i>]: engine 0x.. reference 0x..".
template <class T>
std::string first_difference(const Model& m, const char* what, const T* a, const T* b) {
  for (std::size_t t = 0; t < m.layout.size(); ++t) {
    const std::size_t begin = m.offset[t];
    const std::size_t end = t + 1 < m.layout.size() ? m.offset[t + 1] : m.padded;
    if (std::memcmp(a + begin, b + begin, (end - begin) * sizeof(T)) == 0) continue;
    std::size_t i = begin;
    while (std::memcmp(a + i, b + i, sizeof(T)) == 0) ++i;
    std::uint32_t x = 0, y = 0;
    std::memcpy(&x, a + i, sizeof(T));
    std::memcpy(&y, b + i, sizeof(T));
    char buf[96];
    std::snprintf(buf, sizeof buf, "]%s: engine 0x%0*" PRIx32 " reference 0x%0*" PRIx32,
                  i - begin >= m.layout[t].numel() ? " (padding)" : "",
                  static_cast<int>(2 * sizeof(T)), x, static_cast<int>(2 * sizeof(T)), y);
    return std::string(what) + " " + m.layout[t].name + "[" + std::to_string(i - begin) + buf;
  }
  return "";
}

}  // namespace

std::unique_ptr<Shadow> make_shadow(const Model& m, const State& s, const Options& o) {
  auto sh = std::make_unique<Shadow>();
  sh->state.param = clone(s.param);
  sh->state.exp_avg = clone(s.exp_avg);
  sh->state.exp_avg_sq = clone(s.exp_avg_sq);
  sh->state.acc = clone(s.acc);
  sh->state.compute = clone(s.compute);
  sh->state.step = s.step;
  if (o.q8) {
    sh->state.exp_avg_codes = clone(s.exp_avg_codes);
    sh->state.exp_avg_sq_codes = clone(s.exp_avg_sq_codes);
    sh->state.exp_avg_max = s.exp_avg_max;
    sh->state.exp_avg_sq_max = s.exp_avg_sq_max;
    sh->state.block_offset = s.block_offset;
  }
  sh->calls = make_calls(m, sh->state, s, o);
  return sh;
}

bool compare_with_reference(const Model& m, const State& s, const StepOutcome& e, const Shadow& sh,
                            const Options& o, const Backend& b, std::int64_t step) {
  std::vector<std::string> diffs;  // in the order the step computes them
  std::string matched;             // what was compared and equal
  const auto check = [&](const char* name, std::string diff) {
    if (!diff.empty())
      diffs.push_back(std::move(diff));
    else
      matched += (matched.empty() ? "" : ", ") + std::string(name);
  };
  const auto scalar = [&](const char* name, std::uint64_t x, std::uint64_t y, bool hex) {
    if (x == y) return;
    char buf[96];
    std::snprintf(buf, sizeof buf,
                  hex ? "%s: engine 0x%08" PRIx64 " reference 0x%08" PRIx64
                      : "%s: engine %" PRIu64 " reference %" PRIu64,
                  name, x, y);
    diffs.emplace_back(buf);
  };
  const bool adamw = o.optimizer == Optimizer::adamw;
  check("accumulators", first_difference(m, "accumulators", s.acc.data(), sh.state.acc.data()));
  scalar("norm", sc::f32_bits(e.norm.norm), sc::f32_bits(sh.norm.norm), true);
  scalar("max|g|", sc::f32_bits(e.norm.max_abs), sc::f32_bits(sh.norm.max_abs), true);
  scalar("finite", e.norm.finite, sh.norm.finite, false);
  scalar("NaN count", e.norm.nan_count, sh.norm.nan_count, false);
  scalar("Inf count", e.norm.inf_count, sh.norm.inf_count, false);
  scalar("optimizer applied", e.applied, sh.applied, false);
  if (e.applied && sh.applied) scalar("clip", sc::f32_bits(e.clip), sc::f32_bits(sh.clip), true);
  check("params", first_difference(m, "params", s.param.data(), sh.state.param.data()));
  if (adamw) {
    check("exp_avg", first_difference(m, "exp_avg", s.exp_avg.data(), sh.state.exp_avg.data()));
    check("exp_avg_sq",
          first_difference(m, "exp_avg_sq", s.exp_avg_sq.data(), sh.state.exp_avg_sq.data()));
  }
  if (o.q8) {  // the 8-bit moments: codes and block maxima, byte for byte
    const auto same = [](const void* a, const void* b, std::size_t n) {
      return n == 0 || std::memcmp(a, b, n) == 0;
    };
    check("8-bit exp_avg",
          same(s.exp_avg_codes.data(), sh.state.exp_avg_codes.data(), m.padded) &&
                  same(s.exp_avg_max.data(), sh.state.exp_avg_max.data(), 4 * s.exp_avg_max.size())
              ? ""
              : "8-bit exp_avg: codes or block maxima differ");
    check("8-bit exp_avg_sq",
          same(s.exp_avg_sq_codes.data(), sh.state.exp_avg_sq_codes.data(), m.padded) &&
                  same(s.exp_avg_sq_max.data(), sh.state.exp_avg_sq_max.data(),
                       4 * s.exp_avg_sq_max.size())
              ? ""
              : "8-bit exp_avg_sq: codes or block maxima differ");
  }
  check("compute weights",
        first_difference(m, "compute weights", s.compute.data(), sh.state.compute.data()));
  if (adamw) {
    std::string diff;
    for (std::size_t t = 0; t < s.step.size() && diff.empty(); ++t)
      if (sc::f32_bits(s.step[t]) != sc::f32_bits(sh.state.step[t])) {
        char buf[64];
        std::snprintf(buf, sizeof buf, ": engine %g reference %g", static_cast<double>(s.step[t]),
                      static_cast<double>(sh.state.step[t]));
        diff = "steps " + m.layout[t].name + buf;
      }
    check("steps", diff);
  }

  char who[96];
  std::snprintf(who, sizeof who, "cpu engine (%.*s, %d thread%s)",
                static_cast<int>(b.engine->isa_name().size()), b.engine->isa_name().data(),
                b.engine->threads(), b.engine->threads() == 1 ? "" : "s");
  if (diffs.empty()) {
    std::printf("bitwise: %s == reference on step %" PRId64 ": %s, norm 0x%08" PRIx32
                ", max|g| 0x%08" PRIx32,
                who, step + 1, matched.c_str(), sc::f32_bits(e.norm.norm),
                sc::f32_bits(e.norm.max_abs));
    if (e.applied)
      std::printf(", clip 0x%08" PRIx32, sc::f32_bits(e.clip));
    else
      std::printf(", found-inf (both skipped the optimizer)");
    std::printf(" (check %.2f s)\n", sh.seconds);
    return true;
  }
  std::printf("bitwise: MISMATCH %s != reference on step %" PRId64 ": %s", who, step + 1,
              diffs.front().c_str());
  if (diffs.size() > 1)
    std::printf(" (and %zu more difference%s)", diffs.size() - 1, diffs.size() == 2 ? "" : "s");
  std::printf("\n");
  return false;
}

}  // namespace stepcore_demo
