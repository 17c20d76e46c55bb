// Unit: every formula of stepcore::reference (AdamW native and torch, Adam, SignSGD, SGD,
// Adagrad,
// accumulate, scale_, the gradient read) against expectations computed here from
// docs/numerics.md, independently of the library: hand-worked cases, a real-number
// AdamW in long double, and per-element re-implementations over dtypes x sizes.
#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/step_scalars.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"

namespace {

using stepcore::AccumulatePair;
using stepcore::AdamWConfig;
using stepcore::AdamWFormula;
using stepcore::bfloat16_t;
using stepcore::ConstTensorView;
using stepcore::DType;
using stepcore::float16_t;
using stepcore::GradientRead;
using stepcore::OptimizerTensor;
using stepcore::SignSgdConfig;
using stepcore::TensorView;
namespace ref = stepcore::reference;

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }
float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }
constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// f32 of a double: one correct rounding. For a +,-,*,/,sqrt of f32 operands
// evaluated in double this is the correctly rounded f32 result (53 >= 2*24+2),
// an evaluation path independent of f32 arithmetic.
float F(double x) { return static_cast<float>(x); }
double D(float x) { return static_cast<double>(x); }

// Compares float vectors bit for bit, reporting the first few differences.
void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want,
                      const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (bits(got[i]) != bits(want[i]) && ++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << " (" << std::hex << bits(got[i])
                    << "), want " << want[i] << " (" << bits(want[i]) << ")" << std::dec << " of "
                    << got.size();
}

// ---- storage of any dtype --------------------------------------------------------------

struct Buf {
  DType dtype = DType::f32;
  std::vector<float> f;
  std::vector<std::uint16_t> h;

  Buf() = default;
  Buf(DType t, std::size_t n) : dtype(t) {
    if (t == DType::f32)
      f.assign(n, 0.0f);
    else
      h.assign(n, 0);
  }
  std::size_t size() const { return dtype == DType::f32 ? f.size() : h.size(); }
  void* data() {
    return dtype == DType::f32 ? static_cast<void*>(f.data()) : static_cast<void*>(h.data());
  }
  const void* data() const {
    return dtype == DType::f32 ? static_cast<const void*>(f.data())
                               : static_cast<const void*>(h.data());
  }
  TensorView view() { return {data(), size(), dtype}; }
  ConstTensorView cview() const { return {data(), size(), dtype}; }
  float get(std::size_t i) const {
    switch (dtype) {
      case DType::f32:
        return f[i];
      case DType::bf16:
        return stepcore::bf16_bits_to_f32(h[i]);
      case DType::f16:
        return stepcore::f16_bits_to_f32(h[i]);
    }
    return kNaN;
  }
  void set(std::size_t i, float x) {  // stores R_T(x)
    switch (dtype) {
      case DType::f32:
        f[i] = x;
        break;
      case DType::bf16:
        h[i] = stepcore::f32_to_bf16_bits(x);
        break;
      case DType::f16:
        h[i] = stepcore::f32_to_f16_bits(x);
        break;
    }
  }
  std::vector<unsigned char> bytes() const {
    std::vector<unsigned char> b(size() * (dtype == DType::f32 ? 4 : 2));
    if (!b.empty()) std::memcpy(b.data(), data(), b.size());
    return b;
  }
};

// R_T(x) for a dtype.
float round_dt(float x, DType t) {
  Buf b(t, 1);
  b.set(0, x);
  return b.get(0);
}

// The spec's gradient read: x = R_T(R_T(f32(g) * scale) * clip).
float read_grad(const Buf& g, std::size_t i, GradientRead r) {
  const float a = round_dt(g.get(i) * r.scale, g.dtype);
  return round_dt(a * r.clip, g.dtype);
}

// A random value representable in dtype t: |x| log-uniform in [10^lo, 10^hi].
float rand_val(std::mt19937_64& rng, DType t, double lo, double hi) {
  std::uniform_real_distribution<double> e(lo, hi);
  const double m = std::pow(10.0, e(rng));
  return round_dt(F((rng() & 1) ? -m : m), t);
}

const std::vector<std::size_t>& boundary_sizes() {
  static const std::vector<std::size_t> s = [] {
    std::vector<std::size_t> v = {0,  1,  7,  15,  16,  17,  31,   32,   33,
                                  63, 64, 65, 127, 128, 129, 1023, 1024, 1025};
    std::mt19937_64 rng(2024);
    for (int i = 0; i < 6; ++i) v.push_back(static_cast<std::size_t>(rng() % 3000));
    return v;
  }();
  return s;
}

// ---- independent AdamW scalars and elements (docs/numerics.md section 7) -----------------

struct NativeS {
  float decay, b1, b2, omb1, omb2, step_size, bc2_sqrt, eps;
};

NativeS native_scalars(const AdamWConfig& c, float step) {
  NativeS s{};
  const float lr = F(c.lr), b1 = F(c.beta1), b2 = F(c.beta2), wd = F(c.weight_decay);
  s.decay = F(1.0 - D(lr) * D(wd));
  s.b1 = b1;
  s.b2 = b2;
  s.omb1 = F(1.0 - D(b1));  // 1 - b1 in f32, via double
  s.omb2 = F(1.0 - D(b2));
  const double bc1 = 1.0 - std::pow(D(b1), D(step));
  const double bc2 = 1.0 - std::pow(D(b2), D(step));
  s.step_size = F(D(lr) / bc1);
  s.bc2_sqrt = F(std::sqrt(bc2));
  s.eps = F(c.eps);
  return s;
}

// One native element, each operation evaluated in double and rounded to f32.
void native_element(float& p, float& m, float& v, float g, const NativeS& s) {
  p = F(D(p) * D(s.decay));
  m = F(D(F(D(m) * D(s.b1))) + D(F(D(g) * D(s.omb1))));
  v = F(D(F(D(v) * D(s.b2))) + D(F(D(F(D(g) * D(g))) * D(s.omb2))));
  const float d = F(D(F(D(F(std::sqrt(D(v)))) / D(s.bc2_sqrt))) + D(s.eps));
  p = F(D(p) - D(F(D(F(D(s.step_size) * D(m))) / D(d))));
}

struct TorchS {
  float decay;
  bool apply_decay;
  float w, coeff;
  bool small;
  float b2, c2, bc2_sqrt, neg_step, eps;
};

TorchS torch_scalars(const AdamWConfig& c, float step) {
  TorchS s{};
  s.apply_decay = c.weight_decay != 0.0;
  s.decay = F(1.0 - c.lr * c.weight_decay);
  s.w = F(1.0 - c.beta1);
  s.small = std::fabs(s.w) < 0.5f;
  s.coeff = s.small ? s.w : F(D(s.w) - 1.0);
  s.b2 = F(c.beta2);
  s.c2 = F(1.0 - c.beta2);
  const double bc1 = 1.0 - std::pow(c.beta1, D(step));
  s.bc2_sqrt = F(std::sqrt(1.0 - std::pow(c.beta2, D(step))));
  s.neg_step = F(-(c.lr / bc1));
  s.eps = F(c.eps);
  return s;
}

// torch's second moment: body v = fma(c2*g, g, v*b2); tail v = fma(v, b2, (c2*g)*g).
float torch_v_body(float v, float g, const TorchS& s) {
  return std::fma(F(D(s.c2) * D(g)), g, F(D(v) * D(s.b2)));
}
float torch_v_tail(float v, float g, const TorchS& s) {
  return std::fma(v, s.b2, F(D(F(D(s.c2) * D(g))) * D(g)));
}

// One torch element; `tail` selects the scalar-tail form of v.
void torch_element(float& p, float& m, float& v, float g, const TorchS& s, bool tail) {
  if (s.apply_decay) p = F(D(p) * D(s.decay));
  const float diff = F(D(g) - D(m));
  m = s.small ? std::fma(s.coeff, diff, m) : std::fma(s.coeff, diff, g);
  v = tail ? torch_v_tail(v, g, s) : torch_v_body(v, g, s);
  const float d = F(D(F(D(F(std::sqrt(D(v)))) / D(s.bc2_sqrt))) + D(s.eps));
  p = F(D(p) + D(F(D(F(D(s.neg_step) * D(m))) / D(d))));
}

// ---- AdamW test state: several tensors with their buffers ------------------------------

struct AdamWBufs {
  std::vector<float> p, m, v;
  float step = 0.0f;
  Buf g;
  Buf out;  // size 0 and dtype f32 with no data: no output
  bool has_out = false;

  OptimizerTensor tensor() {
    OptimizerTensor t;
    t.param = stepcore::f32_view(p.data(), p.size());
    t.state[0] = stepcore::f32_view(m.data(), m.size());
    t.state[1] = stepcore::f32_view(v.data(), v.size());
    t.step = &step;
    t.grad = g.cview();
    if (has_out) t.compute_param = out.view();
    return t;
  }
};

AdamWBufs random_adamw(std::mt19937_64& rng, std::size_t n, DType gdt, bool out, DType odt) {
  AdamWBufs b;
  b.p.resize(n);
  b.m.resize(n);
  b.v.resize(n);
  b.g = Buf(gdt, n);
  std::uniform_int_distribution<int> st(0, 50);
  b.step = static_cast<float>(st(rng));
  for (std::size_t i = 0; i < n; ++i) {
    b.p[i] = rand_val(rng, DType::f32, -3, 1);
    b.m[i] = rand_val(rng, DType::f32, -6, -1);
    b.v[i] = std::fabs(rand_val(rng, DType::f32, -10, -2));
    b.g.set(i, rand_val(rng, DType::f32, gdt == DType::f16 ? -5 : -8, 1));
    if (rng() % 37 == 0) b.g.set(i, (rng() & 1) ? 0.0f : -0.0f);
    if (rng() % 41 == 0) b.m[i] = 0.0f;
    if (rng() % 43 == 0) b.v[i] = 0.0f;
  }
  if (out) {
    b.has_out = true;
    b.out = Buf(odt, n);
  }
  return b;
}

void adamw(std::vector<AdamWBufs>& bs, const AdamWConfig& c, GradientRead read = {},
           const std::int32_t* found_inf = nullptr) {
  std::vector<OptimizerTensor> ts;
  for (AdamWBufs& b : bs) ts.push_back(b.tensor());
  ref::adamw_step(ts, c, read, found_inf);
}

// The expected state after one step, element by element.
AdamWBufs expected_adamw(const AdamWBufs& in, const AdamWConfig& c, GradientRead read) {
  AdamWBufs e = in;
  e.step = in.step + 1.0f;
  const std::size_t n = in.p.size();
  const std::size_t w = c.torch_tail_width > 1 ? static_cast<std::size_t>(c.torch_tail_width) : 1;
  const std::size_t tail_begin = c.torch_tail_width > 1 ? n - n % w : n;
  const NativeS ns = native_scalars(c, e.step);
  const TorchS ts = torch_scalars(c, e.step);
  for (std::size_t i = 0; i < n; ++i) {
    const float g = read_grad(in.g, i, read);
    if (c.formula == AdamWFormula::native)
      native_element(e.p[i], e.m[i], e.v[i], g, ns);
    else
      torch_element(e.p[i], e.m[i], e.v[i], g, ts, c.torch_v_first || i >= tail_begin);
    if (e.has_out) e.out.set(i, e.p[i]);
  }
  return e;
}

void expect_adamw_equal(const AdamWBufs& got, const AdamWBufs& want) {
  expect_same_bits(got.p, want.p, "param");
  expect_same_bits(got.m, want.m, "exp_avg");
  expect_same_bits(got.v, want.v, "exp_avg_sq");
  EXPECT_EQ(bits(got.step), bits(want.step)) << "step";
  EXPECT_EQ(got.g.bytes(), want.g.bytes()) << "grad was written";
  EXPECT_EQ(got.out.bytes(), want.out.bytes()) << "compute_param";
}

AdamWConfig native_config() {
  AdamWConfig c;
  c.formula = AdamWFormula::native;
  return c;
}
/// The torch formula of torch's x86 build (tail width `tail`; v's body and tail forms), or
/// with `v_first` its aarch64 build's v on every element; not the target's default.
AdamWConfig torch_config(int tail = 8, bool v_first = false) {
  AdamWConfig c;
  c.formula = AdamWFormula::torch;
  c.torch_tail_width = tail;
  c.torch_v_first = v_first;
  return c;
}

// ---- scalars ----------------------------------------------------------------------

TEST(AdamWScalars, MatchIndependentPreparation) {
  const AdamWConfig cfgs[] = {native_config(), torch_config(),
                              [] {
                                AdamWConfig c;
                                c.lr = 0.1;
                                c.beta1 = 0.3;
                                c.beta2 = 0.95;
                                c.eps = 1e-6;
                                c.weight_decay = 0.5;
                                return c;
                              }(),
                              [] {
                                AdamWConfig c;
                                c.weight_decay = 0.0;
                                return c;
                              }()};
  for (AdamWConfig c : cfgs)
    for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch})
      for (float step : {1.0f, 2.0f, 10.0f, 1000.0f, 16777215.0f}) {
        c.formula = f;
        const stepcore::AdamWScalars s = stepcore::prepare_adamw_scalars(c, step);
        SCOPED_TRACE(testing::Message()
                     << "formula " << static_cast<int>(f) << " step " << step << " lr " << c.lr);
        EXPECT_EQ(bits(s.bc2_sqrt),
                  bits(f == AdamWFormula::native ? native_scalars(c, step).bc2_sqrt
                                                 : torch_scalars(c, step).bc2_sqrt));
        EXPECT_EQ(bits(s.eps), bits(F(c.eps)));
        if (f == AdamWFormula::native) {
          const NativeS n = native_scalars(c, step);
          EXPECT_EQ(bits(s.decay), bits(n.decay));
          EXPECT_EQ(bits(s.beta1), bits(n.b1));
          EXPECT_EQ(bits(s.beta2), bits(n.b2));
          EXPECT_EQ(bits(s.one_minus_beta1), bits(n.omb1));
          EXPECT_EQ(bits(s.one_minus_beta2), bits(n.omb2));
          EXPECT_EQ(bits(s.step_size), bits(n.step_size));
        } else {
          const TorchS t = torch_scalars(c, step);
          EXPECT_EQ(s.apply_decay, t.apply_decay);
          if (t.apply_decay) {
            EXPECT_EQ(bits(s.decay), bits(t.decay));
          }
          EXPECT_EQ(s.lerp_small, t.small);
          EXPECT_EQ(bits(s.lerp_coeff), bits(t.coeff));
          EXPECT_EQ(bits(s.beta2), bits(t.b2));
          EXPECT_EQ(bits(s.one_minus_beta2), bits(t.c2));
          EXPECT_EQ(bits(s.step_size), bits(t.neg_step));
        }
      }
}

TEST(AdamWScalars, NativeAndTorchDifferWhereTheSpecSaysSo) {
  // native rounds beta1 to f32 before the bias correction; torch keeps double.
  // f32(0.9) = 0.89999997615814208984375, so at step 1 bc1 differs by 2.4e-8
  // relative to 0.1: the step sizes f32(1e-3 / bc1) differ.
  AdamWConfig c;
  c.lr = 1e-3;
  c.beta1 = 0.9;
  c.formula = AdamWFormula::native;
  const float native_step = stepcore::prepare_adamw_scalars(c, 1.0f).step_size;
  c.formula = AdamWFormula::torch;
  const float torch_step = stepcore::prepare_adamw_scalars(c, 1.0f).step_size;
  EXPECT_EQ(bits(native_step), bits(F(D(F(1e-3)) / (1.0 - D(F(0.9))))));
  EXPECT_EQ(bits(torch_step), bits(F(-(1e-3 / (1.0 - 0.9)))));
  EXPECT_NE(bits(native_step), bits(-torch_step));
  // torch: w = 0.7 for beta1 = 0.3 -> the large-weight lerp branch, coeff w - 1.
  c.beta1 = 0.3;
  const stepcore::AdamWScalars s = stepcore::prepare_adamw_scalars(c, 1.0f);
  EXPECT_FALSE(s.lerp_small);
  EXPECT_EQ(bits(s.lerp_coeff), bits(F(0.7) - 1.0f));
  // wd = 0: torch skips the decay, native multiplies by exactly 1.
  c.weight_decay = 0.0;
  EXPECT_FALSE(stepcore::prepare_adamw_scalars(c, 1.0f).apply_decay);
  c.formula = AdamWFormula::native;
  EXPECT_EQ(bits(stepcore::prepare_adamw_scalars(c, 1.0f).decay), bits(1.0f));
}

// The torchao formula's scalars (docs/numerics.md 8e): f32 hyper-parameters, the lerp
// coefficients folded in binary64 as torch.compile folds them, and f32 bias corrections
// from the C library's powf, as torchao's compiled kernel computes them (which is not the
// f32 of the binary64 power everywhere).
TEST(AdamWScalars, TorchaoFoldsItsLerpsInBinary64AndTakesPowf) {
  AdamWConfig c;
  c.formula = AdamWFormula::torchao;
  c.lr = 3e-3;
  c.weight_decay = 0.1;
  c.beta1 = 0.3;
  c.beta2 = 0.4;
  const stepcore::AdamWScalars s = stepcore::prepare_adamw_scalars(c, 1.0f);
  EXPECT_EQ(bits(s.decay), bits(F(3e-3) * F(0.1)));
  EXPECT_EQ(bits(s.step_size), bits(F(3e-3)));
  EXPECT_FALSE(s.lerp_small);
  EXPECT_FALSE(s.v_small);
  EXPECT_EQ(bits(s.lerp_coeff), bits(F((1.0 - 0.3) - 1.0)));
  EXPECT_EQ(bits(s.one_minus_beta2), bits(F((1.0 - 0.4) - 1.0)));
  EXPECT_NE(bits(s.one_minus_beta2), bits(F(1.0 - 0.4) - 1.0f)) << "folded in f32 instead";
  EXPECT_EQ(bits(s.bc1), bits(1.0f - F(0.3)));
  EXPECT_EQ(bits(s.bc2_sqrt), bits(std::sqrt(1.0f - F(0.4))));
  // Step 2958 of beta2 = 0.999: the C library's powf (at run time: a compiler folds a
  // constant call exactly) differs from the f32 of the binary64 power.
  c.beta2 = 0.999;
  volatile float base = F(0.999), exponent = 2958.0f;
  const float p_powf = powf(base, exponent);
  const float p_pow = F(std::pow(D(F(0.999)), 2958.0));
  ASSERT_NE(bits(p_powf), bits(p_pow)) << "the example that tells the two apart";
  EXPECT_EQ(bits(stepcore::prepare_adamw_scalars(c, 2958.0f).bc2_sqrt),
            bits(std::sqrt(1.0f - p_powf)));
}

// ---- native AdamW ----------------------------------------------------------------------

TEST(AdamWNative, HandWorkedSingleElement) {
  // p = 1, g = 0.5, m = 0.1, v = 0.01, step 0 -> 1; lr 1e-3, betas 0.9/0.999,
  // eps 1e-8, wd 0.01. Every operation written out with double evaluation and
  // one rounding to f32 each.
  const float lr = F(1e-3), b1 = F(0.9), b2 = F(0.999), eps = F(1e-8), wd = F(0.01);
  const float decay = F(1.0 - D(lr) * D(wd));
  const float omb1 = F(1.0 - D(b1)), omb2 = F(1.0 - D(b2));
  const float step_size = F(D(lr) / (1.0 - D(b1)));  // bc1 at step 1 = 1 - b1
  const float bc2_sqrt = F(std::sqrt(1.0 - D(b2)));
  float p = 1.0f, m = 0.1f, v = 0.01f;
  const float g = 0.5f;
  p = F(D(p) * D(decay));
  const float m_keep = F(D(m) * D(b1));
  const float m_new = F(D(g) * D(omb1));
  m = F(D(m_keep) + D(m_new));
  const float v_keep = F(D(v) * D(b2));
  const float g2 = F(D(g) * D(g));
  const float v_new = F(D(g2) * D(omb2));
  v = F(D(v_keep) + D(v_new));
  const float root = F(std::sqrt(D(v)));
  const float denom = F(D(F(D(root) / D(bc2_sqrt))) + D(eps));
  const float upd = F(D(F(D(step_size) * D(m))) / D(denom));
  p = F(D(p) - D(upd));

  std::vector<AdamWBufs> bs(1);
  bs[0].p = {1.0f};
  bs[0].m = {0.1f};
  bs[0].v = {0.01f};
  bs[0].g = Buf(DType::f32, 1);
  bs[0].g.set(0, 0.5f);
  adamw(bs, native_config());
  EXPECT_EQ(bits(bs[0].p[0]), bits(p));
  EXPECT_EQ(bits(bs[0].m[0]), bits(m));
  EXPECT_EQ(bits(bs[0].v[0]), bits(v));
  EXPECT_EQ(bits(bs[0].step), bits(1.0f));
  // Sanity of the hand computation itself: m = 0.09 + 0.05, v ~ 0.00999 + 0.00025.
  EXPECT_NEAR(m, 0.14, 1e-7);
  EXPECT_NEAR(v, 0.01024, 1e-8);
}

TEST(AdamWNative, CloseToRealNumberAdamW) {
  // The real-number AdamW in long double with the exact hyper-parameters; the f32
  // result must stay within a small relative distance over 20 steps.
  std::mt19937_64 rng(1);
  AdamWConfig c = native_config();
  c.lr = 1e-2;
  c.weight_decay = 0.1;
  const std::size_t n = 64;
  std::vector<AdamWBufs> bs(1);
  AdamWBufs& b = bs[0];
  b.p.resize(n);
  b.m.assign(n, 0.0f);
  b.v.assign(n, 0.0f);
  b.g = Buf(DType::f32, n);
  std::vector<long double> P(n), M(n, 0), V(n, 0);
  for (std::size_t i = 0; i < n; ++i) P[i] = b.p[i] = rand_val(rng, DType::f32, -1, 0.5);
  for (int t = 1; t <= 20; ++t) {
    for (std::size_t i = 0; i < n; ++i) b.g.set(i, rand_val(rng, DType::f32, -3, 0));
    adamw(bs, c);
    // The native formula holds its hyper-parameters in f32 (1 - f32(0.999) is
    // 1.3e-5 away from 0.001 relatively), so the real-number AdamW uses those values.
    const long double b1 = F(c.beta1), b2 = F(c.beta2), lr = F(c.lr), wd = F(c.weight_decay),
                      eps = F(c.eps);
    for (std::size_t i = 0; i < n; ++i) {
      const long double g = b.g.get(i);
      M[i] = b1 * M[i] + (1 - b1) * g;
      V[i] = b2 * V[i] + (1 - b2) * g * g;
      const long double mh = M[i] / (1 - std::pow(b1, static_cast<long double>(t)));
      const long double vh = V[i] / (1 - std::pow(b2, static_cast<long double>(t)));
      P[i] = P[i] * (1 - lr * wd) - lr * mh / (std::sqrt(vh) + eps);
      // m: a few f32 roundings of terms <= 1 per step (m may cancel to ~0: absolute).
      ASSERT_NEAR(static_cast<double>(b.m[i]), static_cast<double>(M[i]), 1e-6);
      // v: a sum of non-negative terms, a few ulps relative per step.
      ASSERT_NEAR(static_cast<double>(b.v[i]), static_cast<double>(V[i]),
                  2e-6 * static_cast<double>(V[i]) + 1e-20);
      // The update has size ~lr; the f32 parameter carries ~1e-7 relative error per step.
      ASSERT_NEAR(static_cast<double>(b.p[i]), static_cast<double>(P[i]), 1e-5)
          << "step " << t << " i " << i;
    }
  }
  EXPECT_EQ(bits(b.step), bits(20.0f));
}

TEST(AdamWNative, NoFusedMultiplyAdd) {
  // Find m, g where m*b1 + g*omb1 rounded twice differs from fma(m, b1, g*omb1):
  // the reference must give the separately rounded sum.
  std::mt19937_64 rng(2);
  const NativeS s = native_scalars(native_config(), 1.0f);
  int found = 0;
  for (int i = 0; i < 100000 && found < 20; ++i) {
    const float m = rand_val(rng, DType::f32, -3, 0), g = rand_val(rng, DType::f32, -3, 0);
    const float sep = F(D(F(D(m) * D(s.b1))) + D(F(D(g) * D(s.omb1))));
    const float fused = std::fma(m, s.b1, F(D(g) * D(s.omb1)));
    if (bits(sep) == bits(fused)) continue;
    ++found;
    std::vector<AdamWBufs> bs(1);
    bs[0].p = {1.0f};
    bs[0].m = {m};
    bs[0].v = {0.0f};
    bs[0].g = Buf(DType::f32, 1);
    bs[0].g.set(0, g);
    adamw(bs, native_config());
    EXPECT_EQ(bits(bs[0].m[0]), bits(sep));
  }
  EXPECT_EQ(found, 20);
}

TEST(AdamWNative, StepCounterIncrementedFirst) {
  for (float step0 : {0.0f, 1.0f, 41.0f, 16777214.0f}) {
    std::mt19937_64 rng(3);
    std::vector<AdamWBufs> bs = {random_adamw(rng, 9, DType::f32, false, DType::f32)};
    bs[0].step = step0;
    const AdamWBufs want = expected_adamw(bs[0], native_config(), {});
    // The expectation with the un-incremented counter, to show it differs.
    AdamWBufs stale_in = bs[0];
    stale_in.step = step0 - 1.0f;
    const AdamWBufs stale = expected_adamw(stale_in, native_config(), {});
    adamw(bs, native_config());
    EXPECT_EQ(bits(bs[0].step), bits(step0 + 1.0f));
    expect_adamw_equal(bs[0], want);
    if (step0 < 100.0f) {
      EXPECT_NE(bits(bs[0].p[0]), bits(stale.p[0])) << step0;
    }
  }
  // At step 1 with zero moments the bias-corrected update is ~lr * sign(g).
  std::vector<AdamWBufs> bs(1);
  bs[0].p = {0.0f, 0.0f};
  bs[0].m = {0.0f, 0.0f};
  bs[0].v = {0.0f, 0.0f};
  bs[0].g = Buf(DType::f32, 2);
  bs[0].g.set(0, 2.0f);
  bs[0].g.set(1, -0.25f);
  AdamWConfig c = native_config();
  c.weight_decay = 0.0;
  adamw(bs, c);
  EXPECT_NEAR(bs[0].p[0], -1e-3, 1e-8);
  EXPECT_NEAR(bs[0].p[1], 1e-3, 1e-8);
}

TEST(AdamWNative, WeightDecayZeroAndNonZero) {
  for (double wd : {0.0, 0.01, 0.5}) {
    for (double lr : {1e-3, 0.1, 1.0}) {
      if (lr * wd > 1.0) continue;
      std::mt19937_64 rng(4);
      AdamWConfig c = native_config();
      c.lr = lr;
      c.weight_decay = wd;
      std::vector<AdamWBufs> bs = {random_adamw(rng, 33, DType::f32, true, DType::f32)};
      const AdamWBufs want = expected_adamw(bs[0], c, {});
      adamw(bs, c);
      expect_adamw_equal(bs[0], want);
    }
  }
  // wd = 0 and g = 0, m = v = 0: the parameter is untouched (decay 1, update 0).
  std::vector<AdamWBufs> bs(1);
  bs[0].p = {1.2345f, -0.0f};
  bs[0].m = {0.0f, 0.0f};
  bs[0].v = {0.0f, 0.0f};
  bs[0].g = Buf(DType::f32, 2);
  AdamWConfig c = native_config();
  c.weight_decay = 0.0;
  adamw(bs, c);
  EXPECT_EQ(bits(bs[0].p[0]), bits(1.2345f));
  // -0 * 1 = -0; -0 - (0 / d) = -0 - 0 = -0.
  EXPECT_EQ(bits(bs[0].p[1]), bits(-0.0f));
}

// ---- torch AdamW -------------------------------------------------------------------

// One-element torch step with tail width 0 (body form); returns {p, m, v}.
std::vector<float> torch_one(float p, float m, float v, float g, AdamWConfig c) {
  std::vector<AdamWBufs> bs(1);
  bs[0].p = {p};
  bs[0].m = {m};
  bs[0].v = {v};
  bs[0].g = Buf(DType::f32, 1);
  bs[0].g.set(0, g);
  adamw(bs, c);
  return {bs[0].p[0], bs[0].m[0], bs[0].v[0]};
}

TEST(AdamWTorch, LerpUsesFmaSmallWeight) {
  // beta1 = 0.9: w = f32(0.1) < 0.5, m' = fma(w, g - m, m).
  AdamWConfig c = torch_config(0);
  const TorchS s = torch_scalars(c, 1.0f);
  ASSERT_TRUE(s.small);
  std::mt19937_64 rng(5);
  int found = 0;
  for (int i = 0; i < 100000 && found < 20; ++i) {
    const float m = rand_val(rng, DType::f32, -3, 0), g = rand_val(rng, DType::f32, -3, 0);
    const float diff = F(D(g) - D(m));
    const float fused = std::fma(s.coeff, diff, m);
    const float sep = F(D(m) + D(F(D(s.coeff) * D(diff))));
    if (bits(fused) == bits(sep)) continue;
    ++found;
    EXPECT_EQ(bits(torch_one(1.0f, m, 0.0f, g, c)[1]), bits(fused));
  }
  EXPECT_EQ(found, 20);
}

TEST(AdamWTorch, LerpLargeWeightBranch) {
  // beta1 = 0.3: w = f32(0.7) >= 0.5, m' = fma(w - 1, g - m, g). Pick inputs where
  // it differs from the small-weight form fma(w, g - m, m) and from the unfused form.
  AdamWConfig c = torch_config(0);
  c.beta1 = 0.3;
  const TorchS s = torch_scalars(c, 1.0f);
  ASSERT_FALSE(s.small);
  ASSERT_EQ(bits(s.coeff), bits(F(0.7) - 1.0f));
  std::mt19937_64 rng(6);
  int found = 0;
  for (int i = 0; i < 200000 && found < 20; ++i) {
    const float m = rand_val(rng, DType::f32, -3, 0), g = rand_val(rng, DType::f32, -3, 0);
    const float diff = F(D(g) - D(m));
    const float large = std::fma(s.coeff, diff, g);
    const float small_form = std::fma(s.w, diff, m);
    const float unfused = F(D(g) + D(F(D(s.coeff) * D(diff))));
    if (bits(large) == bits(small_form) || bits(large) == bits(unfused)) continue;
    ++found;
    EXPECT_EQ(bits(torch_one(1.0f, m, 0.0f, g, c)[1]), bits(large));
  }
  EXPECT_EQ(found, 20);
}

TEST(AdamWTorch, TailWidthSelectsTheTailForm) {
  // For every element choose v, g where the body form fma(c2*g, g, v*b2) and the
  // tail form fma(v, b2, (c2*g)*g) differ (about 1 in 4; both are within an ulp of
  // the exact value, so at most two distinct results exist); then exactly the last
  // numel % W elements of each tensor carry the tail form; with torch_v_first (torch's
  // aarch64 build) every element does, whatever W.
  std::mt19937_64 rng(7);
  const AdamWConfig base = torch_config();
  const TorchS s = torch_scalars(base, 1.0f);
  auto make = [&](std::size_t n) {
    AdamWBufs b;
    b.p.assign(n, 1.0f);
    b.m.assign(n, 0.0f);
    b.v.resize(n);
    b.g = Buf(DType::f32, n);
    for (std::size_t i = 0; i < n; ++i) {
      bool found = false;
      for (int tries = 0; tries < 10000 && !found; ++tries) {
        const float v = std::fabs(rand_val(rng, DType::f32, -4, -1));
        const float g = rand_val(rng, DType::f32, -2, 0);
        if (bits(torch_v_body(v, g, s)) != bits(torch_v_tail(v, g, s))) {
          b.v[i] = v;
          b.g.set(i, g);
          found = true;
        }
      }
      if (!found) ADD_FAILURE() << "no input separates the body and tail forms";
    }
    return b;
  };
  struct Case {
    int width;
    std::size_t n;
    std::size_t fused;  // number of trailing elements in the fused form
  };
  const Case cases[] = {{8, 11, 3},  {8, 16, 0}, {8, 7, 7},  {16, 11, 11}, {16, 16, 0},
                        {16, 33, 1}, {0, 11, 0}, {1, 11, 0}, {64, 65, 1},  {3, 10, 1}};
  for (const bool v_first : {false, true})
    for (const Case& k : cases) {
      SCOPED_TRACE(testing::Message() << "W " << k.width << " n " << k.n << " v_first " << v_first);
      AdamWConfig c = base;
      c.torch_tail_width = k.width;
      c.torch_v_first = v_first;
      std::vector<AdamWBufs> bs = {make(k.n),
                                   make(k.n + 5)};  // two tensors: the tail is per tensor
      const std::vector<AdamWBufs> in = bs;
      adamw(bs, c);
      for (std::size_t t = 0; t < bs.size(); ++t) {
        const std::size_t n = bs[t].v.size();
        const std::size_t w = k.width > 1 ? static_cast<std::size_t>(k.width) : 1;
        const std::size_t nfused = k.width > 1 ? n % w : 0;
        if (t == 0) {
          EXPECT_EQ(nfused, k.fused);
        }
        for (std::size_t i = 0; i < n; ++i) {
          const float v0 = in[t].v[i], g = in[t].g.get(i);
          const float want =
              v_first || i >= n - nfused ? torch_v_tail(v0, g, s) : torch_v_body(v0, g, s);
          EXPECT_EQ(bits(bs[t].v[i]), bits(want)) << "tensor " << t << " i " << i;
        }
      }
    }
}

TEST(AdamWTorch, HandWorkedWeightDecayAndSign) {
  // lr 0.1, wd 0.5, torch: p = 2 * f32(0.95) first. Zero moments, g = 1 at step 1:
  // m = fma(f32(0.1), 1, 0) = f32(0.1); v = f32(0.001) * 1 * 1 = f32(0.001);
  // d = sqrt(v) / f32(sqrt(0.001)) + eps; p += f32(-(0.1 / 0.1)) * m / d.
  AdamWConfig c = torch_config(0);
  c.lr = 0.1;
  c.weight_decay = 0.5;
  const std::vector<float> r = torch_one(2.0f, 0.0f, 0.0f, 1.0f, c);
  const float p1 = F(2.0 * D(F(0.95)));
  const float m1 = F(1.0 - 0.9);
  const float v1 = F(D(F(D(F(1.0 - 0.999)) * 1.0)) * 1.0);
  const float d = F(D(F(std::sqrt(D(v1)) / D(F(std::sqrt(1.0 - 0.999))))) + D(F(1e-8)));
  const float neg_step = F(-(0.1 / (1.0 - 0.9)));
  const float p2 = F(D(p1) + D(F(D(F(D(neg_step) * D(m1))) / D(d))));
  EXPECT_EQ(bits(r[0]), bits(p2));
  EXPECT_EQ(bits(r[1]), bits(m1));
  EXPECT_EQ(bits(r[2]), bits(v1));
  EXPECT_NEAR(r[0], 1.9 - 0.1, 1e-6);  // decayed by 5 %, then an update of ~lr
  // wd = 0 skips the multiply: p stays exactly 2 before the update.
  c.weight_decay = 0.0;
  const std::vector<float> r0 = torch_one(2.0f, 0.0f, 0.0f, 1.0f, c);
  EXPECT_EQ(bits(r0[0]), bits(F(D(2.0f) + D(F(D(F(D(neg_step) * D(m1))) / D(d))))));
}

// ---- both formulas over grad dtypes x boundary sizes ----------------------------------------

template <class T>
struct GradType : ::testing::Test {};
using GradTypes = ::testing::Types<float, bfloat16_t, float16_t>;
TYPED_TEST_SUITE(GradType, GradTypes);

TYPED_TEST(GradType, AdamWMatchesPerElementExpectation) {
  constexpr DType gdt = stepcore::dtype_of_v<TypeParam>;
  std::mt19937_64 rng(100 + static_cast<int>(gdt));
  const GradientRead reads[] = {{1.0f, 1.0f}, {1.0f / 3.0f, 0.71f}, {0.001f, 1.0f}};
  for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch})
    for (const GradientRead& rd : reads) {
      SCOPED_TRACE(testing::Message()
                   << "formula " << static_cast<int>(f) << " scale " << rd.scale);
      AdamWConfig c =
          f == AdamWFormula::native ? native_config() : torch_config(rng() % 2 ? 8 : 16);
      c.weight_decay = rng() % 3 == 0 ? 0.0 : 0.05;
      // All boundary sizes in one call, each with its own counter and output dtype.
      std::vector<AdamWBufs> bs;
      for (std::size_t n : boundary_sizes())
        bs.push_back(random_adamw(rng, n, gdt, rng() % 4 != 0, static_cast<DType>(rng() % 3)));
      std::vector<AdamWBufs> want;
      for (const AdamWBufs& b : bs) want.push_back(expected_adamw(b, c, rd));
      adamw(bs, c, rd);
      for (std::size_t t = 0; t < bs.size(); ++t) {
        SCOPED_TRACE(testing::Message() << "tensor " << t << " numel " << bs[t].p.size());
        expect_adamw_equal(bs[t], want[t]);
        if (bs[t].has_out) {
          for (std::size_t i = 0; i < bs[t].p.size(); ++i) {
            ASSERT_EQ(bits(bs[t].out.get(i)), bits(round_dt(bs[t].p[i], bs[t].out.dtype)));
          }
        }
      }
    }
}

TYPED_TEST(GradType, ReadEqualsEagerScaleThenClip) {
  constexpr DType gdt = stepcore::dtype_of_v<TypeParam>;
  std::mt19937_64 rng(200 + static_cast<int>(gdt));
  const GradientRead reads[] = {
      {0.37f, 0.83f}, {1.0f + 0x1p-11f, 1.0f - 0x1p-11f}, {1e-3f, 0.0f}, {4.0f, 0.5f}};
  for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch})
    for (const GradientRead& rd : reads) {
      const AdamWConfig c = f == AdamWFormula::native ? native_config() : torch_config();
      std::vector<AdamWBufs> lazy;
      for (std::size_t n : {1, 17, 64, 129})
        lazy.push_back(random_adamw(rng, n, gdt, true, DType::bf16));
      std::vector<AdamWBufs> eager = lazy;
      for (AdamWBufs& b : eager) {
        const TensorView v = b.g.view();
        ref::scale_({&v, 1}, rd.scale);
        ref::scale_({&v, 1}, rd.clip);
      }
      adamw(lazy, c, rd);
      adamw(eager, c);
      for (std::size_t t = 0; t < lazy.size(); ++t) {
        expect_same_bits(lazy[t].p, eager[t].p, "param");
        expect_same_bits(lazy[t].m, eager[t].m, "exp_avg");
        expect_same_bits(lazy[t].v, eager[t].v, "exp_avg_sq");
        EXPECT_EQ(lazy[t].out.bytes(), eager[t].out.bytes());
        EXPECT_EQ(bits(lazy[t].step), bits(eager[t].step));
      }
    }
}

TYPED_TEST(GradType, AnF32RoundedReadIsTheReadOfTheExactlyWidenedGradient) {
  // docs/numerics.md 3: as_f32 reads g as an f32 buffer holding f32(g) is read (for f32
  // gradients the two are one), in the steps and in the norm.
  constexpr DType gdt = stepcore::dtype_of_v<TypeParam>;
  std::mt19937_64 rng(250 + static_cast<int>(gdt));
  const GradientRead reads[] = {{0.37f, 0.83f}, {1.0f / 3000.0f, 1.0f}, {1e-3f, 0.0f}};
  for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch})
    for (GradientRead rd : reads) {
      SCOPED_TRACE(testing::Message() << "formula " << static_cast<int>(f) << " scale " << rd.scale
                                      << " clip " << rd.clip);
      const AdamWConfig c = f == AdamWFormula::native ? native_config() : torch_config();
      std::vector<AdamWBufs> held;
      for (std::size_t n : boundary_sizes())
        held.push_back(random_adamw(rng, n, gdt, true, DType::bf16));
      std::vector<AdamWBufs> widened = held;
      for (AdamWBufs& b : widened) {
        Buf w(DType::f32, b.g.size());
        for (std::size_t i = 0; i < w.size(); ++i) w.f[i] = b.g.get(i);  // exact
        b.g = w;
      }
      // The norm of the same reads, digit for digit.
      std::vector<ConstTensorView> hv, wv;
      for (const AdamWBufs& b : held) hv.push_back(b.g.cview());
      for (const AdamWBufs& b : widened) wv.push_back(b.g.cview());
      GradientRead as_f32 = rd;
      as_f32.as_f32 = true;
      EXPECT_TRUE(same_value(ref::norm_partial(hv, {as_f32.scale, 1.0f, true}),
                             ref::norm_partial(wv, {as_f32.scale, 1.0f})));
      adamw(held, c, as_f32);
      adamw(widened, c, rd);
      for (std::size_t t = 0; t < held.size(); ++t) {
        expect_same_bits(held[t].p, widened[t].p, "param");
        expect_same_bits(held[t].m, widened[t].m, "exp_avg");
        expect_same_bits(held[t].v, widened[t].v, "exp_avg_sq");
        EXPECT_EQ(held[t].out.bytes(), widened[t].out.bytes());
      }
    }
}

TYPED_TEST(GradType, SignSgdMatchesPerElementExpectation) {
  constexpr DType gdt = stepcore::dtype_of_v<TypeParam>;
  std::mt19937_64 rng(300 + static_cast<int>(gdt));
  for (double wd : {0.0, 0.1}) {
    SignSgdConfig c;
    c.lr = 0.01;
    c.weight_decay = wd;
    struct S {
      std::vector<float> p;
      Buf g, out;
      bool has_out;
    };
    std::vector<S> ss;
    for (std::size_t n : boundary_sizes()) {
      S s;
      s.p.resize(n);
      s.g = Buf(gdt, n);
      s.has_out = rng() % 2 == 0;
      s.out = Buf(static_cast<DType>(rng() % 3), s.has_out ? n : 0);
      for (std::size_t i = 0; i < n; ++i) {
        s.p[i] = rand_val(rng, DType::f32, -3, 1);
        s.g.set(i, rand_val(rng, DType::f32, -4, 1));
        if (rng() % 7 == 0) s.g.set(i, (rng() & 1) ? 0.0f : -0.0f);
      }
      ss.push_back(std::move(s));
    }
    std::vector<OptimizerTensor> ts;
    for (S& s : ss) {
      OptimizerTensor t;
      t.param = stepcore::f32_view(s.p.data(), s.p.size());
      t.grad = s.g.cview();
      if (s.has_out) t.compute_param = s.out.view();
      ts.push_back(t);
    }
    std::vector<S> want = ss;
    const float neg_lr = F(-c.lr), neg_lr_wd = F(-(c.lr * c.weight_decay));
    for (S& s : want)
      for (std::size_t i = 0; i < s.p.size(); ++i) {
        const float g = s.g.get(i);
        const float sg = g > 0 ? 1.0f : (g < 0 ? -1.0f : 0.0f);
        float p = s.p[i];
        if (wd > 0) p = std::fma(p, neg_lr_wd, p);
        s.p[i] = std::fma(sg, neg_lr, p);
        if (s.has_out) s.out.set(i, s.p[i]);
      }
    const std::vector<S> before = ss;
    // The read's scale and clip are validated but not applied.
    ref::sign_sgd_step(ts, c, {0.125f, 0.5f});
    for (std::size_t t = 0; t < ss.size(); ++t) {
      expect_same_bits(ss[t].p, want[t].p, "param");
      EXPECT_EQ(ss[t].out.bytes(), want[t].out.bytes());
      EXPECT_EQ(ss[t].g.bytes(), before[t].g.bytes()) << "grad was written";
    }
  }
}

TYPED_TEST(GradType, AccumulateCopyAndAdd) {
  constexpr DType sdt = stepcore::dtype_of_v<TypeParam>;
  std::mt19937_64 rng(400 + static_cast<int>(sdt));
  std::vector<std::vector<float>> acc;
  std::vector<Buf> src;
  std::vector<bool> copy;
  for (std::size_t n : boundary_sizes()) {
    acc.emplace_back(n);
    src.emplace_back(sdt, n);
    copy.push_back(rng() % 2 == 0);
    for (std::size_t i = 0; i < n; ++i) {
      acc.back()[i] = rand_val(rng, DType::f32, -3, 3);
      src.back().set(i, rand_val(rng, DType::f32, -3, 3));
    }
  }
  std::vector<AccumulatePair> pairs;
  for (std::size_t k = 0; k < acc.size(); ++k) {
    AccumulatePair pr;
    pr.acc = stepcore::f32_view(acc[k].data(), acc[k].size());
    pr.src = src[k].cview();
    pr.copy = copy[k];
    pairs.push_back(pr);
  }
  std::vector<std::vector<float>> want = acc;
  for (std::size_t k = 0; k < acc.size(); ++k)
    for (std::size_t i = 0; i < acc[k].size(); ++i)
      want[k][i] = copy[k] ? src[k].get(i) : F(D(acc[k][i]) + D(src[k].get(i)));
  const std::vector<Buf> src_before = src;
  ref::accumulate(pairs);
  for (std::size_t k = 0; k < acc.size(); ++k) {
    expect_same_bits(acc[k], want[k], copy[k] ? "copy" : "add");
    EXPECT_EQ(src[k].bytes(), src_before[k].bytes());
  }
}

TYPED_TEST(GradType, ScaleInPlace) {
  constexpr DType dt = stepcore::dtype_of_v<TypeParam>;
  std::mt19937_64 rng(500 + static_cast<int>(dt));
  for (float s : {0.5f, 1.0f / 3.0f, 3.0f, 1e-6f, 0.0f, 1000.0f}) {
    std::vector<Buf> bs;
    for (std::size_t n : boundary_sizes()) {
      Buf b(dt, n);
      for (std::size_t i = 0; i < n; ++i)
        b.set(i,
              rand_val(rng, DType::f32, dt == DType::f16 ? -6 : -30, dt == DType::f16 ? 4.5 : 30));
      bs.push_back(std::move(b));
    }
    std::vector<Buf> want = bs;
    for (Buf& b : want)
      for (std::size_t i = 0; i < b.size(); ++i) b.set(i, F(D(b.get(i)) * D(s)));
    std::vector<TensorView> vs;
    for (Buf& b : bs) vs.push_back(b.view());
    ref::scale_(vs, s);
    for (std::size_t k = 0; k < bs.size(); ++k)
      EXPECT_EQ(bs[k].bytes(), want[k].bytes()) << "scale " << s;
  }
}

// ---- Adam, and AdamW's amsgrad and maximize (docs/numerics.md 8a) ----------------------

struct AdamBufs {
  std::vector<float> p, m, v, x;  // x: max_exp_avg_sq, empty without amsgrad
  float step = 0.0f;
  Buf g;
  Buf out;
  bool has_out = false;
  bool ams = false;  // slot 2 in use

  stepcore::OptimizerTensor tensor() {
    stepcore::OptimizerTensor t;
    t.param = stepcore::f32_view(p.data(), p.size());
    t.state[0] = stepcore::f32_view(m.data(), m.size());
    t.state[1] = stepcore::f32_view(v.data(), v.size());
    if (ams) t.state[2] = stepcore::f32_view(x.data(), x.size());
    t.step = &step;
    t.grad = g.cview();
    if (has_out) t.compute_param = out.view();
    return t;
  }
};

AdamBufs random_adam(std::mt19937_64& rng, std::size_t n, DType gdt, bool ams, bool out,
                     DType odt) {
  const AdamWBufs a = random_adamw(rng, n, gdt, out, odt);
  AdamBufs b;
  b.p = a.p;
  b.m = a.m;
  b.v = a.v;
  b.step = a.step;
  b.g = a.g;
  b.out = a.out;
  b.has_out = a.has_out;
  b.ams = ams;
  if (ams) {
    b.x.resize(n);
    // Old maxima below, equal to and above v, so both branches of the maximum are taken.
    for (std::size_t i = 0; i < n; ++i)
      b.x[i] = i % 3 == 0 ? b.v[i] : (i % 3 == 1 ? F(D(b.v[i]) * 0.5) : F(D(b.v[i]) * 3.0));
  }
  return b;
}

// One element of section 8a, from torch_scalars' pieces.
struct AdamElementArgs {
  TorchS s;
  bool adamw = false, decay_on = false, ams = false, maxi = false;
  float wd32 = 0.0f;
};
void adam_element(float& p, float& m, float& v, float* x, float g, const AdamElementArgs& a,
                  bool tail, bool v_first) {
  if (a.maxi) g = -g;
  if (a.decay_on && !a.adamw) g = std::fma(p, a.wd32, g);
  if (a.decay_on && a.adamw) p = F(D(p) * D(a.s.decay));
  const float diff = F(D(g) - D(m));
  m = a.s.small ? std::fma(a.s.coeff, diff, m) : std::fma(a.s.coeff, diff, g);
  v = tail || v_first ? torch_v_tail(v, g, a.s) : torch_v_body(v, g, a.s);
  float r = v;
  if (a.ams) {
    if (tail)
      *x = *x < v ? v : *x;
    else
      *x = *x > v ? *x : v;  // no NaN here (the random state and gradients are finite)
    r = *x;
  }
  const float d = F(D(F(D(F(std::sqrt(D(r)))) / D(a.s.bc2_sqrt))) + D(a.s.eps));
  p = F(D(p) + D(F(D(F(D(a.s.neg_step) * D(m))) / D(d))));
}

TEST(ReferenceAdam, MatchesPerElementSpecOverDtypesSizesAndOptions) {
  std::mt19937_64 rng(8080);
  const DType dts[] = {DType::f32, DType::bf16, DType::f16};
  int combo = 0;
  for (const bool aarch64 : {false, true})  // torch's x86 (W 8) and aarch64 (W 4, v first) builds
    for (const bool adamw : {false, true})
      for (const bool ams : {false, true})
        for (const bool maxi : {false, true})
          for (const double wd : {0.0, 0.1, 0.37}) {
            ++combo;
            const std::size_t width = aarch64 ? 4 : 8;
            AdamWConfig wc;  // the scalars of 7.2 (lr, betas, eps; decay for AdamW)
            wc.lr = 1e-2;
            wc.beta1 = combo % 2 ? 0.9 : 0.3;
            wc.beta2 = 0.99;
            wc.eps = 1e-8;
            wc.weight_decay = wd;
            wc.amsgrad = ams;
            wc.maximize = maxi;
            wc.torch_tail_width = static_cast<int>(width);
            wc.torch_v_first = aarch64;
            stepcore::AdamConfig ac;
            ac.lr = wc.lr;
            ac.beta1 = wc.beta1;
            ac.beta2 = wc.beta2;
            ac.eps = wc.eps;
            ac.weight_decay = wd;
            ac.amsgrad = ams;
            ac.maximize = maxi;
            ac.torch_tail_width = wc.torch_tail_width;
            ac.torch_v_first = aarch64;
            const GradientRead read{0.5f, combo % 3 ? 1.0f : 0.75f};
            std::vector<AdamBufs> bufs;
            std::size_t k = 0;
            for (std::size_t n : boundary_sizes()) {
              const DType gdt = dts[k % 3], odt = dts[(k + 1) % 3];
              bufs.push_back(random_adam(rng, n, gdt, ams, k % 2 == 0, odt));
              ++k;
            }
            std::vector<AdamBufs> want = bufs;
            for (AdamBufs& e : want) {
              e.step = e.step + 1.0f;
              AdamElementArgs a;
              a.s = torch_scalars(wc, e.step);
              a.adamw = adamw;
              a.decay_on = wd != 0.0;
              a.ams = ams;
              a.maxi = maxi;
              a.wd32 = F(wd);
              const std::size_t n = e.p.size();
              for (std::size_t i = 0; i < n; ++i) {
                const float g = read_grad(e.g, i, read);
                adam_element(e.p[i], e.m[i], e.v[i], ams ? &e.x[i] : nullptr, g, a,
                             i >= n - n % width, aarch64);
                if (e.has_out) e.out.set(i, e.p[i]);
              }
            }
            std::vector<stepcore::OptimizerTensor> ts;
            for (AdamBufs& b : bufs) ts.push_back(b.tensor());
            if (adamw)
              ref::adamw_step(ts, wc, read);
            else
              ref::adam_step(ts, ac, read);
            for (std::size_t i = 0; i < bufs.size(); ++i) {
              SCOPED_TRACE("combo " + std::to_string(combo) + ", numel " +
                           std::to_string(bufs[i].p.size()));
              expect_same_bits(bufs[i].p, want[i].p, "param");
              expect_same_bits(bufs[i].m, want[i].m, "exp_avg");
              expect_same_bits(bufs[i].v, want[i].v, "exp_avg_sq");
              expect_same_bits(bufs[i].x, want[i].x, "max_exp_avg_sq");
              EXPECT_EQ(bits(bufs[i].step), bits(want[i].step));
              EXPECT_EQ(bufs[i].g.bytes(), want[i].g.bytes()) << "grad was written";
              EXPECT_EQ(bufs[i].out.bytes(), want[i].out.bytes()) << "compute_param";
            }
          }
}

TEST(ReferenceAdam, OutOfPlaceEqualsInPlaceAndFoundInfWritesNothing) {
  std::mt19937_64 rng(99);
  stepcore::AdamConfig c;
  c.amsgrad = true;
  c.weight_decay = 0.05;
  AdamBufs in_place = random_adam(rng, 37, DType::bf16, true, true, DType::f16);
  AdamBufs dst = in_place;  // destinations with other contents, sources = the old state
  const AdamBufs src = in_place;
  for (float& e : dst.p) e = 7.0f;
  for (float& e : dst.m) e = 7.0f;
  for (float& e : dst.v) e = 7.0f;
  for (float& e : dst.x) e = 7.0f;
  std::vector<stepcore::OptimizerTensor> a{in_place.tensor()};
  ref::adam_step(a, c);
  stepcore::OptimizerTensor t = dst.tensor();
  t.param_src = {src.p.data(), src.p.size(), DType::f32};
  t.state_src[0] = {src.m.data(), src.m.size(), DType::f32};
  t.state_src[1] = {src.v.data(), src.v.size(), DType::f32};
  t.state_src[2] = {src.x.data(), src.x.size(), DType::f32};
  ref::adam_step(std::span<const stepcore::OptimizerTensor>(&t, 1), c);
  expect_same_bits(dst.p, in_place.p, "param");
  expect_same_bits(dst.m, in_place.m, "exp_avg");
  expect_same_bits(dst.v, in_place.v, "exp_avg_sq");
  expect_same_bits(dst.x, in_place.x, "max_exp_avg_sq");
  EXPECT_EQ(dst.out.bytes(), in_place.out.bytes());
  // found_inf: every buffer and the counter stay as they were.
  const AdamBufs before = in_place;
  const std::int32_t flag = 1;
  std::vector<stepcore::OptimizerTensor> b{in_place.tensor()};
  ref::adam_step(b, c, {}, &flag);
  expect_same_bits(in_place.p, before.p, "param");
  expect_same_bits(in_place.x, before.x, "max_exp_avg_sq");
  EXPECT_EQ(bits(in_place.step), bits(before.step));
  EXPECT_EQ(in_place.out.bytes(), before.out.bytes());
}

// ---- hand-worked scale_, accumulate, SignSGD --------------------------------------------

TEST(ScaleHandWorked, OverflowSubnormalsZerosAndNaN) {
  auto run16 = [](DType t, std::uint16_t in, float s) {
    std::uint16_t x = in;
    const TensorView v{&x, 1, t};
    ref::scale_({&v, 1}, s);
    return x;
  };
  // f16
  EXPECT_EQ(run16(DType::f16, 0x7A00, 2.0f), 0x7C00);         // 49152 * 2 -> Inf
  EXPECT_EQ(run16(DType::f16, 0xFA00, 2.0f), 0xFC00);         // -> -Inf
  EXPECT_EQ(run16(DType::f16, 0x7BFF, 1.0f), 0x7BFF);         // 65504 * 1 exact
  EXPECT_EQ(run16(DType::f16, 0x0400, 0x1p-5f), 0x0020);      // 2^-14 * 2^-5 = 2^-19 subnormal
  EXPECT_EQ(run16(DType::f16, 0x0001, 0.5f), 0x0000);         // 2^-25: tie -> 0
  EXPECT_EQ(run16(DType::f16, 0x0003, 0.5f), 0x0002);         // 1.5 * 2^-24: tie -> 2
  EXPECT_EQ(run16(DType::f16, 0x8001, 0.5f), 0x8000);         // -> -0
  EXPECT_EQ(run16(DType::f16, 0xBC00, 0.0f), 0x8000);         // -1 * 0 = -0
  EXPECT_EQ(run16(DType::f16, 0xFE01, 1.0f), 0x7E00);         // NaN -> 0x7E00, sign dropped
  EXPECT_EQ(run16(DType::f16, 0x3C00, 1.0f / 3.0f), 0x3555);  // 1/3 in f16
  // bf16
  EXPECT_EQ(run16(DType::bf16, 0x7F00, 4.0f), 0x7F80);            // 2^127 * 4 -> Inf
  EXPECT_EQ(run16(DType::bf16, 0x0080, 0.5f), 0x0040);            // 2^-126 / 2: subnormal
  EXPECT_EQ(run16(DType::bf16, 0x3F80, 1.0f + 0x1p-8f), 0x3F80);  // tie -> even
  EXPECT_EQ(run16(DType::bf16, 0xFFC1, 1.0f), 0x7FC0);            // NaN -> 0x7FC0, sign dropped
  EXPECT_EQ(run16(DType::bf16, 0xBF80, 0.0f), 0x8000);
  // f32
  float x[4] = {FLT_MAX, FLT_MIN, -1.0f, 3.0f};
  const TensorView v = stepcore::f32_view(x, 4);
  ref::scale_({&v, 1}, 2.0f);
  EXPECT_EQ(bits(x[0]), bits(kInf));
  EXPECT_EQ(bits(x[1]), bits(2 * FLT_MIN));
  ref::scale_({&v, 1}, 0.0f);
  EXPECT_TRUE(std::isnan(x[0]));  // Inf * 0
  EXPECT_EQ(bits(x[1]), 0u);
  EXPECT_EQ(bits(x[2]), bits(-0.0f));
  float y = FLT_MIN;
  const TensorView vy = stepcore::f32_view(&y, 1);
  ref::scale_({&vy, 1}, 0.5f);
  EXPECT_EQ(bits(y), 0x00400000u);  // subnormal, exact
  // Empty list and empty tensors are fine.
  ref::scale_({}, 2.0f);
}

TEST(AccumulateHandWorked, SpecialValues) {
  std::vector<float> acc = {1.0f, FLT_MAX, kInf, 0.0f, -0.0f, 1.0f};
  const std::vector<float> src = {1.0f, FLT_MAX, -kInf, -0.0f, -0.0f, 0x1p-24f};
  AccumulatePair pr;
  pr.acc = stepcore::f32_view(acc.data(), acc.size());
  pr.src = stepcore::const_view(src.data(), src.size());
  ref::accumulate({&pr, 1});
  EXPECT_EQ(bits(acc[0]), bits(2.0f));
  EXPECT_EQ(bits(acc[1]), bits(kInf));
  EXPECT_TRUE(std::isnan(acc[2]));       // Inf + -Inf
  EXPECT_EQ(bits(acc[3]), bits(0.0f));   // +0 + -0 = +0
  EXPECT_EQ(bits(acc[4]), bits(-0.0f));  // -0 + -0 = -0
  EXPECT_EQ(bits(acc[5]), bits(1.0f));   // 1 + 2^-24: tie -> 1
  // copy widens exactly, NaN payloads and -0 included.
  const std::uint16_t b16[3] = {0x7FC1, 0x8000, 0x3F81};
  const std::uint16_t h16[3] = {0xFE01, 0x0001, 0x7C00};
  std::vector<float> a1(3, 5.0f), a2(3, 5.0f);
  AccumulatePair prs[2];
  prs[0].acc = stepcore::f32_view(a1.data(), 3);
  prs[0].src = ConstTensorView(b16, 3, DType::bf16);
  prs[0].copy = true;
  prs[1].acc = stepcore::f32_view(a2.data(), 3);
  prs[1].src = ConstTensorView(h16, 3, DType::f16);
  prs[1].copy = true;
  ref::accumulate(prs);
  EXPECT_EQ(bits(a1[0]), 0x7FC10000u);
  EXPECT_EQ(bits(a1[1]), 0x80000000u);
  EXPECT_EQ(bits(a1[2]), 0x3F810000u);
  EXPECT_EQ(bits(a2[0]), 0xFFC02000u);
  EXPECT_EQ(bits(a2[1]), bits(0x1p-24f));
  EXPECT_EQ(bits(a2[2]), bits(kInf));
  // add: bf16 1.0078125 + 1 = 2.0078125 exactly.
  std::vector<float> a3 = {1.0f};
  const std::uint16_t one_b = 0x3F81;
  AccumulatePair p3;
  p3.acc = stepcore::f32_view(a3.data(), 1);
  p3.src = ConstTensorView(&one_b, 1, DType::bf16);
  ref::accumulate({&p3, 1});
  EXPECT_EQ(bits(a3[0]), bits(2.0078125f));
}

TEST(SignSgdHandWorked, SignsZerosAndDecay) {
  // lr 0.5 (exact), no decay: p - 0.5 * sign(g).
  SignSgdConfig c;
  c.lr = 0.5;
  c.weight_decay = 0.0;
  std::vector<float> p = {1.0f, 1.0f, 1.0f, 1.0f, -0.0f, -0.0f, 0.0f, 1.0f};
  const std::vector<float> g = {3.0f, -2.0f, 0.0f, -0.0f, 0.0f, -0.0f, -0.0f, kNaN};
  OptimizerTensor t;
  t.param = stepcore::f32_view(p.data(), p.size());
  t.grad = stepcore::const_view(g.data(), g.size());
  ref::sign_sgd_step({&t, 1}, c);
  EXPECT_EQ(bits(p[0]), bits(0.5f));
  EXPECT_EQ(bits(p[1]), bits(1.5f));
  EXPECT_EQ(bits(p[2]), bits(1.0f));
  EXPECT_EQ(bits(p[3]), bits(1.0f));
  // sign(+-0) = +0 and +0 * -0.5 = -0: fma(+0, -0.5, -0) = -0 + -0 = -0. Were sign(-0)
  // taken as -0, the product would be +0 and the sum +0.
  EXPECT_EQ(bits(p[4]), bits(-0.0f));
  EXPECT_EQ(bits(p[5]), bits(-0.0f));
  EXPECT_EQ(bits(p[6]), bits(0.0f));  // -0 + +0 = +0
  EXPECT_TRUE(std::isnan(p[7]));
  // With decay: lr 0.5, wd 0.5 -> neg_lr_wd = -0.25: p = 2 - 0.5 = 1.5, then 1.5 - 0.5 = 1.
  c.weight_decay = 0.5;
  std::vector<float> q = {2.0f, 2.0f, -4.0f};
  const std::vector<float> gq = {1.0f, -0.0f, -1.0f};
  std::vector<std::uint16_t> out(3, 0xFFFF);
  OptimizerTensor tq;
  tq.param = stepcore::f32_view(q.data(), 3);
  tq.grad = stepcore::const_view(gq.data(), 3);
  tq.compute_param = TensorView{out.data(), 3, DType::bf16};
  ref::sign_sgd_step({&tq, 1}, c);
  EXPECT_EQ(bits(q[0]), bits(1.0f));
  EXPECT_EQ(bits(q[1]), bits(1.5f));
  EXPECT_EQ(bits(q[2]), bits(-2.5f));  // -4 + 1 = -3, then -3 + 0.5
  EXPECT_EQ(out[0], 0x3F80);
  EXPECT_EQ(out[1], 0x3FC0);
  EXPECT_EQ(out[2], 0xC020);
}

TEST(SignSgdHandWorked, DecayIsOneFusedOperation) {
  // p = fma(p, -(lr*wd), p) rounds once. The exact value p*k + p needs at most
  // ~51 significant bits here (a 48-bit product within a few binades of p), so it
  // is exact in long double (64-bit significand) and rounding that to f32 is the
  // single rounding the spec asks for.
  std::mt19937_64 rng(8);
  SignSgdConfig c;
  c.lr = 0.3;
  c.weight_decay = 0.7;
  const float k = F(-(c.lr * c.weight_decay));
  int differs = 0;
  for (int i = 0; i < 2000; ++i) {
    float p = rand_val(rng, DType::f32, -2, 2);
    const float g = 0.0f;  // sign 0: only the decay acts
    const long double exact =
        static_cast<long double>(p) * k + p;  // exact: 48-bit product, close exponents
    const float once = static_cast<float>(exact);
    const float twice = F(D(F(D(p) * D(k))) + D(p));
    if (bits(once) != bits(twice)) ++differs;
    OptimizerTensor t;
    t.param = stepcore::f32_view(&p, 1);
    t.grad = stepcore::const_view(&g, 1);
    ref::sign_sgd_step({&t, 1}, c);
    ASSERT_EQ(bits(p), bits(once)) << i;
  }
  EXPECT_GT(differs, 0);  // the inputs do distinguish one rounding from two
}

// ---- found_inf and gradients never written ---------------------------------------------

// ---- SGD (docs/numerics.md 8b) -------------------------------------------------------------

// One SGD tensor over caller-owned vectors; the buffer is used when non-empty.
stepcore::OptimizerTensor sgd_tensor(std::vector<float>& p, std::vector<float>& b,
                                     const std::vector<float>& g, float& step) {
  stepcore::OptimizerTensor t;
  t.param = {p.data(), p.size(), DType::f32};
  if (!b.empty()) t.state[0] = {b.data(), b.size(), DType::f32};
  t.step = &step;
  t.grad = {g.data(), g.size(), DType::f32};
  return t;
}

// ---- Adagrad (docs/numerics.md 8c) ------------------------------------------------------

// One Adagrad tensor over caller-owned vectors (param, sum, grad, counter).
stepcore::OptimizerTensor adagrad_tensor(std::vector<float>& p, std::vector<float>& sum,
                                         const std::vector<float>& g, float& step) {
  stepcore::OptimizerTensor t;
  t.param = {p.data(), p.size(), DType::f32};
  t.state[0] = {sum.data(), sum.size(), DType::f32};
  t.step = &step;
  t.grad = {g.data(), g.size(), DType::f32};
  return t;
}

// The first step (counter 1 after its increment) sets b = g (after maximize and weight
// decay, no dampening) whatever the buffer held; later steps read it.
TEST(SgdHandWorked, FirstStepSetsTheBufferFromTheGradient) {
  stepcore::SgdConfig c;
  c.lr = 0.5;
  c.momentum = 0.5;
  c.dampening = 0.25;
  c.maximize = true;
  const std::vector<float> g = {1.0f, -2.0f, 0.0f, -0.0f, 3.0f};
  for (float garbage : {kNaN, 7.0f}) {
    std::vector<float> p = {4.0f, 4.0f, 1.0f, -0.0f, 0.0f}, b(5, garbage);
    float step = 0.0f;
    const stepcore::OptimizerTensor t = sgd_tensor(p, b, g, step);
    ref::sgd_step({&t, 1}, c);
    EXPECT_EQ(step, 1.0f);
    // b = -g; p = fma(b, -0.5, p), all exact here; -(+0) = -0, -(-0) = +0.
    expect_same_bits(b, {-1.0f, 2.0f, -0.0f, 0.0f, -3.0f}, "first-step buffer");
    expect_same_bits(p, {4.5f, 3.0f, 1.0f, -0.0f, 1.5f}, "first-step param");
    // Second step: b = fma(g', 0.75, b * 0.5) with g' = -g (all exact again).
    ref::sgd_step({&t, 1}, c);
    // (Exact in the body and the tail form alike, whatever the tail width; zeros keep
    // their sign.)
    expect_same_bits(b, {-1.25f, 2.5f, -0.0f, 0.0f, -3.75f}, "second-step buffer");
    expect_same_bits(p, {5.125f, 1.75f, 1.0f, -0.0f, 3.375f}, "second-step param");
  }
}

// Each product-plus-sum of 8b is one fused operation: chosen operands where the separately
// rounded form differs (products with 48 significant bits).
TEST(SgdHandWorked, EachSumIsOneFusedOperation) {
  const float a = 1.0f + 3 * 0x1p-23f;  // a^2 = 1 + 6u + 9u^2: 9u^2 is lost when rounded
  {
    // weight decay: g = fma(p, wd, g) with p = wd = a, g = -1; momentum 0, lr 1.
    stepcore::SgdConfig c;
    c.lr = 1.0;
    c.weight_decay = static_cast<double>(a);
    std::vector<float> p = {a}, b;
    const std::vector<float> g = {-1.0f};
    float step = 0.0f;
    const stepcore::OptimizerTensor t = sgd_tensor(p, b, g, step);
    ref::sgd_step({&t, 1}, c);
    const float g1 = F(D(a) * D(a) - 1.0);  // one rounding of 6u + 9u^2
    EXPECT_NE(bits(g1), bits(a * a - 1.0f));
    EXPECT_EQ(bits(p[0]), bits(F(D(a) - D(g1))));
  }
  {
    // update: p = fma(g, -lr, p) with g = lr = a, p = 1 (momentum 0, no decay).
    stepcore::SgdConfig c;
    c.lr = static_cast<double>(a);
    std::vector<float> p = {1.0f}, b;
    const std::vector<float> g = {a};
    float step = 0.0f;
    const stepcore::OptimizerTensor t = sgd_tensor(p, b, g, step);
    ref::sgd_step({&t, 1}, c);
    EXPECT_EQ(bits(p[0]), bits(F(1.0 - D(a) * D(a))));
    EXPECT_NE(bits(p[0]), bits(1.0f - a * a));
  }
}

// The momentum update's two forms: the body rounds b * mom, the last numel mod W elements
// round g * c (W = torch_tail_width; 0 and 1: body form everywhere).
TEST(SgdHandWorked, TailWidthSelectsTheMomentumForm) {
  // b = mom = a, g = -RN(a^2), dampening 0 (c = 1): the body gives g + RN(b * mom) = +0,
  // the tail fma(b, mom, g) = a^2 - RN(a^2) = 9u^2.
  const float a = 1.0f + 3 * 0x1p-23f;
  stepcore::SgdConfig c;
  c.lr = 0.0;  // the parameter stays; only the buffer is under test
  c.momentum = static_cast<double>(a);
  const float b0 = a, g0 = -F(D(a) * D(a));
  const float body = 0.0f, tail = F(D(a) * D(a) + D(g0));
  ASSERT_EQ(bits(tail), bits(9 * 0x1p-46f));
  for (int w : {0, 1, 4, 8, 16}) {
    c.torch_tail_width = w;
    std::vector<float> p(11, 1.0f), b(11, b0);
    const std::vector<float> g(11, g0);
    float step = 1.0f;  // not the first step
    const stepcore::OptimizerTensor t = sgd_tensor(p, b, g, step);
    ref::sgd_step({&t, 1}, c);
    const std::size_t tail_begin = w > 1 ? 11 - 11 % static_cast<std::size_t>(w) : 11;
    for (std::size_t i = 0; i < 11; ++i)
      EXPECT_EQ(bits(b[i]), bits(i < tail_begin ? body : tail)) << "W " << w << " [" << i << "]";
  }
}

// found_inf skips the call entirely: the counter stays, so the next call is the first step.
TEST(SgdHandWorked, FoundInfKeepsTheFirstStepFirst) {
  stepcore::SgdConfig c;
  c.lr = 1.0;
  c.momentum = 0.9;
  std::vector<float> p = {1.0f, 2.0f}, b = {kNaN, kNaN};
  const std::vector<float> g = {0.5f, -0.25f};
  float step = 0.0f;
  const stepcore::OptimizerTensor t = sgd_tensor(p, b, g, step);
  const std::int32_t flag = 1;
  ref::sgd_step({&t, 1}, c, {}, &flag);
  EXPECT_EQ(step, 0.0f);
  EXPECT_TRUE(std::isnan(b[0]) && p[0] == 1.0f);
  ref::sgd_step({&t, 1}, c);
  expect_same_bits(b, {0.5f, -0.25f}, "buffer");
  expect_same_bits(p, {0.5f, 2.25f}, "param");
}

// Out of place from param_src and state_src[0]: the bits of the in-place step, sources intact.
TEST(SgdHandWorked, OutOfPlaceEqualsInPlace) {
  stepcore::SgdConfig c;
  c.lr = 0.1;
  c.momentum = 0.9;
  c.dampening = 0.1;
  c.weight_decay = 0.01;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> p0(37), b0(37), g(37);
  for (std::size_t i = 0; i < 37; ++i) p0[i] = nd(rng), b0[i] = nd(rng), g[i] = nd(rng);
  std::vector<float> p = p0, b = b0, q(37, kNaN), m(37, kNaN);
  float s1 = 3.0f, s2 = 3.0f;
  const stepcore::OptimizerTensor in_place = sgd_tensor(p, b, g, s1);
  stepcore::OptimizerTensor out = sgd_tensor(q, m, g, s2);
  out.param_src = {p0.data(), p0.size(), DType::f32};
  out.state_src[0] = {b0.data(), b0.size(), DType::f32};
  const std::vector<float> p0_copy = p0, b0_copy = b0;
  ref::sgd_step({&in_place, 1}, c);
  ref::sgd_step({&out, 1}, c);
  expect_same_bits(q, p, "param");
  expect_same_bits(m, b, "momentum_buffer");
  expect_same_bits(p0, p0_copy, "param_src");
  expect_same_bits(b0, b0_copy, "state_src[0]");
}

// Worked by hand on exact values: g*g, sqrt and the quotients below are exact in f32, and
// f32(1e-10) is below half an ulp of 1.5 and 2, so d = sqrt(sum) there.
TEST(AdagradHandWorked, DecayMaximizeAndLrDecay) {
  stepcore::AdagradConfig c;
  c.lr = 0.5;
  c.lr_decay = 1.0;
  std::vector<float> p{1.0f, -0.0f}, sum{0.0f, 0.0f}, g{2.0f, -0.0f};
  float step = 0.0f;
  const auto t = adagrad_tensor(p, sum, g, step);
  ref::adagrad_step({&t, 1}, c);  // clr = 0.5 / (1 + 0 * 1): p = 1 - (0.5 * 2) / 2
  EXPECT_EQ(step, 1.0f);
  EXPECT_EQ(bits(p[0]), bits(0.5f));
  EXPECT_EQ(bits(sum[0]), bits(4.0f));
  EXPECT_EQ(bits(p[1]), bits(0.0f));  // -0 - ((0.5 * -0) / (0 + eps)) = -0 - (-0) = +0
  EXPECT_EQ(bits(sum[1]), bits(0.0f));
  g = {0.0f, 0.0f};
  ref::adagrad_step({&t, 1}, c);  // clr = 0.5 / 2; g = 0: p unchanged, sum unchanged
  EXPECT_EQ(step, 2.0f);
  EXPECT_EQ(bits(p[0]), bits(0.5f));
  EXPECT_EQ(bits(sum[0]), bits(4.0f));

  // weight decay 0.5 and maximize: g = fma(p, 0.5, -2) = -1.5, sum = 2.25, d = 1.5,
  // p = 1 - (0.5 * -1.5) / 1.5 = 1.5
  stepcore::AdagradConfig m;
  m.lr = 0.5;
  m.weight_decay = 0.5;
  m.maximize = true;
  p = {1.0f};
  sum = {0.0f};
  std::vector<float> g2{2.0f};
  float step2 = 0.0f;
  const auto t2 = adagrad_tensor(p, sum, g2, step2);
  ref::adagrad_step({&t2, 1}, m);
  EXPECT_EQ(bits(p[0]), bits(1.5f));
  EXPECT_EQ(bits(sum[0]), bits(2.25f));
}

// Out of place (param_src, state_src[0]) gives the in-place bits and leaves the sources
// intact; the compute output is R_bf16(p); a gradient 2^10 times larger read with scale
// 2^-10 gives the same bits (torch's power-of-two grad_scale, 8c).
TEST(AdagradReference, OutOfPlaceOutputAndPowerOfTwoScale) {
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const std::size_t n = 37;
  std::vector<float> p0(n), s0(n), g(n), g_big(n);
  for (std::size_t i = 0; i < n; ++i) {
    p0[i] = nd(rng);
    s0[i] = std::fabs(nd(rng));
    g[i] = nd(rng);
    g_big[i] = g[i] * 1024.0f;  // exact
  }
  stepcore::AdagradConfig c;
  c.lr_decay = 0.01;
  c.weight_decay = 0.1;
  std::vector<float> p_in = p0, s_in = s0;
  float step_in = 4.0f;
  const auto in = adagrad_tensor(p_in, s_in, g, step_in);
  ref::adagrad_step({&in, 1}, c);

  std::vector<float> p_out(n, 7.0f), s_out(n, 7.0f), p_src = p0, s_src = s0;
  std::vector<std::uint16_t> out_bf16(n);
  float step_out = 4.0f;
  auto t = adagrad_tensor(p_out, s_out, g_big, step_out);
  t.param_src = {p_src.data(), n, DType::f32};
  t.state_src[0] = {s_src.data(), n, DType::f32};
  t.compute_param = {out_bf16.data(), n, DType::bf16};
  ref::adagrad_step({&t, 1}, c, GradientRead{1.0f / 1024.0f, 1.0f});
  EXPECT_EQ(step_out, step_in);
  EXPECT_EQ(std::memcmp(p_out.data(), p_in.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(s_out.data(), s_in.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(p_src.data(), p0.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(s_src.data(), s0.data(), n * sizeof(float)), 0);
  for (std::size_t i = 0; i < n; ++i)
    EXPECT_EQ(out_bf16[i], stepcore::f32_to_bf16_bits(p_in[i])) << i;
}

TEST(FoundInf, NonZeroWritesNothing) {
  std::mt19937_64 rng(9);
  for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch}) {
    const AdamWConfig c = f == AdamWFormula::native ? native_config() : torch_config();
    std::vector<AdamWBufs> bs;
    for (std::size_t n : {1, 17, 100})
      bs.push_back(random_adamw(rng, n, DType::bf16, true, DType::f16));
    const std::vector<AdamWBufs> before = bs;
    for (std::int32_t flag : {1, -1, 0x7FFFFFFF}) {
      adamw(bs, c, {0.5f, 0.5f}, &flag);
      for (std::size_t t = 0; t < bs.size(); ++t) {
        expect_same_bits(bs[t].p, before[t].p, "param");
        expect_same_bits(bs[t].m, before[t].m, "exp_avg");
        expect_same_bits(bs[t].v, before[t].v, "exp_avg_sq");
        EXPECT_EQ(bits(bs[t].step), bits(before[t].step));
        EXPECT_EQ(bs[t].out.bytes(), before[t].out.bytes());
      }
    }
    // A zero flag steps normally.
    const std::int32_t zero = 0;
    std::vector<AdamWBufs> want;
    for (const AdamWBufs& b : bs) want.push_back(expected_adamw(b, c, {0.5f, 0.5f}));
    adamw(bs, c, {0.5f, 0.5f}, &zero);
    for (std::size_t t = 0; t < bs.size(); ++t) expect_adamw_equal(bs[t], want[t]);
  }
  // SignSGD
  std::vector<float> p = {1.0f, 2.0f};
  const std::vector<float> g = {1.0f, -1.0f};
  std::vector<float> out = {7.0f, 7.0f};
  OptimizerTensor t;
  t.param = stepcore::f32_view(p.data(), 2);
  t.grad = stepcore::const_view(g.data(), 2);
  t.compute_param = stepcore::f32_view(out.data(), 2);
  const std::int32_t one = 1, zero = 0;
  ref::sign_sgd_step({&t, 1}, SignSgdConfig{}, {}, &one);
  EXPECT_EQ(bits(p[0]), bits(1.0f));
  EXPECT_EQ(bits(p[1]), bits(2.0f));
  EXPECT_EQ(bits(out[0]), bits(7.0f));
  ref::sign_sgd_step({&t, 1}, SignSgdConfig{}, {}, &zero);
  EXPECT_NE(bits(p[0]), bits(1.0f));
  EXPECT_EQ(bits(out[0]), bits(p[0]));
}

TEST(Gradients, NeverWrittenEvenWithNaNAndScale) {
  std::mt19937_64 rng(10);
  for (DType gdt : {DType::f32, DType::bf16, DType::f16}) {
    std::vector<AdamWBufs> bs = {random_adamw(rng, 50, gdt, true, DType::f32)};
    bs[0].g.set(3, kNaN);
    bs[0].g.set(4, kInf);
    const std::vector<unsigned char> before = bs[0].g.bytes();
    adamw(bs, native_config(), {0.25f, 0.5f});
    EXPECT_EQ(bs[0].g.bytes(), before);
    adamw(bs, torch_config(), {0.25f, 0.5f});
    EXPECT_EQ(bs[0].g.bytes(), before);
    // NaN and Inf gradients propagate into that element only.
    EXPECT_TRUE(std::isnan(bs[0].p[3]));
    EXPECT_FALSE(std::isnan(bs[0].p[2]));
    const ConstTensorView cv = bs[0].g.cview();
    (void)ref::norm_partial({&cv, 1}, {0.25f, 0.5f});
    EXPECT_EQ(bs[0].g.bytes(), before);
  }
}

}  // namespace
