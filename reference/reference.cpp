// The scalar reference implementation of docs/numerics.md: one element at a
// time, each statement one IEEE binary32 operation in the spec's order.
// Built with -ffp-contract=off so the compiler fuses nothing; fused operations
// are written as std::fma where the spec has them.
#include "stepcore/reference.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <variant>
#include <vector>

#include "core/fp_env.hpp"
#include "core/norm_p.hpp"
#include "core/optimizers/adamw.hpp"
#include "core/optimizers/lion.hpp"
#include "core/q8_maps.hpp"
#include "core/step_scalars.hpp"
#include "core/superaccumulator.hpp"
#include "core/validate.hpp"
#include "reference/testing.hpp"
#include "stepcore/convert.hpp"

namespace stepcore::reference {
namespace {

// Returns element i of a read-only view as binary32 (exact widening).
float load(const ConstTensorView& v, std::size_t i) {
  switch (v.dtype) {
    case DType::f32:
      return static_cast<const float*>(v.data)[i];
    case DType::bf16:
      return bf16_bits_to_f32(static_cast<const std::uint16_t*>(v.data)[i]);
    case DType::f16:
      return f16_bits_to_f32(static_cast<const std::uint16_t*>(v.data)[i]);
  }
  throw Error(Errc::internal, "dtype", "unreachable");
}

// Returns x rounded to dtype t and widened back (R_t).
float round_dtype(float x, DType t) {
  switch (t) {
    case DType::f32:
      return x;
    case DType::bf16:
      return bf16_bits_to_f32(f32_to_bf16_bits(x));
    case DType::f16:
      return f16_bits_to_f32(f32_to_f16_bits(x));
  }
  throw Error(Errc::internal, "dtype", "unreachable");
}

// Stores x rounded to the view's dtype at element i.
void store(const TensorView& v, std::size_t i, float x) {
  switch (v.dtype) {
    case DType::f32:
      static_cast<float*>(v.data)[i] = x;
      return;
    case DType::bf16:
      static_cast<std::uint16_t*>(v.data)[i] = f32_to_bf16_bits(x);
      return;
    case DType::f16:
      static_cast<std::uint16_t*>(v.data)[i] = f32_to_f16_bits(x);
      return;
  }
  throw Error(Errc::internal, "dtype", "unreachable");
}

// The gradient read: x = R_T(R_T(f32(g) * scale) * clip), T the gradient's dtype, or
// f32 with r.as_f32.
float read_gradient(const ConstTensorView& g, std::size_t i, const GradientRead& r) {
  const DType t = r.as_f32 ? DType::f32 : g.dtype;
  float x = load(g, i);
  x = round_dtype(x * r.scale, t);
  x = round_dtype(x * r.clip, t);
  return x;
}

bool has_output(const TensorView& v) { return v.data != nullptr || v.numel != 0; }

// An out-of-place step, literally: the old values are copied from the source into the
// destination (validated: f32, the same size, the destination itself or disjoint from
// every written buffer), then the destination steps in place.
void copy_source(const ConstTensorView& src, const TensorView& dst) {
  if (src.numel == 0 || src.data == dst.data) return;  // none (empty), or in place
  std::memcpy(dst.data, src.data, src.bytes());
}

// Where torch's scalar tail begins in an n-element tensor whose param (and state) is stored
// as `param` (docs/numerics.md 7.2, 7.3): the last n mod W' elements, W' the tail width for
// f32, twice it for bf16/f16 (Vectorized<T> of 16-bit T holds twice the f32 lanes).
std::size_t torch_tail_begin(std::size_t n, int tail_width, DType param) {
  std::size_t w = tail_width > 1 ? static_cast<std::size_t>(tail_width) : 1;
  if (param != DType::f32) w = 2 * w;
  return n - n % w;
}

// The hyper-parameters of torch's fused Adam and AdamW, as the trainer holds them (double).
struct TorchAdamHyper {
  bool adamw = false;  // AdamW: decoupled decay p*(1 - lr*wd); Adam: L2, g + p*wd
  double lr = 0.0, beta1 = 0.0, beta2 = 0.0, eps = 0.0, weight_decay = 0.0;
  bool amsgrad = false, maximize = false;
  bool v_first = false;  // v = fma(v, b2, cg*g) in the body too (torch's aarch64 build)
  int tail_width = 8;
};

// The hyper-parameters of an AdamConfig or AdamWConfig for torch_adam_family_step.
template <class C>
TorchAdamHyper torch_adam_hyper(const C& config, bool adamw) {
  TorchAdamHyper h;
  h.adamw = adamw;
  h.lr = config.lr;
  h.beta1 = config.beta1;
  h.beta2 = config.beta2;
  h.eps = config.eps;
  h.weight_decay = config.weight_decay;
  h.amsgrad = config.amsgrad;
  h.maximize = config.maximize;
  h.v_first = config.torch_v_first;
  h.tail_width = config.torch_tail_width;
  return h;
}

// docs/numerics.md 8a, literally: torch.optim.Adam/AdamW(fused=True). The tensors are
// validated; state[0] exp_avg, state[1] exp_avg_sq, state[2] max_exp_avg_sq, all in the
// param's dtype: each value widened when read, rounded to that dtype when stored (7.3).
void torch_adam_family_step(std::span<const OptimizerTensor> tensors, const TorchAdamHyper& h,
                            const GradientRead& read) {
  for (const OptimizerTensor& t : tensors) {
    copy_source(t.param_src, t.param);
    for (int k = 0; k < (h.amsgrad ? 3 : 2); ++k) copy_source(t.state_src[k], t.state[k]);
    *t.step = *t.step + 1.0f;
    // Scalars: binary64 on the host, each rounded to f32 once, as the spec lists them.
    const double step = static_cast<double>(*t.step);
    const bool decay_on = h.weight_decay != 0.0;
    const float wd = static_cast<float>(h.weight_decay);                  // Adam
    const float decay = static_cast<float>(1.0 - h.lr * h.weight_decay);  // AdamW
    const float w = static_cast<float>(1.0 - h.beta1);
    const bool small = std::fabs(w) < 0.5f;
    const float coeff = small ? w : w - 1.0f;
    const float b2 = static_cast<float>(h.beta2);
    const float c2 = static_cast<float>(1.0 - h.beta2);
    const double bc1 = 1.0 - std::pow(h.beta1, step);
    const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, step)));
    const float neg_step = static_cast<float>(-(h.lr / bc1));
    const float eps = static_cast<float>(h.eps);

    const bool out = has_output(t.compute_param);
    const std::size_t n = t.param.numel;
    const std::size_t tail_begin = torch_tail_begin(n, h.tail_width, t.param.dtype);
    for (std::size_t i = 0; i < n; ++i) {
      const bool body = i < tail_begin;
      float g = read_gradient(t.grad, i, read);
      float p = load(t.param, i);
      float m = load(t.state[0], i);
      float v = load(t.state[1], i);
      if (h.maximize) g = -g;
      if (decay_on && !h.adamw) g = std::fma(p, wd, g);
      if (decay_on && h.adamw) p = p * decay;
      const float diff = g - m;
      m = small ? std::fma(coeff, diff, m) : std::fma(coeff, diff, g);
      const float cg = c2 * g;
      if (body && !h.v_first) {
        const float v_keep = v * b2;
        v = std::fma(cg, g, v_keep);
      } else {
        const float cgg = cg * g;
        v = std::fma(v, b2, cgg);
      }
      float r = v;
      if (h.amsgrad) {
        float x = load(t.state[2], i);
        if (body)
          x = (std::isnan(x) || std::isnan(v)) ? std::numeric_limits<float>::quiet_NaN()
                                               : (x > v ? x : v);
        else
          x = x < v ? v : x;
        store(t.state[2], i, x);
        r = x;  // the unrounded maximum (a 16-bit slot stores it rounded)
      }
      const float root = std::sqrt(r);
      const float scaled_root = root / bc2_sqrt;
      const float denom = scaled_root + eps;
      const float num = neg_step * m;
      const float update = num / denom;
      p = p + update;
      store(t.param, i, p);
      store(t.state[0], i, m);
      store(t.state[1], i, v);
      if (out) store(t.compute_param, i, p);
    }
  }
}

}  // namespace

namespace {

// docs/numerics.md 7.1 (the native formula), literally, over validated tensors: state[0]
// exp_avg, state[1] exp_avg_sq, f32 or the param's bf16/f16 (widened when read, rounded
// when stored, 7.3).
void adamw_native_steps(std::span<const OptimizerTensor> tensors, const AdamWConfig& config,
                        GradientRead read) {
  for (const OptimizerTensor& t : tensors) {
    copy_source(t.param_src, t.param);
    copy_source(t.state_src[0], t.state[0]);
    copy_source(t.state_src[1], t.state[1]);
    *t.step = *t.step + 1.0f;
    const AdamWScalars s = prepare_adamw_scalars(config, *t.step);
    const bool out = has_output(t.compute_param);
    for (std::size_t i = 0; i < t.param.numel; ++i) {
      const float g = read_gradient(t.grad, i, read);
      float p = load(t.param, i);
      float m = load(t.state[0], i);
      float v = load(t.state[1], i);
      p = p * s.decay;
      const float m_keep = m * s.beta1;
      const float m_new = g * s.one_minus_beta1;
      m = m_keep + m_new;
      const float v_keep = v * s.beta2;
      const float g2 = g * g;
      const float v_new = g2 * s.one_minus_beta2;
      v = v_keep + v_new;
      const float root = std::sqrt(v);
      const float scaled_root = root / s.bc2_sqrt;
      const float denom = scaled_root + s.eps;
      const float num = s.step_size * m;
      const float update = num / denom;
      p = p - update;
      store(t.param, i, p);
      store(t.state[0], i, m);
      store(t.state[1], i, v);
      if (out) store(t.compute_param, i, p);
    }
  }
}

// docs/numerics.md 8e (torchao's AdamW8bit and Adam8bit arithmetic), literally, over
// validated tensors: state[0] exp_avg, state[1] exp_avg_sq, state[2] max_exp_avg_sq with
// amsgrad; no FMA. AdamW (`adamw`) decays the parameter, Adam adds wd * p to the gradient.
template <class Config>
void torchao_adam_steps(std::span<const OptimizerTensor> tensors, const Config& config,
                        GradientRead read, bool adamw) {
  // P(b, t): the C library's binary32 powf of the f32 beta.
  auto power = [](double beta, double t) {
    return powf(static_cast<float>(beta), static_cast<float>(t));
  };
  const float lr = static_cast<float>(config.lr);
  const float wd = static_cast<float>(config.weight_decay);
  const float lrwd = lr * wd;
  // The lerp weights' branch and coefficient, each from binary64 (w or w - 1).
  const double w1d = 1.0 - config.beta1, w2d = 1.0 - config.beta2;
  const bool small1 = std::fabs(w1d) < 0.5, small2 = std::fabs(w2d) < 0.5;
  const float c1 = static_cast<float>(small1 ? w1d : w1d - 1.0);
  const float c2 = static_cast<float>(small2 ? w2d : w2d - 1.0);
  const float eps = static_cast<float>(config.eps);
  for (const OptimizerTensor& t : tensors) {
    copy_source(t.param_src, t.param);
    for (int k = 0; k < (config.amsgrad ? 3 : 2); ++k) copy_source(t.state_src[k], t.state[k]);
    *t.step = *t.step + 1.0f;
    const double step = static_cast<double>(*t.step);
    const float bc1 = 1.0f - power(config.beta1, step);
    const float bc2s = std::sqrt(1.0f - power(config.beta2, step));
    const bool out = has_output(t.compute_param);
    for (std::size_t i = 0; i < t.param.numel; ++i) {
      float g = read_gradient(t.grad, i, read);
      float p = load(t.param, i);
      float m = load(t.state[0], i);
      float v = load(t.state[1], i);
      if (adamw) {
        const float decay = lrwd * p;
        p = p - decay;
      } else {
        const float l2 = wd * p;
        g = g + l2;
      }
      // torch's lerp decomposition: coeff * (end - start) + base, base the start for a
      // small weight, else the end.
      const float dm = g - m;
      const float um = c1 * dm;
      m = small1 ? m + um : g + um;
      const float g2 = g * g;
      const float dv = g2 - v;
      const float uv = c2 * dv;
      v = small2 ? v + uv : g2 + uv;
      float r = v;
      if (config.amsgrad) {
        float x = load(t.state[2], i);
        x = (std::isnan(x) || std::isnan(v)) ? std::numeric_limits<float>::quiet_NaN()
                                             : (x > v ? x : v);
        store(t.state[2], i, x);
        r = x;
      }
      const float mhat = m / bc1;
      const float num = lr * mhat;
      const float root = std::sqrt(r);
      const float scaled_root = root / bc2s;
      const float denom = scaled_root + eps;
      const float update = num / denom;
      p = p - update;
      store(t.param, i, p);
      store(t.state[0], i, m);
      store(t.state[1], i, v);
      if (out) store(t.compute_param, i, p);
    }
  }
}

// ---- block-wise 8-bit slots (docs/numerics.md 8f), literally ----------------------------

// The value code c stands for in the signed or the unsigned map.
float q8_value(bool non_negative, int c) {
  const std::uint32_t b = non_negative ? detail::kQ8UnsignedBits[c] : detail::kQ8SignedBits[c];
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// N(y): the code whose value is nearest to y in exact arithmetic, a tie to the code of
// larger magnitude; a NaN gives the zero code; below the least value, the least code.
std::uint8_t q8_nearest(float y, bool non_negative) {
  if (std::isnan(y)) return non_negative ? detail::kQ8UnsignedZero : detail::kQ8SignedZero;
  int lo = -1;  // the last code whose value is <= y (the map ascends)
  for (int c = 0; c < 256; ++c)
    if (q8_value(non_negative, c) <= y) lo = c;
  if (lo < 0) return 0;
  if (lo == 255) return 255;
  const float a = q8_value(non_negative, lo), b = q8_value(non_negative, lo + 1);
  // Both distances are exact in binary64: y lies between two neighbouring values.
  const double below = static_cast<double>(y) - a, above = static_cast<double>(b) - y;
  if (below != above) return static_cast<std::uint8_t>(below < above ? lo : lo + 1);
  return static_cast<std::uint8_t>(std::fabs(a) > std::fabs(b) ? lo : lo + 1);
}

// torchao's quantizer (8f.1): an eight-step search, then up one code when the rounded
// residual reaches half the rounded gap.
std::uint8_t q8_torchao(float y, bool non_negative) {
  int c = 0;
  for (int k = 128; k >= 1; k /= 2)
    if (y >= q8_value(non_negative, c + k)) c += k;
  const int u = c + 1 < 255 ? c + 1 : 255;
  const float residual = y - q8_value(non_negative, c);
  const float gap = q8_value(non_negative, u) - q8_value(non_negative, c);
  const float half = gap * 0.5f;
  if (residual >= half) c = u;
  return static_cast<std::uint8_t>(c);
}

bool has_q8(const Q8Slot& q) { return q.codes != nullptr || q.absmax != nullptr; }

// Runs `step` over `tensors` with every 8-bit slot dequantized into an f32 array
// (x = M[c] * absmax, one f32 product each), then requantizes each block of each such
// slot from its new values: native, a = max|x| (NaN if any is NaN), codes N(x / a);
// torchao, A = max(a, 1e-12) stored and codes by its search on x / A.
template <class Step>
void with_q8_slots(std::span<const OptimizerTensor> tensors, const bool* non_negative, int used,
                   bool torchao, Step&& step) {
  std::vector<OptimizerTensor> ts(tensors.begin(), tensors.end());
  std::vector<std::vector<float>> values;
  values.reserve(ts.size() * static_cast<std::size_t>(used));
  for (OptimizerTensor& t : ts)
    for (int k = 0; k < used; ++k) {
      if (!has_q8(t.q8[k])) continue;
      const std::size_t n = t.param.numel;
      std::vector<float>& x = values.emplace_back(n);
      for (std::size_t i = 0; i < n; ++i)
        x[i] = q8_value(non_negative[k], t.q8[k].codes[i]) * t.q8[k].absmax[i / kQ8BlockSize];
      t.state[k] = TensorView{x.data(), n, DType::f32};
      t.q8[k] = {};
    }
  step(std::span<const OptimizerTensor>(ts));
  std::size_t next = 0;
  for (const OptimizerTensor& t : tensors)
    for (int k = 0; k < used; ++k) {
      if (!has_q8(t.q8[k])) continue;
      const std::vector<float>& x = values[next++];
      for (std::size_t b0 = 0; b0 < x.size(); b0 += kQ8BlockSize) {
        const std::size_t b1 = std::min(x.size(), b0 + kQ8BlockSize);
        float a = 0.0f;
        bool nan = false;
        for (std::size_t i = b0; i < b1; ++i) {
          if (std::isnan(x[i])) nan = true;
          a = std::fabs(x[i]) > a ? std::fabs(x[i]) : a;
        }
        // A NaN block's maximum: the canonical quiet NaN; torchao's, all bits set (ATen's
        // vector maximum ORs the unordered lanes' all-ones mask into its result).
        if (nan) a = std::bit_cast<float>(torchao ? 0xFFFFFFFFu : 0x7FC00000u);
        if (torchao && !nan) a = a > 1e-12f ? a : 1e-12f;
        t.q8[k].absmax[b0 / kQ8BlockSize] = a;
        for (std::size_t i = b0; i < b1; ++i) {
          const float y = x[i] / a;
          t.q8[k].codes[i] =
              torchao ? q8_torchao(y, non_negative[k]) : q8_nearest(y, non_negative[k]);
        }
      }
    }
}

}  // namespace

void adamw_step(std::span<const OptimizerTensor> tensors, const AdamWConfig& config,
                GradientRead read, const std::int32_t* found_inf) {
  detail::validate_adamw_slots(tensors, config, read, detail::StepCounters::read,
                               detail::ParamDTypes::model_and_q8);
  const detail::FpEnvGuard env;
  if (found_inf != nullptr && *found_inf != 0) return;
  const bool torchao = config.formula == AdamWFormula::torchao;
  with_q8_slots(tensors, detail::AdamW::kSlotNonNegative, config.amsgrad ? 3 : 2, torchao,
                [&](std::span<const OptimizerTensor> ts) {
                  if (config.formula == AdamWFormula::native)
                    adamw_native_steps(ts, config, read);  // no amsgrad, maximize (validated)
                  else if (torchao)
                    torchao_adam_steps(ts, config, read, true);  // no maximize (validated)
                  else
                    torch_adam_family_step(ts, torch_adam_hyper(config, /*adamw=*/true), read);
                });
}

void adam_step(std::span<const OptimizerTensor> tensors, const AdamConfig& config,
               GradientRead read, const std::int32_t* found_inf) {
  detail::validate_adam(tensors, config, read, detail::StepCounters::read,
                        detail::ParamDTypes::model_and_q8);
  const detail::FpEnvGuard env;
  if (found_inf != nullptr && *found_inf != 0) return;
  const bool torchao = config.formula == AdamWFormula::torchao;
  with_q8_slots(tensors, detail::AdamW::kSlotNonNegative, config.amsgrad ? 3 : 2, torchao,
                [&](std::span<const OptimizerTensor> ts) {
                  if (torchao)
                    torchao_adam_steps(ts, config, read, false);  // no maximize (validated)
                  else
                    torch_adam_family_step(ts, torch_adam_hyper(config, /*adamw=*/false), read);
                });
}

void sign_sgd_step(std::span<const OptimizerTensor> tensors, const SignSgdConfig& config,
                   GradientRead read, const std::int32_t* found_inf) {
  detail::validate_sign_sgd_slots(tensors, config, read, detail::ParamDTypes::model);
  const detail::FpEnvGuard env;
  if (found_inf != nullptr && *found_inf != 0) return;
  // docs/numerics.md 8: the param widened when read, rounded once when stored (7.3).
  const SignSgdScalars s = prepare_sign_sgd_scalars(config);
  for (const OptimizerTensor& t : tensors) {
    copy_source(t.param_src, t.param);
    const bool out = has_output(t.compute_param);
    for (std::size_t i = 0; i < t.param.numel; ++i) {
      const float g = load(t.grad, i);
      // sign(g): +1, -1, +0 for either zero, NaN for NaN.
      const float sg = g > 0.0f ? 1.0f : (g < 0.0f ? -1.0f : (g == 0.0f ? 0.0f : g));
      float p = load(t.param, i);
      if (s.apply_decay) p = std::fma(p, s.neg_lr_wd, p);
      p = std::fma(sg, s.neg_lr, p);
      store(t.param, i, p);
      if (out) store(t.compute_param, i, p);
    }
  }
}

void sgd_step(std::span<const OptimizerTensor> tensors, const SgdConfig& config, GradientRead read,
              const std::int32_t* found_inf) {
  detail::validate_sgd(tensors, config, read, detail::StepCounters::read,
                       detail::ParamDTypes::model);
  const detail::FpEnvGuard env;
  if (found_inf != nullptr && *found_inf != 0) return;
  // The scalars of docs/numerics.md 8b, each rounded once from its double expression.
  const float wd = static_cast<float>(config.weight_decay);
  const float mom = static_cast<float>(config.momentum);
  const float c = static_cast<float>(1.0 - config.dampening);
  const float neg_lr = static_cast<float>(-config.lr);
  const bool use_decay = config.weight_decay != 0.0;
  const bool use_momentum = config.momentum != 0.0;
  for (const OptimizerTensor& t : tensors) {
    copy_source(t.param_src, t.param);
    if (use_momentum) copy_source(t.state_src[0], t.state[0]);
    *t.step = *t.step + 1.0f;
    const bool first_step = *t.step == 1.0f;
    const bool out = has_output(t.compute_param);
    const std::size_t n = t.param.numel;
    // the first element of torch's scalar loop
    const std::size_t tail_begin = torch_tail_begin(n, config.torch_tail_width, t.param.dtype);
    for (std::size_t i = 0; i < n; ++i) {
      float g = read_gradient(t.grad, i, read);
      float p = load(t.param, i);
      if (config.maximize) g = -g;
      if (use_decay) g = std::fma(p, wd, g);
      if (use_momentum) {
        float b = load(t.state[0], i);
        if (first_step) {
          b = g;
        } else if (i < tail_begin) {
          const float b_keep = b * mom;
          b = std::fma(g, c, b_keep);
        } else {
          const float g_new = g * c;
          b = std::fma(b, mom, g_new);
        }
        store(t.state[0], i, b);  // the unrounded b goes on (7.3)
        if (config.nesterov) {
          g = std::fma(b, mom, g);
        } else {
          g = b;
        }
      }
      p = std::fma(g, neg_lr, p);
      store(t.param, i, p);
      if (out) store(t.compute_param, i, p);
    }
  }
}

void adagrad_step(std::span<const OptimizerTensor> tensors, const AdagradConfig& config,
                  GradientRead read, const std::int32_t* found_inf) {
  detail::validate_adagrad(tensors, config, read, detail::StepCounters::read,
                           detail::ParamDTypes::model);
  const detail::FpEnvGuard env;
  if (found_inf != nullptr && *found_inf != 0) return;
  // Scalars shared by every tensor (binary64 to f32, section 8c).
  const float wd = static_cast<float>(config.weight_decay);
  const float eps = static_cast<float>(config.eps);
  const bool apply_decay = config.weight_decay != 0.0;
  for (const OptimizerTensor& t : tensors) {
    copy_source(t.param_src, t.param);
    copy_source(t.state_src[0], t.state[0]);
    *t.step = *t.step + 1.0f;
    // clr = lr / (1 + (step - 1) * lr_decay), the denominator one binary64 FMA.
    const double step = static_cast<double>(*t.step);
    const double denom = std::fma(step - 1.0, config.lr_decay, 1.0);
    const double clr_double = config.lr / denom;
    const float clr = static_cast<float>(clr_double);
    const bool out = has_output(t.compute_param);
    for (std::size_t i = 0; i < t.param.numel; ++i) {
      float g = read_gradient(t.grad, i, read);
      float p = load(t.param, i);
      float sum = load(t.state[0], i);
      if (config.maximize) g = -g;
      if (apply_decay) g = std::fma(p, wd, g);
      sum = std::fma(g, g, sum);
      const float root = std::sqrt(sum);
      const float denom_e = root + eps;
      const float num = clr * g;
      const float update = num / denom_e;
      p = p - update;
      store(t.param, i, p);
      store(t.state[0], i, sum);
      if (out) store(t.compute_param, i, p);
    }
  }
}

void lion_step(std::span<const OptimizerTensor> tensors, const LionConfig& config,
               GradientRead read, const std::int32_t* found_inf) {
  detail::validate_unit<detail::Lion>(tensors, config, read, detail::StepCounters::read,
                                      detail::ParamDTypes::model);
  const detail::FpEnvGuard env;
  if (found_inf != nullptr && *found_inf != 0) return;
  // The scalars of docs/numerics.md 8d, each rounded once from binary64.
  const float b1 = static_cast<float>(config.beta1);
  const float c1 = static_cast<float>(1.0 - config.beta1);
  const float b2 = static_cast<float>(config.beta2);
  const float c2 = static_cast<float>(1.0 - config.beta2);
  const float neg_lr = static_cast<float>(-config.lr);
  const float neg_lrwd = static_cast<float>(-(config.lr * config.weight_decay));
  const bool decay = config.weight_decay > 0.0;
  for (const OptimizerTensor& t : tensors) {
    copy_source(t.param_src, t.param);
    copy_source(t.state_src[0], t.state[0]);
    const bool out = has_output(t.compute_param);
    for (std::size_t i = 0; i < t.param.numel; ++i) {
      const float g = read_gradient(t.grad, i, read);
      float p = load(t.param, i);
      const float m = load(t.state[0], i);
      const float m_keep = b1 * m;
      const float g_part = c1 * g;
      const float u = m_keep + g_part;
      // sign(u): +1, -1, +0 for either zero, NaN for NaN.
      const float s = u > 0.0f ? 1.0f : (u < 0.0f ? -1.0f : (u == 0.0f ? 0.0f : u));
      if (decay) p = std::fma(p, neg_lrwd, p);
      const float step = s * neg_lr;
      p = p + step;
      const float m_old = b2 * m;
      const float m_new = c2 * g;
      store(t.param, i, p);
      store(t.state[0], i, m_old + m_new);
      if (out) store(t.compute_param, i, p);
    }
  }
}

void optimizer_step(std::span<const OptimizerTensor> tensors, const OptimizerConfig& config,
                    GradientRead read, const std::int32_t* found_inf) {
  struct Step {
    std::span<const OptimizerTensor> t;
    GradientRead read;
    const std::int32_t* found_inf;
    void operator()(const AdamWConfig& c) const { adamw_step(t, c, read, found_inf); }
    void operator()(const SignSgdConfig& c) const { sign_sgd_step(t, c, read, found_inf); }
    void operator()(const AdamConfig& c) const { adam_step(t, c, read, found_inf); }
    void operator()(const SgdConfig& c) const { sgd_step(t, c, read, found_inf); }
    void operator()(const AdagradConfig& c) const { adagrad_step(t, c, read, found_inf); }
    void operator()(const LionConfig& c) const { lion_step(t, c, read, found_inf); }
  };
  std::visit(Step{tensors, read, found_inf}, config);
}

void accumulate(std::span<const AccumulatePair> pairs) {
  detail::validate_accumulate(pairs);
  const detail::FpEnvGuard env;
  for (const AccumulatePair& pr : pairs) {
    auto* A = static_cast<float*>(pr.acc.data);
    for (std::size_t i = 0; i < pr.acc.numel; ++i) {
      const float x = load(pr.src, i);
      A[i] = pr.copy ? x : A[i] + x;
    }
  }
}

void scale_(std::span<const TensorView> tensors, float scale) {
  detail::validate_scale(tensors, scale);
  const detail::FpEnvGuard env;
  for (const TensorView& t : tensors) {
    const ConstTensorView c = t;
    for (std::size_t i = 0; i < t.numel; ++i) store(t, i, load(c, i) * scale);
  }
}

NormPartial norm_partial(std::span<const ConstTensorView> tensors, GradientRead read,
                         NormOrder order) {
  detail::validate_norm(tensors, read);
  const detail::FpEnvGuard env;
  NormPartial p;
  std::uint64_t since_normalize = 0;
  for (const ConstTensorView& t : tensors) {
    for (std::size_t i = 0; i < t.numel; ++i) {
      const float x = read_gradient(t, i, read);
      if (std::isnan(x)) {
        ++p.nan_count;
        continue;
      }
      if (std::isinf(x)) {
        ++p.inf_count;
        continue;
      }
      const std::uint32_t a = f32_bits(x) & 0x7FFFFFFFu;
      if (a > p.max_abs_bits) p.max_abs_bits = a;
      if (a == 0) continue;
      std::uint64_t m = 0;
      int shift = 0;
      if (order == NormOrder::one)
        testing::abs_units(x, m, shift);
      else
        testing::square_units(x, m, shift);
      detail::deposit(p.digits, m, shift);
      if (++since_normalize == (1u << 30)) {
        detail::normalize_digits(p.digits);
        since_normalize = 0;
      }
    }
  }
  detail::normalize_digits(p.digits);
  return p;
}

NormResult p_norm(std::span<const ConstTensorView> tensors, double p, GradientRead read) {
  detail::validate_norm(tensors, read);
  detail::validate_p(p);
  if (p == 2.0) return finalize(norm_partial(tensors, read, NormOrder::two), NormOrder::two);
  if (p == 1.0) return finalize(norm_partial(tensors, read, NormOrder::one), NormOrder::one);
  // docs/numerics.md 6.6: every element's facts, then every term, in storage order.
  detail::PNormFacts facts;
  for (const ConstTensorView& t : tensors) detail::add_facts(t, read, 0, t.numel, facts);
  detail::PowerSum sum;
  const double base = detail::power_base(facts, p);
  if (base > 0.0)
    for (const ConstTensorView& t : tensors) detail::add_powers(t, read, 0, t.numel, base, p, sum);
  return detail::finish_p_norm(facts, sum, p);
}

namespace testing {
void square_units(float x, std::uint64_t& mantissa_squared, int& shift) {
  const std::uint32_t a = f32_bits(x) & 0x7FFFFFFFu;
  const std::uint32_t exp = a >> 23;
  const std::uint64_t mant = exp == 0 ? (a & 0x7FFFFFu) : ((a & 0x7FFFFFu) | 0x800000u);
  const int e = exp == 0 ? -149 : static_cast<int>(exp) - 150;  // |x| = mant * 2^e
  mantissa_squared = mant * mant;                               // exact, < 2^48
  shift = 2 * e - kNormUnitExponent;                            // x^2 / 2^-298 = mant^2 * 2^shift
}

void abs_units(float x, std::uint64_t& mantissa, int& shift) {
  const std::uint32_t a = f32_bits(x) & 0x7FFFFFFFu;
  const std::uint32_t exp = a >> 23;
  mantissa = exp == 0 ? (a & 0x7FFFFFu) : ((a & 0x7FFFFFu) | 0x800000u);
  const int e = exp == 0 ? -149 : static_cast<int>(exp) - 150;  // |x| = mant * 2^e
  shift = e - kNorm1UnitExponent;                               // |x| / 2^-149 = mant * 2^shift
}

std::uint8_t q8_nearest(float y, bool non_negative) {
  return reference::q8_nearest(y, non_negative);
}
std::uint8_t q8_torchao(float y, bool non_negative) {
  return reference::q8_torchao(y, non_negative);
}
}  // namespace testing

}  // namespace stepcore::reference
