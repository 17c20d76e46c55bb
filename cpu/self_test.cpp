// The known-answer self-test of each ISA's kernels (docs/numerics.md section 13): on
// first use in a process (cpu::self_test, registry.cpp), every kernel of the ISA's table
// runs on a small built-in adversarial input and is compared, bit for bit, with
// stepcore::reference: every optimizer unit of core/optimizers/all.hpp with each of its
// samples (Unit::kSamples: its variants and forms), every param/state, gradient and
// output dtype, in place and out of place (streamed), and with 8-bit state (units that
// take it: the table's dequantization and requantization); accumulate, scale_, the norms.
//
// Invariant: the inputs straddle every place the bodies branch — the vector width of
// every ISA (lengths 53 = 3*16 + 5), a range edge inside a tensor (the engine's chunk
// edges), torch's scalar tail, the norm's block edge (2048) — and hold the values where
// roundings differ: ±0, subnormals, bf16 and f16 rounding ties and overflow edges,
// FLT_MAX, ±Inf and NaN payloads, and pairs where a fused and an unfused multiply-add
// disagree. Comparison follows the spec: exact bits, except that two f32 (or f16) NaNs
// produced by arithmetic are equal whatever their payload and sign.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "core/fp_env.hpp"
#include "core/optimizers/all.hpp"
#include "cpu/dispatch.hpp"
#include "cpu/q8_slots.hpp"
#include "stepcore/convert.hpp"
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

// ---- the optimizer units ----------------------------------------------------------------

/// The initial values of one unit case (f32; converted to the param dtype when stored):
/// the param, each state slot, the gradient. Slots 1 and up hold second moments and maxima
/// (non-negative); slot 0 is signed, or non-negative in odd samples (Adagrad's sum).
struct UnitInputs {
  std::vector<float> param;
  std::vector<float> state[kMaxOptimizerSlots];
  std::vector<float> state_magnitudes;  // slot 0's values as magnitudes
  std::vector<float> grad;
  UnitInputs() {
    Filler f;
    param = values(kLength, f, true, true, -20, 4);
    state[0] = values(kLength, f, true, false, -30, 0);
    for (int k = 1; k < kMaxOptimizerSlots; ++k) {
      state[k] = values(kLength, f, true, false, -60, -2);
      for (float& x : state[k]) x = std::fabs(x);
    }
    state_magnitudes = state[0];
    for (float& x : state_magnitudes) x = std::fabs(x);
    grad = values(kLength, f, true, true, -24, 2);
  }
};

const UnitInputs& unit_inputs() {
  static const UnitInputs inputs;
  return inputs;
}

/// The arrays of one run of a unit's step: the param and the state slots in the param's
/// dtype, and the compute output; `dst` and `src` view them (in place: no sources).
template <class Opt>
struct UnitArrays {
  static constexpr int kArrays = 1 + Opt::kSlots;
  std::vector<std::uint32_t> data[kArrays];
  std::vector<std::uint32_t> out;
  UnitArrays(DType dtype, int sample) {
    const UnitInputs& in = unit_inputs();
    data[0] = storage(dtype, in.param);
    for (int k = 0; k < Opt::kSlots; ++k)
      data[1 + k] = storage(dtype, k == 0 && sample % 2 == 1 ? in.state_magnitudes : in.state[k]);
    out.assign(kLength + 1, 0);
  }
};

/// The label of one kernel of a unit: "adamw streamed (variant 2; param f32, grad bf16,
/// output f16)".
std::string unit_kernel_label(const char* unit, bool streamed, int variant, DType param, DType grad,
                              int out) {
  return std::string(unit) + (streamed ? " streamed" : "") + " (variant " +
         std::to_string(variant) + "; param " + dtype_label(param) + ", grad " + dtype_label(grad) +
         ", output " + (out == 0 ? "none" : dtype_label(kDTypes[out - 1])) + ")";
}

/// The reference's compute output in dtype `od` (output kind 2 or 3): its f32 one (the new
/// param) rounded to nearest even, as docs/numerics.md defines a compute output.
std::vector<std::uint32_t> rounded_output(const std::vector<std::uint32_t>& f32_out, DType od) {
  std::vector<float> p(kLength);
  std::memcpy(p.data(), f32_out.data(), kLength * sizeof(float));
  return storage(od, p);
}

/// Runs every kernel of unit Opt in `t` (in place for every param, gradient and output
/// dtype; through the streamed kernels for f32 params) on each of the unit's kSamples and
/// compares the results with the reference's step of the same arrays: one reference run
/// per sample, param and gradient dtype (an f32 param's with an f32 compute output, which
/// the other output dtypes round).
template <class Opt>
bool check_unit(const KernelTable& t, Failure& fail) {
  const detail::UnitKernels<Opt>& kernels = t.units.template of<Opt>();
  const std::vector<std::uint32_t> grads[] = {storage(DType::f32, unit_inputs().grad),
                                              storage(DType::bf16, unit_inputs().grad),
                                              storage(DType::f16, unit_inputs().grad)};
  int sample = 0;
  for (const ::stepcore::detail::UnitSample<typename Opt::Config>& s : Opt::kSamples) {
    const typename Opt::Config& config = s.config;
    const int variant = Opt::variant(config);
    const int used = Opt::slots(variant);
    const float step_after = Opt::kCountsSteps ? s.step + 1.0f : 0.0f;
    for (const DType pd : kDTypes) {
      const int p = static_cast<int>(pd);
      const bool f32 = pd == DType::f32;
      for (const DType gd : kDTypes) {
        const int g = static_cast<int>(gd);
        const int mode = (sample + g + p) % 3;  // every kernel meets every read over the samples
        const GradientRead read = read_of(mode);
        const void* grad = grads[g].data();
        // The reference, in place on its own copy.
        UnitArrays<Opt> want(pd, sample);
        float counter = s.step;
        OptimizerTensor rt;
        rt.param = TensorView{want.data[0].data(), kLength, pd};
        for (int k = 0; k < used; ++k)
          rt.state[k] = TensorView{want.data[1 + k].data(), kLength, pd};
        if (Opt::kCountsSteps) rt.step = &counter;
        rt.grad = ConstTensorView(grad, kLength, gd);
        if (f32) rt.compute_param = TensorView{want.out.data(), kLength, DType::f32};
        reference::optimizer_step({&rt, 1}, OptimizerConfig(config), read);
        // 16-bit params have no compute output (docs/numerics.md 7.3) and no streamed kernel.
        for (int out = 0; out < (f32 ? detail::kOutputKinds : 1); ++out) {
          const DType od = out == 0 ? DType::f32 : kDTypes[out - 1];
          const std::vector<std::uint32_t> want_out =
              out >= 2 ? rounded_output(want.out, od) : want.out;
          // The kernel in place, in two ranges (an edge inside the tensor, like a chunk's).
          const detail::UnitFn<Opt> fn = kernels.step[p][g][out];
          const detail::UnitFn<Opt> fn_s = f32 ? kernels.streamed[g][out] : nullptr;
          if (fn == nullptr || (f32 && fn_s == nullptr)) {
            fail.kernel = unit_kernel_label(Opt::kName, fn != nullptr, variant, pd, gd, out);
            fail.detail = "the table has no kernel here";
            return false;
          }
          UnitArrays<Opt> got(pd, sample);
          TensorView dst[UnitArrays<Opt>::kArrays] = {};
          ConstTensorView src[UnitArrays<Opt>::kArrays] = {};
          for (int k = 0; k <= used; ++k) dst[k] = TensorView{got.data[k].data(), kLength, pd};
          TensorView o = out == 0 ? TensorView{} : TensorView{got.out.data(), kLength, od};
          const auto range = detail::unit_range<Opt>(config, step_after, read, dst, src, grad, o);
          fn(range, 0, kSplit);
          fn(range, kSplit, kLength);
          // The same step out of place through the streamed kernel (f32 params): sources
          // the initial values, destinations of garbage aligned alike (so all of them
          // stream), one element past a line in odd samples (the scalar head first).
          std::vector<Destination> streamed_dst;
          std::vector<std::uint32_t> streamed_out(kLength + 1, 0);
          if (f32) {
            const UnitArrays<Opt> initial(pd, sample);
            streamed_dst.reserve(UnitArrays<Opt>::kArrays);
            for (int k = 0; k <= used; ++k) {
              streamed_dst.emplace_back(static_cast<std::size_t>(sample % 2));
              dst[k] = f32_view(streamed_dst.back().data, kLength);
              src[k] = ConstTensorView(initial.data[k].data(), kLength, DType::f32);
            }
            if (out != 0) o.data = streamed_out.data();
            const auto oop = detail::unit_range<Opt>(config, step_after, read, dst, src, grad, o);
            fn_s(oop, 0, kSplit);
            fn_s(oop, kSplit, kLength);
          }
          // Compare: the in-place arrays, then the streamed destinations.
          for (int path = 0; path < (f32 ? 2 : 1); ++path) {
            std::string d;
            const char* what = "";
            for (int k = 0; k <= used && d.empty(); ++k) {
              const void* g_k = path == 0 ? static_cast<const void*>(got.data[k].data())
                                          : static_cast<const void*>(streamed_dst[k].data);
              d = compare(pd, want.data[k].data(), g_k, kLength);
              what = k == 0 ? "param" : Opt::kSlotNames[k - 1];
            }
            if (d.empty() && out != 0) {
              d = compare(od, want_out.data(), path == 0 ? got.out.data() : streamed_out.data(),
                          kLength);
              what = "compute_param";
            }
            if (!d.empty()) {
              fail.kernel = unit_kernel_label(Opt::kName, path == 1, variant, pd, gd, out);
              char buf[96];
              std::snprintf(buf, sizeof buf, "sample %d, step %g, %s read: ", sample,
                            static_cast<double>(step_after), read_label(mode));
              fail.detail = buf + std::string(what) + " " + d;
              return false;
            }
          }
        }
      }
    }
    ++sample;
  }
  return true;
}

/// Runs each of unit Opt's q8 kernels (8-bit slots: every param, gradient and output dtype)
/// on one of the unit's samples in turn (the first kernel on all of them), and compares the params,
/// output, codes and maxima with the reference's step. The tensor is a whole block and a tail, run
/// as two ranges (a chunk edge); its codes are every code, its maxima every kind (0, subnormal,
/// torchao's floor, normal), its gradient adversarial.
template <class Opt>
bool check_q8_unit(const KernelTable& t, Failure& fail) {
  if constexpr (::stepcore::detail::unit_takes_q8<Opt>()) {
    constexpr std::size_t n = kQ8BlockSize + kLength;
    constexpr std::size_t blocks = 2;
    const detail::UnitKernels<Opt>& kernels = t.units.template of<Opt>();
    Filler f;
    const std::vector<float> param = values(n, f, true, false, -20, 4);
    const std::vector<float> grad = values(n, f, true, false, -30, 2);
    // Every kernel (param, gradient and output dtype) once, on samples in turn, and the
    // first kernel on every sample.
    constexpr int kSampleCount = static_cast<int>(std::size(Opt::kSamples));
    int kernel = 0;
    for (const DType pd : kDTypes)
      for (const DType gd : kDTypes)
        for (int out = 0; out < (pd == DType::f32 ? detail::kOutputKinds : 1); ++out, ++kernel)
          for (int sample = kernel == 0 ? 0 : kernel % kSampleCount;
               sample < (kernel == 0 ? kSampleCount : kernel % kSampleCount + 1); ++sample) {
            const ::stepcore::detail::UnitSample<typename Opt::Config>& s = Opt::kSamples[sample];
            const typename Opt::Config& config = s.config;
            const int variant = Opt::variant(config);
            const int used = Opt::slots(variant);
            const GradientRead read = read_of((sample + static_cast<int>(gd) + out) % 3);
            const std::vector<std::uint32_t> g = storage(gd, grad);
            struct Copy {
              std::vector<std::uint32_t> p;
              std::vector<std::uint8_t> codes[kMaxOptimizerSlots];
              float absmax[kMaxOptimizerSlots][blocks];
              float step;
            } want, got;
            want.p = storage(pd, param);
            want.step = s.step;
            for (int k = 0; k < used; ++k) {
              want.codes[k].resize(n);
              for (std::size_t i = 0; i < n; ++i)
                want.codes[k][i] = static_cast<std::uint8_t>((i * (2 * k + 1) + 7 * sample) % 256);
              want.absmax[k][0] = f32_from_bits(k == 0 ? 0x3A83126Fu : 0x00000005u << sample % 8);
              want.absmax[k][1] =
                  sample % 2 == 0 ? 0.0f : f32_from_bits(::stepcore::detail::kQ8TorchaoFloorBits);
            }
            got = want;
            auto view = [&](Copy& c) {
              OptimizerTensor v;
              v.param = TensorView{c.p.data(), n, pd};
              v.step = &c.step;
              v.grad = ConstTensorView(g.data(), n, gd);
              for (int k = 0; k < used; ++k) v.q8[k] = Q8Slot{c.codes[k].data(), c.absmax[k]};
              return v;
            };
            const bool f32 = pd == DType::f32;
            const DType od = out == 0 ? DType::f32 : kDTypes[out - 1];
            const detail::Q8Fn<Opt> fn =
                detail::q8_kernel(kernels, static_cast<int>(pd), static_cast<int>(gd), out);
            const std::string label =
                unit_kernel_label(Opt::kName, false, variant, pd, gd, out) + " q8";
            if (fn == nullptr) {
              fail.kernel = label;
              fail.detail = "the table has no kernel here";
              return false;
            }
            std::vector<std::uint32_t> want_out(n, 0), got_out(n + 1, 0);
            for (int step = 0; step < 1; ++step) {
              OptimizerTensor rv = view(want);
              if (f32) rv.compute_param = TensorView{want_out.data(), n, DType::f32};
              reference::optimizer_step({&rv, 1}, OptimizerConfig(config), read);
              OptimizerTensor kv = view(got);
              const TensorView o = out == 0 ? TensorView{} : TensorView{got_out.data(), n, od};
              kv.compute_param = o;
              const detail::Q8Slots q = detail::q8_slots<Opt>(kv, variant);
              got.step = got.step + 1.0f;
              TensorView dst[1 + Opt::kSlots] = {kv.param};
              ConstTensorView src[1 + Opt::kSlots] = {};
              const auto range =
                  detail::unit_range<Opt>(config, got.step, read, dst, src, g.data(), o);
              fn(range, q, 0, kQ8BlockSize);
              fn(range, q, kQ8BlockSize, n);  // a chunk edge between blocks
              std::string d = compare(pd, want.p.data(), got.p.data(), n);
              if (d.empty() && out != 0) {
                std::vector<float> w(n);
                std::memcpy(w.data(), want_out.data(), n * sizeof(float));
                d = compare(od, storage(od, w).data(), got_out.data(), n);
                if (!d.empty()) d = "compute_param " + d;
              }
              for (int k = 0; k < used && d.empty(); ++k) {
                for (std::size_t i = 0; i < n && d.empty(); ++i)
                  if (want.codes[k][i] != got.codes[k][i])
                    d = std::string(Opt::kSlotNames[k]) + " code " + std::to_string(i) + ": want " +
                        std::to_string(want.codes[k][i]) + ", got " +
                        std::to_string(got.codes[k][i]);
                for (std::size_t b = 0; b < blocks && d.empty(); ++b)
                  if (f32_bits(want.absmax[k][b]) != f32_bits(got.absmax[k][b]))
                    d = std::string(Opt::kSlotNames[k]) + " absmax " + std::to_string(b) +
                        " differs";
              }
              if (!d.empty()) {
                fail.kernel = label;
                fail.detail = "sample " + std::to_string(sample) + ", step " +
                              std::to_string(step) + ": " + d;
                return false;
              }
            }
          }
  }
  return true;
}

/// check_unit (and check_q8_unit) of every unit the library builds
/// (core/optimizers/all.hpp), in its order.
bool check_units(const KernelTable& t, Failure& fail) {
  bool ok = true;
  ::stepcore::detail::AllUnits::for_each([&](auto unit) {
    if (ok) ok = check_unit<decltype(unit)>(t, fail);
    if (ok) ok = check_q8_unit<decltype(unit)>(t, fail);
  });
  return ok;
}

// ---- accumulate, scale, norms -------------------------------------------------------------

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

}  // namespace

SelfTestResult detail::run_self_test(Isa isa, const KernelTable& table) {
  const ::stepcore::detail::FpEnvGuard env;
  const auto start = std::chrono::steady_clock::now();
  Failure fail;
  const bool passed = check_units(table, fail) && check_accumulate_and_scale(table, fail) &&
                      check_norm(table, fail);
  SelfTestResult r;
  r.isa = isa;
  r.passed = passed;
  r.kernel = fail.kernel;
  r.detail = fail.detail;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

}  // namespace stepcore::cpu
