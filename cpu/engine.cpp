// The CPU engine: configuration (ISA, threads), validation, the static work
// partition, one OpenMP parallel region per call, and dispatch to the ISA's table.
#include <omp.h>
#include <sched.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif
#if defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <xsimd/config/xsimd_cpuid.hpp>

#include "core/fp_env.hpp"
#include "core/norm_p.hpp"
#include "core/optimizers/all.hpp"
#include "core/validate.hpp"
#include "cpu/dispatch.hpp"
#include "cpu/q8_slots.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/error.hpp"
#include "stepcore/numa.hpp"

namespace stepcore::cpu {

bool detail::isa_supported(Isa isa) {
#if defined(__x86_64__)
  const auto arch = xsimd::available_architectures();
  switch (isa) {
    case Isa::sse2:
      return arch.sse2;
    case Isa::avx2:
      return arch.fma3_avx2;
    case Isa::avx512:
      return arch.avx512bw && arch.avx512dq;
    case Isa::neon:
      return false;  // not this build's target
  }
#elif defined(__aarch64__)
  // Advanced SIMD with IEEE double lanes is part of every AArch64 Linux processor; the
  // hardware capability says so (and an emulator reports it).
  if (isa == Isa::neon) return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0;
#endif
  return false;
}

/// After a thread's streaming (non-temporal) stores: x86's are weakly ordered and need a
/// store fence before another thread may read them; other targets stream with ordinary
/// stores (ArchOps::stream), ordered by the region's closing barrier.
inline void fence_streamed_stores() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

namespace {

int affinity_cpu_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return omp_get_num_procs();
}

/// One unit of static work: elements [begin, end) of tensor `tensor`.
struct Chunk {
  std::size_t tensor;
  std::size_t begin;
  std::size_t end;
};

/// Returns the chunks of tensors with the given sizes, in tensor order.
template <class SizeOf>
std::vector<Chunk> make_chunks(std::size_t count, SizeOf size_of) {
  std::vector<Chunk> chunks;
  for (std::size_t t = 0; t < count; ++t) {
    const std::size_t n = size_of(t);
    for (std::size_t b = 0; b < n; b += Engine::kWorkChunkElements)
      chunks.push_back({t, b, std::min(n, b + Engine::kWorkChunkElements)});
  }
  return chunks;
}

/// Runs body(chunk) for every chunk on `threads` threads. Thread k takes the
/// contiguous run of chunks whose first element (counted over all tensors) lies
/// in [k*total/T, (k+1)*total/T): a static partition that depends only on the
/// sizes and the thread count.
/// Binds the calling worker to `pu` unless it already is (thread_local memo: OpenMP
/// keeps its pool threads between regions).
void bind_worker(int pu) {
  thread_local int bound = -1;
  if (bound != pu && numa::bind_this_thread(pu)) bound = pu;
}

/// `fence`: the chunks may write with streaming stores, which are weakly ordered; each
/// thread drains its own (sfence) after its last chunk, so all are visible once the
/// region's barrier is passed and the call returns.
template <class Body>
void run_static(const std::vector<Chunk>& chunks, int threads, const std::vector<int>& cpus,
                Body body, bool fence = false) {
  if (chunks.empty()) return;
  std::vector<std::size_t> start(chunks.size() + 1, 0);
  for (std::size_t c = 0; c < chunks.size(); ++c)
    start[c + 1] = start[c] + (chunks[c].end - chunks[c].begin);
  const std::size_t total = start.back();
  const int team = static_cast<int>(std::min<std::size_t>(threads, chunks.size()));
  // The caller is worker 0: give it its own affinity back afterwards.
  std::vector<int> caller_affinity;
  if (!cpus.empty()) caller_affinity = numa::this_thread_affinity();
  auto restore = [&] {
    if (caller_affinity.empty()) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int pu : caller_affinity) CPU_SET(pu, &set);
    sched_setaffinity(0, sizeof set, &set);
  };
  if (team <= 1) {
    const ::stepcore::detail::FpEnvGuard env;
    if (!cpus.empty()) numa::bind_this_thread(cpus.front());
    for (const Chunk& c : chunks) body(c);
    if (fence) fence_streamed_stores();
    restore();
    return;
  }
#pragma omp parallel num_threads(team)
  {
    const ::stepcore::detail::FpEnvGuard env;  // per thread: MXCSR is thread state
    if (!cpus.empty()) {
      const auto w = static_cast<std::size_t>(omp_get_thread_num()) % cpus.size();
      if (omp_get_thread_num() == 0)
        numa::bind_this_thread(cpus[w]);  // the caller: restored below, so no memo
      else
        bind_worker(cpus[w]);
    }
    const auto k = static_cast<std::size_t>(omp_get_thread_num());
    const auto T = static_cast<std::size_t>(omp_get_num_threads());
    const std::size_t lo = total * k / T;
    const std::size_t hi = total * (k + 1) / T;
    const auto first = static_cast<std::size_t>(
        std::lower_bound(start.begin(), start.end() - 1, lo) - start.begin());
    for (std::size_t c = first; c < chunks.size() && start[c] < hi; ++c) body(chunks[c]);
    if (fence) fence_streamed_stores();
  }
  restore();
}

[[noreturn]] void unreachable_dtype(const char* what) {
  throw Error(Errc::internal, what, "dtype combination has no kernel (validation missed it)");
}

}  // namespace

std::string_view isa_name(Isa isa) noexcept {
  switch (isa) {
    case Isa::sse2:
      return "sse2";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
    case Isa::neon:
      return "neon";
  }
  return "invalid";
}

Isa parse_isa(std::string_view name, const char* argument) {
  if (name == "sse2") return Isa::sse2;
  if (name == "avx2") return Isa::avx2;
  if (name == "avx512") return Isa::avx512;
  if (name == "neon") return Isa::neon;
  throw Error(Errc::invalid_argument, argument,
              "unknown ISA '" + std::string(name) + "' (expected sse2, avx2, avx512 or neon)");
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa i : {Isa::sse2, Isa::avx2, Isa::avx512, Isa::neon})
    if (detail::isa_supported(i)) out.push_back(i);
  return out;
}

Isa best_isa() {
  const auto all = supported_isas();
  if (all.empty())
    throw Error(Errc::not_supported, "isa", "this processor runs none of this build's ISAs");
  return all.back();
}

Engine::Engine(EngineConfig config) {
  // An ISA asked for must pass its self-test; one chosen here falls back to the best
  // lower ISA that passes (docs/numerics.md section 13).
  const char* asked_by = nullptr;
  if (config.isa) {
    isa_ = *config.isa;
    asked_by = "config.isa";
  } else if (const char* env = std::getenv("STEPCORE_ISA"); env && *env) {
    isa_ = parse_isa(env, "STEPCORE_ISA");
    asked_by = "STEPCORE_ISA";
  }
  if (asked_by != nullptr) {
    if (static_cast<int>(isa_) >= kIsaCount)
      throw Error(Errc::invalid_argument, asked_by, "not an Isa enumerator");
    if (!detail::isa_supported(isa_))
      throw Error(Errc::not_supported, asked_by,
                  "this processor cannot run " + std::string(cpu::isa_name(isa_)));
    self_test_ = cpu::self_test(isa_);
    if (!self_test_.passed)
      throw Error(Errc::not_supported, asked_by,
                  std::string(cpu::isa_name(isa_)) + " failed its known-answer self-test: " +
                      self_test_.kernel + ": " + self_test_.detail);
  } else {
    const auto all = supported_isas();
    if (all.empty())
      throw Error(Errc::not_supported, "isa", "this processor runs none of this build's ISAs");
    bool found = false;
    for (auto it = all.rbegin(); it != all.rend() && !found; ++it) {
      SelfTestResult r = cpu::self_test(*it);
      if (r.passed) {
        isa_ = *it;
        self_test_ = std::move(r);
        found = true;
      } else {
        rejected_.push_back(std::move(r));
      }
    }
    if (!found)
      throw Error(Errc::internal, "isa",
                  "no ISA passed its known-answer self-test; sse2: " + rejected_.back().kernel +
                      ": " + rejected_.back().detail);
    for (const SelfTestResult& r : rejected_)
      if (detail::warn_once_about(r.isa))
        std::fprintf(stderr,
                     "stepcore: warning: the %s kernels failed their known-answer self-test "
                     "(%s: %s); using %s instead\n",
                     std::string(cpu::isa_name(r.isa)).c_str(), r.kernel.c_str(), r.detail.c_str(),
                     std::string(cpu::isa_name(isa_)).c_str());
  }

  for (std::size_t i = 0; i < config.cpus.size(); ++i)
    if (config.cpus[i] < 0 || config.cpus[i] >= CPU_SETSIZE)
      throw Error(Errc::invalid_argument, "config.cpus[" + std::to_string(i) + "]",
                  "not a CPU index: " + std::to_string(config.cpus[i]));
  cpus_ = config.cpus;
  if (config.threads == 0 && !cpus_.empty()) config.threads = static_cast<int>(cpus_.size());
  if (config.threads < 0 || config.threads > 4096)
    throw Error(Errc::invalid_argument, "config.threads",
                "must be in [0, 4096], got " + std::to_string(config.threads));
  threads_ = config.threads;
  if (threads_ == 0) {
    if (const char* env = std::getenv("STEPCORE_THREADS"); env && *env) {
      char* endp = nullptr;
      const long v = std::strtol(env, &endp, 10);
      if (*endp != '\0' || v < 1 || v > 4096)
        throw Error(Errc::invalid_argument, "STEPCORE_THREADS",
                    std::string("must be an integer in [1, 4096], got '") + env + "'");
      threads_ = static_cast<int>(v);
    } else {
      threads_ = affinity_cpu_count();
    }
  }
}

namespace {

/// One tensor of a unit's step as the engine reads it: destinations (the parameter, then
/// each slot) and their optional sources.
struct TensorViews {
  TensorView dst[1 + kMaxOptimizerSlots];
  ConstTensorView src[1 + kMaxOptimizerSlots];
  ConstTensorView grad;
  TensorView out;
  float* step;
};

TensorViews views_of(const OptimizerTensor& t) {
  TensorViews v{{t.param}, {t.param_src}, t.grad, t.compute_param, t.step};
  for (int s = 0; s < kMaxOptimizerSlots; ++s) {
    v.dst[1 + s] = t.state[s];
    v.src[1 + s] = t.state_src[s];
  }
  return v;
}

}  // namespace

// One step of unit Opt over validated tensors: every dtype combination is resolved to a
// kernel before anything is written; then each counter is advanced (units that count
// steps), the ranges built and the chunks run. A tensor with 8-bit slots runs its unit's
// q8 kernel.
template <class Opt>
void Engine::run_unit(std::span<const OptimizerTensor> tensors, const typename Opt::Config& config,
                      GradientRead read) const {
  const detail::UnitKernels<Opt>& kernels = detail::kernel_table(isa_).units.template of<Opt>();
  std::vector<detail::UnitRange<Opt>> ranges(tensors.size());
  std::vector<detail::UnitFn<Opt>> fns(tensors.size());
  // The kernel of each tensor, by its dtypes: param and state (one dtype), gradient,
  // compute output. 16-bit params never stream (unit_range), so only f32 needs both forms.
  auto kernel_of = [&](const TensorViews& v, bool streamed) {
    const int p = static_cast<int>(v.dst[0].dtype);
    const int g = static_cast<int>(v.grad.dtype);
    const int o = detail::output_kind(v.out);
    if (p < 0 || p >= detail::kDTypes || g < 0 || g >= detail::kDTypes)
      return detail::UnitFn<Opt>{nullptr};
    if (streamed) return p == 0 ? kernels.streamed[g][o] : detail::UnitFn<Opt>{nullptr};
    return kernels.step[p][g][o];
  };
  // The 8-bit slots of each tensor, and the kernel that steps them (q8_slots.hpp).
  std::vector<detail::Q8Slots> q8(tensors.size());
  std::vector<detail::Q8Fn<Opt>> q8_fns(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    q8[i] = detail::q8_slots<Opt>(tensors[i], Opt::variant(config));
    const TensorViews v = views_of(tensors[i]);
    if (q8[i].slots > 0)
      q8_fns[i] = detail::q8_kernel(kernels, static_cast<int>(v.dst[0].dtype),
                                    static_cast<int>(v.grad.dtype), detail::output_kind(v.out));
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorViews v = views_of(tensors[i]);
    const bool f32 = v.dst[0].dtype == DType::f32;
    if (q8[i].slots > 0 ? !q8_fns[i] : !kernel_of(v, false) || (f32 && !kernel_of(v, true)))
      unreachable_dtype(Opt::kName);
  }
  // All checks passed: from here on the call writes.
  bool streamed = false;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorViews v = views_of(tensors[i]);
    float step = 0.0f;
    if constexpr (Opt::kCountsSteps) step = *v.step = *v.step + 1.0f;
    ranges[i] = detail::unit_range<Opt>(config, step, read, v.dst, v.src, v.grad.data, v.out);
    if (q8[i].slots > 0) {
      ranges[i].stream = 0;  // block by block: plain stores
      continue;
    }
    // A range with out-of-place destinations streams them; in place, the plain kernel.
    fns[i] = kernel_of(v, ranges[i].stream != 0);
    streamed = streamed || ranges[i].stream != 0;
  }
  static_assert(Engine::kWorkChunkElements % kQ8BlockSize == 0, "chunks are whole 8-bit blocks");
  const auto chunks =
      make_chunks(tensors.size(), [&](std::size_t t) { return tensors[t].param.numel; });
  run_static(
      chunks, threads_, cpus_,
      [&](const Chunk& c) {
        if (q8[c.tensor].slots > 0)
          q8_fns[c.tensor](ranges[c.tensor], q8[c.tensor], c.begin, c.end);
        else
          fns[c.tensor](ranges[c.tensor], c.begin, c.end);
      },
      streamed);
}

template <class Config>
void Engine::step(std::span<const OptimizerTensor> tensors, const Config& config, GradientRead read,
                  const std::int32_t* found_inf) const {
  using Opt =
      typename ::stepcore::detail::UnitForConfig<Config, ::stepcore::detail::AllUnits>::type;
  // Parameters in the model's dtype: f32, bf16 or f16, the state in the same dtype, or
  // 8-bit (units that take it).
  ::stepcore::detail::validate_unit<Opt>(
      tensors, config, read, ::stepcore::detail::StepCounters::read,
      ::stepcore::detail::unit_takes_q8<Opt>() ? ::stepcore::detail::ParamDTypes::model_and_q8
                                               : ::stepcore::detail::ParamDTypes::model);
  if (found_inf != nullptr && *found_inf != 0) return;
  run_unit<Opt>(tensors, config, read);
}

namespace detail {
// Every unit's Engine::step (AllUnits), by address: an object with external linkage that
// names them instantiates each here, for the callers in other translation units.
template <class... Units>
constexpr auto step_instances(::stepcore::detail::UnitList<Units...>) {
  return std::make_tuple(&Engine::step<typename Units::Config>...);
}
extern const auto kStepInstances = step_instances(::stepcore::detail::AllUnits{});
}  // namespace detail

void Engine::accumulate(std::span<const AccumulatePair> pairs) const {
  ::stepcore::detail::validate_accumulate(pairs);
  const detail::KernelTable& table = detail::kernel_table(isa_);
  std::vector<detail::AccumulateFn> fns(pairs.size());
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    const int s = static_cast<int>(pairs[i].src.dtype);
    if (s < 0 || s >= detail::kDTypes) unreachable_dtype("accumulate");
    fns[i] = table.accumulate[s];
  }
  const auto chunks = make_chunks(pairs.size(), [&](std::size_t t) { return pairs[t].acc.numel; });
  run_static(chunks, threads_, cpus_, [&](const Chunk& c) {
    const AccumulatePair& p = pairs[c.tensor];
    fns[c.tensor](static_cast<float*>(p.acc.data), p.src.data, p.copy, c.begin, c.end);
  });
}

void Engine::scale_(std::span<const TensorView> tensors, float scale) const {
  ::stepcore::detail::validate_scale(tensors, scale);
  const detail::KernelTable& table = detail::kernel_table(isa_);
  std::vector<detail::ScaleFn> fns(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const int d = static_cast<int>(tensors[i].dtype);
    if (d < 0 || d >= detail::kDTypes) unreachable_dtype("scale_");
    fns[i] = table.scale[d];
  }
  const auto chunks = make_chunks(tensors.size(), [&](std::size_t t) { return tensors[t].numel; });
  run_static(chunks, threads_, cpus_,
             [&](const Chunk& c) { fns[c.tensor](tensors[c.tensor].data, scale, c.begin, c.end); });
}

void Engine::first_touch(std::span<const TensorView> tensors) const {
  ::stepcore::detail::validate_tensors(tensors);
  const auto chunks = make_chunks(tensors.size(), [&](std::size_t t) { return tensors[t].numel; });
  run_static(chunks, threads_, cpus_, [&](const Chunk& c) {
    const TensorView& t = tensors[c.tensor];
    const std::size_t es = dtype_size(t.dtype);
    std::memset(static_cast<char*>(t.data) + c.begin * es, 0, (c.end - c.begin) * es);
  });
}

NormPartial Engine::norm_partial(std::span<const ConstTensorView> tensors,
                                 GradientRead read) const {
  return norm_partial(tensors, read, NormMode::fast);
}

NormPartial Engine::norm_partial(std::span<const ConstTensorView> tensors, GradientRead read,
                                 NormMode mode, NormOrder order) const {
  ::stepcore::detail::validate_norm(tensors, read);
  const int o = static_cast<int>(order);
  if (o < 0 || o >= kNormOrders)
    throw Error(Errc::invalid_argument, "order", "not a NormOrder (" + std::to_string(o) + ")");
  const detail::KernelTable& table = detail::kernel_table(isa_);
  const detail::NormFn* fns = mode == NormMode::exact ? table.norm_exact[o] : table.norm[o];
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const int d = static_cast<int>(tensors[i].dtype);
    if (d < 0 || d >= detail::kDTypes) unreachable_dtype("norm_partial");
  }
  const auto chunks = make_chunks(tensors.size(), [&](std::size_t t) { return tensors[t].numel; });
  // One partial per chunk, merged afterwards: exact integer sums, any order.
  std::vector<NormPartial> partials(chunks.size());
  run_static(chunks, threads_, cpus_, [&](const Chunk& c) {
    const auto slot = static_cast<std::size_t>(&c - chunks.data());
    const int d = static_cast<int>(tensors[c.tensor].dtype);
    fns[d](tensors[c.tensor].data, read, c.begin, c.end, partials[slot]);
  });
  NormPartial total;
  for (const NormPartial& p : partials) merge(total, p);
  return total;
}

NormResult Engine::norm(std::span<const ConstTensorView> tensors, GradientRead read,
                        NormOrder order) const {
  NormResult r = finalize(norm_partial(tensors, read, NormMode::fast, order), order);
  if (r.needs_exact) r = finalize(norm_partial(tensors, read, NormMode::exact, order), order);
  return r;
}

NormResult Engine::p_norm(std::span<const ConstTensorView> tensors, double p,
                          GradientRead read) const {
  ::stepcore::detail::validate_norm(tensors, read);
  ::stepcore::detail::validate_p(p);
  if (p == 2.0) return norm(tensors, read, NormOrder::two);
  if (p == 1.0) return norm(tensors, read, NormOrder::one);
  // Two passes over the same static partition; each chunk's pieces are exact and merged
  // afterwards, so the split cannot change them (core/norm_p.hpp).
  const auto chunks = make_chunks(tensors.size(), [&](std::size_t t) { return tensors[t].numel; });
  std::vector<::stepcore::detail::PNormFacts> facts(chunks.size());
  run_static(chunks, threads_, cpus_, [&](const Chunk& c) {
    const auto slot = static_cast<std::size_t>(&c - chunks.data());
    ::stepcore::detail::add_facts(tensors[c.tensor], read, c.begin, c.end, facts[slot]);
  });
  ::stepcore::detail::PNormFacts all;
  for (const auto& f : facts) ::stepcore::detail::merge(all, f);
  ::stepcore::detail::PowerSum sum;
  const double base = ::stepcore::detail::power_base(all, p);
  if (base > 0.0) {
    std::vector<::stepcore::detail::PowerSum> sums(chunks.size());
    run_static(chunks, threads_, cpus_, [&](const Chunk& c) {
      const auto slot = static_cast<std::size_t>(&c - chunks.data());
      ::stepcore::detail::add_powers(tensors[c.tensor], read, c.begin, c.end, base, p, sums[slot]);
    });
    for (const auto& s : sums) ::stepcore::detail::merge(sum, s);
  }
  return ::stepcore::detail::finish_p_norm(all, sum, p);
}

}  // namespace stepcore::cpu
