// The 8-bit state tests' tensor sets (docs/numerics.md 8f): tensors whose every array a
// step writes is held in the set (so a copy steps on its own), their adversarial
// gradients, the reference's step of them and a bitwise comparison. Shared by the CPU
// engine's and the device bodies' tests.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/optimizers/all.hpp"
#include "core/q8_maps.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"

namespace stepcore::testing_support::q8 {

using stepcore::AdamConfig;
using stepcore::AdamWConfig;
using stepcore::DType;
using stepcore::kQ8BlockSize;
using stepcore::OptimizerTensor;
using stepcore::Q8Slot;
using stepcore::TensorView;

inline std::uint32_t q8_bits(float f) { return std::bit_cast<std::uint32_t>(f); }

// One optimizer's tensors with 8-bit state, everything a step writes held here, so a copy
// steps independently of its original.
struct Q8Set {
  struct Tensor {
    std::size_t n = 0;
    DType param_dtype = DType::f32;
    DType grad_dtype = DType::f32;
    bool output = false;             // a bf16 compute output (f32 params only)
    std::vector<std::uint32_t> p32;  // f32 param patterns
    std::vector<std::uint16_t> p16;  // bf16/f16 param patterns
    std::vector<std::uint16_t> out;  // the compute output's bf16 patterns
    std::vector<float> g32;
    std::vector<std::uint16_t> g16;
    float step = 0.0f;
    std::vector<std::uint8_t> codes[3];
    std::vector<float> absmax[3];
  };
  std::vector<Tensor> tensors;
  int slots = 2;

  std::vector<OptimizerTensor> views() {
    std::vector<OptimizerTensor> vs;
    static std::uint8_t no_code;
    static float no_max;
    for (Tensor& t : tensors) {
      OptimizerTensor v;
      v.param = t.param_dtype == DType::f32 ? TensorView{t.p32.data(), t.n, DType::f32}
                                            : TensorView{t.p16.data(), t.n, t.param_dtype};
      v.step = &t.step;
      v.grad = t.grad_dtype == DType::f32
                   ? stepcore::ConstTensorView{t.g32.data(), t.n, DType::f32}
                   : stepcore::ConstTensorView{t.g16.data(), t.n, DType::bf16};
      if (t.output) v.compute_param = TensorView{t.out.data(), t.n, DType::bf16};
      for (int k = 0; k < slots; ++k)
        v.q8[k] =
            t.n == 0 ? Q8Slot{&no_code, &no_max} : Q8Slot{t.codes[k].data(), t.absmax[k].data()};
      vs.push_back(v);
    }
    return vs;
  }
};

struct TensorSpec {
  std::size_t n;
  DType param;
  DType grad;
  bool output;
};

// A set for a step of configuration c: the slots its variant uses, each fresh (the zero
// code of its map; maxima 0, or torchao's least stored maximum under its rule), with
// random params.
template <class Config>
Q8Set make_set(const std::vector<TensorSpec>& specs, const Config& c) {
  using Opt = typename stepcore::detail::UnitForConfig<Config, stepcore::detail::AllUnits>::type;
  const int v = Opt::variant(c);
  const bool torchao = stepcore::detail::unit_q8_rule<Opt>(v) == stepcore::detail::Q8Rule::torchao;
  Q8Set set;
  set.slots = Opt::slots(v);
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 0.5f);
  for (const TensorSpec& s : specs) {
    Q8Set::Tensor t;
    t.n = s.n;
    t.param_dtype = s.param;
    t.grad_dtype = s.grad;
    t.output = s.output;
    if (s.param == DType::f32) {
      t.p32.resize(s.n);
      for (auto& x : t.p32) x = q8_bits(nd(rng));
    } else {
      t.p16.resize(s.n);
      for (auto& x : t.p16)
        x = s.param == DType::bf16 ? stepcore::f32_to_bf16_bits(nd(rng))
                                   : stepcore::f32_to_f16_bits(nd(rng));
    }
    if (s.output) t.out.assign(s.n, 0);
    (s.grad == DType::f32 ? t.g32.resize(s.n) : t.g16.resize(s.n));
    const std::size_t blocks = (s.n + kQ8BlockSize - 1) / kQ8BlockSize;
    for (int k = 0; k < set.slots; ++k) {
      const bool u = stepcore::detail::unit_slot_non_negative<Opt>(k);
      t.codes[k].assign(s.n, static_cast<std::uint8_t>(u ? stepcore::detail::kQ8UnsignedZero
                                                         : stepcore::detail::kQ8SignedZero));
      t.absmax[k].assign(blocks, torchao ? 1e-12f : 0.0f);
    }
    set.tensors.push_back(std::move(t));
  }
  return set;
}

// The name of configuration c in a failure message: the optimizer, AdamW's formula, amsgrad.
inline std::string q8_config_name(const AdamWConfig& c) {
  return std::string("adamw ") +
         std::string(stepcore::kAdamWFormulaNames[static_cast<int>(c.formula)]) +
         (c.amsgrad ? " amsgrad" : "");
}
inline std::string q8_config_name(const AdamConfig& c) {
  return c.amsgrad ? "adam amsgrad" : "adam";
}

// The gradients of step s, the same for every copy: all-zero blocks, blocks with one
// non-zero, exact zeros inside blocks, magnitudes from 2^-75 (subnormal moments) to 2^20,
// and at step 4 one element of the last tensor at 2^63 (its square overflows: an infinite
// moment, and its block NaN from the next step).
inline void fill_grads(Q8Set& set, int s) {
  std::mt19937 rng(1000 + static_cast<unsigned>(s));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-75, 20);
  for (std::size_t t = 0; t < set.tensors.size(); ++t) {
    Q8Set::Tensor& x = set.tensors[t];
    for (std::size_t i = 0; i < x.n; ++i) {
      const std::size_t block = i / kQ8BlockSize;
      float g;
      if (block % 4 == 1)
        g = 0.0f;
      else if (block % 4 == 2)
        g = i % kQ8BlockSize == 17 ? std::ldexp(nd(rng), binade(rng)) : 0.0f;
      else
        g = i % 5 == 3 ? 0.0f : std::ldexp(nd(rng), binade(rng));
      if (s == 4 && t + 1 == set.tensors.size() && i == x.n / 2) g = 0x1p63f;
      if (x.grad_dtype == DType::f32)
        x.g32[i] = g;
      else
        x.g16[i] = stepcore::f32_to_bf16_bits(g);
    }
  }
}

inline void expect_same(const Q8Set& got, const Q8Set& want, const std::string& what) {
  for (std::size_t t = 0; t < got.tensors.size(); ++t) {
    const auto& a = got.tensors[t];
    const auto& b = want.tensors[t];
    const std::string w =
        what + " tensor " + std::to_string(t) + " (n " + std::to_string(a.n) + ")";
    ASSERT_EQ(a.p32, b.p32) << w << " param";
    ASSERT_EQ(a.p16, b.p16) << w << " param";
    ASSERT_EQ(a.out, b.out) << w << " compute output";
    ASSERT_EQ(q8_bits(a.step), q8_bits(b.step)) << w;
    for (int k = 0; k < got.slots; ++k) {
      ASSERT_EQ(a.codes[k], b.codes[k]) << w << " codes of slot " << k;
      for (std::size_t i = 0; i < a.absmax[k].size(); ++i)
        ASSERT_EQ(q8_bits(a.absmax[k][i]), q8_bits(b.absmax[k][i]))
            << w << " absmax " << k << "." << i;
    }
  }
}

inline void reference_step(std::vector<OptimizerTensor>& v, const AdamWConfig& c,
                           stepcore::GradientRead read) {
  stepcore::reference::adamw_step(v, c, read);
}
inline void reference_step(std::vector<OptimizerTensor>& v, const AdamConfig& c,
                           stepcore::GradientRead read) {
  stepcore::reference::adam_step(v, c, read);
}

inline std::vector<AdamConfig> adam_configs() {
  AdamConfig plain;
  plain.lr = 1e-2;
  plain.weight_decay = 0.05;
  AdamConfig ams = plain;
  ams.amsgrad = true;
  ams.beta1 = 0.3;
  ams.torch_v_first = true;
  ams.torch_tail_width = 4;
  return {plain, ams};
}

// Boundary sizes, each a tensor of one multi-tensor call: the vector width's, the block's
// and 4 Ki's neighbours; every param and gradient dtype, and a compute output.
inline std::vector<TensorSpec> boundary_specs() {
  std::vector<TensorSpec> specs;
  const std::size_t sizes[] = {0, 1, 31, 32, 33, 255, 256, 257, 1023, 1024, 1025, 4095, 4096, 4097};
  int k = 0;
  for (std::size_t n : sizes)
    for (DType p : {DType::f32, DType::bf16, DType::f16}) {
      const DType g = (k++ % 2 == 0) ? DType::f32 : DType::bf16;
      specs.push_back({n, p, g, false});
    }
  specs.push_back({777, DType::f32, DType::f32, true});
  return specs;
}

}  // namespace stepcore::testing_support::q8
