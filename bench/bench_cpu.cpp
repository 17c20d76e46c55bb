// stepcore-bench (CPU): the engine's kernels at 64M parameters over a realistic
// list of tensors, per ISA and thread count, each with its bandwidth and its
// "roofline" ratio to a same-traffic probe measured in the same run.
//
// A probe loads and stores exactly the arrays, dtypes and threads of its kernel
// with trivial arithmetic (multi-versioned for the processor by the compiler),
// i.e. what the memory system gives that access pattern. A STREAM triad and the
// scalar reference (one thread) are reported beside them for scale. Every kernel
// benchmark first validates its output against stepcore::reference, bit for bit,
// on a sample of tensors, and refuses to time a wrong kernel.
#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "core/optimizers/all.hpp"
#include "cpu/testing.hpp"
#include "kernels/checked_plans.hpp"
#include "kernels/plans.hpp"
#include "kernels/testing.hpp"
#include "model_sizes.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/numa.hpp"
#include "stepcore/reference.hpp"

namespace {

using namespace stepcore;
using ::stepcore::detail::UnitSample;

template <class T>
struct Slab {
  std::unique_ptr<T[], decltype(&std::free)> data{nullptr, &std::free};
  std::size_t n = 0;
  explicit Slab(std::size_t count) : n(count) {
    data.reset(static_cast<T*>(std::aligned_alloc(64, ((count * sizeof(T) + 63) / 64) * 64)));
#pragma omp parallel for schedule(static)
    for (std::size_t i = 0; i < count; ++i) std::memset(&data[i], 0, sizeof(T));
  }
  T* get() { return data.get(); }
};

struct State {
  std::vector<std::size_t> sizes;
  std::vector<std::size_t> offsets;
  std::size_t total = 0;
  Slab<float> p, m, v, acc, gf32;
  Slab<std::uint16_t> gbf16, out;
  std::vector<float> steps;

  explicit State(std::size_t target)
      : sizes(bench::model_sizes(target)),
        total(count(sizes)),
        p(total),
        m(total),
        v(total),
        acc(total),
        gf32(total),
        gbf16(total),
        out(total) {
    std::size_t off = 0;
    for (std::size_t s : sizes) {
      offsets.push_back(off);
      off += s;
    }
    steps.assign(sizes.size(), 0.0f);
#pragma omp parallel
    {
      std::mt19937 rng(1234 + omp_get_thread_num());
      std::normal_distribution<float> nd(0.0f, 1.0f);
#pragma omp for schedule(static)
      for (std::size_t i = 0; i < total; ++i) {
        p.get()[i] = nd(rng) * 0.02f;
        m.get()[i] = nd(rng) * 1e-4f;
        v.get()[i] = std::abs(nd(rng)) * 1e-8f;
        gf32.get()[i] = nd(rng) * 1e-3f;
        gbf16.get()[i] = f32_to_bf16_bits(nd(rng) * 1e-3f);
        acc.get()[i] = nd(rng) * 1e-3f;
      }
    }
  }
  static std::size_t count(const std::vector<std::size_t>& s) {
    std::size_t t = 0;
    for (auto x : s) t += x;
    return t;
  }

  std::vector<OptimizerTensor> adamw(DType grad, bool output) {
    std::vector<OptimizerTensor> t;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t o = offsets[k], n = sizes[k];
      OptimizerTensor a;
      a.param = {p.get() + o, n, DType::f32};
      a.state[0] = {m.get() + o, n, DType::f32};
      a.state[1] = {v.get() + o, n, DType::f32};
      a.step = &steps[k];
      a.grad = grad == DType::f32 ? ConstTensorView{gf32.get() + o, n, DType::f32}
                                  : ConstTensorView{gbf16.get() + o, n, DType::bf16};
      if (output) a.compute_param = {out.get() + o, n, DType::bf16};
      t.push_back(a);
    }
    return t;
  }
  std::vector<OptimizerTensor> sign_sgd() {
    std::vector<OptimizerTensor> t;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t o = offsets[k], n = sizes[k];
      OptimizerTensor s;  // the param alone: no state slot, no step counter
      s.param = {p.get() + o, n, DType::f32};
      s.grad = {gbf16.get() + o, n, DType::bf16};
      s.compute_param = {out.get() + o, n, DType::bf16};
      t.push_back(s);
    }
    return t;
  }
  std::vector<AccumulatePair> accumulate() {
    std::vector<AccumulatePair> t;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t o = offsets[k], n = sizes[k];
      t.push_back({{acc.get() + o, n, DType::f32}, {gbf16.get() + o, n, DType::bf16}, false});
    }
    return t;
  }
  std::vector<ConstTensorView> grads(DType d) {
    std::vector<ConstTensorView> t;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t o = offsets[k], n = sizes[k];
      if (d == DType::f32)
        t.push_back({acc.get() + o, n, DType::f32});
      else
        t.push_back({gbf16.get() + o, n, DType::bf16});
    }
    return t;
  }
};

State& state() {
  static State s(std::size_t{64} << 20);
  return s;
}

// ---- same-traffic probes (multi-versioned by the compiler, OpenMP static) ------------
#define STEPCORE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// AdamW: read p, m, v, g; write p, m, v (and the bf16 copy).
template <class G>
STEPCORE_CLONES void probe_adamw(float* p, float* m, float* v, const G* g, std::uint16_t* out,
                                 std::size_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t i = 0; i < n; ++i) {
    float gi;
    if constexpr (sizeof(G) == 2) {
      gi = static_cast<float>(g[i]);
    } else {
      gi = g[i];
    }
    const float pi = p[i] + gi;
    p[i] = pi;
    m[i] = m[i] + gi;
    v[i] = v[i] + gi;
    if (out) out[i] = static_cast<std::uint16_t>(f32_bits(pi) >> 16);
  }
}
// An optimizer unit with K f32 state slots: read p, the slots and an f32 g; write p, the
// slots and the bf16 copy.
template <int K>
STEPCORE_CLONES void probe_slots(float* p, float* const* slots, const float* g, std::uint16_t* out,
                                 std::size_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float pi = p[i] + gi;
    p[i] = pi;
    for (int k = 0; k < K; ++k) slots[k][i] = slots[k][i] + gi;
    out[i] = static_cast<std::uint16_t>(f32_bits(pi) >> 16);
  }
}
// An optimizer unit with bf16 params (docs/numerics.md 7.3): read p, K slots and g (all
// bf16); write p and the slots (bf16), each widened and narrowed by shifts.
template <int K>
STEPCORE_CLONES void probe_slots_bf16(std::uint16_t* p, std::uint16_t* const* slots,
                                      const std::uint16_t* g, std::size_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t i = 0; i < n; ++i) {
    const float gi = f32_from_bits(std::uint32_t{g[i]} << 16);
    p[i] =
        static_cast<std::uint16_t>(f32_bits(f32_from_bits(std::uint32_t{p[i]} << 16) + gi) >> 16);
    for (int k = 0; k < K; ++k)
      slots[k][i] = static_cast<std::uint16_t>(
          f32_bits(f32_from_bits(std::uint32_t{slots[k][i]} << 16) + gi) >> 16);
  }
}
// AdamW with 8-bit state (docs/numerics.md 8f): read p, g, the two code arrays and each
// block's two maxima; write p, the codes, the maxima and the bf16 copy.
template <class G>
STEPCORE_CLONES void probe_adamw8bit(float* p, std::uint8_t* cm, std::uint8_t* cv, float* am,
                                     float* av, const G* g, std::uint16_t* out, std::size_t n,
                                     int threads) {
  const std::size_t blocks = (n + kQ8BlockSize - 1) / kQ8BlockSize;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t i1 = std::min(n, (b + 1) * kQ8BlockSize);
    for (std::size_t i = b * kQ8BlockSize; i < i1; ++i) {
      float gi;
      if constexpr (sizeof(G) == 2) {
        gi = f32_from_bits(std::uint32_t{g[i]} << 16);
      } else {
        gi = g[i];
      }
      const float pi = p[i] + gi;
      p[i] = pi;
      const auto k = static_cast<std::uint8_t>(f32_bits(gi));
      cm[i] = static_cast<std::uint8_t>(cm[i] + k);
      cv[i] = static_cast<std::uint8_t>(cv[i] ^ k);
      if (out) out[i] = static_cast<std::uint16_t>(f32_bits(pi) >> 16);
    }
    am[b] = am[b] + 1.0f;
    av[b] = av[b] + 1.0f;
  }
}
STEPCORE_CLONES void probe_sign_sgd(float* p, const std::uint16_t* g, std::uint16_t* out,
                                    std::size_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t i = 0; i < n; ++i) {
    const float pi = p[i] + static_cast<float>(g[i]);
    p[i] = pi;
    out[i] = static_cast<std::uint16_t>(f32_bits(pi) >> 16);
  }
}
STEPCORE_CLONES void probe_accumulate(float* acc, const std::uint16_t* g, std::size_t n,
                                      int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t i = 0; i < n; ++i) acc[i] = acc[i] + static_cast<float>(g[i]);
}
// Norm: read the gradient once (OR of the raw bits in the element's own width).
template <class T>
STEPCORE_CLONES T probe_read(const T* x, std::size_t n, int threads) {
  T r = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : r)
  for (std::size_t i = 0; i < n; ++i) r |= x[i];
  return r;
}
// AdamW out of place: read the sources and the gradient, write the destinations with
// streaming stores, each thread fencing its own: what the machine gives a step whose
// destination lines are written without being read. The widest streaming store the
// processor has, a whole 64-byte line of each array at a time (narrower stores
// interleaved across three arrays run several times slower on some processors); one
// function per width, each compiled for its ISA. The arrays are 64-byte aligned.
[[gnu::target("avx512f")]] void probe_lines_64(const float* ps, const float* ms, const float* vs,
                                               float* pd, float* md, float* vd, const float* g,
                                               std::size_t n, int threads) {
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (std::size_t i = 0; i < n / 16 * 16; i += 16)
      for (auto [src, dst] : {std::pair{ps, pd}, std::pair{ms, md}, std::pair{vs, vd}})
        _mm512_stream_ps(dst + i, _mm512_add_ps(_mm512_load_ps(src + i), _mm512_load_ps(g + i)));
    _mm_sfence();
  }
}
[[gnu::target("avx")]] void probe_lines_32(const float* ps, const float* ms, const float* vs,
                                           float* pd, float* md, float* vd, const float* g,
                                           std::size_t n, int threads) {
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (std::size_t i = 0; i < n / 16 * 16; i += 16) {
      for (auto [src, dst] : {std::pair{ps, pd}, std::pair{ms, md}, std::pair{vs, vd}}) {
        const __m256 a = _mm256_add_ps(_mm256_load_ps(src + i), _mm256_load_ps(g + i));
        const __m256 b = _mm256_add_ps(_mm256_load_ps(src + i + 8), _mm256_load_ps(g + i + 8));
        _mm256_stream_ps(dst + i, a);
        _mm256_stream_ps(dst + i + 8, b);
      }
    }
    _mm_sfence();
  }
}
void probe_lines_16(const float* ps, const float* ms, const float* vs, float* pd, float* md,
                    float* vd, const float* g, std::size_t n, int threads) {
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (std::size_t i = 0; i < n / 16 * 16; i += 16) {
      for (auto [src, dst] : {std::pair{ps, pd}, std::pair{ms, md}, std::pair{vs, vd}}) {
        __m128 x[4];
        for (int l = 0; l < 4; ++l)
          x[l] = _mm_add_ps(_mm_load_ps(src + i + 4 * l), _mm_load_ps(g + i + 4 * l));
        for (int l = 0; l < 4; ++l) _mm_stream_ps(dst + i + 4 * l, x[l]);
      }
    }
    _mm_sfence();
  }
}
void probe_adamw_streamed(const float* ps, const float* ms, const float* vs, float* pd, float* md,
                          float* vd, const float* g, std::size_t n, int threads) {
  if (__builtin_cpu_supports("avx512f"))
    probe_lines_64(ps, ms, vs, pd, md, vd, g, n, threads);
  else if (__builtin_cpu_supports("avx"))
    probe_lines_32(ps, ms, vs, pd, md, vd, g, n, threads);
  else
    probe_lines_16(ps, ms, vs, pd, md, vd, g, n, threads);
  for (std::size_t i = n / 16 * 16; i < n; ++i) {
    pd[i] = ps[i] + g[i];
    md[i] = ms[i] + g[i];
    vd[i] = vs[i] + g[i];
  }
}
STEPCORE_CLONES void triad(float* a, const float* b, const float* c, std::size_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t i = 0; i < n; ++i) a[i] = b[i] + 1.5f * c[i];
}

/// Returns the best bandwidth (bytes/s) of `fn` over a few runs.
template <class Fn>
double best_bandwidth(Fn fn, double bytes, int runs = 5) {
  double best = 0.0;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, bytes / s);
  }
  return best;
}

/// Times `op` in the benchmark loop and reports GB/s and parameters/s.
template <class Op>
void run_timed(benchmark::State& st, Op op, double bytes) {
  for (auto _ : st) op();
  st.SetBytesProcessed(static_cast<std::int64_t>(bytes) * st.iterations());
  st.counters["GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["Gparams/s"] = benchmark::Counter(static_cast<double>(state().total) * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
}

/// Sets `roofline` = best kernel bandwidth / best probe bandwidth over rounds that
/// alternate the two, so that drift in the machine's bandwidth (a shared VM) hits
/// both alike. The timed loop's own GB/s is reported separately.
template <class Kernel, class Probe>
void set_roofline(benchmark::State& st, double bytes, Kernel kernel, Probe probe, int rounds = 7) {
  double best_kernel = 0.0, best_probe = 0.0;
  for (int r = 0; r < rounds; ++r) {
    best_probe = std::max(best_probe, best_bandwidth(probe, bytes, 1));
    best_kernel = std::max(best_kernel, best_bandwidth(kernel, bytes, 1));
  }
  st.counters["roofline"] = best_kernel / best_probe;
  st.counters["best_GB/s"] = best_kernel * 1e-9;
  st.counters["probe_GB/s"] = best_probe * 1e-9;
}

/// Runs `op` once on a copy of the first tensors and compares with the reference.
[[noreturn]] void validation_failed(const char* what) {
  std::fprintf(stderr, "stepcore-bench: %s does not match the reference; refusing to time it\n",
               what);
  std::exit(1);
}

bool validate_adamw(const cpu::Engine& eng, DType grad, bool output) {
  // A private small model: a few tensors of awkward sizes.
  const std::size_t sizes[] = {1, 33, 4097, 70001};
  std::size_t total = 0;
  for (auto s : sizes) total += s;
  std::vector<float> p(total), m(total), v(total), g(total);
  std::vector<std::uint16_t> gb(total), o1(total), o2(total);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (std::size_t i = 0; i < total; ++i) {
    p[i] = nd(rng);
    m[i] = nd(rng) * 1e-3f;
    v[i] = std::abs(nd(rng)) * 1e-6f;
    g[i] = nd(rng) * 1e-2f;
    gb[i] = f32_to_bf16_bits(g[i]);
  }
  auto p2 = p, m2 = m, v2 = v;
  std::vector<float> s1(4, 0.0f), s2(4, 0.0f);
  std::vector<OptimizerTensor> a, b;
  std::size_t off = 0;
  for (int k = 0; k < 4; ++k) {
    const std::size_t n = sizes[k];
    const ConstTensorView gv = grad == DType::f32
                                   ? ConstTensorView{g.data() + off, n, DType::f32}
                                   : ConstTensorView{gb.data() + off, n, DType::bf16};
    a.push_back(
        {{p.data() + off, n, DType::f32},
         {TensorView{m.data() + off, n, DType::f32}, TensorView{v.data() + off, n, DType::f32}},
         &s1[k],
         gv,
         output ? TensorView{o1.data() + off, n, DType::bf16} : TensorView{}});
    b.push_back(
        {{p2.data() + off, n, DType::f32},
         {TensorView{m2.data() + off, n, DType::f32}, TensorView{v2.data() + off, n, DType::f32}},
         &s2[k],
         gv,
         output ? TensorView{o2.data() + off, n, DType::bf16} : TensorView{}});
    off += n;
  }
  const GradientRead read{1.0f / 4096.0f, 0.5f};
  reference::adamw_step(a, AdamWConfig{}, read);
  eng.step(b, AdamWConfig{}, read);
  return std::memcmp(p.data(), p2.data(), total * 4) == 0 &&
         std::memcmp(m.data(), m2.data(), total * 4) == 0 &&
         std::memcmp(v.data(), v2.data(), total * 4) == 0 &&
         std::memcmp(o1.data(), o2.data(), total * 2) == 0;
}

/// The benchmark model's AdamW state in 8 bits: the codes of exp_avg and exp_avg_sq, and
/// one f32 maximum per block of each tensor (blocks restart at each tensor).
struct Q8State {
  Slab<std::uint8_t> cm, cv;
  Slab<float> am, av;
  std::vector<std::size_t> block_offsets;
  std::vector<float> steps;
  std::size_t blocks = 0;

  static std::size_t count_blocks(const State& s) {
    std::size_t b = 0;
    for (std::size_t n : s.sizes) b += (n + kQ8BlockSize - 1) / kQ8BlockSize;
    return b;
  }
  explicit Q8State(const State& s)
      : cm(s.total),
        cv(s.total),
        am(count_blocks(s)),
        av(count_blocks(s)),
        blocks(count_blocks(s)) {
    std::size_t off = 0;
    for (std::size_t n : s.sizes) {
      block_offsets.push_back(off);
      off += (n + kQ8BlockSize - 1) / kQ8BlockSize;
    }
    steps.assign(s.sizes.size(), 0.0f);
#pragma omp parallel
    {
      std::mt19937 rng(99 + omp_get_thread_num());
#pragma omp for schedule(static)
      for (std::size_t i = 0; i < s.total; ++i) {
        cm.get()[i] = static_cast<std::uint8_t>(rng());
        cv.get()[i] = static_cast<std::uint8_t>(rng());
      }
#pragma omp for schedule(static)
      for (std::size_t b = 0; b < blocks; ++b) {
        am.get()[b] = 1e-4f;
        av.get()[b] = 1e-8f;
      }
    }
  }
  std::vector<OptimizerTensor> adamw(State& s, DType grad, bool output) {
    std::vector<OptimizerTensor> t = s.adamw(grad, output);
    for (std::size_t k = 0; k < t.size(); ++k) {
      t[k].state[0] = {};
      t[k].state[1] = {};
      t[k].step = &steps[k];
      t[k].q8[0] = {cm.get() + s.offsets[k], am.get() + block_offsets[k]};
      t[k].q8[1] = {cv.get() + s.offsets[k], av.get() + block_offsets[k]};
    }
    return t;
  }
};

Q8State& q8_state() {
  static Q8State q(state());
  return q;
}

/// Two AdamW steps with 8-bit state on tensors of awkward sizes equal the reference's bit for
/// bit: parameters, compute output, codes and maxima.
bool validate_adamw8bit(const cpu::Engine& eng, DType grad, bool output) {
  const std::size_t sizes[] = {1, 33, 4097, 70001};
  struct T {
    std::vector<float> p, g;
    std::vector<std::uint16_t> gb, out;
    std::vector<std::uint8_t> cm, cv;
    std::vector<float> am, av;
    float step = 0.0f;
  };
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<T> a;
  for (std::size_t n : sizes) {
    T t;
    t.p.resize(n);
    t.g.resize(n);
    t.gb.resize(n);
    t.out.assign(n, 0);
    t.cm.assign(n, 127);
    t.cv.assign(n, 0);
    t.am.assign((n + kQ8BlockSize - 1) / kQ8BlockSize, 0.0f);
    t.av = t.am;
    for (std::size_t i = 0; i < n; ++i) {
      t.p[i] = nd(rng);
      t.g[i] = nd(rng) * 1e-2f;
      t.gb[i] = f32_to_bf16_bits(t.g[i]);
    }
    a.push_back(std::move(t));
  }
  std::vector<T> b = a;
  auto views = [&](std::vector<T>& ts) {
    std::vector<OptimizerTensor> v;
    for (T& t : ts) {
      const std::size_t n = t.p.size();
      OptimizerTensor o;
      o.param = {t.p.data(), n, DType::f32};
      o.step = &t.step;
      o.grad = grad == DType::f32 ? ConstTensorView{t.g.data(), n, DType::f32}
                                  : ConstTensorView{t.gb.data(), n, DType::bf16};
      if (output) o.compute_param = {t.out.data(), n, DType::bf16};
      o.q8[0] = {t.cm.data(), t.am.data()};
      o.q8[1] = {t.cv.data(), t.av.data()};
      v.push_back(o);
    }
    return v;
  };
  const GradientRead read{1.0f / 4096.0f, 0.5f};
  for (int step = 0; step < 2; ++step) {
    reference::adamw_step(views(a), AdamWConfig{}, read);
    eng.step(views(b), AdamWConfig{}, read);
  }
  for (std::size_t k = 0; k < a.size(); ++k) {
    const std::size_t n = a[k].p.size();
    if (std::memcmp(a[k].p.data(), b[k].p.data(), n * 4) != 0 || a[k].out != b[k].out ||
        a[k].cm != b[k].cm || a[k].cv != b[k].cv ||
        std::memcmp(a[k].am.data(), b[k].am.data(), a[k].am.size() * 4) != 0 ||
        std::memcmp(a[k].av.data(), b[k].av.data(), a[k].av.size() * 4) != 0)
      return false;
  }
  return true;
}

/// Returns the PUs of this process's NUMA placement (one rank on the node of the
/// first CPU in the affinity mask), empty when unknown.
std::vector<int> placement_cpus() {
  static const std::vector<int> cpus = [] {
    try {
      const numa::Topology t = numa::Topology::live();
      const int first = numa::this_thread_affinity().front();
      for (const numa::Node& n : t.nodes())
        for (const numa::Core& c : n.cores)
          for (int pu : c.pus)
            if (pu == first) return t.place_on_node(n.os_index, 0, 1).cpus;
    } catch (const Error&) {
    }
    return std::vector<int>{};
  }();
  return cpus;
}

/// Engine for args (isa, threads[, bound]): bound binds worker k to the k-th core of
/// the placement (stepcore::numa), unbound leaves scheduling to the OS.
cpu::Engine engine_for(benchmark::State& st) {
  const auto isa = static_cast<cpu::Isa>(st.range(0));
  const int threads = static_cast<int>(st.range(1));
  const bool bound = st.range(2) != 0;
  std::vector<int> cpus;
  if (bound) {
    cpus = placement_cpus();
    if (cpus.size() > static_cast<std::size_t>(threads))
      cpus.resize(static_cast<std::size_t>(threads));
  }
  cpu::Engine eng(cpu::EngineConfig{isa, threads, cpus});
  st.SetLabel(std::string(eng.isa_name()) + "/t" + std::to_string(threads) +
              (bound ? "/bound" : "/unbound"));
  return eng;
}

// ---- benchmarks -----------------------------------------------------------------
template <DType G, bool Output, bool LazyScale = true>
void BM_AdamW(benchmark::State& st) {
  const cpu::Engine eng = engine_for(st);
  if (!validate_adamw(eng, G, Output)) validation_failed("the AdamW step");
  State& s = state();
  auto tensors = s.adamw(G, Output);
  const double bytes =
      static_cast<double>(s.total) * (12.0 + dtype_size(G) + 12.0 + (Output ? 2.0 : 0.0));
  const int th = eng.threads();
  const AdamWConfig cfg;
  // The step's loss scale applied lazily on read, or a gradient that arrives scaled.
  const GradientRead read{LazyScale ? 1.0f / 4096.0f : 1.0f, 1.0f};
  auto kernel = [&] {
    for (auto& t : tensors) *t.step = 0.0f;  // keep the bias corrections in range
    eng.step(tensors, cfg, read);
  };
  auto probe = [&] {
    std::uint16_t* out = Output ? s.out.get() : nullptr;
    if constexpr (G == DType::f32)
      probe_adamw(s.p.get(), s.m.get(), s.v.get(), s.gf32.get(), out, s.total, th);
    else
      probe_adamw(s.p.get(), s.m.get(), s.v.get(), s.gbf16.get(), out, s.total, th);
  };
  run_timed(st, kernel, bytes);
  set_roofline(st, bytes, kernel, probe);
}

/// AdamW with 8-bit state over the benchmark model (docs/numerics.md 8f), against its
/// same-traffic probe; validated first.
template <DType G, bool Output>
void BM_AdamW8bit(benchmark::State& st) {
  const cpu::Engine eng = engine_for(st);
  if (!validate_adamw8bit(eng, G, Output)) validation_failed("the AdamW step with 8-bit state");
  State& s = state();
  Q8State& q = q8_state();
  auto tensors = q.adamw(s, G, Output);
  const double bytes =
      static_cast<double>(s.total) * (4.0 + dtype_size(G) + 2.0 + 6.0 + (Output ? 2.0 : 0.0)) +
      static_cast<double>(q.blocks) * 16.0;
  const int th = eng.threads();
  const AdamWConfig cfg;
  const GradientRead read{1.0f / 4096.0f, 1.0f};
  auto kernel = [&] {
    for (auto& t : tensors) *t.step = 0.0f;  // keep the bias corrections in range
    eng.step(tensors, cfg, read);
  };
  auto probe = [&] {
    std::uint16_t* out = Output ? s.out.get() : nullptr;
    if constexpr (G == DType::f32)
      probe_adamw8bit(s.p.get(), q.cm.get(), q.cv.get(), q.am.get(), q.av.get(), s.gf32.get(), out,
                      s.total, th);
    else
      probe_adamw8bit(s.p.get(), q.cm.get(), q.cv.get(), q.am.get(), q.av.get(), s.gbf16.get(), out,
                      s.total, th);
  };
  run_timed(st, kernel, bytes);
  set_roofline(st, bytes, kernel, probe);
}

/// The buffers of the out-of-place comparison over the benchmark model's tensor list
/// (every tensor 64-byte aligned, as a manager's slabs are): the old state (sources), the
/// destinations, an f32 gradient and a bf16 compute copy. One size is held at a time.
struct OutOfPlaceState {
  std::size_t target;
  std::vector<std::size_t> sizes, offsets;
  std::size_t total;
  Slab<float> ps, ms, vs, pd, md, vd, g;
  Slab<std::uint16_t> out;
  std::vector<float> steps;

  explicit OutOfPlaceState(std::size_t elements)
      : target(elements),
        sizes(bench::model_sizes(elements)),
        total(State::count(sizes)),
        ps(total),
        ms(total),
        vs(total),
        pd(total),
        md(total),
        vd(total),
        g(total),
        out(total),
        steps(sizes.size(), 0.0f) {
    std::size_t off = 0;
    for (std::size_t s : sizes) {
      offsets.push_back(off);
      off += s;
    }
#pragma omp parallel
    {
      std::mt19937 rng(77 + omp_get_thread_num());
      std::normal_distribution<float> nd(0.0f, 1.0f);
#pragma omp for schedule(static)
      for (std::size_t i = 0; i < total; ++i) {
        ps.get()[i] = pd.get()[i] = nd(rng) * 0.02f;
        ms.get()[i] = md.get()[i] = nd(rng) * 1e-4f;
        vs.get()[i] = vd.get()[i] = std::abs(nd(rng)) * 1e-8f;
        g.get()[i] = nd(rng) * 1e-3f;
      }
    }
  }
  /// The tensors of a step into the destinations: read from the sources when
  /// `out_of_place`, else from the destinations themselves (in place).
  std::vector<OptimizerTensor> tensors(bool out_of_place, bool output) {
    std::vector<OptimizerTensor> t;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t o = offsets[k], n = sizes[k];
      OptimizerTensor a;
      a.param = {pd.get() + o, n, DType::f32};
      a.state[0] = {md.get() + o, n, DType::f32};
      a.state[1] = {vd.get() + o, n, DType::f32};
      a.step = &steps[k];
      a.grad = {g.get() + o, n, DType::f32};
      if (output) a.compute_param = {out.get() + o, n, DType::bf16};
      if (out_of_place) {
        a.param_src = {ps.get() + o, n, DType::f32};
        a.state_src[0] = {ms.get() + o, n, DType::f32};
        a.state_src[1] = {vs.get() + o, n, DType::f32};
      }
      t.push_back(a);
    }
    return t;
  }
};

OutOfPlaceState& out_of_place_state(std::size_t target) {
  static std::unique_ptr<OutOfPlaceState> s;
  if (!s || s->target != target) {
    s.reset();  // free the previous size first
    s = std::make_unique<OutOfPlaceState>(target);
  }
  return *s;
}

/// Steps a small model out of place (destinations and sources at odd offsets) and
/// compares with the reference's in-place step of a copy, bit for bit, sources intact.
bool validate_adamw_out_of_place(const cpu::Engine& eng, bool output) {
  const std::size_t sizes[] = {1, 33, 4097, 70001};
  std::size_t total = 0;
  for (auto s : sizes) total += s;
  std::mt19937 rng(6);
  std::normal_distribution<float> nd;
  std::vector<float> src(3 * total + 1), g(total);
  for (auto& x : src) x = std::abs(nd(rng)) * 1e-3f;
  for (auto& x : g) x = nd(rng) * 1e-2f;
  const std::vector<float> src_before = src;
  std::vector<float> ref(src.begin() + 1, src.end()), dst(3 * total + 2, -1.0f);
  std::vector<std::uint16_t> o1(total), o2(total);
  std::vector<float> s1(4, 2.0f), s2(4, 2.0f);
  std::vector<OptimizerTensor> a, b;
  std::size_t off = 0;
  for (int k = 0; k < 4; ++k) {
    const std::size_t n = sizes[k];
    const ConstTensorView gv{g.data() + off, n, DType::f32};
    a.push_back({{ref.data() + off, n, DType::f32},
                 {TensorView{ref.data() + total + off, n, DType::f32},
                  TensorView{ref.data() + 2 * total + off, n, DType::f32}},
                 &s1[k],
                 gv,
                 output ? TensorView{o1.data() + off, n, DType::bf16} : TensorView{}});
    OptimizerTensor t{{dst.data() + 2 + off, n, DType::f32},
                      {TensorView{dst.data() + 2 + total + off, n, DType::f32},
                       TensorView{dst.data() + 2 + 2 * total + off, n, DType::f32}},
                      &s2[k],
                      gv,
                      output ? TensorView{o2.data() + off, n, DType::bf16} : TensorView{}};
    t.param_src = {src.data() + 1 + off, n, DType::f32};
    t.state_src[0] = {src.data() + 1 + total + off, n, DType::f32};
    t.state_src[1] = {src.data() + 1 + 2 * total + off, n, DType::f32};
    b.push_back(t);
    off += n;
  }
  const GradientRead read{1.0f / 4096.0f, 0.5f};
  reference::adamw_step(a, AdamWConfig{}, read);
  eng.step(b, AdamWConfig{}, read);
  return std::memcmp(ref.data(), dst.data() + 2, 3 * total * 4) == 0 &&
         std::memcmp(o1.data(), o2.data(), total * 2) == 0 && src == src_before;
}

/// AdamW out of place (sources to destinations) against in place on the same buffers, at
/// args (isa, threads, millions of elements): f32 gradient, optional bf16 copy. The timed
/// loop is the out-of-place step; `oop/inplace` is the ratio of the two steps' best times
/// over rounds that alternate them (one speculative step's cost over the plain step's), and
/// `probe_oop/inplace` the same ratio of two trivial loops over the state arrays and the
/// gradient (in place; out of place with streaming stores): what this machine allows. The
/// timed loop's GB/s counts the in-place step's bytes.
template <bool Output>
void BM_AdamWOutOfPlace(benchmark::State& st) {
  const auto isa = static_cast<cpu::Isa>(st.range(0));
  const int threads = static_cast<int>(st.range(1));
  const cpu::Engine eng(cpu::EngineConfig{isa, threads});
  if (!validate_adamw_out_of_place(eng, Output)) validation_failed("the AdamW step out of place");
  if (!validate_adamw(eng, DType::f32, Output)) validation_failed("the AdamW step");
  OutOfPlaceState& s = out_of_place_state(static_cast<std::size_t>(st.range(2)) << 20);
  auto oop = s.tensors(true, Output);
  auto in_place = s.tensors(false, Output);
  const AdamWConfig cfg;
  const GradientRead read{1.0f / 4096.0f, 1.0f};
  auto step = [&](std::vector<OptimizerTensor>& t) {
    for (float& c : s.steps) c = 0.0f;  // keep the bias corrections in range
    eng.step(t, cfg, read);
  };
  const double bytes = static_cast<double>(s.total) * (12.0 + 4.0 + 12.0 + (Output ? 2.0 : 0.0));
  run_timed(
      st, [&] { step(oop); }, bytes);
  const int th = eng.threads();
  auto probe_in_place = [&] {
    probe_adamw(s.pd.get(), s.md.get(), s.vd.get(), s.g.get(), nullptr, s.total, th);
  };
  auto probe_streamed = [&] {
    probe_adamw_streamed(s.ps.get(), s.ms.get(), s.vs.get(), s.pd.get(), s.md.get(), s.vd.get(),
                         s.g.get(), s.total, th);
  };
  auto seconds = [&](auto fn) { return bytes / best_bandwidth(fn, bytes, 1); };
  double best_oop = 1e30, best_in_place = 1e30, probe_oop = 1e30, probe_in = 1e30;
  for (int r = 0; r < 7; ++r) {
    best_in_place = std::min(best_in_place, seconds([&] { step(in_place); }));
    best_oop = std::min(best_oop, seconds([&] { step(oop); }));
    probe_in = std::min(probe_in, seconds(probe_in_place));
    probe_oop = std::min(probe_oop, seconds(probe_streamed));
  }
  st.counters["oop_ms"] = best_oop * 1e3;
  st.counters["inplace_ms"] = best_in_place * 1e3;
  st.counters["oop/inplace"] = best_oop / best_in_place;
  st.counters["probe_oop/inplace"] = probe_oop / probe_in;
  st.SetLabel(std::string(eng.isa_name()) + "/t" + std::to_string(threads) + "/" +
              std::to_string(s.total) + " elements");
}

void BM_SignSgd(benchmark::State& st) {
  const cpu::Engine eng = engine_for(st);
  State& s = state();
  auto tensors = s.sign_sgd();
  {  // validate on a prefix of the gradients
    const std::size_t n = 70001;
    std::vector<float> p1(s.p.get(), s.p.get() + n), p2 = p1;
    std::vector<std::uint16_t> o1(n), o2(n);
    std::vector<OptimizerTensor> a(1), b(1);  // the param alone: no state slot, no counter
    a[0].param = {p1.data(), n, DType::f32};
    b[0].param = {p2.data(), n, DType::f32};
    a[0].grad = b[0].grad = {s.gbf16.get(), n, DType::bf16};
    a[0].compute_param = {o1.data(), n, DType::bf16};
    b[0].compute_param = {o2.data(), n, DType::bf16};
    const SignSgdConfig c{1e-3, 0.1};
    reference::sign_sgd_step(a, c);
    eng.step(b, c);
    if (std::memcmp(p1.data(), p2.data(), n * 4) || std::memcmp(o1.data(), o2.data(), n * 2))
      validation_failed("the SignSGD step");
  }
  const double bytes = static_cast<double>(s.total) * (4.0 + 2.0 + 4.0 + 2.0);
  const int th = eng.threads();
  auto kernel = [&] { eng.step(tensors, SignSgdConfig{1e-6, 0.0}); };
  auto probe = [&] { probe_sign_sgd(s.p.get(), s.gbf16.get(), s.out.get(), s.total, th); };
  run_timed(st, kernel, bytes);
  set_roofline(st, bytes, kernel, probe);
}

void BM_Accumulate(benchmark::State& st) {
  const cpu::Engine eng = engine_for(st);
  State& s = state();
  auto pairs = s.accumulate();
  {
    const std::size_t n = 70001;
    std::vector<float> a1(s.acc.get(), s.acc.get() + n), a2 = a1;
    std::vector<AccumulatePair> x{
        {{a1.data(), n, DType::f32}, {s.gbf16.get(), n, DType::bf16}, false}};
    std::vector<AccumulatePair> y{
        {{a2.data(), n, DType::f32}, {s.gbf16.get(), n, DType::bf16}, false}};
    reference::accumulate(x);
    eng.accumulate(y);
    if (std::memcmp(a1.data(), a2.data(), n * 4)) validation_failed("accumulate");
  }
  const double bytes = static_cast<double>(s.total) * (4.0 + 2.0 + 4.0);
  const int th = eng.threads();
  auto kernel = [&] { eng.accumulate(pairs); };
  auto probe = [&] { probe_accumulate(s.acc.get(), s.gbf16.get(), s.total, th); };
  run_timed(st, kernel, bytes);
  set_roofline(st, bytes, kernel, probe);
}

/// The norm partial of order O (2: squares; 1: |x|, clip_grad_norm_(norm_type=1)).
template <DType D, NormOrder O = NormOrder::two>
void BM_NormPartials(benchmark::State& st) {
  const cpu::Engine eng = engine_for(st);
  State& s = state();
  auto grads = s.grads(D);
  // f32: the offload manager's case, accumulators read with the step's scale.
  const GradientRead read{D == DType::f32 ? 1.0f / 4096.0f : 1.0f, 1.0f};
  {
    std::vector<ConstTensorView> first(grads.begin(), grads.begin() + 8);
    const NormResult a = finalize(reference::norm_partial(first, read, O), O);
    const NormResult b = eng.norm(first, read, O);
    if (f32_bits(a.norm) != f32_bits(b.norm)) validation_failed("norm_partial");
  }
  const double bytes = static_cast<double>(s.total) * dtype_size(D);
  const int th = eng.threads();
  auto kernel = [&] { benchmark::DoNotOptimize(eng.norm_partial(grads, read, NormMode::fast, O)); };
  auto probe = [&] {
    if constexpr (D == DType::f32)
      benchmark::DoNotOptimize(
          probe_read(reinterpret_cast<const std::uint32_t*>(s.acc.get()), s.total, th));
    else
      benchmark::DoNotOptimize(probe_read(s.gbf16.get(), s.total, th));
  };
  run_timed(st, kernel, bytes);
  set_roofline(st, bytes, kernel, probe);
}

void BM_StreamTriad(benchmark::State& st) {
  State& s = state();
  const int th = static_cast<int>(st.range(0));
  const double bytes = static_cast<double>(s.total) * 12.0;
  for (auto _ : st) triad(s.acc.get(), s.p.get(), s.m.get(), s.total, th);
  st.SetBytesProcessed(static_cast<std::int64_t>(bytes) * st.iterations());
  st.counters["GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel("t" + std::to_string(th));
}

void BM_AdamWScalarReference(benchmark::State& st) {
  State& s = state();
  auto tensors = s.adamw(DType::bf16, true);
  const double bytes = static_cast<double>(s.total) * 28.0;
  for (auto& t : tensors) *t.step = 0.0f;
  for (auto _ : st)
    reference::adamw_step(tensors, AdamWConfig{}, GradientRead{1.0f / 4096.0f, 1.0f});
  st.SetBytesProcessed(static_cast<std::int64_t>(bytes) * st.iterations());
  st.counters["GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["Gparams/s"] = benchmark::Counter(static_cast<double>(s.total) * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel("scalar reference, t1");
  for (auto& t : tensors) *t.step = 0.0f;
}

// Host cost per call of the GPU launchers' checks and plans for 2,000 tensors (a large
// model's list): what the host spends before the first launch; no device needed. Arg 0:
// scale+norm (0) or AdamW (1); arg 1: a first call (the cache of validated calls off:
// validation, one memory check per buffer, the plan) or a repeated call (the cache on:
// the arguments compared with the validated call's, no checks). The memory check is a
// counting no-op here (on a GPU each is a runtime query).
void BM_GpuPlanHostOverhead(benchmark::State& st) {
  const bool adamw = st.range(0) != 0;
  const bool repeated = st.range(1) != 0;
  const std::size_t n_tensors = 2000;
  std::vector<std::size_t> sizes;
  std::mt19937 rng(3);
  for (std::size_t i = 0; i < n_tensors; ++i) sizes.push_back(1 + rng() % 300000);
  std::vector<TensorView> views;
  std::vector<OptimizerTensor> tensors;
  std::vector<float> steps(n_tensors, 0.0f);
  std::uintptr_t fake = 0x100000;  // never dereferenced: plans are plain data
  for (std::size_t i = 0; i < n_tensors; ++i) {
    auto* p = reinterpret_cast<float*>(fake);
    fake += (sizes[i] * 4 + 255) / 256 * 256 * 4;
    views.push_back({p, sizes[i], DType::bf16});
    OptimizerTensor t;
    t.param = {p, sizes[i], DType::f32};
    t.state[0] = {p + sizes[i], sizes[i], DType::f32};
    t.state[1] = {p + 2 * sizes[i], sizes[i], DType::f32};
    t.grad = {p + 3 * sizes[i], sizes[i], DType::bf16};
    t.step = &steps[i];
    tensors.push_back(t);
  }
  float scalars[2] = {1.0f, 1.0f};
  double bias[2] = {1.0, 1.0};
  NormPartial partial{};
  std::vector<std::uint8_t> workspace(gpu::scale_and_norm_workspace_bytes(views));
  const OptimizerDeviceArgs d{&scalars[0], &scalars[1], nullptr, nullptr, bias};
  std::size_t checks = 0;
  const gpu::detail::MemoryCheck check = [&checks](const void*, std::size_t,
                                                   const ::stepcore::detail::Arg&) { ++checks; };
  const gpu::testing::ScopedPlanCache cache(repeated);
  auto call = [&] {
    if (adamw)
      benchmark::DoNotOptimize(gpu::detail::checked_optimizer_plan<::stepcore::detail::AdamW>(
          tensors, AdamWConfig{}, d, check));
    else
      benchmark::DoNotOptimize(gpu::detail::checked_norm_plan(
          views, &partial, "d_partial", workspace.data(), workspace.size(), check));
  };
  call();  // a repeated call's first: validated and cached here
  checks = 0;
  for (auto _ : st) call();
  st.counters["checks/call"] =
      static_cast<double>(checks) / static_cast<double>(std::max<std::int64_t>(st.iterations(), 1));
  st.SetLabel(std::string(adamw ? "AdamW" : "scale+norm") + " checks and plan, 2000 tensors, " +
              (repeated ? "repeated call (cached)" : "first call"));
}

/// The known-answer self-test of one ISA (arg 0), run afresh each iteration: what the
/// first engine of a process pays once per ISA (docs/numerics.md section 13).
void BM_SelfTest(benchmark::State& st) {
  const auto isa = static_cast<cpu::Isa>(st.range(0));
  double total = 0;
  for (auto _ : st) {
    cpu::testing::override_kernel_table(isa, nullptr);  // forget the recorded result
    const cpu::SelfTestResult r = cpu::self_test(isa);
    if (!r.passed) validation_failed("self_test");
    st.SetIterationTime(r.seconds);
    total += r.seconds;
  }
  st.counters["ms"] = total * 1e3 / static_cast<double>(st.iterations());
  st.SetLabel(std::string(cpu::isa_name(isa)));
}

void isa_args(benchmark::internal::Benchmark* b) {
  for (cpu::Isa isa : cpu::supported_isas()) b->Arg(static_cast<int>(isa));
}

void isa_thread_args(benchmark::internal::Benchmark* b) {
  static const bool noted = [] {
    const auto have = cpu::supported_isas();
    for (cpu::Isa isa : {cpu::Isa::sse2, cpu::Isa::avx2, cpu::Isa::avx512})
      if (std::find(have.begin(), have.end(), isa) == have.end())
        std::fprintf(stderr, "not run: %s (this processor lacks it)\n",
                     std::string(cpu::isa_name(isa)).c_str());
    return true;
  }();
  (void)noted;
  const int max_threads = cpu::Engine().threads();
  for (cpu::Isa isa : cpu::supported_isas())
    for (int t = 1; t <= max_threads; t *= 2) b->Args({static_cast<int>(isa), t, 0});
  if ((max_threads & (max_threads - 1)) != 0)
    for (cpu::Isa isa : cpu::supported_isas()) b->Args({static_cast<int>(isa), max_threads, 0});
  // Bound to the NUMA placement's cores, best ISA, all threads.
  if (!placement_cpus().empty()) b->Args({static_cast<int>(cpu::best_isa()), max_threads, 1});
}

/// (isa, threads, millions of elements) for the out-of-place comparison: avx2 and
/// avx512 where the processor runs them (else its best ISA), 1 and all threads, 16 M
/// and 64 M elements.
void out_of_place_args(benchmark::internal::Benchmark* b) {
  const int max_threads = cpu::Engine().threads();
  std::vector<cpu::Isa> isas;
  for (cpu::Isa isa : cpu::supported_isas())
    if (isa != cpu::Isa::sse2) isas.push_back(isa);
  if (isas.empty()) isas.push_back(cpu::best_isa());
  std::vector<int> thread_counts{1};
  if (max_threads > 1) thread_counts.push_back(max_threads);
  for (int m : {16, 64})  // size outermost: the buffers are built once per size
    for (cpu::Isa isa : isas)
      for (int t : thread_counts) b->Args({static_cast<int>(isa), t, m});
}

// ---- every optimizer unit of the table: registered at run time (register_units) ---------

/// Calls fn(std::integral_constant<int, K>{}) for a slot count k in [0, kMaxOptimizerSlots]:
/// the probes' loops over the slots unrolled for the unit's run-time count.
template <class Fn, int K = 0>
void with_slot_count(int k, Fn&& fn) {
  if constexpr (K < kMaxOptimizerSlots) {
    if (k != K) return with_slot_count<Fn, K + 1>(k, static_cast<Fn&&>(fn));
  }
  fn(std::integral_constant<int, K>{});
}

/// The generic records of the benchmark model for a unit with `k` slots (m, v, then x),
/// f32 gradients, bf16 copies.
std::vector<OptimizerTensor> generic_tensors(State& s, Slab<float>& x, int k, bool counters) {
  std::vector<OptimizerTensor> t;
  float* slots[kMaxOptimizerSlots] = {s.m.get(), s.v.get(), x.get()};
  for (std::size_t j = 0; j < s.sizes.size(); ++j) {
    const std::size_t o = s.offsets[j], n = s.sizes[j];
    OptimizerTensor a;
    a.param = {s.p.get() + o, n, DType::f32};
    for (int q = 0; q < k; ++q) a.state[q] = {slots[q] + o, n, DType::f32};
    a.step = counters ? &s.steps[j] : nullptr;
    a.grad = {s.gf32.get() + o, n, DType::f32};
    a.compute_param = {s.out.get() + o, n, DType::bf16};
    t.push_back(a);
  }
  return t;
}

/// Fresh validation arrays of n elements: a param and kMaxOptimizerSlots state arrays, all
/// non-negative (a valid state of every unit: Adagrad's sum among them), the third slot
/// above or below the second (amsgrad's max).
std::vector<std::vector<float>> fresh_arrays(std::size_t n) {
  std::vector<std::vector<float>> a(1 + kMaxOptimizerSlots);
  std::mt19937 rng(99);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::size_t i = 0; i < n; ++i) {
    a[0].push_back(nd(rng) * 0.02f);
    a[1].push_back(std::abs(nd(rng)) * 1e-4f);
    a[2].push_back(std::abs(nd(rng)) * 1e-8f);
    a[3].push_back(a[2].back() * (i % 2 == 0 ? 2.0f : 0.5f));
  }
  return a;
}

/// One optimizer unit's step through Engine::step at `cfg` (one of its samples) against the
/// same-traffic probe: its variant's K slots, f32 gradients, a bf16 copy. Validated first:
/// two steps on a prefix of the model, from the sample's step counter, equal
/// reference::optimizer_step's bit for bit.
template <class Unit>
void unit_benchmark(benchmark::State& st, const UnitSample<typename Unit::Config>& sample,
                    const std::string& what) {
  const cpu::Engine eng = engine_for(st);
  State& s = state();
  const auto& cfg = sample.config;
  const int k = Unit::slots(Unit::variant(cfg));
  const bool counters = Unit::kCountsSteps;
  static Slab<float> x(s.total);  // the third slot (amsgrad's max)
#pragma omp parallel for schedule(static)
  for (std::size_t i = 0; i < s.total; ++i) x.get()[i] = s.v.get()[i] * 2.0f;
  {
    const std::size_t n = 70001;
    // Fresh state (the timed runs and the probes leave the model's arrays anywhere).
    std::vector<std::vector<float>> a = fresh_arrays(n), b = a;
    std::vector<std::uint16_t> oa(n), ob(n);
    float ca = sample.step, cb = sample.step;
    auto record = [&](std::vector<std::vector<float>>& v, std::vector<std::uint16_t>& o, float& c) {
      OptimizerTensor t;
      t.param = {v[0].data(), n, DType::f32};
      for (int q = 0; q < k; ++q) t.state[q] = {v[q + 1].data(), n, DType::f32};
      t.step = counters ? &c : nullptr;
      t.grad = {s.gf32.get(), n, DType::f32};
      t.compute_param = {o.data(), n, DType::bf16};
      return t;
    };
    const OptimizerTensor ta = record(a, oa, ca), tb = record(b, ob, cb);
    for (int step = 0; step < 2; ++step) {
      reference::optimizer_step(std::span<const OptimizerTensor>(&ta, 1), OptimizerConfig(cfg));
      eng.step(std::span<const OptimizerTensor>(&tb, 1), cfg);
    }
    for (std::size_t q = 0; q < a.size(); ++q)
      for (std::size_t i = 0; i < n; ++i)
        if (f32_bits(a[q][i]) != f32_bits(b[q][i])) {
          std::fprintf(stderr, "array %zu element %zu: reference %a, engine %a\n", q, i,
                       static_cast<double>(a[q][i]), static_cast<double>(b[q][i]));
          validation_failed(what.c_str());
        }
    if (std::memcmp(oa.data(), ob.data(), n * 2) != 0 || ca != cb) validation_failed(what.c_str());
  }
  auto tensors = generic_tensors(s, x, k, counters);
  const double bytes = static_cast<double>(s.total) * (8.0 * (1 + k) + 4.0 + 2.0);
  const int th = eng.threads();
  auto kernel = [&] {
    for (float& c : s.steps) c = 0.0f;  // keep the bias corrections in range
    eng.step(std::span<const OptimizerTensor>(tensors), cfg);
  };
  float* slots[kMaxOptimizerSlots] = {s.m.get(), s.v.get(), x.get()};
  with_slot_count(k, [&](auto K) {
    auto probe = [&] {
      probe_slots<decltype(K)::value>(s.p.get(), slots, s.gf32.get(), s.out.get(), s.total, th);
    };
    run_timed(st, kernel, bytes);
    set_roofline(st, bytes, kernel, probe);
  });
}

/// One optimizer unit's step at `cfg` with bf16 params, state and gradients (torch's fused
/// bf16 path, docs/numerics.md 7.3) through Engine::step, against the same-traffic bf16
/// probe. Validated first: two steps on a prefix of the model equal the reference's bit
/// for bit.
template <class Unit>
void unit_benchmark_bf16(benchmark::State& st, const UnitSample<typename Unit::Config>& sample,
                         const std::string& what) {
  const cpu::Engine eng = engine_for(st);
  State& s = state();
  const auto& cfg = sample.config;
  const int k = Unit::slots(Unit::variant(cfg));
  const bool counters = Unit::kCountsSteps;
  // The bf16 model: param and up to kMaxOptimizerSlots slots, from the f32 model's values.
  static Slab<std::uint16_t> p16(s.total),
      slot16[kMaxOptimizerSlots] = {Slab<std::uint16_t>(s.total), Slab<std::uint16_t>(s.total),
                                    Slab<std::uint16_t>(s.total)};
#pragma omp parallel for schedule(static)
  for (std::size_t i = 0; i < s.total; ++i) {
    p16.get()[i] = f32_to_bf16_bits(s.p.get()[i]);
    slot16[0].get()[i] = f32_to_bf16_bits(s.m.get()[i]);
    slot16[1].get()[i] = f32_to_bf16_bits(s.v.get()[i]);
    slot16[2].get()[i] = f32_to_bf16_bits(s.v.get()[i] * 2.0f);
  }
  {
    const std::size_t n = 70001;
    const std::vector<std::vector<float>> f = fresh_arrays(n);
    std::vector<std::vector<std::uint16_t>> a(f.size());
    for (std::size_t q = 0; q < f.size(); ++q)
      for (float v : f[q]) a[q].push_back(f32_to_bf16_bits(v));
    std::vector<std::vector<std::uint16_t>> b = a;
    float ca = sample.step, cb = sample.step;
    auto record = [&](std::vector<std::vector<std::uint16_t>>& v, float& c) {
      OptimizerTensor t;
      t.param = {v[0].data(), n, DType::bf16};
      for (int q = 0; q < k; ++q) t.state[q] = {v[q + 1].data(), n, DType::bf16};
      t.step = counters ? &c : nullptr;
      t.grad = {s.gbf16.get(), n, DType::bf16};
      return t;
    };
    const OptimizerTensor ta = record(a, ca), tb = record(b, cb);
    for (int step = 0; step < 2; ++step) {
      reference::optimizer_step(std::span<const OptimizerTensor>(&ta, 1), OptimizerConfig(cfg));
      eng.step(std::span<const OptimizerTensor>(&tb, 1), cfg);
    }
    if (a != b || ca != cb) validation_failed(what.c_str());
  }
  std::vector<OptimizerTensor> tensors;
  for (std::size_t j = 0; j < s.sizes.size(); ++j) {
    const std::size_t o = s.offsets[j], n = s.sizes[j];
    OptimizerTensor a;
    a.param = {p16.get() + o, n, DType::bf16};
    for (int q = 0; q < k; ++q) a.state[q] = {slot16[q].get() + o, n, DType::bf16};
    a.step = counters ? &s.steps[j] : nullptr;
    a.grad = {s.gbf16.get() + o, n, DType::bf16};
    tensors.push_back(a);
  }
  const double bytes = static_cast<double>(s.total) * (4.0 * (1 + k) + 2.0);
  const int th = eng.threads();
  auto kernel = [&] {
    for (float& c : s.steps) c = 0.0f;  // keep the bias corrections in range
    eng.step(std::span<const OptimizerTensor>(tensors), cfg);
  };
  std::uint16_t* slots[kMaxOptimizerSlots] = {slot16[0].get(), slot16[1].get(), slot16[2].get()};
  with_slot_count(k, [&](auto K) {
    auto probe = [&] {
      probe_slots_bf16<decltype(K)::value>(p16.get(), slots, s.gbf16.get(), s.total, th);
    };
    run_timed(st, kernel, bytes);
    set_roofline(st, bytes, kernel, probe);
  });
}

/// The first of unit U's samples whose configuration computes variant v, or nullptr.
template <class U>
const UnitSample<typename U::Config>* first_sample(int v) {
  for (const auto& sample : U::kSamples)
    if (U::variant(sample.config) == v) return &sample;
  return nullptr;
}

/// A readable name of variant v of unit U: the fields of its first sample that select it
/// (each one that, set back to its default, selects another variant), joined by '/': a
/// flag by its name ("amsgrad"), AdamW's formula by its value ("native"), a number by its
/// name ("momentum"); "" when the sample selects it with the defaults.
template <class U>
std::string variant_label(int v) {
  using C = typename U::Config;
  const C& c = first_sample<U>(v)->config;
  std::string label;
  for (const HyperField<C>& f : OptimizerTraits<C>::kFields)
    std::visit(
        [&](auto member) {
          C back = c;
          back.*member = C{}.*member;
          if (U::variant(back) == v) return;
          label += label.empty() ? "" : "/";
          if constexpr (std::is_same_v<decltype(member), AdamWFormula C::*>)
            label += kAdamWFormulaNames[static_cast<std::size_t>(c.*member)];
          else
            label += f.name;
        },
        f.member);
  return label;
}

/// Registers, for every unit of the table (detail::AllUnits) and each of its variants, an
/// f32-gradient, bf16-copy benchmark and a bf16-params one, named
/// "<unit>[/<variant>]/f32grad/bf16out" and ".../bf16params" (the variant named by
/// variant_label, or "variant<v>" where two would share a name), each at the variant's
/// first sample (UnitSample: the unit's own configurations).
void register_units() {
  ::stepcore::detail::AllUnits::for_each([](auto unit) {
    using U = decltype(unit);
    std::vector<std::string> names;
    for (int v = 0; v < U::kVariants; ++v) {
      if (first_sample<U>(v) == nullptr) {
        std::fprintf(stderr, "not run: %s variant %d (no sample computes it)\n", U::kName, v);
        names.emplace_back();
        continue;
      }
      const std::string label = variant_label<U>(v);
      std::string name = std::string(U::kName) + (label.empty() ? "" : "/" + label);
      if (std::find(names.begin(), names.end(), name) != names.end())
        name = std::string(U::kName) + "/variant" + std::to_string(v);
      names.push_back(name);
    }
    for (int v = 0; v < U::kVariants; ++v) {
      if (names[v].empty()) continue;
      const auto* sample = first_sample<U>(v);
      const std::string f32 = names[v] + "/f32grad/bf16out", bf16 = names[v] + "/bf16params";
      benchmark::RegisterBenchmark(
          f32.c_str(), [sample, f32](benchmark::State& st) { unit_benchmark<U>(st, *sample, f32); })
          ->Apply(isa_thread_args)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark(
          bf16.c_str(),
          [sample, bf16](benchmark::State& st) { unit_benchmark_bf16<U>(st, *sample, bf16); })
          ->Apply(isa_thread_args)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  });
}

}  // namespace

BENCHMARK(BM_StreamTriad)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdamW<DType::bf16, true, false>)
    ->Name("AdamW/bf16grad/bf16out/prescaled")
    ->Apply(isa_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_AdamW<DType::bf16, true>)
    ->Name("AdamW/bf16grad/bf16out")
    ->Apply(isa_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_AdamW<DType::f32, true>)
    ->Name("AdamW/f32grad/bf16out")
    ->Apply(isa_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_AdamW<DType::f32, false>)
    ->Name("AdamW/f32grad")
    ->Apply(isa_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_AdamW8bit<DType::f32, false>)
    ->Name("AdamW8bit/f32grad")
    ->Apply(isa_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_AdamW8bit<DType::bf16, true>)
    ->Name("AdamW8bit/bf16grad/bf16out")
    ->Apply(isa_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_AdamWOutOfPlace<false>)
    ->Name("AdamW/outofplace/f32grad")
    ->Apply(out_of_place_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_AdamWOutOfPlace<true>)
    ->Name("AdamW/outofplace/f32grad/bf16out")
    ->Apply(out_of_place_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_SignSgd)
    ->Name("SignSGD/bf16grad/bf16out")
    ->Apply(isa_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Accumulate)
    ->Name("Accumulate/bf16")
    ->Apply(isa_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_NormPartials<DType::f32>)
    ->Name("NormPartials/f32/scaled")
    ->Apply(isa_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_NormPartials<DType::bf16>)
    ->Name("NormPartials/bf16")
    ->Apply(isa_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_NormPartials<DType::f32, NormOrder::one>)
    ->Name("Norm1Partials/f32/scaled")
    ->Apply(isa_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_NormPartials<DType::bf16, NormOrder::one>)
    ->Name("Norm1Partials/bf16")
    ->Apply(isa_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_SelfTest)
    ->Name("SelfTest")
    ->Apply(isa_args)
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(BM_GpuPlanHostOverhead)
    ->Name("GpuPlanHostOverhead")
    ->ArgNames({"adamw", "repeated"})
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AdamWScalarReference)
    ->Name("AdamW/scalar-reference")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(1);

// The units' benchmarks are registered at run time, after the studies above.
int main(int argc, char** argv) {
  register_units();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
