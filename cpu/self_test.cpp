// The known-answer self-test of each ISA's kernels (docs/numerics.md section 13): on
// first use in a process, every kernel of the ISA's table runs on a small built-in
// adversarial input and is compared, bit for bit, with stepcore::reference.
//
// Invariant: the inputs straddle every place the bodies branch — the vector width of
// every ISA (lengths 53 = 3*16 + 5), a range edge inside a tensor (the engine's chunk
// edges), torch's scalar tail, the norm's block edge (2048) — and hold the values where
// roundings differ: ±0, subnormals, bf16 and f16 rounding ties and overflow edges,
// FLT_MAX, ±Inf and NaN payloads, and pairs where a fused and an unfused multiply-add
// disagree. Comparison follows the spec: exact bits, except that two f32 (or f16) NaNs
// produced by arithmetic are equal whatever their payload and sign.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/fp_env.hpp"
#include "cpu/dispatch.hpp"
#include "cpu/testing.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/error.hpp"
#include "stepcore/reference.hpp"

namespace stepcore::cpu {
namespace {

using detail::KernelTable;

// ---- the inputs -----------------------------------------------------------------------

/// f32 patterns where roundings, conversions or NaN handling differ.
constexpr std::uint32_t kSpecials[] = {
    0x00000000u, 0x80000000u,               // +0, -0
    0x00000001u, 0x80000001u,               // smallest subnormals
    0x007FFFFFu, 0x00800000u,               // largest subnormal, smallest normal
    0x3F800000u, 0xBF800000u, 0x3F800001u,  // 1, -1, 1 + ulp
    0x3F808000u, 0x3F818000u,               // bf16 ties: to even (down), to even (up)
    0x3F801000u, 0x3F803000u,               // f16 ties: down, up
    0x33000000u, 0x33C00000u, 0x387FC000u,  // f16: 2^-25 (tie to 0), 1.5*2^-24, subnormal edge
    0x477FEFFFu, 0x477FF000u,               // f16: just below 65520, 65520 (to Inf)
    0x7F7F7FFFu, 0x7F7F8000u, 0x7F7FFFFFu,  // bf16 overflow edge, FLT_MAX
    0x3F802000u, 0x3F7FE000u,               // (1 + 2^-10)^2 and (1 - 2^-12)^2 style fma pairs
    0x7F800000u, 0xFF800000u,               // +-Inf
    0x7FC00000u, 0xFFC00001u, 0x7F800001u, 0x7FA00000u,  // NaNs: quiet, payload, signalling
};
constexpr std::size_t kSpecialCount = sizeof kSpecials / sizeof kSpecials[0];

/// A deterministic generator of f32 values with random sign, exponent in
/// [lo, hi] and mantissa.
struct Filler {
  std::uint64_t state = 0x9E3779B97F4A7C15ull;
  std::uint32_t next() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<std::uint32_t>(state >> 32);
  }
  float value(int lo, int hi) {
    const std::uint32_t r = next();
    const int e = lo + static_cast<int>(r % static_cast<std::uint32_t>(hi - lo + 1));
    const std::uint32_t bits =
        ((r >> 31) << 31) | (static_cast<std::uint32_t>(e + 127) << 23) | (next() & 0x7FFFFFu);
    return f32_from_bits(bits);
  }
};

constexpr std::size_t kLength = 53;  // 3 vectors of 16 + 5: every ISA has lanes and a tail
constexpr std::size_t kSplit = 32;   // a range edge inside the tensor (multiple of every width)
constexpr std::size_t kNormLength = detail::kNormBlockElements + kLength;

/// Values of a tensor: the specials (optionally without NaN/Inf) spread over the
/// tensor, random values in between.
std::vector<float> values(std::size_t n, Filler& f, bool specials, bool non_finite, int lo,
                          int hi) {
  std::vector<float> v(n);
  std::size_t s = 0;
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = f.value(lo, hi);
    if (specials && (n <= kLength ? i % 2 == 0 : i % 3 == 1)) {
      const float x = f32_from_bits(kSpecials[s++ % kSpecialCount]);
      if (non_finite || std::isfinite(x)) v[i] = x;
    }
  }
  return v;
}

/// Storage of `dtype` holding `src` converted (as the framework's buffers would).
std::vector<std::uint32_t> storage(DType dtype, const std::vector<float>& src) {
  std::vector<std::uint32_t> out((src.size() * dtype_size(dtype) + 3) / 4 + 1, 0);
  for (std::size_t i = 0; i < src.size(); ++i) {
    if (dtype == DType::f32) {
      std::memcpy(reinterpret_cast<char*>(out.data()) + 4 * i, &src[i], 4);
    } else {
      const std::uint16_t h =
          dtype == DType::bf16 ? f32_to_bf16_bits(src[i]) : f32_to_f16_bits(src[i]);
      std::memcpy(reinterpret_cast<char*>(out.data()) + 2 * i, &h, 2);
    }
  }
  return out;
}

// ---- comparison -----------------------------------------------------------------------

/// Returns "" when `got` equals `want` as `dtype` storage by the spec's rule, else the
/// first difference.
std::string compare(DType dtype, const void* want, const void* got, std::size_t n) {
  char buf[160];
  for (std::size_t i = 0; i < n; ++i) {
    if (dtype == DType::f32) {
      std::uint32_t a, b;
      std::memcpy(&a, static_cast<const char*>(want) + 4 * i, 4);
      std::memcpy(&b, static_cast<const char*>(got) + 4 * i, 4);
      const bool both_nan = (a & 0x7FFFFFFFu) > 0x7F800000u && (b & 0x7FFFFFFFu) > 0x7F800000u;
      if (a == b || both_nan) continue;
      std::snprintf(buf, sizeof buf, "element %zu: reference 0x%08x, kernel 0x%08x", i, a, b);
      return buf;
    }
    std::uint16_t a, b;
    std::memcpy(&a, static_cast<const char*>(want) + 2 * i, 2);
    std::memcpy(&b, static_cast<const char*>(got) + 2 * i, 2);
    // bf16 and f16 NaNs are exact (0x7FC0, 0x7E00: sign and payload dropped).
    if (a == b) continue;
    std::snprintf(buf, sizeof buf, "element %zu: reference 0x%04x, kernel 0x%04x", i, a, b);
    return buf;
  }
  return "";
}

const char* dtype_label(DType d) {
  return d == DType::f32 ? "f32" : d == DType::bf16 ? "bf16" : "f16";
}
const char* read_label(int mode) {
  return mode == 0 ? "plain" : mode == 1 ? "scaled" : "scaled+clipped";
}

GradientRead read_of(int mode) {
  GradientRead r;
  if (mode >= 1) r.scale = 0x1.555556p-6f;  // about 1/48: rounds on every grid
  if (mode >= 2) r.clip = 0x1.6p-1f;        // 0.6875
  return r;
}

constexpr DType kDTypes[] = {DType::f32, DType::bf16, DType::f16};

/// An out-of-place destination: kLength floats of NaN garbage starting `lead` elements past
/// a 64-byte boundary (lead 1: the streamed kernels' scalar head runs before their lanes).
struct Destination {
  std::vector<float> storage;
  float* data;
  explicit Destination(std::size_t lead)
      : storage(kLength + 16 + lead, f32_from_bits(0x7FC0DEADu)) {
    const auto a = reinterpret_cast<std::uintptr_t>(storage.data());
    data = storage.data() + (64 - a % 64) % 64 / sizeof(float) + lead;
  }
};

/// The first failure of one ISA's table, or nothing.
struct Failure {
  std::string kernel;
  std::string detail;
};

// ---- the cases --------------------------------------------------------------------------

bool check_adamw(const KernelTable& t, Failure& fail) {
  Filler f;
  const auto p0 = values(kLength, f, true, false, -20, 4);
  const auto m0 = values(kLength, f, true, false, -30, 0);
  auto v0 = values(kLength, f, true, false, -60, -2);
  for (float& x : v0) x = std::fabs(x);
  const auto g_vals = values(kLength, f, true, true, -24, 2);
  for (const AdamWFormula formula : {AdamWFormula::native, AdamWFormula::torch}) {
    for (const double wd : {0.0, 0.1}) {
      for (const double beta1 : {0.9, 0.3}) {  // torch's lerp: both branches
        if (formula == AdamWFormula::native && beta1 != 0.9) continue;
        AdamWConfig config;
        config.formula = formula;
        config.lr = 1e-3;
        config.beta1 = beta1;
        config.weight_decay = wd;
        for (const DType gd : kDTypes) {
          const auto g = storage(gd, g_vals);
          for (int out = 0; out < detail::kOutputKinds; ++out) {
            for (int mode = 0; mode < 3; ++mode) {
              if (out != 0 && mode == 1) continue;  // outputs once per read with a clip
              const GradientRead read = read_of(mode);
              const DType od = out == 0 ? DType::f32 : kDTypes[out - 1];
              std::vector<float> pr = p0, mr = m0, vr = v0, pk = p0, mk = m0, vk = v0;
              std::vector<std::uint32_t> outr(kLength + 1, 0), outk(kLength + 1, 0);
              float step_r = 2.0f, step_k = 2.0f;
              auto tensor = [&](std::vector<float>& p, std::vector<float>& m, std::vector<float>& v,
                                std::vector<std::uint32_t>& o, float* step) {
                AdamWTensor a;
                a.param = f32_view(p.data(), kLength);
                a.exp_avg = f32_view(m.data(), kLength);
                a.exp_avg_sq = f32_view(v.data(), kLength);
                a.step = step;
                a.grad = ConstTensorView(g.data(), kLength, gd);
                if (out != 0) a.compute_param = TensorView{o.data(), kLength, od};
                return a;
              };
              const AdamWTensor ref = tensor(pr, mr, vr, outr, &step_r);
              reference::adamw_step({&ref, 1}, config, read);
              const AdamWTensor ker = tensor(pk, mk, vk, outk, &step_k);
              step_k = step_k + 1.0f;
              // The same step out of place through the streamed kernel: sources p0/m0/v0,
              // destinations of garbage aligned alike (so all three stream).
              const std::size_t lead = wd == 0.0 ? 1 : 0;
              Destination ps(lead), ms(lead), vs(lead);
              std::vector<std::uint32_t> outs(kLength + 1, 0);
              float step_s = step_k;
              AdamWTensor oop = tensor(pk, mk, vk, outs, &step_s);
              oop.param = f32_view(ps.data, kLength);
              oop.exp_avg = f32_view(ms.data, kLength);
              oop.exp_avg_sq = f32_view(vs.data, kLength);
              oop.param_src = ConstTensorView(p0.data(), kLength, DType::f32);
              oop.exp_avg_src = ConstTensorView(m0.data(), kLength, DType::f32);
              oop.exp_avg_sq_src = ConstTensorView(v0.data(), kLength, DType::f32);
              using Unit = ::stepcore::detail::AdamW;
              const auto range = detail::adamw_range(ker, config, read, step_k);
              const auto streamed = detail::adamw_range(oop, config, read, step_s);
              const detail::UnitFn<Unit> fn = t.units.of<Unit>().step[0][static_cast<int>(gd)][out];
              const detail::UnitFn<Unit> fn_s =
                  t.units.of<Unit>().streamed[static_cast<int>(gd)][out];
              fn(range, 0, kSplit);
              fn(range, kSplit, kLength);
              fn_s(streamed, 0, kSplit);
              fn_s(streamed, kSplit, kLength);
              std::string d;
              const char* what = "";
              const char* path = "";
              for (const auto& [p, m, v, o, name] :
                   {std::tuple{pk.data(), mk.data(), vk.data(), outk.data(), ""},
                    std::tuple{ps.data, ms.data, vs.data, outs.data(), "streamed "}}) {
                if (d.empty()) d = compare(DType::f32, pr.data(), p, kLength), what = "param";
                if (d.empty()) d = compare(DType::f32, mr.data(), m, kLength), what = "exp_avg";
                if (d.empty()) d = compare(DType::f32, vr.data(), v, kLength), what = "exp_avg_sq";
                if (d.empty() && out != 0)
                  d = compare(od, outr.data(), o, kLength), what = "compute_param";
                if (!d.empty()) {
                  path = name;
                  break;
                }
              }
              if (!d.empty()) {
                fail.kernel = std::string("adamw ") + path + "(" +
                              (formula == AdamWFormula::torch ? "torch" : "native") + ", grad " +
                              dtype_label(gd) + ", output " +
                              (out == 0 ? "none" : dtype_label(od)) + ")";
                char buf[96];
                std::snprintf(buf, sizeof buf, "wd %g, beta1 %g, %s read: ", wd, beta1,
                              read_label(mode));
                fail.detail = buf + std::string(what) + " " + d;
                return false;
              }
            }
          }
        }
      }
    }
  }
  return true;
}

bool check_sign_sgd(const KernelTable& t, Failure& fail) {
  Filler f;
  const auto p0 = values(kLength, f, true, true, -20, 10);
  const auto g_vals = values(kLength, f, true, true, -30, 4);
  for (const double wd : {0.0, 0.1}) {
    SignSgdConfig config;
    config.lr = 1e-3;
    config.weight_decay = wd;
    for (const DType gd : kDTypes) {
      const auto g = storage(gd, g_vals);
      for (int out = 0; out < detail::kOutputKinds; ++out) {
        const DType od = out == 0 ? DType::f32 : kDTypes[out - 1];
        std::vector<float> pr = p0, pk = p0;
        std::vector<std::uint32_t> outr(kLength + 1, 0), outk(kLength + 1, 0);
        SignSgdTensor ref{f32_view(pr.data(), kLength), ConstTensorView(g.data(), kLength, gd), {}};
        if (out != 0) ref.compute_param = TensorView{outr.data(), kLength, od};
        reference::sign_sgd_step({&ref, 1}, config);
        SignSgdTensor ker{f32_view(pk.data(), kLength), ConstTensorView(g.data(), kLength, gd), {}};
        if (out != 0) ker.compute_param = TensorView{outk.data(), kLength, od};
        // The streamed kernel, out of place: source p0, a garbage destination.
        Destination ps(wd == 0.0 ? 1 : 0);
        std::vector<std::uint32_t> outs(kLength + 1, 0);
        SignSgdTensor oop = ker;
        oop.param = f32_view(ps.data, kLength);
        oop.param_src = ConstTensorView(p0.data(), kLength, DType::f32);
        if (out != 0) oop.compute_param = TensorView{outs.data(), kLength, od};
        using Unit = ::stepcore::detail::SignSgd;
        const auto range = detail::sign_sgd_range(ker, config);
        const auto streamed = detail::sign_sgd_range(oop, config);
        const detail::UnitFn<Unit> fn = t.units.of<Unit>().step[0][static_cast<int>(gd)][out];
        const detail::UnitFn<Unit> fn_s = t.units.of<Unit>().streamed[static_cast<int>(gd)][out];
        fn(range, 0, kSplit);
        fn(range, kSplit, kLength);
        fn_s(streamed, 0, kSplit);
        fn_s(streamed, kSplit, kLength);
        const char* path = "";
        std::string d = compare(DType::f32, pr.data(), pk.data(), kLength);
        if (d.empty() && out != 0) d = compare(od, outr.data(), outk.data(), kLength);
        if (d.empty()) {
          path = "streamed ";
          d = compare(DType::f32, pr.data(), ps.data, kLength);
          if (d.empty() && out != 0) d = compare(od, outr.data(), outs.data(), kLength);
        }
        if (!d.empty()) {
          fail.kernel = std::string("sign_sgd ") + path + "(grad " + dtype_label(gd) + ", output " +
                        (out == 0 ? "none" : dtype_label(od)) + ")";
          fail.detail = (wd == 0.0 ? "no decay: " : "decay: ") + d;
          return false;
        }
      }
    }
  }
  return true;
}

bool check_accumulate_and_scale(const KernelTable& t, Failure& fail) {
  Filler f;
  const auto acc0 = values(kLength, f, true, true, -30, 30);
  const auto src_vals = values(kLength, f, true, true, -30, 30);
  for (const DType sd : kDTypes) {
    const auto src = storage(sd, src_vals);
    for (const bool copy : {false, true}) {
      std::vector<float> ar = acc0, ak = acc0;
      const AccumulatePair pair{f32_view(ar.data(), kLength),
                                ConstTensorView(src.data(), kLength, sd), copy};
      reference::accumulate({&pair, 1});
      t.accumulate[static_cast<int>(sd)](ak.data(), src.data(), copy, 0, kSplit);
      t.accumulate[static_cast<int>(sd)](ak.data(), src.data(), copy, kSplit, kLength);
      const std::string d = compare(DType::f32, ar.data(), ak.data(), kLength);
      if (!d.empty()) {
        fail.kernel = std::string("accumulate (") + dtype_label(sd) + (copy ? ", copy)" : ", add)");
        fail.detail = d;
        return false;
      }
    }
    for (const float s : {0x1.555556p-6f, 3.0e5f}) {
      auto dr = src, dk = src;
      const TensorView view{dr.data(), kLength, sd};
      reference::scale_({&view, 1}, s);
      t.scale[static_cast<int>(sd)](dk.data(), s, 0, kSplit);
      t.scale[static_cast<int>(sd)](dk.data(), s, kSplit, kLength);
      const std::string d = compare(sd, dr.data(), dk.data(), kLength);
      if (!d.empty()) {
        fail.kernel = std::string("scale_ (") + dtype_label(sd) + ")";
        fail.detail = "scale " + std::to_string(s) + ": " + d;
        return false;
      }
    }
  }
  return true;
}

std::string partial_difference(const NormPartial& want, const NormPartial& got, bool digits,
                               NormOrder order) {
  char buf[160];
  if (want.nan_count != got.nan_count || want.inf_count != got.inf_count) {
    std::snprintf(buf, sizeof buf, "counts: reference %llu NaN %llu Inf, kernel %llu NaN %llu Inf",
                  static_cast<unsigned long long>(want.nan_count),
                  static_cast<unsigned long long>(want.inf_count),
                  static_cast<unsigned long long>(got.nan_count),
                  static_cast<unsigned long long>(got.inf_count));
    return buf;
  }
  if (want.max_abs_bits != got.max_abs_bits) {
    std::snprintf(buf, sizeof buf, "max |x|: reference 0x%08x, kernel 0x%08x", want.max_abs_bits,
                  got.max_abs_bits);
    return buf;
  }
  if (digits) {
    for (int k = 0; k < kNormDigits; ++k)
      if (want.digits[k] != got.digits[k]) {
        std::snprintf(buf, sizeof buf, "digit %d: reference 0x%llx, kernel 0x%llx", k,
                      static_cast<unsigned long long>(want.digits[k]),
                      static_cast<unsigned long long>(got.digits[k]));
        return buf;
      }
    return "";
  }
  const NormResult a = finalize(want, order), b = finalize(got, order);
  if (!b.needs_exact && f32_bits(a.norm) != f32_bits(b.norm) &&
      !(std::isnan(a.norm) && std::isnan(b.norm))) {
    std::snprintf(buf, sizeof buf, "norm: reference 0x%08x, kernel 0x%08x", f32_bits(a.norm),
                  f32_bits(b.norm));
    return buf;
  }
  return "";
}

bool check_norm(const KernelTable& t, Failure& fail) {
  Filler f;
  // A finite input across the block edge (mixed magnitudes: squares far outside f32),
  // and a short one with NaN and Inf (the exact fallback inside the fast kernel).
  const auto finite = values(kNormLength, f, true, false, -126, 127);
  const auto special = values(kLength, f, true, true, -40, 40);
  for (const DType dt : kDTypes) {
    for (const auto* vals : {&finite, &special}) {
      const std::size_t n = vals->size();
      const auto data = storage(dt, *vals);
      const ConstTensorView view(data.data(), n, dt);
      const std::size_t split =
          n > detail::kNormBlockElements ? detail::kNormBlockElements : kSplit;
      for (int mode = 0; mode < 3; ++mode) {
        const GradientRead read = read_of(mode);
        for (const NormOrder order : {NormOrder::two, NormOrder::one}) {
          NormPartial want = reference::norm_partial({&view, 1}, read, order);
          for (const bool exact : {false, true}) {
            const int o = static_cast<int>(order), g = static_cast<int>(dt);
            const detail::NormFn fn = exact ? t.norm_exact[o][g] : t.norm[o][g];
            NormPartial a, b;
            fn(data.data(), read, 0, split, a);
            fn(data.data(), read, split, n, b);
            merge(a, b);
            const std::string d = partial_difference(want, a, exact, order);
            if (!d.empty()) {
              fail.kernel = std::string(exact ? "norm_partial exact (" : "norm_partial fast (") +
                            (order == NormOrder::one ? "1-norm, " : "") + dtype_label(dt) + ")";
              fail.detail = std::to_string(n) + " elements, " + read_label(mode) + " read: " + d;
              return false;
            }
          }
        }
      }
    }
  }
  return true;
}

// ---- the once-per-process record ------------------------------------------------------

struct Registry {
  std::mutex mutex;  ///< guards results and warned (not the hot-path table lookup)
  std::optional<SelfTestResult> results[kIsaCount];
  bool warned[kIsaCount] = {};
  /// A test's replacement tables; read on every engine call, so atomic, not locked.
  std::atomic<const KernelTable*> overrides[kIsaCount] = {};
};

Registry& registry() {
  static Registry r;
  return r;
}

const KernelTable& builtin_table(Isa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case Isa::sse2:
      return detail::kernel_table_sse2();
    case Isa::avx2:
      return detail::kernel_table_avx2();
    case Isa::avx512:
      return detail::kernel_table_avx512();
#elif defined(__aarch64__)
    case Isa::neon:
      return detail::kernel_table_neon();
#endif
    default:
      break;
  }
  throw Error(Errc::not_supported, "isa",
              std::string(isa_name(isa)) + " has no kernels in this build (another target's ISA)");
}

/// The table engines of `isa` run: a test's replacement, else the built-in one.
const KernelTable& table_in_force(Isa isa) {
  const KernelTable* t =
      registry().overrides[static_cast<int>(isa)].load(std::memory_order_acquire);
  return t != nullptr ? *t : builtin_table(isa);
}

SelfTestResult run_self_test(Isa isa, const KernelTable& table) {
  const ::stepcore::detail::FpEnvGuard env;
  const auto start = std::chrono::steady_clock::now();
  Failure fail;
  const bool passed = check_adamw(table, fail) && check_sign_sgd(table, fail) &&
                      check_accumulate_and_scale(table, fail) && check_norm(table, fail);
  SelfTestResult r;
  r.isa = isa;
  r.passed = passed;
  r.kernel = fail.kernel;
  r.detail = fail.detail;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

}  // namespace

namespace detail {

const KernelTable& kernel_table(Isa isa) { return table_in_force(isa); }

bool warn_once_about(Isa isa) {
  Registry& reg = registry();
  const std::lock_guard<std::mutex> lock(reg.mutex);
  const bool first = !reg.warned[static_cast<int>(isa)];
  reg.warned[static_cast<int>(isa)] = true;
  return first;
}

}  // namespace detail

namespace testing {

void override_kernel_table(Isa isa, const detail::KernelTable* table) {
  Registry& reg = registry();
  const std::lock_guard<std::mutex> lock(reg.mutex);
  reg.overrides[static_cast<int>(isa)].store(table, std::memory_order_release);
  reg.results[static_cast<int>(isa)].reset();
  reg.warned[static_cast<int>(isa)] = false;
}

const detail::KernelTable& builtin_kernel_table(Isa isa) { return builtin_table(isa); }

}  // namespace testing

SelfTestResult self_test(Isa isa) {
  if (static_cast<int>(isa) >= kIsaCount)
    throw Error(Errc::invalid_argument, "isa", "not an Isa enumerator");
  if (!detail::isa_supported(isa))
    throw Error(Errc::not_supported, "isa",
                "this processor cannot run " + std::string(isa_name(isa)));
  Registry& reg = registry();
  const std::lock_guard<std::mutex> lock(reg.mutex);
  std::optional<SelfTestResult>& slot = reg.results[static_cast<int>(isa)];
  if (!slot) slot = run_self_test(isa, table_in_force(isa));
  return *slot;
}

}  // namespace stepcore::cpu
