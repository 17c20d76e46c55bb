// Unit: argument validation of every stepcore::reference entry point. Each bad
// argument gets stepcore::Error with the right code() and an argument() naming it,
// and every buffer of the call (valid tensors before the bad one, step counters,
// gradients, outputs) is bit-for-bit unchanged: all-or-nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/validate.hpp"
#include "expect_error.hpp"
#include "stepcore/error.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"

namespace {

using stepcore::AccumulatePair;
using stepcore::AdagradConfig;
using stepcore::AdamConfig;
using stepcore::AdamWConfig;
using stepcore::AdamWFormula;
using stepcore::ConstTensorView;
using stepcore::DType;
using stepcore::Errc;
using stepcore::GradientRead;
using stepcore::LionConfig;
using stepcore::OptimizerTensor;
using stepcore::SgdConfig;
using stepcore::SignSgdConfig;
using stepcore::TensorView;
namespace ref = stepcore::reference;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kNaNf = std::numeric_limits<float>::quiet_NaN();
constexpr float kInff = std::numeric_limits<float>::infinity();
const DType kBadDType = static_cast<DType>(7);

// Every buffer of a test lives in one arena, so one snapshot covers all of them.
class Arena {
 public:
  Arena() : mem_(1 << 20) {
    std::mt19937 rng(1);
    for (auto& b : mem_) b = static_cast<std::byte>(rng() & 0x3F);  // small positive floats, no NaN
  }
  template <class T>
  T* alloc(std::size_t n) {
    used_ = (used_ + 63) & ~std::size_t{63};
    T* p = reinterpret_cast<T*>(mem_.data() + used_);
    used_ += n * sizeof(T) + 64;  // a gap: separate allocations never touch
    if (used_ > mem_.size()) throw std::runtime_error("arena too small");
    return p;
  }
  std::vector<std::byte> snapshot() const { return mem_; }
  bool same(const std::vector<std::byte>& s) const { return s == mem_; }

 private:
  std::vector<std::byte> mem_;
  std::size_t used_ = 0;
};

// Runs f, which must throw stepcore::Error(code, one of `args`), and checks that
// the arena is unchanged.
void expect_error(const Arena& arena, const std::function<void()>& f, Errc code,
                  std::vector<std::string> args) {
  const auto before = arena.snapshot();
  test_support::expect_error(f, code, std::move(args));
  EXPECT_TRUE(arena.same(before)) << "a buffer changed although the call failed";
}

// ---- AdamW ----------------------------------------------------------------------------

struct AdamWFixture : ::testing::Test {
  Arena arena;
  std::vector<OptimizerTensor> valid;  // tensors[0..2]

  // An AdamW tensor: state[0] exp_avg, state[1] exp_avg_sq, a step counter.
  OptimizerTensor make(std::size_t n, DType gdt = DType::f32, DType odt = DType::bf16,
                       bool out = true) {
    OptimizerTensor t;
    t.param = {arena.alloc<float>(n), n, DType::f32};
    t.state[0] = {arena.alloc<float>(n), n, DType::f32};
    t.state[1] = {arena.alloc<float>(n), n, DType::f32};
    t.step = arena.alloc<float>(1);
    *t.step = 3.0f;
    t.grad = {arena.alloc<std::uint32_t>(n), n, gdt};  // room for any dtype
    if (out) t.compute_param = {arena.alloc<std::uint32_t>(n), n, odt};
    return t;
  }
  void SetUp() override {
    valid.push_back(make(5, DType::f32, DType::f32));
    valid.push_back(make(17, DType::bf16, DType::f16));
    valid.push_back(make(8, DType::f16, DType::bf16, false));
  }
  // The valid tensors plus `bad` as tensors[3].
  std::vector<OptimizerTensor> with(const OptimizerTensor& bad) {
    std::vector<OptimizerTensor> v = valid;
    v.push_back(bad);
    return v;
  }
  void expect(const std::vector<OptimizerTensor>& ts, const AdamWConfig& c, GradientRead r,
              Errc code, std::vector<std::string> args, const std::int32_t* found_inf = nullptr) {
    expect_error(
        arena, [&] { ref::adamw_step(ts, c, r, found_inf); }, code, std::move(args));
  }
  void expect_tensor(const OptimizerTensor& bad, Errc code, const std::string& arg) {
    for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch}) {
      AdamWConfig c;
      c.formula = f;
      expect(with(bad), c, {}, code, {arg});
    }
  }
  void expect_config(const AdamWConfig& c, Errc code, const std::string& arg) {
    expect(with(make(9)), c, {}, code, {arg});
  }
};

TEST_F(AdamWFixture, ValidCallWritesTheArena) {
  // The control: the same buffers accept a valid call, and it does write.
  const auto before = arena.snapshot();
  ref::adamw_step(with(make(9)), AdamWConfig{});
  EXPECT_FALSE(arena.same(before));
  EXPECT_EQ(*valid[0].step, 4.0f);
}

TEST_F(AdamWFixture, HyperParameters) {
  auto cfg = [](auto set) {
    AdamWConfig c;
    set(c);
    return c;
  };
  expect_config(cfg([](AdamWConfig& c) { c.lr = kNaN; }), Errc::non_finite, "config.lr");
  expect_config(cfg([](AdamWConfig& c) { c.lr = kInf; }), Errc::non_finite, "config.lr");
  expect_config(cfg([](AdamWConfig& c) { c.lr = -1e-3; }), Errc::invalid_argument, "config.lr");
  expect_config(cfg([](AdamWConfig& c) { c.lr = 1e300, c.weight_decay = 0; }), Errc::out_of_range,
                "config.lr");
  expect_config(cfg([](AdamWConfig& c) { c.beta1 = kNaN; }), Errc::non_finite, "config.beta1");
  expect_config(cfg([](AdamWConfig& c) { c.beta1 = 1.0; }), Errc::invalid_argument, "config.beta1");
  expect_config(cfg([](AdamWConfig& c) { c.beta1 = -0.1; }), Errc::invalid_argument,
                "config.beta1");
  expect_config(cfg([](AdamWConfig& c) { c.beta2 = kNaN; }), Errc::non_finite, "config.beta2");
  expect_config(cfg([](AdamWConfig& c) { c.beta2 = -0.1; }), Errc::invalid_argument,
                "config.beta2");
  expect_config(cfg([](AdamWConfig& c) { c.beta2 = 1.0; }), Errc::invalid_argument, "config.beta2");
  expect_config(cfg([](AdamWConfig& c) { c.eps = 0.0; }), Errc::invalid_argument, "config.eps");
  expect_config(cfg([](AdamWConfig& c) { c.eps = -1e-8; }), Errc::invalid_argument, "config.eps");
  expect_config(cfg([](AdamWConfig& c) { c.eps = kNaN; }), Errc::non_finite, "config.eps");
  expect_config(cfg([](AdamWConfig& c) { c.eps = kInf; }), Errc::non_finite, "config.eps");
  expect_config(cfg([](AdamWConfig& c) { c.eps = 1e-60; }), Errc::out_of_range,
                "config.eps");  // 0 in f32
  expect_config(cfg([](AdamWConfig& c) { c.eps = 1e300; }), Errc::out_of_range,
                "config.eps");  // Inf in f32
  expect_config(cfg([](AdamWConfig& c) { c.weight_decay = -0.01; }), Errc::invalid_argument,
                "config.weight_decay");
  expect_config(cfg([](AdamWConfig& c) { c.weight_decay = kNaN; }), Errc::non_finite,
                "config.weight_decay");
  expect_config(cfg([](AdamWConfig& c) { c.lr = 0.5, c.weight_decay = 3.0; }),
                Errc::invalid_argument, "config.weight_decay");
  expect_config(cfg([](AdamWConfig& c) { c.torch_tail_width = -1; }), Errc::out_of_range,
                "config.torch_tail_width");
  // Native formula: hyper-parameters are checked again after rounding to f32.
  expect_config(
      cfg([](AdamWConfig& c) { c.formula = AdamWFormula::native, c.beta1 = 1.0 - 0x1p-26; }),
      Errc::out_of_range, "config.beta1");
  expect_config(
      cfg([](AdamWConfig& c) { c.formula = AdamWFormula::native, c.beta2 = 1.0 - 0x1p-26; }),
      Errc::out_of_range, "config.beta2");
  expect_config(cfg([](AdamWConfig& c) {
                  c.formula = AdamWFormula::native, c.lr = 0.1, c.weight_decay = 10.0;
                }),
                Errc::out_of_range,
                "config.weight_decay");  // exactly 1 in double, 1.0000000149 in f32
  expect_config(cfg([](AdamWConfig& c) { c.torch_tail_width = 65; }), Errc::out_of_range,
                "config.torch_tail_width");
  expect_config(cfg([](AdamWConfig& c) { c.formula = static_cast<AdamWFormula>(7); }),
                Errc::invalid_argument, "config.formula");
  // Boundary values that are valid.
  for (auto c :
       {cfg([](AdamWConfig& c) { c.lr = 0.0; }),
        cfg([](AdamWConfig& c) { c.beta1 = 0.0, c.beta2 = 0.0; }),
        cfg([](AdamWConfig& c) { c.lr = 1.0, c.weight_decay = 1.0; }),
        cfg([](AdamWConfig& c) { c.torch_tail_width = 64, c.formula = AdamWFormula::torch; })})
    EXPECT_NO_THROW(ref::adamw_step(with(make(3)), c));
}

TEST_F(AdamWFixture, GradientRead) {
  const AdamWConfig c;
  const auto t = with(make(4));
  expect(t, c, {0.0f, 1.0f}, Errc::invalid_argument, {"read.scale"});
  expect(t, c, {-1.0f, 1.0f}, Errc::invalid_argument, {"read.scale"});
  expect(t, c, {kNaNf, 1.0f}, Errc::non_finite, {"read.scale"});
  expect(t, c, {kInff, 1.0f}, Errc::non_finite, {"read.scale"});
  expect(t, c, {1.0f, 1.5f}, Errc::invalid_argument, {"read.clip"});
  expect(t, c, {1.0f, -0.5f}, Errc::invalid_argument, {"read.clip"});
  expect(t, c, {1.0f, kNaNf}, Errc::non_finite, {"read.clip"});
  expect(t, c, {1.0f, kInff}, Errc::non_finite, {"read.clip"});
  // Validation comes before found_inf: a set flag does not hide a bad argument.
  const std::int32_t flag = 1;
  expect(t, c, {kNaNf, 1.0f}, Errc::non_finite, {"read.scale"}, &flag);
  // clip 0 and 1 are valid for AdamW.
  EXPECT_NO_THROW(ref::adamw_step(t, c, {1.0f, 0.0f}));
  EXPECT_NO_THROW(ref::adamw_step(t, c, {1.0f, 1.0f}));
}

TEST_F(AdamWFixture, PointersDtypesAndSizes) {
  const std::string n = "tensors[3].";
  auto bad = [&](auto mutate) {
    OptimizerTensor t = make(6);
    mutate(t);
    return t;
  };
  expect_tensor(bad([](OptimizerTensor& t) { t.param.data = nullptr; }), Errc::null_pointer,
                n + "param");
  // A bf16/f16 param with f32 state: AdamFixture.StateSlots names the state or the output.
  expect_tensor(bad([](OptimizerTensor& t) { t.param.dtype = kBadDType; }), Errc::unsupported_dtype,
                n + "param");
  expect_tensor(bad([](OptimizerTensor& t) { t.param.numel = (std::size_t{1} << 61); }),
                Errc::out_of_range, n + "param");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[0].data = nullptr; }), Errc::null_pointer,
                n + "exp_avg");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[0].dtype = DType::f16; }),
                Errc::unsupported_dtype, n + "exp_avg");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[0].numel = 5; }), Errc::size_mismatch,
                n + "exp_avg");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[0].numel = 7; }), Errc::size_mismatch,
                n + "exp_avg");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[1].data = nullptr; }), Errc::null_pointer,
                n + "exp_avg_sq");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[1].dtype = DType::bf16; }),
                Errc::unsupported_dtype, n + "exp_avg_sq");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[1].numel = 0; }), Errc::size_mismatch,
                n + "exp_avg_sq");
  expect_tensor(bad([](OptimizerTensor& t) { t.grad.data = nullptr; }), Errc::null_pointer,
                n + "grad");
  expect_tensor(bad([](OptimizerTensor& t) { t.grad.dtype = kBadDType; }), Errc::unsupported_dtype,
                n + "grad");
  expect_tensor(bad([](OptimizerTensor& t) { t.grad.numel = 5; }), Errc::size_mismatch, n + "grad");
  expect_tensor(bad([](OptimizerTensor& t) { t.compute_param.numel = 5; }), Errc::size_mismatch,
                n + "compute_param");
  expect_tensor(bad([](OptimizerTensor& t) { t.compute_param.data = nullptr; }), Errc::null_pointer,
                n + "compute_param");
  expect_tensor(bad([](OptimizerTensor& t) { t.compute_param.dtype = kBadDType; }),
                Errc::unsupported_dtype, n + "compute_param");
  // param and its moments empty, the gradient not: the gradient is the mismatch.
  expect_tensor(
      bad([](OptimizerTensor& t) { t.param.numel = t.state[0].numel = t.state[1].numel = 0; }),
      Errc::size_mismatch, n + "grad");
  // Sizes of a valid empty tensor with null pointers are fine.
  OptimizerTensor empty;
  float step = 0.0f;
  empty.step = &step;
  EXPECT_NO_THROW(ref::adamw_step(with(empty), AdamWConfig{}));
}

TEST_F(AdamWFixture, StepCounters) {
  const std::string s = "tensors[3].step";
  auto with_step = [&](float v) {
    OptimizerTensor t = make(4);
    *t.step = v;
    return t;
  };
  OptimizerTensor null_step = make(4);
  null_step.step = nullptr;
  expect_tensor(null_step, Errc::null_pointer, s);
  expect_tensor(with_step(kNaNf), Errc::non_finite, s);
  expect_tensor(with_step(kInff), Errc::non_finite, s);
  expect_tensor(with_step(1.5f), Errc::out_of_range, s);
  expect_tensor(with_step(-1.0f), Errc::out_of_range, s);
  expect_tensor(with_step(16777216.0f), Errc::out_of_range, s);  // 2^24
  expect_tensor(with_step(16777218.0f), Errc::out_of_range, s);
  expect_tensor(with_step(1e30f), Errc::out_of_range, s);
  // The largest valid counter.
  OptimizerTensor ok = with_step(16777215.0f);
  EXPECT_NO_THROW(ref::adamw_step(with(ok), AdamWConfig{}));
  EXPECT_EQ(*ok.step, 16777216.0f);
}

TEST_F(AdamWFixture, Overlaps) {
  const std::string n = "tensors[3].";
  {
    // compute_param starting inside its own param.
    OptimizerTensor t = make(6, DType::f32, DType::f32);
    t.compute_param.data = static_cast<float*>(t.param.data) + 1;
    expect_tensor(t, Errc::overlap, n + "compute_param");
  }
  {
    // exp_avg starting inside its own (f32) gradient.
    OptimizerTensor t = make(6);
    t.state[0].data = const_cast<float*>(static_cast<const float*>(t.grad.data)) + 2;
    expect_tensor(t, Errc::overlap, n + "exp_avg");
  }
  {
    // exp_avg_sq starting inside tensors[0].param.
    OptimizerTensor t = make(4);
    t.state[1].data = static_cast<float*>(valid[0].param.data) + 1;
    expect_tensor(t, Errc::overlap, n + "exp_avg_sq");
  }
  {
    // compute_param (bf16) starting inside tensors[1].grad (read only).
    OptimizerTensor t = make(6);
    t.compute_param.data =
        const_cast<std::uint16_t*>(static_cast<const std::uint16_t*>(valid[1].grad.data)) + 3;
    expect_tensor(t, Errc::overlap, n + "compute_param");
  }
  {
    // Two tensors sharing one step counter (same address: either may be named).
    OptimizerTensor t = make(4);
    t.step = valid[0].step;
    expect(with(t), AdamWConfig{}, {}, Errc::overlap, {"tensors[3].step", "tensors[0].step"});
  }
  {
    // A step counter inside its own param.
    OptimizerTensor t = make(4);
    t.step = static_cast<float*>(t.param.data) + 2;
    *t.step = 1.0f;
    expect_tensor(t, Errc::overlap, n + "step");
  }
  {
    // The same tensor twice: its param overlaps itself.
    expect(with(valid[1]), AdamWConfig{}, {}, Errc::overlap,
           {"tensors[3].param", "tensors[1].param", "tensors[3].exp_avg", "tensors[1].exp_avg",
            "tensors[3].exp_avg_sq", "tensors[1].exp_avg_sq", "tensors[3].step", "tensors[1].step",
            "tensors[3].compute_param", "tensors[1].compute_param", "tensors[3].grad",
            "tensors[1].grad"});
  }
  // Read-only buffers may alias: two tensors reading one gradient is valid.
  OptimizerTensor shared = make(17);
  shared.grad = valid[1].grad;
  EXPECT_NO_THROW(ref::adamw_step(with(shared), AdamWConfig{}));
}

TEST_F(AdamWFixture, OutOfPlaceSources) {
  const std::string n = "tensors[3].";
  // A tensor of 6 elements stepping out of place from three separate f32 sources.
  auto out_of_place = [&](auto mutate) {
    OptimizerTensor t = make(6);
    t.param_src = {arena.alloc<float>(6), 6, DType::f32};
    t.state_src[0] = {arena.alloc<float>(6), 6, DType::f32};
    t.state_src[1] = {arena.alloc<float>(6), 6, DType::f32};
    mutate(t);
    return t;
  };
  // dtype, size, null data, alignment: named as the source.
  expect_tensor(out_of_place([](OptimizerTensor& t) { t.param_src.dtype = DType::bf16; }),
                Errc::unsupported_dtype, n + "param_src");
  expect_tensor(out_of_place([](OptimizerTensor& t) { t.state_src[0].dtype = kBadDType; }),
                Errc::unsupported_dtype, n + "exp_avg_src");
  expect_tensor(out_of_place([](OptimizerTensor& t) { t.state_src[1].numel = 5; }),
                Errc::size_mismatch, n + "exp_avg_sq_src");
  expect_tensor(out_of_place([](OptimizerTensor& t) { t.param_src.numel = 7; }),
                Errc::size_mismatch, n + "param_src");
  expect_tensor(out_of_place([](OptimizerTensor& t) { t.state_src[0].data = nullptr; }),
                Errc::null_pointer, n + "exp_avg_src");
  expect_tensor(out_of_place([](OptimizerTensor& t) {
                  t.param_src.data = static_cast<const std::byte*>(t.param_src.data) + 2;
                }),
                Errc::invalid_argument, n + "param_src");
  // A source must be its destination exactly or overlap no written buffer of the call.
  expect_tensor(out_of_place([](OptimizerTensor& t) {
                  t.param_src.data = static_cast<const float*>(t.param.data) + 1;  // partial
                }),
                Errc::overlap, n + "param_src");
  expect_tensor(out_of_place([](OptimizerTensor& t) {
                  t.state_src[1].data = static_cast<const float*>(t.state[0].data) + 1;
                }),
                Errc::overlap, n + "exp_avg_sq_src");
  expect_tensor(out_of_place([&](OptimizerTensor& t) {  // another tensor's param
                  t.state_src[0].data = static_cast<const float*>(valid[1].param.data) + 3;
                }),
                Errc::overlap, n + "exp_avg_src");
  expect_tensor(out_of_place([&](OptimizerTensor& t) {  // another tensor's compute output (f32)
                  t.state_src[0].data = static_cast<const float*>(valid[0].compute_param.data) + 1;
                }),
                Errc::overlap, n + "exp_avg_src");
  {  // its own compute output, starting at the same address: either may be named
    OptimizerTensor t = out_of_place([](OptimizerTensor& a) {
      a.compute_param.dtype = DType::f32;
      a.param_src.data = a.compute_param.data;
    });
    expect(with(t), AdamWConfig{}, {}, Errc::overlap, {n + "param_src", n + "compute_param"});
  }
  {  // a step counter (a one-element tensor's source at tensors[0]'s counter; same address)
    OptimizerTensor t = make(1);
    t.param_src = {valid[0].step, 1, DType::f32};
    expect(with(t), AdamWConfig{}, {}, Errc::overlap, {n + "param_src", "tensors[0].step"});
  }
  // Accepted: sources that are exactly their destinations (in place), and read-only
  // sources sharing memory with each other or with a gradient.
  auto run = [&](const OptimizerTensor& t) { ref::adamw_step(with(t), AdamWConfig{}); };
  EXPECT_NO_THROW(run(out_of_place([](OptimizerTensor&) {})));
  EXPECT_NO_THROW(run(out_of_place([](OptimizerTensor& t) {
    t.param_src = t.param;
    t.state_src[0] = t.state[0];
    t.state_src[1] = t.state[1];
  })));
  EXPECT_NO_THROW(run(out_of_place([&](OptimizerTensor& t) {
    t.state_src[0] = t.param_src;
    t.state_src[1] = {valid[0].grad.data, 6, DType::f32};  // valid[0]'s f32 gradient
  })));
}

// ---- Adagrad ---------------------------------------------------------------------------

struct AdagradFixture : ::testing::Test {
  Arena arena;
  std::vector<OptimizerTensor> valid;  // tensors[0..2]

  OptimizerTensor make(std::size_t n, bool out = true) {
    OptimizerTensor t;
    t.param = {arena.alloc<float>(n), n, DType::f32};
    t.state[0] = {arena.alloc<float>(n), n, DType::f32};
    t.step = arena.alloc<float>(1);
    *t.step = 3.0f;
    t.grad = {arena.alloc<std::uint32_t>(n), n, DType::f32};
    if (out) t.compute_param = {arena.alloc<std::uint32_t>(n), n, DType::bf16};
    return t;
  }
  void SetUp() override {
    valid.push_back(make(5));
    valid.push_back(make(17, false));
    valid.push_back(make(8));
  }
  std::vector<OptimizerTensor> with(const OptimizerTensor& bad) {
    std::vector<OptimizerTensor> v = valid;
    v.push_back(bad);
    return v;
  }
  void expect(const std::vector<OptimizerTensor>& ts, const AdagradConfig& c, GradientRead r,
              Errc code, std::vector<std::string> args) {
    expect_error(
        arena, [&] { ref::adagrad_step(ts, c, r); }, code, std::move(args));
  }
  void expect_tensor(const OptimizerTensor& bad, Errc code, const std::string& arg) {
    expect(with(bad), AdagradConfig{}, {}, code, {arg});
  }
};

TEST_F(AdagradFixture, ValidCallWritesTheArena) {
  const auto before = arena.snapshot();
  ref::adagrad_step(with(make(9)), AdagradConfig{});
  EXPECT_FALSE(arena.same(before));
  EXPECT_EQ(*valid[0].step, 4.0f);
}

TEST_F(AdagradFixture, FoundInfWritesNothing) {
  const auto ts = with(make(9));
  const auto before = arena.snapshot();
  const std::int32_t found_inf = 1;
  ref::adagrad_step(ts, AdagradConfig{}, {}, &found_inf);
  EXPECT_TRUE(arena.same(before));
}

// torch.optim.Adagrad's bounds: every hyper-parameter finite and >= 0 (eps = 0 and
// lr_decay = 0 included), and the values rounded to f32 finite there.
TEST_F(AdagradFixture, HyperParameters) {
  auto cfg = [](auto set) {
    AdagradConfig c;
    set(c);
    return c;
  };
  const auto t = with(make(9));
  struct Field {
    const char* name;
    double AdagradConfig::*member;
  };
  for (const Field f :
       {Field{"config.lr", &AdagradConfig::lr}, Field{"config.lr_decay", &AdagradConfig::lr_decay},
        Field{"config.weight_decay", &AdagradConfig::weight_decay},
        Field{"config.initial_accumulator_value", &AdagradConfig::initial_accumulator_value},
        Field{"config.eps", &AdagradConfig::eps}}) {
    SCOPED_TRACE(f.name);
    expect(t, cfg([&](AdagradConfig& c) { c.*f.member = kNaN; }), {}, Errc::non_finite, {f.name});
    expect(t, cfg([&](AdagradConfig& c) { c.*f.member = kInf; }), {}, Errc::non_finite, {f.name});
    expect(t, cfg([&](AdagradConfig& c) { c.*f.member = -kInf; }), {}, Errc::non_finite, {f.name});
    expect(t, cfg([&](AdagradConfig& c) { c.*f.member = -1e-3; }), {}, Errc::invalid_argument,
           {f.name});
    expect(t, cfg([&](AdagradConfig& c) { c.*f.member = -std::numeric_limits<double>::min(); }), {},
           Errc::invalid_argument, {f.name});
    // 0 is in range for every one of them (torch: `0.0 <= value`).
    EXPECT_NO_THROW(ref::adagrad_step(with(make(4)), cfg([&](AdagradConfig& c) {
                                        c.*f.member = 0.0;
                                        c.initial_accumulator_value = 0.5;  // no 0 / 0
                                      })));
  }
  // Values that overflow when the kernel rounds them to f32 (lr_decay is never rounded).
  expect(t, cfg([](AdagradConfig& c) { c.lr = 1e300; }), {}, Errc::out_of_range, {"config.lr"});
  expect(t, cfg([](AdagradConfig& c) { c.weight_decay = 1e39; }), {}, Errc::out_of_range,
         {"config.weight_decay"});
  expect(t, cfg([](AdagradConfig& c) { c.initial_accumulator_value = 1e39; }), {},
         Errc::out_of_range, {"config.initial_accumulator_value"});
  expect(t, cfg([](AdagradConfig& c) { c.eps = 1e39; }), {}, Errc::out_of_range, {"config.eps"});
  EXPECT_NO_THROW(ref::adagrad_step(with(make(4)), cfg([](AdagradConfig& c) {
                                      c.lr_decay = 1e300;
                                      c.eps = 1e-300;  // rounds to +0 in f32: allowed, as 0 is
                                    })));
  // The read scalars, as every optimizer's.
  const AdagradConfig c;
  expect(t, c, {0.0f, 1.0f}, Errc::invalid_argument, {"read.scale"});
  expect(t, c, {kNaNf, 1.0f}, Errc::non_finite, {"read.scale"});
  expect(t, c, {1.0f, 1.5f}, Errc::invalid_argument, {"read.clip"});
  expect(t, c, {1.0f, kInff}, Errc::non_finite, {"read.clip"});
}

TEST_F(AdagradFixture, TensorsSlotsAndStepCounters) {
  auto bad = [&](auto mutate) {
    OptimizerTensor t = make(6);
    mutate(t);
    return t;
  };
  // A bf16/f16 param (docs/numerics.md 7.3) takes no compute output, and its state must
  // share its dtype: the f32 sum is named.
  expect_tensor(bad([](OptimizerTensor& t) { t.param.dtype = DType::bf16; }),
                Errc::invalid_argument, "tensors[3].compute_param");
  expect_tensor(bad([](OptimizerTensor& t) {
                  t.param.dtype = DType::bf16;
                  t.compute_param = {};
                }),
                Errc::unsupported_dtype, "tensors[3].sum");
  expect_tensor(bad([](OptimizerTensor& t) { t.grad.numel = 7; }), Errc::size_mismatch,
                "tensors[3].grad");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[0] = {}; }), Errc::size_mismatch,
                "tensors[3].sum");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[0].dtype = DType::f16; }),
                Errc::unsupported_dtype, "tensors[3].sum");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[0].data = nullptr; }), Errc::null_pointer,
                "tensors[3].sum");
  expect_tensor(bad([&](OptimizerTensor& t) {
                  t.state[1] = {arena.alloc<float>(6), 6, DType::f32};
                }),
                Errc::invalid_argument, "tensors[3].state[1]");
  expect_tensor(bad([&](OptimizerTensor& t) {
                  t.state[2] = {arena.alloc<float>(6), 6, DType::f32};
                }),
                Errc::invalid_argument, "tensors[3].state[2]");
  expect_tensor(bad([&](OptimizerTensor& t) {
                  t.state_src[1] = {arena.alloc<float>(6), 6, DType::f32};
                }),
                Errc::invalid_argument, "tensors[3].state_src[1]");
  expect_tensor(bad([](OptimizerTensor& t) {
                  t.state_src[0] = {t.state[0].data, 5, DType::f32};
                }),
                Errc::size_mismatch, "tensors[3].sum_src");
  expect_tensor(bad([](OptimizerTensor& t) {
                  t.state_src[0] = {static_cast<float*>(t.param.data) + 1, 6, DType::f32};
                }),
                Errc::overlap, "tensors[3].sum_src");
  expect(with(bad(
             [](OptimizerTensor& t) { t.state[0].data = static_cast<float*>(t.param.data) + 2; })),
         AdagradConfig{}, {}, Errc::overlap, {"tensors[3].sum", "tensors[3].param"});
  expect_tensor(bad([](OptimizerTensor& t) { t.step = nullptr; }), Errc::null_pointer,
                "tensors[3].step");
  for (const float v : {-1.0f, 0.5f, 16777216.0f}) {
    SCOPED_TRACE(v);
    expect_tensor(bad([&](OptimizerTensor& t) { *t.step = v; }), Errc::out_of_range,
                  "tensors[3].step");
  }
  expect_tensor(bad([](OptimizerTensor& t) { *t.step = kNaNf; }), Errc::non_finite,
                "tensors[3].step");
  expect(with(bad([&](OptimizerTensor& t) { t.step = valid[0].step; })), AdagradConfig{}, {},
         Errc::overlap, {"tensors[3].step", "tensors[0].step"});
  // An in-place source (the slot itself) and an out-of-place one are both accepted.
  OptimizerTensor ok = make(6);
  ok.state_src[0] = ok.state[0];
  ok.param_src = {arena.alloc<float>(6), 6, DType::f32};
  EXPECT_NO_THROW(ref::adagrad_step(with(ok), AdagradConfig{}));
}

// ---- Lion ------------------------------------------------------------------------------

struct LionFixture : ::testing::Test {
  Arena arena;
  std::vector<OptimizerTensor> valid;  // tensors[0..1]

  OptimizerTensor make(std::size_t n) {
    OptimizerTensor t;
    t.param = {arena.alloc<float>(n), n, DType::f32};
    t.state[0] = {arena.alloc<float>(n), n, DType::f32};
    t.grad = {arena.alloc<std::uint32_t>(n), n, DType::f32};
    t.compute_param = {arena.alloc<std::uint32_t>(n), n, DType::bf16};
    return t;
  }
  void SetUp() override {
    valid.push_back(make(5));
    valid.push_back(make(17));
  }
  std::vector<OptimizerTensor> with(const OptimizerTensor& bad) {
    std::vector<OptimizerTensor> v = valid;
    v.push_back(bad);
    return v;
  }
  void expect(const std::vector<OptimizerTensor>& ts, const LionConfig& c, GradientRead r,
              Errc code, std::vector<std::string> args) {
    expect_error(
        arena, [&] { ref::lion_step(ts, c, r); }, code, std::move(args));
  }
};

TEST_F(LionFixture, ValidCallWritesAndFoundInfDoesNot) {
  const auto ts = with(make(9));
  const auto before = arena.snapshot();
  const std::int32_t found_inf = 1;
  ref::lion_step(ts, LionConfig{}, {}, &found_inf);
  EXPECT_TRUE(arena.same(before));
  ref::lion_step(ts, LionConfig{});
  EXPECT_FALSE(arena.same(before));
}

// docs/numerics.md 8d: lr and weight_decay finite and >= 0, f32(lr) finite, lr * wd <= 1,
// betas finite in [0, 1] (both ends allowed); the read scalars as every optimizer's.
TEST_F(LionFixture, HyperParameters) {
  auto cfg = [](auto set) {
    LionConfig c;
    set(c);
    return c;
  };
  const auto t = with(make(9));
  struct Field {
    const char* name;
    double LionConfig::*member;
  };
  for (const Field f :
       {Field{"config.lr", &LionConfig::lr}, Field{"config.beta1", &LionConfig::beta1},
        Field{"config.beta2", &LionConfig::beta2},
        Field{"config.weight_decay", &LionConfig::weight_decay}}) {
    SCOPED_TRACE(f.name);
    expect(t, cfg([&](LionConfig& c) { c.*f.member = kNaN; }), {}, Errc::non_finite, {f.name});
    expect(t, cfg([&](LionConfig& c) { c.*f.member = kInf; }), {}, Errc::non_finite, {f.name});
    expect(t, cfg([&](LionConfig& c) { c.*f.member = -kInf; }), {}, Errc::non_finite, {f.name});
    expect(t, cfg([&](LionConfig& c) { c.*f.member = -1e-3; }), {}, Errc::invalid_argument,
           {f.name});
    expect(t, cfg([&](LionConfig& c) { c.*f.member = -std::numeric_limits<double>::min(); }), {},
           Errc::invalid_argument, {f.name});
    EXPECT_NO_THROW(ref::lion_step(with(make(4)), cfg([&](LionConfig& c) { c.*f.member = 0.0; })));
  }
  for (const char* beta : {"config.beta1", "config.beta2"}) {
    SCOPED_TRACE(beta);
    auto set = [&](LionConfig& c, double v) { (beta[11] == '1' ? c.beta1 : c.beta2) = v; };
    expect(t, cfg([&](LionConfig& c) { set(c, 1.0000001); }), {}, Errc::invalid_argument, {beta});
    EXPECT_NO_THROW(ref::lion_step(with(make(4)), cfg([&](LionConfig& c) { set(c, 1.0); })));
  }
  expect(t, cfg([](LionConfig& c) { c.lr = 1e39; }), {}, Errc::out_of_range, {"config.lr"});
  expect(t, cfg([](LionConfig& c) {
           c.lr = 0.5;
           c.weight_decay = 2.5;
         }),
         {}, Errc::invalid_argument, {"config.weight_decay"});
  EXPECT_NO_THROW(ref::lion_step(with(make(4)), cfg([](LionConfig& c) {
                                   c.lr = 0.5;
                                   c.weight_decay = 2.0;
                                 })));
  const LionConfig c;
  expect(t, c, {0.0f, 1.0f}, Errc::invalid_argument, {"read.scale"});
  expect(t, c, {kNaNf, 1.0f}, Errc::non_finite, {"read.scale"});
  expect(t, c, {1.0f, 1.5f}, Errc::invalid_argument, {"read.clip"});
}

// One exp_avg slot and no step counter: the others, and a counter, are named.
TEST_F(LionFixture, OneSlotAndNoCounter) {
  auto bad = [&](auto mutate) {
    OptimizerTensor t = make(6);
    mutate(t);
    return with(t);
  };
  const LionConfig c;
  expect(bad([](OptimizerTensor& t) { t.state[0] = {}; }), c, {}, Errc::size_mismatch,
         {"tensors[2].exp_avg"});
  expect(bad([&](OptimizerTensor& t) {
           t.state[1] = {arena.alloc<float>(6), 6, DType::f32};
         }),
         c, {}, Errc::invalid_argument, {"tensors[2].state[1]"});
  expect(bad([&](OptimizerTensor& t) { t.step = arena.alloc<float>(1); }), c, {},
         Errc::invalid_argument, {"tensors[2].step"});
  expect(bad([](OptimizerTensor& t) {
           t.state_src[0] = {static_cast<float*>(t.param.data) + 1, 6, DType::f32};
         }),
         c, {}, Errc::overlap, {"tensors[2].exp_avg_src"});
}

// ---- Adam, and AdamW on OptimizerTensors (amsgrad, maximize) ---------------------------

struct AdamFixture : ::testing::Test {
  Arena arena;
  std::vector<OptimizerTensor> valid;  // tensors[0..2], with a max_exp_avg_sq slot

  // A tensor with slots 0 and 1, and slot 2 (max_exp_avg_sq) when `max_slot`.
  OptimizerTensor make(std::size_t n, bool max_slot = true, DType gdt = DType::f32,
                       bool out = true) {
    OptimizerTensor t;
    t.param = {arena.alloc<float>(n), n, DType::f32};
    for (int k = 0; k < (max_slot ? 3 : 2); ++k)
      t.state[k] = {arena.alloc<float>(n), n, DType::f32};
    t.step = arena.alloc<float>(1);
    *t.step = 3.0f;
    t.grad = {arena.alloc<std::uint32_t>(n), n, gdt};
    if (out) t.compute_param = {arena.alloc<std::uint32_t>(n), n, DType::bf16};
    return t;
  }
  void SetUp() override {
    valid.push_back(make(5));
    valid.push_back(make(17, true, DType::bf16));
    valid.push_back(make(8, true, DType::f16, false));
  }
  std::vector<OptimizerTensor> with(const OptimizerTensor& bad, bool max_slots = true) {
    std::vector<OptimizerTensor> v = valid;
    if (!max_slots)
      for (auto& t : v) t.state[2] = {};
    v.push_back(bad);
    return v;
  }
  static AdamConfig ams() {
    AdamConfig c;
    c.amsgrad = true;
    return c;
  }
  void expect_adam(const std::vector<OptimizerTensor>& ts, const AdamConfig& c, Errc code,
                   const std::string& arg, const std::int32_t* found_inf = nullptr) {
    expect_error(arena, [&] { ref::adam_step(ts, c, {}, found_inf); }, code, {arg});
  }
  void expect_adamw(const std::vector<OptimizerTensor>& ts, const AdamWConfig& c, Errc code,
                    const std::string& arg) {
    expect_error(arena, [&] { ref::adamw_step(ts, c); }, code, {arg});
  }
  // A bad tensors[3] is refused by Adam and by AdamW (both with amsgrad).
  void expect_tensor(const OptimizerTensor& bad, Errc code, const std::string& arg) {
    expect_adam(with(bad), ams(), code, arg);
    AdamWConfig w;
    w.amsgrad = true;
    expect_adamw(with(bad), w, code, arg);
  }
};

TEST_F(AdamFixture, ValidCallsWriteTheArena) {
  auto before = arena.snapshot();
  ref::adam_step(with(make(9)), ams());
  EXPECT_FALSE(arena.same(before));
  EXPECT_EQ(*valid[0].step, 4.0f);
  before = arena.snapshot();
  AdamWConfig w;
  w.amsgrad = true;
  w.maximize = true;
  ref::adamw_step(with(make(9)), w);
  EXPECT_FALSE(arena.same(before));
  EXPECT_EQ(*valid[0].step, 5.0f);
  // found_inf set: nothing is written, no counter advances.
  const auto ts = with(make(9));
  before = arena.snapshot();
  const std::int32_t flag = 1;
  ref::adam_step(ts, ams(), {}, &flag);
  EXPECT_TRUE(arena.same(before));
}

TEST_F(AdamFixture, AdamHyperParameters) {
  auto cfg = [](auto set) {
    AdamConfig c;
    set(c);
    return c;
  };
  const auto ts = with(make(9, false), false);
  const auto expect_config = [&](const AdamConfig& c, Errc code, const std::string& arg) {
    expect_adam(ts, c, code, arg);
  };
  expect_config(cfg([](AdamConfig& c) { c.lr = kNaN; }), Errc::non_finite, "config.lr");
  expect_config(cfg([](AdamConfig& c) { c.lr = kInf; }), Errc::non_finite, "config.lr");
  expect_config(cfg([](AdamConfig& c) { c.lr = -1e-3; }), Errc::invalid_argument, "config.lr");
  expect_config(cfg([](AdamConfig& c) { c.lr = 1e300; }), Errc::out_of_range, "config.lr");
  expect_config(cfg([](AdamConfig& c) { c.beta1 = kNaN; }), Errc::non_finite, "config.beta1");
  expect_config(cfg([](AdamConfig& c) { c.beta1 = 1.0; }), Errc::invalid_argument, "config.beta1");
  expect_config(cfg([](AdamConfig& c) { c.beta1 = -0.1; }), Errc::invalid_argument, "config.beta1");
  expect_config(cfg([](AdamConfig& c) { c.beta2 = kInf; }), Errc::non_finite, "config.beta2");
  expect_config(cfg([](AdamConfig& c) { c.beta2 = 1.0; }), Errc::invalid_argument, "config.beta2");
  expect_config(cfg([](AdamConfig& c) { c.beta2 = -0.1; }), Errc::invalid_argument, "config.beta2");
  expect_config(cfg([](AdamConfig& c) { c.eps = 0.0; }), Errc::invalid_argument, "config.eps");
  expect_config(cfg([](AdamConfig& c) { c.eps = -1e-8; }), Errc::invalid_argument, "config.eps");
  expect_config(cfg([](AdamConfig& c) { c.eps = kNaN; }), Errc::non_finite, "config.eps");
  expect_config(cfg([](AdamConfig& c) { c.eps = 1e-60; }), Errc::out_of_range, "config.eps");
  expect_config(cfg([](AdamConfig& c) { c.eps = 1e300; }), Errc::out_of_range, "config.eps");
  expect_config(cfg([](AdamConfig& c) { c.weight_decay = -0.01; }), Errc::invalid_argument,
                "config.weight_decay");
  expect_config(cfg([](AdamConfig& c) { c.weight_decay = kNaN; }), Errc::non_finite,
                "config.weight_decay");
  expect_config(cfg([](AdamConfig& c) { c.weight_decay = kInf; }), Errc::non_finite,
                "config.weight_decay");
  expect_config(cfg([](AdamConfig& c) { c.weight_decay = 1e300; }), Errc::out_of_range,
                "config.weight_decay");  // Inf in f32
  expect_config(cfg([](AdamConfig& c) { c.torch_tail_width = -1; }), Errc::out_of_range,
                "config.torch_tail_width");
  expect_config(cfg([](AdamConfig& c) { c.torch_tail_width = 65; }), Errc::out_of_range,
                "config.torch_tail_width");
  // Adam's formulas are torch's and torchao's; torchao's has no maximize and rounds the
  // betas to f32 before its bias corrections.
  expect_config(cfg([](AdamConfig& c) { c.formula = AdamWFormula::native; }),
                Errc::invalid_argument, "config.formula");
  expect_config(cfg([](AdamConfig& c) { c.formula = static_cast<AdamWFormula>(7); }),
                Errc::invalid_argument, "config.formula");
  expect_config(cfg([](AdamConfig& c) {
                  c.formula = AdamWFormula::torchao;
                  c.maximize = true;
                }),
                Errc::invalid_argument, "config.maximize");
  expect_config(cfg([](AdamConfig& c) {
                  c.formula = AdamWFormula::torchao;
                  c.beta2 = 0.99999999999;
                }),
                Errc::out_of_range, "config.beta2");
  // torch's bias corrections are binary64: the same beta2 runs.
  EXPECT_NO_THROW(ref::adam_step(ts, cfg([](AdamConfig& c) { c.beta2 = 0.99999999999; })));
  // Validation comes before found_inf.
  const std::int32_t flag = 1;
  expect_adam(ts, cfg([](AdamConfig& c) { c.beta1 = 1.0; }), Errc::invalid_argument, "config.beta1",
              &flag);
  // Boundary values that are valid (L2 decay has no lr * wd <= 1 rule).
  for (auto c : {cfg([](AdamConfig& c) { c.lr = 0.0; }),
                 cfg([](AdamConfig& c) { c.beta1 = 0.0, c.beta2 = 0.0; }),
                 cfg([](AdamConfig& c) { c.lr = 0.5, c.weight_decay = 3.0; }),
                 cfg([](AdamConfig& c) { c.maximize = true, c.torch_tail_width = 64; })})
    EXPECT_NO_THROW(ref::adam_step(ts, c));
}

TEST_F(AdamFixture, AmsgradAndMaximizeNeedTheTorchFormula) {
  AdamWConfig c;
  c.formula = AdamWFormula::native;
  c.amsgrad = true;
  expect_adamw(with(make(9)), c, Errc::invalid_argument, "config.amsgrad");
  c.amsgrad = false;
  c.maximize = true;
  expect_adamw(with(make(9, false), false), c, Errc::invalid_argument, "config.maximize");
  // The native formula without them runs on OptimizerTensors too.
  c.maximize = false;
  EXPECT_NO_THROW(ref::adamw_step(with(make(9, false), false), c));
}

TEST_F(AdamFixture, StateSlots) {
  const std::string n = "tensors[3].";
  auto bad = [&](auto mutate) {
    OptimizerTensor t = make(6);
    mutate(t);
    return t;
  };
  expect_tensor(bad([](OptimizerTensor& t) { t.state[0].dtype = DType::bf16; }),
                Errc::unsupported_dtype, n + "exp_avg");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[1].numel = 5; }), Errc::size_mismatch,
                n + "exp_avg_sq");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[2] = {}; }), Errc::size_mismatch,
                n + "max_exp_avg_sq");  // amsgrad needs max_exp_avg_sq
  expect_tensor(bad([](OptimizerTensor& t) { t.state[2].data = nullptr; }), Errc::null_pointer,
                n + "max_exp_avg_sq");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[2].data = t.state[1].data; }), Errc::overlap,
                {n + "max_exp_avg_sq"});
  expect_tensor(bad([](OptimizerTensor& t) {
                  t.state_src[1] = {t.state[0].data, 5, DType::f32};
                }),
                Errc::size_mismatch, n + "exp_avg_sq_src");
  expect_tensor(bad([](OptimizerTensor& t) {
                  t.state_src[2] = {t.grad.data, 6, DType::f16};
                }),
                Errc::unsupported_dtype, n + "max_exp_avg_sq_src");
  expect_tensor(bad([](OptimizerTensor& t) { t.step = nullptr; }), Errc::null_pointer, n + "step");
  // An f16 param (docs/numerics.md 7.3): no compute output; the f32 state is named.
  expect_tensor(bad([](OptimizerTensor& t) { t.param.dtype = DType::f16; }), Errc::invalid_argument,
                n + "compute_param");
  expect_tensor(bad([](OptimizerTensor& t) {
                  t.param.dtype = DType::f16;
                  t.compute_param = {};
                }),
                Errc::unsupported_dtype, n + "exp_avg");
  // Without amsgrad, slot 2 and its source must be empty.
  const auto no_max = [&](auto mutate) {
    OptimizerTensor t = make(6, false);
    mutate(t);
    return with(t, false);
  };
  expect_adam(no_max([&](OptimizerTensor& t) { t.state[2] = valid[0].state[2]; }), AdamConfig{},
              Errc::invalid_argument, n + "state[2]");
  expect_adam(no_max([&](OptimizerTensor& t) { t.state_src[2] = valid[0].state[2]; }), AdamConfig{},
              Errc::invalid_argument, n + "state_src[2]");
  expect_adamw(no_max([&](OptimizerTensor& t) { t.state[2] = valid[0].state[2]; }), AdamWConfig{},
               Errc::invalid_argument, n + "state[2]");
  // An out-of-place source of a valid slot is accepted (the destination itself, or disjoint).
  OptimizerTensor oop = make(6);
  float* src = arena.alloc<float>(6);
  oop.state_src[2] = {src, 6, DType::f32};
  oop.state_src[0] = {oop.state[0].data, 6, DType::f32};
  EXPECT_NO_THROW(ref::adam_step(with(oop), ams()));
}

// ---- SignSGD ---------------------------------------------------------------------------

struct SignSgdFixture : ::testing::Test {
  Arena arena;
  std::vector<OptimizerTensor> valid;

  // A SignSGD tensor: the param only (no state slot, no step counter).
  OptimizerTensor make(std::size_t n, DType gdt = DType::f32, bool out = true,
                       DType odt = DType::f16) {
    OptimizerTensor t;
    t.param = {arena.alloc<float>(n), n, DType::f32};
    t.grad = {arena.alloc<std::uint32_t>(n), n, gdt};
    if (out) t.compute_param = {arena.alloc<std::uint32_t>(n), n, odt};
    return t;
  }
  void SetUp() override {
    valid.push_back(make(5));
    valid.push_back(make(9, DType::bf16, false));
    valid.push_back(make(16, DType::f16, true, DType::bf16));
  }
  std::vector<OptimizerTensor> with(const OptimizerTensor& bad) {
    std::vector<OptimizerTensor> v = valid;
    v.push_back(bad);
    return v;
  }
  void expect(const std::vector<OptimizerTensor>& ts, const SignSgdConfig& c, GradientRead r,
              Errc code, std::vector<std::string> args) {
    expect_error(
        arena, [&] { ref::sign_sgd_step(ts, c, r); }, code, std::move(args));
  }
};

TEST_F(SignSgdFixture, ValidCallWritesTheArena) {
  const auto before = arena.snapshot();
  ref::sign_sgd_step(with(make(3)), SignSgdConfig{});
  EXPECT_FALSE(arena.same(before));
}

TEST_F(SignSgdFixture, HyperParametersAndRead) {
  const auto t = with(make(4));
  auto cfg = [](double lr, double wd) {
    SignSgdConfig c;
    c.lr = lr;
    c.weight_decay = wd;
    return c;
  };
  expect(t, cfg(kNaN, 0), {}, Errc::non_finite, {"config.lr"});
  expect(t, cfg(kInf, 0), {}, Errc::non_finite, {"config.lr"});
  expect(t, cfg(-0.1, 0), {}, Errc::invalid_argument, {"config.lr"});
  expect(t, cfg(1e300, 0), {}, Errc::out_of_range, {"config.lr"});
  expect(t, cfg(0.1, kNaN), {}, Errc::non_finite, {"config.weight_decay"});
  expect(t, cfg(0.1, -1), {}, Errc::invalid_argument, {"config.weight_decay"});
  expect(t, cfg(0.5, 2.5), {}, Errc::invalid_argument, {"config.weight_decay"});
  const SignSgdConfig c;
  expect(t, c, {1.0f, 0.0f}, Errc::invalid_argument, {"read.clip"});  // SignSGD needs clip > 0
  expect(t, c, {1.0f, 1.5f}, Errc::invalid_argument, {"read.clip"});
  expect(t, c, {1.0f, kNaNf}, Errc::non_finite, {"read.clip"});
  expect(t, c, {0.0f, 1.0f}, Errc::invalid_argument, {"read.scale"});
  expect(t, c, {kNaNf, 1.0f}, Errc::non_finite, {"read.scale"});
  expect(t, c, {kInff, 1.0f}, Errc::non_finite, {"read.scale"});
  EXPECT_NO_THROW(ref::sign_sgd_step(t, c, {1e-30f, 1e-30f}));
}

TEST_F(SignSgdFixture, TensorsAndOverlaps) {
  const SignSgdConfig c;
  auto bad = [&](auto mutate) {
    OptimizerTensor t = make(6);
    mutate(t);
    return with(t);
  };
  expect(bad([](OptimizerTensor& t) { t.param.dtype = kBadDType; }), c, {}, Errc::unsupported_dtype,
         {"tensors[3].param"});
  // A bf16 param (docs/numerics.md 7.3) has no compute output.
  expect(bad([](OptimizerTensor& t) { t.param.dtype = DType::bf16; }), c, {},
         Errc::invalid_argument, {"tensors[3].compute_param"});
  expect(bad([](OptimizerTensor& t) { t.param.data = nullptr; }), c, {}, Errc::null_pointer,
         {"tensors[3].param"});
  expect(bad([](OptimizerTensor& t) { t.grad.numel = 7; }), c, {}, Errc::size_mismatch,
         {"tensors[3].grad"});
  expect(bad([](OptimizerTensor& t) { t.grad.dtype = kBadDType; }), c, {}, Errc::unsupported_dtype,
         {"tensors[3].grad"});
  expect(bad([](OptimizerTensor& t) { t.grad.data = nullptr; }), c, {}, Errc::null_pointer,
         {"tensors[3].grad"});
  expect(bad([](OptimizerTensor& t) { t.compute_param.numel = 2; }), c, {}, Errc::size_mismatch,
         {"tensors[3].compute_param"});
  expect(bad([](OptimizerTensor& t) { t.compute_param.dtype = kBadDType; }), c, {},
         Errc::unsupported_dtype, {"tensors[3].compute_param"});
  expect(bad([&](OptimizerTensor& t) {
           t.compute_param.data = static_cast<float*>(t.param.data) + 1;
         }),
         c, {}, Errc::overlap, {"tensors[3].compute_param"});
  expect(bad([&](OptimizerTensor& t) {
           t.param.data = const_cast<float*>(static_cast<const float*>(valid[0].grad.data)) + 1;
         }),
         c, {}, Errc::overlap, {"tensors[3].param"});
  // Shared read-only gradients are fine.
  OptimizerTensor shared = make(5);
  shared.grad = valid[0].grad;
  EXPECT_NO_THROW(ref::sign_sgd_step(with(shared), c));
}

TEST_F(SignSgdFixture, OutOfPlaceSource) {
  const SignSgdConfig c;
  auto bad = [&](auto mutate) {
    OptimizerTensor t = make(6);
    t.param_src = {arena.alloc<float>(6), 6, DType::f32};
    mutate(t);
    return with(t);
  };
  const std::string name = "tensors[3].param_src";
  expect(bad([](OptimizerTensor& t) { t.param_src.dtype = DType::f16; }), c, {},
         Errc::unsupported_dtype, {name});
  expect(bad([](OptimizerTensor& t) { t.param_src.numel = 5; }), c, {}, Errc::size_mismatch,
         {name});
  expect(bad([](OptimizerTensor& t) { t.param_src.data = nullptr; }), c, {}, Errc::null_pointer,
         {name});
  expect(bad([](OptimizerTensor& t) {
           t.param_src.data = static_cast<const float*>(t.param.data) + 2;  // partial
         }),
         c, {}, Errc::overlap, {name});
  expect(bad([&](OptimizerTensor& t) {  // another tensor's param
           t.param_src.data = static_cast<const float*>(valid[2].param.data) + 1;
         }),
         c, {}, Errc::overlap, {name});
  EXPECT_NO_THROW(ref::sign_sgd_step(bad([](OptimizerTensor&) {}), c));
  EXPECT_NO_THROW(ref::sign_sgd_step(bad([](OptimizerTensor& t) { t.param_src = t.param; }), c));
}

// ---- SGD -----------------------------------------------------------------------------------

struct SgdFixture : ::testing::Test {
  Arena arena;
  std::vector<OptimizerTensor> valid;
  SgdConfig config;  // momentum 0.9: every tensor needs its momentum buffer

  OptimizerTensor make(std::size_t n, DType gdt = DType::f32, bool out = true, bool buffer = true) {
    OptimizerTensor t;
    t.param = {arena.alloc<float>(n), n, DType::f32};
    if (buffer) t.state[0] = {arena.alloc<float>(n), n, DType::f32};
    t.step = arena.alloc<float>(1);
    *t.step = 2.0f;
    t.grad = {arena.alloc<std::uint32_t>(n), n, gdt};
    if (out) t.compute_param = {arena.alloc<std::uint32_t>(n), n, DType::bf16};
    return t;
  }
  void SetUp() override {
    config.lr = 0.1;
    config.momentum = 0.9;
    valid.push_back(make(5));
    valid.push_back(make(17, DType::bf16, false));
    valid.push_back(make(8, DType::f16));
  }
  std::vector<OptimizerTensor> with(const OptimizerTensor& bad) {
    std::vector<OptimizerTensor> v = valid;
    v.push_back(bad);
    return v;
  }
  void expect(const std::vector<OptimizerTensor>& ts, const SgdConfig& c, GradientRead r, Errc code,
              std::vector<std::string> args, const std::int32_t* found_inf = nullptr) {
    expect_error(
        arena, [&] { ref::sgd_step(ts, c, r, found_inf); }, code, std::move(args));
  }
  void expect_config(const SgdConfig& c, Errc code, const std::string& arg) {
    expect(with(make(9)), c, {}, code, {arg});
  }
  void expect_tensor(const OptimizerTensor& bad, Errc code, const std::string& arg) {
    expect(with(bad), config, {}, code, {arg});
  }
};

TEST_F(SgdFixture, ValidCallWritesTheArena) {
  const auto before = arena.snapshot();
  ref::sgd_step(with(make(3)), config);
  EXPECT_FALSE(arena.same(before));
  EXPECT_EQ(*valid[0].step, 3.0f);
}

TEST_F(SgdFixture, HyperParameters) {
  auto cfg = [&](auto set) {
    SgdConfig c = config;
    set(c);
    return c;
  };
  expect_config(cfg([](SgdConfig& c) { c.lr = kNaN; }), Errc::non_finite, "config.lr");
  expect_config(cfg([](SgdConfig& c) { c.lr = kInf; }), Errc::non_finite, "config.lr");
  expect_config(cfg([](SgdConfig& c) { c.lr = -1e-3; }), Errc::invalid_argument, "config.lr");
  expect_config(cfg([](SgdConfig& c) { c.lr = 1e300; }), Errc::out_of_range, "config.lr");
  expect_config(cfg([](SgdConfig& c) { c.momentum = kNaN; }), Errc::non_finite, "config.momentum");
  expect_config(cfg([](SgdConfig& c) { c.momentum = -kInf; }), Errc::non_finite, "config.momentum");
  expect_config(cfg([](SgdConfig& c) { c.momentum = -0.1; }), Errc::invalid_argument,
                "config.momentum");
  expect_config(cfg([](SgdConfig& c) { c.momentum = 1e300; }), Errc::out_of_range,
                "config.momentum");
  expect_config(cfg([](SgdConfig& c) { c.dampening = kNaN; }), Errc::non_finite,
                "config.dampening");
  expect_config(cfg([](SgdConfig& c) { c.dampening = -0.1; }), Errc::invalid_argument,
                "config.dampening");
  expect_config(cfg([](SgdConfig& c) { c.dampening = 1.5; }), Errc::invalid_argument,
                "config.dampening");
  expect_config(cfg([](SgdConfig& c) { c.weight_decay = kInf; }), Errc::non_finite,
                "config.weight_decay");
  expect_config(cfg([](SgdConfig& c) { c.weight_decay = -0.01; }), Errc::invalid_argument,
                "config.weight_decay");
  expect_config(cfg([](SgdConfig& c) { c.weight_decay = 1e300; }), Errc::out_of_range,
                "config.weight_decay");
  // torch: nesterov needs momentum > 0 and zero dampening.
  expect_config(cfg([](SgdConfig& c) { c.nesterov = true, c.dampening = 0.1; }),
                Errc::invalid_argument, "config.nesterov");
  expect_config(cfg([](SgdConfig& c) { c.nesterov = true, c.momentum = 0.0; }),
                Errc::invalid_argument, "config.nesterov");
  expect_config(cfg([](SgdConfig& c) { c.torch_tail_width = -1; }), Errc::out_of_range,
                "config.torch_tail_width");
  expect_config(cfg([](SgdConfig& c) { c.torch_tail_width = 65; }), Errc::out_of_range,
                "config.torch_tail_width");
  // Boundary values that are valid.
  for (auto c :
       {cfg([](SgdConfig& c) { c.lr = 0.0; }), cfg([](SgdConfig& c) { c.dampening = 1.0; }),
        cfg([](SgdConfig& c) { c.nesterov = true, c.maximize = true; }),
        cfg([](SgdConfig& c) { c.momentum = 1.0, c.weight_decay = 5.0; }),
        cfg([](SgdConfig& c) { c.torch_tail_width = 64; })})
    EXPECT_NO_THROW(ref::sgd_step(with(make(3)), c));
}

TEST_F(SgdFixture, GradientReadAndFoundInf) {
  const auto t = with(make(4));
  expect(t, config, {0.0f, 1.0f}, Errc::invalid_argument, {"read.scale"});
  expect(t, config, {kNaNf, 1.0f}, Errc::non_finite, {"read.scale"});
  expect(t, config, {1.0f, 1.5f}, Errc::invalid_argument, {"read.clip"});
  expect(t, config, {1.0f, kInff}, Errc::non_finite, {"read.clip"});
  // Validation comes before found_inf; a set flag then writes nothing.
  const std::int32_t flag = 1;
  expect(t, config, {kNaNf, 1.0f}, Errc::non_finite, {"read.scale"}, &flag);
  const auto before = arena.snapshot();
  ref::sgd_step(t, config, {}, &flag);
  EXPECT_TRUE(arena.same(before));
}

TEST_F(SgdFixture, MomentumBufferSlot) {
  const std::string n = "tensors[3].";
  auto bad = [&](auto mutate) {
    OptimizerTensor t = make(6);
    mutate(t);
    return t;
  };
  // momentum != 0: the buffer is required, f32, the param's size.
  expect_tensor(bad([](OptimizerTensor& t) { t.state[0] = {}; }), Errc::size_mismatch,
                n + "momentum_buffer");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[0].data = nullptr; }), Errc::null_pointer,
                n + "momentum_buffer");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[0].dtype = DType::bf16; }),
                Errc::unsupported_dtype, n + "momentum_buffer");
  expect_tensor(bad([](OptimizerTensor& t) { t.state[0].numel = 5; }), Errc::size_mismatch,
                n + "momentum_buffer");
  expect_tensor(
      bad([](OptimizerTensor& t) { t.state[0].data = static_cast<float*>(t.param.data) + 1; }),
      Errc::overlap, n + "momentum_buffer");
  // SGD has one slot: the others and their sources stay empty.
  expect_tensor(bad([&](OptimizerTensor& t) {
                  t.state[1] = {arena.alloc<float>(6), 6, DType::f32};
                }),
                Errc::invalid_argument, n + "state[1]");
  expect_tensor(bad([&](OptimizerTensor& t) {
                  t.state[2] = {arena.alloc<float>(6), 6, DType::f32};
                }),
                Errc::invalid_argument, n + "state[2]");
  expect_tensor(bad([&](OptimizerTensor& t) {
                  t.state_src[1] = {arena.alloc<float>(6), 6, DType::f32};
                }),
                Errc::invalid_argument, n + "state_src[1]");
  // The buffer's out-of-place source: as AdamW's sources.
  expect_tensor(
      bad([&](OptimizerTensor& t) {
        t.state_src[0] = {static_cast<const float*>(valid[0].param.data) + 1, 6, DType::f32};
      }),
      Errc::overlap, n + "momentum_buffer_src");
  expect_tensor(bad([&](OptimizerTensor& t) {
                  t.state_src[0] = {arena.alloc<float>(6), 6, DType::f16};
                }),
                Errc::unsupported_dtype, n + "momentum_buffer_src");
  EXPECT_NO_THROW(ref::sgd_step(with(bad([&](OptimizerTensor& t) {
                                  t.state_src[0] = {arena.alloc<float>(6), 6, DType::f32};
                                })),
                                config));
  // momentum == 0: no buffer may be given.
  SgdConfig plain = config;
  plain.momentum = 0.0;
  std::vector<OptimizerTensor> none = {make(5, DType::f32, true, false), make(6)};
  expect(none, plain, {}, Errc::invalid_argument, {"tensors[1].state[0]"});
  none[1] = make(6, DType::f32, true, false);
  none[1].state_src[0] = {arena.alloc<float>(6), 6, DType::f32};
  expect(none, plain, {}, Errc::invalid_argument, {"tensors[1].state_src[0]"});
  none[1].state_src[0] = {};
  EXPECT_NO_THROW(ref::sgd_step(none, plain));
}

TEST_F(SgdFixture, TensorsAndStepCounters) {
  const std::string n = "tensors[3].";
  auto bad = [&](auto mutate) {
    OptimizerTensor t = make(6);
    mutate(t);
    return t;
  };
  // An f16 param (docs/numerics.md 7.3): no compute output; the f32 buffer is named.
  expect_tensor(bad([](OptimizerTensor& t) { t.param.dtype = DType::f16; }), Errc::invalid_argument,
                n + "compute_param");
  expect_tensor(bad([](OptimizerTensor& t) {
                  t.param.dtype = DType::f16;
                  t.compute_param = {};
                }),
                Errc::unsupported_dtype, n + "momentum_buffer");
  expect_tensor(bad([](OptimizerTensor& t) { t.grad.numel = 7; }), Errc::size_mismatch, n + "grad");
  expect_tensor(bad([](OptimizerTensor& t) { t.compute_param.dtype = kBadDType; }),
                Errc::unsupported_dtype, n + "compute_param");
  expect_tensor(bad([&](OptimizerTensor& t) {
                  t.param_src = {static_cast<const float*>(t.param.data) + 2, 6, DType::f32};
                }),
                Errc::overlap, n + "param_src");
  expect_tensor(bad([](OptimizerTensor& t) { t.step = nullptr; }), Errc::null_pointer, n + "step");
  expect_tensor(bad([](OptimizerTensor& t) { *t.step = kNaNf; }), Errc::non_finite, n + "step");
  expect_tensor(bad([](OptimizerTensor& t) { *t.step = 1.5f; }), Errc::out_of_range, n + "step");
  expect_tensor(bad([](OptimizerTensor& t) { *t.step = 16777216.0f; }), Errc::out_of_range,
                n + "step");
  expect_tensor(bad([](OptimizerTensor& t) {
                  t.step = static_cast<float*>(t.param.data) + 1;
                  *t.step = 2.0f;  // a valid count, inside the written param
                }),
                Errc::overlap, n + "step");
  // An empty tensor needs no buffer, only its counter.
  OptimizerTensor empty;
  float step = 0.0f;
  empty.step = &step;
  EXPECT_NO_THROW(ref::sgd_step(with(empty), config));
  EXPECT_EQ(step, 1.0f);
}

// ---- accumulate ---------------------------------------------------------------------------

struct AccumulateFixture : ::testing::Test {
  Arena arena;
  std::vector<AccumulatePair> valid;

  AccumulatePair make(std::size_t n, DType sdt = DType::f32, bool copy = false) {
    AccumulatePair p;
    p.acc = {arena.alloc<float>(n), n, DType::f32};
    p.src = {arena.alloc<std::uint32_t>(n), n, sdt};
    p.copy = copy;
    return p;
  }
  void SetUp() override {
    valid.push_back(make(5));
    valid.push_back(make(33, DType::bf16, true));
    valid.push_back(make(8, DType::f16));
  }
  std::vector<AccumulatePair> with(const AccumulatePair& bad) {
    std::vector<AccumulatePair> v = valid;
    v.push_back(bad);
    return v;
  }
  void expect(const AccumulatePair& bad, Errc code, std::vector<std::string> args) {
    const auto ps = with(bad);
    expect_error(
        arena, [&] { ref::accumulate(ps); }, code, std::move(args));
  }
};

TEST_F(AccumulateFixture, ValidCallWritesTheArena) {
  const auto before = arena.snapshot();
  ref::accumulate(with(make(3)));
  EXPECT_FALSE(arena.same(before));
}

TEST_F(AccumulateFixture, BadPairs) {
  auto bad = [&](auto mutate) {
    AccumulatePair p = make(6);
    mutate(p);
    return p;
  };
  expect(bad([](AccumulatePair& p) { p.acc.dtype = DType::bf16; }), Errc::unsupported_dtype,
         {"pairs[3].acc"});
  expect(bad([](AccumulatePair& p) { p.acc.dtype = kBadDType; }), Errc::unsupported_dtype,
         {"pairs[3].acc"});
  expect(bad([](AccumulatePair& p) { p.acc.data = nullptr; }), Errc::null_pointer,
         {"pairs[3].acc"});
  expect(bad([](AccumulatePair& p) { p.src.numel = 5; }), Errc::size_mismatch, {"pairs[3].src"});
  expect(bad([](AccumulatePair& p) { p.src.dtype = kBadDType; }), Errc::unsupported_dtype,
         {"pairs[3].src"});
  expect(bad([](AccumulatePair& p) { p.src.data = nullptr; }), Errc::null_pointer,
         {"pairs[3].src"});
  // acc starting inside its own source.
  expect(bad([](AccumulatePair& p) {
           p.acc.data = const_cast<float*>(static_cast<const float*>(p.src.data)) + 1;
         }),
         Errc::overlap, {"pairs[3].acc"});
  // acc starting inside pairs[0].acc.
  expect(bad([&](AccumulatePair& p) { p.acc.data = static_cast<float*>(valid[0].acc.data) + 2; }),
         Errc::overlap, {"pairs[3].acc"});
  // src starting inside pairs[1].acc (written).
  expect(bad([&](AccumulatePair& p) { p.src.data = static_cast<float*>(valid[1].acc.data) + 2; }),
         Errc::overlap, {"pairs[3].src"});
  // acc identical to its src (copy onto itself is still an overlap).
  expect(bad([](AccumulatePair& p) {
           p.src = ConstTensorView(p.acc);
           p.copy = true;
         }),
         Errc::overlap, {"pairs[3].acc", "pairs[3].src"});
  // Sources may alias each other.
  AccumulatePair shared = make(5);
  shared.src = valid[0].src;
  EXPECT_NO_THROW(ref::accumulate(with(shared)));
}

// ---- scale_ --------------------------------------------------------------------------------

struct ScaleFixture : ::testing::Test {
  Arena arena;
  std::vector<TensorView> valid;
  TensorView make(std::size_t n, DType t) { return {arena.alloc<std::uint32_t>(n), n, t}; }
  void SetUp() override {
    valid = {make(4, DType::f32), make(9, DType::bf16), make(17, DType::f16)};
  }
  std::vector<TensorView> with(const TensorView& bad) {
    std::vector<TensorView> v = valid;
    v.push_back(bad);
    return v;
  }
  void expect(const std::vector<TensorView>& ts, float s, Errc code,
              std::vector<std::string> args) {
    expect_error(
        arena, [&] { ref::scale_(ts, s); }, code, std::move(args));
  }
};

TEST_F(ScaleFixture, ScaleAndTensors) {
  const auto ok = with(make(3, DType::f32));
  {
    const auto before = arena.snapshot();
    ref::scale_(ok, 0.5f);
    EXPECT_FALSE(arena.same(before));
  }
  expect(ok, kNaNf, Errc::non_finite, {"scale"});
  expect(ok, kInff, Errc::non_finite, {"scale"});
  expect(ok, -kInff, Errc::non_finite, {"scale"});
  expect(ok, -1.0f, Errc::invalid_argument, {"scale"});
  EXPECT_NO_THROW(ref::scale_(ok, 0.0f));  // s >= 0
  TensorView t = make(6, DType::bf16);
  t.dtype = kBadDType;
  expect(with(t), 2.0f, Errc::unsupported_dtype, {"tensors[3]"});
  t = make(6, DType::f16);
  t.data = nullptr;
  expect(with(t), 2.0f, Errc::null_pointer, {"tensors[3]"});
  t = make(6, DType::f32);
  t.numel = std::size_t{1} << 61;
  expect(with(t), 2.0f, Errc::out_of_range, {"tensors[3]"});
  // tensors[3] starting inside tensors[2].
  t = TensorView{static_cast<std::uint16_t*>(valid[2].data) + 5, 4, DType::f16};
  expect(with(t), 2.0f, Errc::overlap, {"tensors[3]"});
  // The same tensor twice.
  expect(with(valid[0]), 2.0f, Errc::overlap, {"tensors[3]", "tensors[0]"});
}

// ---- norm_partial ------------------------------------------------------------------------

TEST(NormValidation, ReadAndTensors) {
  Arena arena;
  std::vector<ConstTensorView> ts = {ConstTensorView(arena.alloc<float>(4), 4, DType::f32),
                                     ConstTensorView(arena.alloc<std::uint16_t>(7), 7, DType::bf16),
                                     ConstTensorView(arena.alloc<std::uint16_t>(7), 7, DType::f16)};
  auto expect = [&](const std::vector<ConstTensorView>& v, GradientRead r, Errc code,
                    std::string arg) {
    expect_error(arena, [&] { (void)ref::norm_partial(v, r); }, code, {std::move(arg)});
  };
  expect(ts, {0.0f, 1.0f}, Errc::invalid_argument, "read.scale");
  expect(ts, {-2.0f, 1.0f}, Errc::invalid_argument, "read.scale");
  expect(ts, {kNaNf, 1.0f}, Errc::non_finite, "read.scale");
  expect(ts, {kInff, 1.0f}, Errc::non_finite, "read.scale");
  expect(ts, {1.0f, 1.5f}, Errc::invalid_argument, "read.clip");
  expect(ts, {1.0f, -0.1f}, Errc::invalid_argument, "read.clip");
  expect(ts, {1.0f, kNaNf}, Errc::non_finite, "read.clip");
  auto bad = ts;
  bad.push_back(ConstTensorView(arena.alloc<float>(3), 3, kBadDType));
  expect(bad, {}, Errc::unsupported_dtype, "tensors[3]");
  bad.back() = ConstTensorView(nullptr, 3, DType::f32);
  expect(bad, {}, Errc::null_pointer, "tensors[3]");
  bad.back() = ConstTensorView(arena.alloc<float>(3), std::size_t{1} << 61, DType::f32);
  expect(bad, {}, Errc::out_of_range, "tensors[3]");
  // Inputs may overlap (read only), clip may be 0, empty tensors may be null.
  auto fine = ts;
  fine.push_back(ts[0]);
  fine.push_back(ConstTensorView(nullptr, 0, DType::f16));
  EXPECT_NO_THROW((void)ref::norm_partial(fine, {2.0f, 0.0f}));
}

// ---- the error type ------------------------------------------------------------------------

TEST(ErrorType, CodeArgumentAndMessage) {
  const stepcore::Error e(Errc::size_mismatch, "tensors[2].grad", "5 elements, but param has 6");
  EXPECT_EQ(e.code(), Errc::size_mismatch);
  EXPECT_EQ(e.argument(), "tensors[2].grad");
  const std::string what = e.what();
  EXPECT_NE(what.find("size_mismatch"), std::string::npos);
  EXPECT_NE(what.find("tensors[2].grad"), std::string::npos);
  EXPECT_EQ(stepcore::errc_name(Errc::overlap), "overlap");
  EXPECT_EQ(stepcore::errc_name(Errc::non_finite), "non_finite");
}

// A refused formula's message lists the formulas of that optimizer's field, written out
// here: AdamW takes three, Adam two.
TEST(FormulaErrors, ListTheOptimizersOwnFormulas) {
  const auto message = [](auto&& call) {
    try {
      call();
    } catch (const stepcore::Error& e) {
      EXPECT_EQ(e.argument(), "config.formula");
      return std::string(e.what());
    }
    ADD_FAILURE() << "accepted";
    return std::string();
  };
  AdamWConfig w;
  w.formula = static_cast<AdamWFormula>(7);
  EXPECT_NE(message([&] {
              stepcore::detail::validate_adamw_config(w);
            }).find("adamw's formula is 'native', 'torch' or 'torchao'"),
            std::string::npos);
  AdamConfig a;
  a.formula = AdamWFormula::native;
  EXPECT_NE(message([&] {
              stepcore::detail::validate_adam_config(a, stepcore::GradientRead{});
            }).find("adam's formula is 'torch' or 'torchao'"),
            std::string::npos);
}

}  // namespace
