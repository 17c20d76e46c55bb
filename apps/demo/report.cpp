// stepcore-demo's report: the formatting helpers, the checksums, and every printed
// line of the main phase (the numa line samples where the placed state's pages are).
#include "report.hpp"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#if defined(__linux__)
#include <unistd.h>
#endif

#include "stepcore/config.hpp"
#include "stepcore/numa.hpp"

namespace stepcore_demo {

namespace {

/// FNV-1a (64-bit) over a sequence of words (32-bit f32 or 16-bit bf16 patterns).
struct Fnv64 {
  std::uint64_t h = 0xCBF29CE484222325ull;
  /// Mixes one word into the hash.
  void add(std::uint64_t word) { h = (h ^ word) * 0x100000001B3ull; }
};

/// Returns the FNV-1a hash of the f32 bit patterns of every tensor slice of `buf`.
std::uint64_t hash_f32(const Model& m, const float* buf) {
  Fnv64 f;
  for (std::size_t t = 0; t < m.layout.size(); ++t)
    for (std::size_t i = 0; i < m.layout[t].numel(); ++i) f.add(sc::f32_bits(buf[m.offset[t] + i]));
  return f.h;
}

/// Returns the FNV-1a hash of the bf16 bit patterns of every tensor slice of `buf`.
std::uint64_t hash_bf16(const Model& m, const sc::bfloat16_t* buf) {
  Fnv64 f;
  for (std::size_t t = 0; t < m.layout.size(); ++t)
    for (std::size_t i = 0; i < m.layout[t].numel(); ++i) f.add(buf[m.offset[t] + i].bits);
  return f.h;
}

/// Returns the FNV-1a hash of the 8-bit codes of every tensor slice of `a` and then of `b`.
std::uint64_t hash_codes(const Model& m, const std::uint8_t* a, const std::uint8_t* b) {
  Fnv64 f;
  for (const std::uint8_t* buf : {a, b})
    for (std::size_t t = 0; t < m.layout.size(); ++t)
      for (std::size_t i = 0; i < m.layout[t].numel(); ++i) f.add(buf[m.offset[t] + i]);
  return f.h;
}

/// Returns the FNV-1a hash of the f32 bit patterns of `a`, then `b`.
std::uint64_t hash_floats(const std::vector<float>& a, const std::vector<float>& b) {
  Fnv64 f;
  for (const std::vector<float>* v : {&a, &b})
    for (float x : *v) f.add(sc::f32_bits(x));
  return f.h;
}

/// Where a sample of the placed state's pages are (numa::page_nodes).
struct PageCheck {
  std::size_t checked = 0;
  std::size_t on_node = 0;    ///< on the chosen node
  std::size_t elsewhere = 0;  ///< on another node
  std::size_t absent = 0;     ///< not faulted in (never touched)
  std::size_t unknown = 0;    ///< the query failed
  int error = 0;              ///< errno of the last failed query
};

/// Adds every 64th page of [data, data + bytes) to `pc` (a coarser stride for buffers
/// of more than 2^20 pages, at most 16,384 samples each): one move_pages query per
/// sample page.
void check_pages(PageCheck& pc, const void* data, std::size_t bytes, int node) {
#if defined(__linux__)
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
#else
  const std::size_t page = 4096;
#endif
  const std::size_t pages = (bytes + page - 1) / page;
  const std::size_t stride = std::max<std::size_t>(64, (pages + 16383) / 16384);
  for (std::size_t i = 0; i < pages; i += stride) {
    const std::vector<int> where =
        sc::numa::page_nodes(static_cast<const char*>(data) + i * page, 1);
    const int w = where.empty() ? -EFAULT : where.front();
    ++pc.checked;
    if (w == node)
      ++pc.on_node;
    else if (w >= 0)
      ++pc.elsewhere;
    else if (w == -ENOENT)
      ++pc.absent;
    else {
      ++pc.unknown;
      pc.error = -w;
    }
  }
}

}  // namespace

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string grouped(std::uint64_t n) {
  std::string d = std::to_string(n);
  for (int i = static_cast<int>(d.size()) - 3; i > 0; i -= 3)
    d.insert(static_cast<std::size_t>(i), ",");
  return d;
}

std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  return buf;
}

std::string f32_text(float x) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.9g [0x%08" PRIx32 "]", static_cast<double>(x), sc::f32_bits(x));
  return buf;
}

void warn_once(const std::string& message) {
  static std::set<std::string> seen;  // the demo's main thread only
  if (seen.insert(message).second) std::fprintf(stderr, "stepcore: warning: %s\n", message.c_str());
}

void print_phase(const char* name, double sec, double bytes, const std::string& note) {
  if (bytes > 0 && sec > 0)
    std::printf("  %-10s %9.1f ms %7.2f GB/s   %s\n", name, sec * 1e3, bytes / sec / 1e9,
                note.c_str());
  else
    std::printf("  %-10s %9.1f ms %12s   %s\n", name, sec * 1e3, "", note.c_str());
}

void print_header(const Model& m, const Options& o, const Backend& b) {
  const ModelConfig& c = m.config;
  const ModelConfig& p = *m.published;
  std::printf("stepcore-demo %d.%d.%d\n", STEPCORE_VERSION_MAJOR, STEPCORE_VERSION_MINOR,
              STEPCORE_VERSION_PATCH);
  std::printf("backend    %.*s: %.*s\n", static_cast<int>(b.name.size()), b.name.data(),
              static_cast<int>(b.description.size()), b.description.data());
  std::printf("model      %.*s layout: layers %" PRId64 " of %" PRId64 ", vocab %" PRId64
              " of %" PRId64 ", hidden %" PRId64 ", intermediate %" PRId64 ", heads %" PRId64
              " (kv %" PRId64 ") x %" PRId64 "%s, %s embeddings\n",
              static_cast<int>(c.name.size()), c.name.data(), c.layers, p.layers, c.vocab, p.vocab,
              c.hidden, c.intermediate, c.heads, c.kv_heads, c.head_dim,
              c.qkv_bias ? ", q/k/v bias" : "", c.tied_embeddings ? "tied" : "untied");
  std::size_t nodecay = 0;
  for (const TensorSpec& t : m.layout)
    if (no_decay(t.kind)) ++nodecay;
  std::printf("layout     %zu tensors (%zu without decay), %s parameters (published model: %s)\n",
              m.layout.size(), nodecay, grouped(m.numel).c_str(),
              grouped(total_numel(build_layout(p))).c_str());
  if (o.print_layout)
    for (std::size_t t = 0; t < m.layout.size(); ++t)
      std::printf("  %-48s %7" PRId64 " x %-6" PRId64 " %12s  %s\n", m.layout[t].name.c_str(),
                  m.layout[t].rows, m.layout[t].cols, grouped(m.layout[t].numel()).c_str(),
                  kind_name(m.layout[t].kind));
  const double n = static_cast<double>(m.numel);
  // The moments: f32, or (adamw8bit) 8-bit codes and maxima for tensors of >= 4096 elements.
  double q8_numel = 0.0;
  for (const TensorSpec& t : m.layout)
    if (o.q8 && t.numel() >= kMin8bitSize) q8_numel += static_cast<double>(t.numel());
  const double moments = o.optimizer == Optimizer::adamw
                             ? 8.0 * (n - q8_numel) + 2.0 * (q8_numel + q8_numel / 64)
                             : 0.0;
  const double grads = static_cast<double>(sc::dtype_size(o.grad_dtype)) * n;
  const double total = 4.0 * n + moments + 4.0 * n + grads + 2.0 * n;
  std::printf("state      %s (%.0f B/parameter): params f32 %s, ", human_bytes(total).c_str(),
              total / n, human_bytes(4.0 * n).c_str());
  if (o.optimizer == Optimizer::adamw)
    std::printf("exp_avg + exp_avg_sq %s %s, ", o.q8 ? "8-bit" : "f32",
                human_bytes(moments).c_str());
  std::printf("accumulators f32 %s, micro-batch grads %s %s, compute weights bf16 %s\n",
              human_bytes(4.0 * n).c_str(), o.grad_dtype == sc::DType::bf16 ? "bf16" : "f32",
              human_bytes(grads).c_str(), human_bytes(2.0 * n).c_str());
  std::printf("run        %" PRId64 " steps x %" PRId64 " micro-batches, ", o.steps,
              o.micro_batches);
  if (o.optimizer == Optimizer::adamw)
    std::printf("adamw (%s formula, betas 0.9/0.999, eps 1e-8), ",
                o.formula != sc::AdamWFormula::torch
                    ? sc::kAdamWFormulaNames[static_cast<std::size_t>(o.formula)].data()
                : o.torch_aarch64 ? "torch (aarch64 build)"
                                  : "torch (x86 build)");
  else
    std::printf("sign_sgd, ");
  std::printf("lr %g, weight decay %g, max_norm ", o.lr, o.weight_decay);
  if (o.max_norm > 0.0)
    std::printf("%g", o.max_norm);
  else
    std::printf("none (no clipping)");
  std::printf(", seed %" PRIu64 "\n", o.seed);
  if (!b.engine)
    std::printf("check      none: the reference backend is the oracle\n");
  else if (o.check_steps == 0)
    std::printf("check      off (--check-steps 0)\n");
  else
    std::printf(
        "check      step%s 1%s also run by stepcore::reference on a copy of the state, "
        "compared bit for bit (not in the phase timings)\n",
        o.check_steps > 1 && o.steps > 1 ? "s" : "",
        o.check_steps > 1 && o.steps > 1
            ? ("-" + std::to_string(std::min(o.check_steps, o.steps))).c_str()
            : "");
}

void print_numa(const State& s, const Backend& b) {
  const NumaChoice& c = b.numa;
  constexpr const char* kUnplaced = "threads float, state pre-faulted by the allocating thread";
  if (!b.engine) {
    std::printf("numa       not used: the reference backend runs one unbound thread\n");
    return;
  }
  if (!c.enabled) {
    std::printf("numa       off (--no-bind): %s\n", kUnplaced);
    return;
  }
  std::printf("numa       local rank %d/%d, gpu %s, ", c.local_rank, c.local_world_size,
              c.gpu.c_str());
  if (!c.bound) {
    std::printf("unbound: %s; %s\n", c.reason.c_str(), kUnplaced);
    return;
  }
  std::printf("node %d (%s), cpus %s (", c.node, c.node_why.c_str(), cpu_list(c.cpus).c_str());
  if (c.cpus.size() == c.share.size())
    std::printf("%zu core%s", c.cpus.size(), c.cpus.size() == 1 ? "" : "s");
  else
    std::printf("%s %zu of the share's %zu cores %s", c.threads_source.c_str(), c.cpus.size(),
                c.share.size(), cpu_list(c.share).c_str());
  if (c.oversubscribed) std::printf("; OVERSUBSCRIBED: %s", c.reason.c_str());
  std::printf("), ");

  PageCheck pc;
  bool all_bound = true;
  for (const AlignedArray<float>* a : {&s.param, &s.exp_avg, &s.exp_avg_sq, &s.acc}) {
    const sc::numa::HostBuffer* h = a->placed();
    if (h == nullptr) continue;  // empty (SignSGD moments)
    all_bound = all_bound && h->numa_node() == c.node;
    check_pages(pc, a->data(), a->bytes(), c.node);
  }
  if (all_bound)
    std::printf("state on node %d", c.node);
  else
    std::printf("state first-touched by the workers, not bound to node %d (mbind refused)", c.node);
  std::printf(" (checked %zu pages: %zu on node %d", pc.checked, pc.on_node, c.node);
  if (pc.elsewhere) std::printf(", %zu on other nodes", pc.elsewhere);
  if (pc.absent) std::printf(", %zu not present", pc.absent);
  if (pc.unknown) std::printf(", %zu unknown: %s", pc.unknown, std::strerror(pc.error));
  std::printf(")\n");
  if (pc.on_node != pc.checked) {
    std::fflush(stdout);
    warn_once(std::to_string(pc.checked - pc.on_node) + " of " + std::to_string(pc.checked) +
              " sampled state pages are not on NUMA node " + std::to_string(c.node));
  }
}

void print_checksums(const Model& model, const State& state, const Options& o) {
  std::printf("checksum   params f32 %016" PRIx64 "  compute bf16 %016" PRIx64,
              hash_f32(model, state.param.data()), hash_bf16(model, state.compute.data()));
  if (o.optimizer == Optimizer::adamw)
    std::printf("  exp_avg %016" PRIx64 "  exp_avg_sq %016" PRIx64,
                hash_f32(model, state.exp_avg.data()), hash_f32(model, state.exp_avg_sq.data()));
  if (o.q8)
    std::printf("  8-bit codes %016" PRIx64 "  maxima %016" PRIx64,
                hash_codes(model, state.exp_avg_codes.data(), state.exp_avg_sq_codes.data()),
                hash_floats(state.exp_avg_max, state.exp_avg_sq_max));
  std::printf("  (FNV-1a 64 over bit patterns)\n");
}

void print_summary(const Options& o, const Totals& totals, double total_seconds) {
  std::printf("summary    %" PRId64 " steps: %" PRId64 " applied, %" PRId64
              " skipped (found-inf), %" PRId64 " clipped; stepcore phases %.2f s, ",
              o.steps, totals.applied, totals.skipped, totals.clipped, totals.phases);
  if (totals.checked > 0)
    std::printf("bitwise check %.2f s (%" PRId64 " step%s, %s), ", totals.check, totals.checked,
                totals.checked == 1 ? "" : "s",
                totals.mismatched == 0
                    ? "all equal"
                    : (std::to_string(totals.mismatched) + " MISMATCHED").c_str());
  std::printf("total %.2f s\n", total_seconds);
}

}  // namespace stepcore_demo
