// libFuzzer harness: every CPU engine entry point family (the step over OptimizerTensor
// records of every optimizer unit: AdamW, SignSGD, Adam, SGD, Adagrad, Lion; accumulate,
// scale_, norm_partial of order 2 or 1, p_norm of the other
// orders, the order a fuzzed choice), and the generic device step
// (Device::optimizer_step on the host device: the GPU kernels' plans and block bodies,
// its inputs in "device memory" it reads when it runs) on random tensor
// lists carved from one arena: random sizes and dtypes, overlapping, adjacent and misaligned
// ranges, null pointers, hyper-parameters including NaN/Inf/subnormal/huge, found-inf flags, the
// param and state dtype (f32, bf16, f16; sometimes mixed), every ISA the machine runs. Differential
// oracle: the scalar reference on a copy of the arena. Either both succeed with identical bits, or
// both throw the same Errc and the engine's arena is unchanged (all-or-nothing).
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "fuzz/fuzz_input.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"

namespace {

using namespace stepcore;

constexpr std::size_t kArenaBytes = 2048;
constexpr int kMaxTensors = 4;

// The engines of every ISA this machine runs, 2 threads each (built once).
const std::vector<std::unique_ptr<cpu::Engine>>& engines() {
  static const auto all = [] {
    std::vector<std::unique_ptr<cpu::Engine>> v;
    for (cpu::Isa isa : cpu::supported_isas()) {
      cpu::EngineConfig c;
      c.isa = isa;
      c.threads = 2;
      v.push_back(std::make_unique<cpu::Engine>(c));
    }
    return v;
  }();
  return all;
}

struct Arena {
  alignas(64) std::array<std::byte, kArenaBytes> bytes;
};

// A view into `arena` at a fuzzed offset: numel elements of a fuzzed dtype (sometimes
// null, sometimes misaligned, sometimes overlapping others; clipped to the arena).
struct Slot {
  std::size_t offset = 0;
  std::size_t numel = 0;
  DType dtype = DType::f32;
  bool null = false;
};

Slot decode_slot(fuzz::Input& in, std::optional<DType> dtype) {
  static const std::size_t sizes[] = {0, 1, 7, 8, 15, 16, 17, 31, 33, 64, 65, 100};
  Slot s;
  const std::uint8_t d = in.byte();
  s.dtype = dtype ? *dtype : (d % 3 == 0 ? DType::f32 : d % 3 == 1 ? DType::bf16 : DType::f16);
  if (in.byte() % 8 == 0 && dtype) s.dtype = (d & 8) ? DType::bf16 : DType::f16;  // wrong dtype
  s.numel = sizes[in.below(sizeof sizes / sizeof sizes[0])];
  const std::size_t esize = dtype_size(s.dtype);
  const std::size_t max_off = kArenaBytes - s.numel * esize;
  s.offset = (in.below(static_cast<std::uint32_t>(max_off / 2 + 1)) * 2) % (max_off + 1);
  if (in.byte() % 4 != 0) s.offset -= s.offset % esize;  // mostly aligned
  s.null = in.byte() % 32 == 0;
  return s;
}

TensorView view(Arena& a, const Slot& s) {
  return TensorView{s.null ? nullptr : a.bytes.data() + s.offset, s.numel, s.dtype};
}

/// The norm orders op 4 fuzzes: the exact partials (2 first: a corpus input without the
/// byte keeps its meaning), then the orders of docs/numerics.md 6.6.
constexpr double kNormKinds[] = {2.0, 1.0, __builtin_inf(), -__builtin_inf(), 0.0, 3.0, 0.5, -1.5};

struct Case {
  int op = 0;
  int n = 0;
  // Per tensor, by role: 0 param, 1-2 the first state slots, 3 step, 4 grad, 5 compute, 6
  // the third state slot.
  std::array<std::array<Slot, 7>, kMaxTensors> slots;
  std::array<int, kMaxTensors> state_slots{};  // generic ops: how many slots are given
  std::array<bool, kMaxTensors> has_compute{};
  std::array<bool, kMaxTensors> copy{};
  AdamWConfig adamw;
  SignSgdConfig sign;
  AdamConfig adam;
  SgdConfig sgd;
  AdagradConfig adagrad;
  LionConfig lion;
  bool lion_for_adagrad = false;  // op 7 runs Lion (decoded last: older inputs keep Adagrad)
  GradientRead read;
  float factor = 1.0f;
  bool found_inf_given = false;
  std::int32_t found_inf = 0;
  bool exact = false;
  // The optimizers run on the host device (Device::optimizer_step) instead of the engine,
  // lr and weight decay from its StepHyper when `hyper`.
  bool device = false;
  bool hyper = false;
  std::uint8_t norm_kind = 0;      // op 4: the norm's order, kNormKinds[norm_kind]
  DType param_dtype = DType::f32;  // params and state (docs/numerics.md 7.3)
};

Case decode(fuzz::Input& in) {
  Case c;
  c.op = in.byte() % 8;
  c.n = in.byte() % (kMaxTensors + 1);
  const int pd = in.byte() % 4;  // f32 half the time, else bf16 or f16
  c.param_dtype = pd == 2 ? DType::bf16 : pd == 3 ? DType::f16 : DType::f32;
  for (int i = 0; i < c.n; ++i) {
    auto& t = c.slots[i];
    switch (c.op) {
      case 0:  // adamw: param, exp_avg, exp_avg_sq (param dtype), step (one f32), grad, compute
        t[0] = decode_slot(in, c.param_dtype);
        t[1] = decode_slot(in, c.param_dtype);
        t[2] = decode_slot(in, c.param_dtype);
        t[3] = decode_slot(in, DType::f32);
        t[4] = decode_slot(in, std::nullopt);
        t[5] = decode_slot(in, std::nullopt);
        if (in.byte() % 4 != 0) {  // mostly consistent sizes
          t[1].numel = t[2].numel = t[4].numel = t[5].numel = t[0].numel;
          t[3].numel = 1;
        }
        c.has_compute[i] = in.flag();
        break;
      case 1:  // sign_sgd: param (param dtype), grad, compute
        t[0] = decode_slot(in, c.param_dtype);
        t[4] = decode_slot(in, std::nullopt);
        t[5] = decode_slot(in, std::nullopt);
        if (in.byte() % 4 != 0) t[4].numel = t[5].numel = t[0].numel;
        c.has_compute[i] = in.flag();
        break;
      case 2:  // accumulate: acc (f32), src
        t[0] = decode_slot(in, DType::f32);
        t[4] = decode_slot(in, std::nullopt);
        if (in.byte() % 4 != 0) t[4].numel = t[0].numel;
        c.copy[i] = in.flag();
        break;
      case 5:  // adam, sgd, adagrad: param, three state slots (param dtype), step, grad, compute
      case 6:
      case 7:
        t[0] = decode_slot(in, c.param_dtype);
        t[1] = decode_slot(in, c.param_dtype);
        t[2] = decode_slot(in, c.param_dtype);
        t[6] = decode_slot(in, c.param_dtype);
        t[3] = decode_slot(in, DType::f32);
        t[4] = decode_slot(in, std::nullopt);
        t[5] = decode_slot(in, std::nullopt);
        if (in.byte() % 4 != 0) {  // mostly consistent sizes
          t[1].numel = t[2].numel = t[6].numel = t[4].numel = t[5].numel = t[0].numel;
          t[3].numel = 1;
        }
        c.has_compute[i] = in.flag();
        c.state_slots[i] = in.byte() % 4;
        break;
      default:  // scale_, norm_partial: one tensor each
        t[0] = decode_slot(in, std::nullopt);
        break;
    }
    // Keep every slot inside the arena after the size fix-ups; a step counter is one f32
    // whatever its slot's size (an empty slot may sit at the arena's end).
    for (Slot& s : t) {
      const std::size_t bytes = s.numel * dtype_size(s.dtype);
      if (s.offset + bytes > kArenaBytes) s.offset = kArenaBytes - bytes;
    }
    if (t[3].offset + 4 > kArenaBytes) t[3].offset = kArenaBytes - 4;
  }
  c.adamw.lr = fuzz::special(in);
  c.adamw.beta1 = fuzz::special(in);
  c.adamw.beta2 = fuzz::special(in);
  c.adamw.eps = fuzz::special(in);
  c.adamw.weight_decay = fuzz::special(in);
  c.adamw.formula = in.flag() ? AdamWFormula::torch : AdamWFormula::native;
  c.adamw.torch_tail_width = in.flag() ? 8 : static_cast<int>(in.byte() % 20) - 2;
  c.adamw.torch_v_first = in.flag();
  c.adam.lr = fuzz::special(in);
  c.adam.beta1 = fuzz::special(in);
  c.adam.beta2 = fuzz::special(in);
  c.adam.eps = fuzz::special(in);
  c.adam.weight_decay = fuzz::special(in);
  c.adam.amsgrad = in.flag();
  c.adam.maximize = in.flag();
  c.adam.torch_tail_width = in.flag() ? 8 : static_cast<int>(in.byte() % 20) - 2;
  c.adam.torch_v_first = in.flag();
  c.sgd.lr = fuzz::special(in);
  c.sgd.momentum = in.flag() ? 0.0 : fuzz::special(in);
  c.sgd.dampening = fuzz::special(in);
  c.sgd.weight_decay = fuzz::special(in);
  c.sgd.nesterov = in.flag();
  c.sgd.maximize = in.flag();
  c.sgd.torch_tail_width = in.flag() ? 8 : static_cast<int>(in.byte() % 20) - 2;
  c.adagrad.lr = fuzz::special(in);
  c.adagrad.lr_decay = fuzz::special(in);
  c.adagrad.weight_decay = fuzz::special(in);
  c.adagrad.initial_accumulator_value = fuzz::special(in);
  c.adagrad.eps = fuzz::special(in);
  c.adagrad.maximize = in.flag();
  c.sign.lr = fuzz::special(in);
  c.sign.weight_decay = fuzz::special(in);
  c.read.scale = static_cast<float>(fuzz::special(in));
  c.read.clip = static_cast<float>(fuzz::special(in));
  c.factor = static_cast<float>(fuzz::special(in));
  c.found_inf_given = in.flag();
  c.found_inf = static_cast<std::int32_t>(in.byte() % 3);
  c.exact = in.flag();
  // A byte that once chose between two record types for ops 0 and 1 (there is one now):
  // still read, so every input of the corpus decodes to the case it was found with.
  (void)in.flag();
  c.device = in.flag();
  c.hyper = in.flag();
  c.norm_kind = static_cast<std::uint8_t>(in.byte() % (sizeof kNormKinds / sizeof kNormKinds[0]));
  c.lion.lr = fuzz::special(in);
  c.lion.beta1 = fuzz::special(in);
  c.lion.beta2 = fuzz::special(in);
  c.lion.weight_decay = fuzz::special(in);
  c.lion_for_adagrad = in.flag();
  return c;
}

// The configuration an optimizer op runs (ops 0, 1, 5, 6, 7).
OptimizerConfig config_of(const Case& c) {
  switch (c.op) {
    case 0:
      return c.adamw;
    case 1:
      return c.sign;
    case 5:
      return c.adam;
    case 6:
      return c.sgd;
    default:
      return c.lion_for_adagrad ? OptimizerConfig(c.lion) : OptimizerConfig(c.adagrad);
  }
}

// The host device the device cases run on: any host memory is its "device memory".
device::Device& host_device() {
  static const auto dev = device::make_host_device(32, device::HostDeviceMemory::any_host_memory);
  return *dev;
}

// One generic device step: the scale, clip, found-inf flag, lr and weight decay and the
// optimizer's table in "device memory", read when it runs.
void device_step(std::span<const OptimizerTensor> t, const OptimizerConfig& config, const Case& c,
                 const std::vector<double>& table) {
  const std::int32_t flag = c.found_inf_given ? c.found_inf : 0;
  const StepHyper h = std::visit(
      [](const auto& x) {
        return StepHyper{x.lr, x.weight_decay};
      },
      config);
  OptimizerDeviceArgs d;
  d.scale = &c.read.scale;
  d.clip = &c.read.clip;
  d.found_inf = c.found_inf_given ? &flag : nullptr;
  d.hyper = c.hyper ? &h : nullptr;
  d.table = table.data();
  host_device().optimizer_step(t, config, d);
}

// Runs the case on `a` with the engine (nullptr: the reference); returns the Errc thrown
// or nullopt, and the norm partial for op 4.
std::optional<Errc> run(const Case& c, Arena& a, const cpu::Engine* e, NormPartial& partial,
                        const std::vector<double>* table, NormResult& p_norm) {
  try {
    const std::int32_t* fi = c.found_inf_given ? &c.found_inf : nullptr;
    switch (c.op) {
      case 0: {
        // AdamW's slots exp_avg, exp_avg_sq (amsgrad: its missing third slot is refused).
        std::vector<OptimizerTensor> t(c.n);
        for (int i = 0; i < c.n; ++i) {
          const auto& s = c.slots[i];
          t[i].param = view(a, s[0]);
          t[i].state[0] = view(a, s[1]);
          t[i].state[1] = view(a, s[2]);
          t[i].step = s[3].null ? nullptr : reinterpret_cast<float*>(a.bytes.data() + s[3].offset);
          t[i].grad = view(a, s[4]);
          if (c.has_compute[i]) t[i].compute_param = view(a, s[5]);
        }
        const std::span<const OptimizerTensor> ts(t);
        if (e && c.device)
          device_step(ts, c.adamw, c, *table);
        else if (e)
          e->step(ts, c.adamw, c.read, fi);
        else
          reference::adamw_step(ts, c.adamw, c.read, fi);
        break;
      }
      case 1: {
        std::vector<OptimizerTensor> t(c.n);  // the param alone: no slot, no counter
        for (int i = 0; i < c.n; ++i) {
          t[i].param = view(a, c.slots[i][0]);
          t[i].grad = view(a, c.slots[i][4]);
          if (c.has_compute[i]) t[i].compute_param = view(a, c.slots[i][5]);
        }
        const std::span<const OptimizerTensor> ts(t);
        if (e && c.device)
          device_step(ts, c.sign, c, *table);
        else if (e)
          e->step(ts, c.sign, c.read, fi);
        else
          reference::sign_sgd_step(ts, c.sign, c.read, fi);
        break;
      }
      case 5:
      case 6:
      case 7: {
        std::vector<OptimizerTensor> t(c.n);
        for (int i = 0; i < c.n; ++i) {
          const auto& s = c.slots[i];
          t[i].param = view(a, s[0]);
          const Slot* state[3] = {&s[1], &s[2], &s[6]};
          for (int k = 0; k < c.state_slots[i]; ++k) t[i].state[k] = view(a, *state[k]);
          t[i].step = s[3].null ? nullptr : reinterpret_cast<float*>(a.bytes.data() + s[3].offset);
          t[i].grad = view(a, s[4]);
          if (c.has_compute[i]) t[i].compute_param = view(a, s[5]);
        }
        const std::span<const OptimizerTensor> ts(t);
        if (e && c.device) {
          device_step(ts, config_of(c), c, *table);
        } else if (c.op == 5) {
          if (e)
            e->step(ts, c.adam, c.read, fi);
          else
            reference::adam_step(ts, c.adam, c.read, fi);
        } else if (c.op == 6) {
          if (e)
            e->step(ts, c.sgd, c.read, fi);
          else
            reference::sgd_step(ts, c.sgd, c.read, fi);
        } else if (c.lion_for_adagrad) {
          if (e)
            e->step(ts, c.lion, c.read, fi);
          else
            reference::lion_step(ts, c.lion, c.read, fi);
        } else {
          if (e)
            e->step(ts, c.adagrad, c.read, fi);
          else
            reference::adagrad_step(ts, c.adagrad, c.read, fi);
        }
        break;
      }
      case 2: {
        std::vector<AccumulatePair> p(c.n);
        for (int i = 0; i < c.n; ++i) {
          p[i].acc = view(a, c.slots[i][0]);
          p[i].src = view(a, c.slots[i][4]);
          p[i].copy = c.copy[i];
        }
        if (e)
          e->accumulate(p);
        else
          reference::accumulate(p);
        break;
      }
      case 3: {
        std::vector<TensorView> t(c.n);
        for (int i = 0; i < c.n; ++i) t[i] = view(a, c.slots[i][0]);
        if (e)
          e->scale_(t, c.factor);
        else
          reference::scale_(t, c.factor);
        break;
      }
      default: {
        std::vector<ConstTensorView> t(c.n);
        for (int i = 0; i < c.n; ++i) t[i] = view(a, c.slots[i][0]);
        const double p = kNormKinds[c.norm_kind];
        const NormOrder order = p == 1.0 ? NormOrder::one : NormOrder::two;
        if (p != 2.0 && p != 1.0)  // the other orders: their finished norm
          p_norm = e ? e->p_norm(t, p, c.read) : reference::p_norm(t, p, c.read);
        else if (e)
          partial = e->norm_partial(t, c.read, c.exact ? NormMode::exact : NormMode::fast, order);
        else
          partial = reference::norm_partial(t, c.read, order);
        break;
      }
    }
  } catch (const Error& err) {
    return err.code();
  }
  return std::nullopt;
}

// The byte offsets of every f32 element the case writes (aligned ones: misaligned data is
// refused before anything runs).
std::vector<std::size_t> f32_outputs(const Case& c) {
  std::vector<std::size_t> out;
  auto add = [&](const Slot& s) {
    if (s.null || s.dtype != DType::f32 || s.offset % 4 != 0) return;
    for (std::size_t k = 0; k < s.numel; ++k) out.push_back(s.offset + 4 * k);
  };
  for (int i = 0; i < c.n; ++i) {
    const auto& t = c.slots[i];
    switch (c.op) {
      case 0:
        add(t[0]), add(t[1]), add(t[2]), add(t[3]);
        if (c.has_compute[i]) add(t[5]);
        break;
      case 1:
        add(t[0]);
        if (c.has_compute[i]) add(t[5]);
        break;
      case 5:
      case 6:
      case 7:
        add(t[0]), add(t[1]), add(t[2]), add(t[6]), add(t[3]);
        if (c.has_compute[i]) add(t[5]);
        break;
      case 2:
      case 3:
        add(t[0]);
        break;
      default:
        break;  // norm_partial writes nothing
    }
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Input in(data, size);
  const auto& all = engines();
  const cpu::Engine& engine = *all[in.byte() % all.size()];
  Case c = decode(in);
  Arena original;
  for (auto& b : original.bytes) b = static_cast<std::byte>(in.byte());
  // The device step reads the scale, clip and counters from device memory, unchecked (the
  // host does not read them): give it what the reference accepts there, so the two still
  // agree on every refusal, and its table (a configuration the table refuses, a beta
  // within 2^-22 steps of 1, the device does not run: documented, not a difference).
  std::vector<double> table;
  const bool optimizer = c.op == 0 || c.op == 1 || c.op >= 5;
  // The device steps f32 params only (docs/numerics.md 7.3: the CPU engine's bf16/f16).
  if (!optimizer || c.param_dtype != DType::f32) c.device = false;
  for (int i = 0; i < c.n; ++i)  // a mixed list: one param in another dtype
    if (c.slots[i][0].dtype != DType::f32) c.device = false;
  if (c.device) {
    c.read = GradientRead{0.5f, 0.75f};
    for (int i = 0; i < c.n; ++i) {
      const Slot& st = c.slots[i][3];
      if (c.op != 1 && !st.null && st.offset % 4 == 0) {
        const float three = 3.0f;
        std::memcpy(original.bytes.data() + st.offset, &three, 4);
      }
    }
    const OptimizerConfig config = config_of(c);
    try {
      table = gpu::make_optimizer_table(config);
    } catch (const Error& err) {
      if (err.code() == Errc::not_supported) return 0;
      table = {0.0, 0.0};  // a placeholder: the step refuses the configuration first
    }
  }
  Arena mine = original, ref = original;
  NormPartial p_mine, p_ref;
  NormResult n_mine, n_ref;
  const std::optional<Errc> e_mine = run(c, mine, &engine, p_mine, &table, n_mine);
  const std::optional<Errc> e_ref = run(c, ref, nullptr, p_ref, nullptr, n_ref);
  if (e_mine != e_ref) {  // the same checker on every path
    std::fprintf(stderr, "fuzz_engine: op %d (device %d, lion %d): engine %d, reference %d\n", c.op,
                 c.device ? 1 : 0, c.lion_for_adagrad ? 1 : 0,
                 e_mine ? static_cast<int>(*e_mine) : -1, e_ref ? static_cast<int>(*e_ref) : -1);
    __builtin_trap();
  }
  if (e_mine) {  // refused: nothing written
    if (std::memcmp(mine.bytes.data(), original.bytes.data(), kArenaBytes) != 0) __builtin_trap();
    return 0;
  }
  // docs/numerics.md: an f32 result of arithmetic on a NaN is specified only as "a NaN"
  // (x86 propagates an operand's payload); outputs stored as bf16/f16 are exact bits.
  // So an f32 output element that is a NaN on both sides counts as equal.
  for (const std::size_t off : f32_outputs(c)) {
    float x, y;
    std::memcpy(&x, mine.bytes.data() + off, 4);
    std::memcpy(&y, ref.bytes.data() + off, 4);
    if (x != x && y != y) std::memcpy(mine.bytes.data() + off, ref.bytes.data() + off, 4);
  }
  if (std::memcmp(mine.bytes.data(), ref.bytes.data(), kArenaBytes) != 0) __builtin_trap();
  const double p = kNormKinds[c.norm_kind];
  if (c.op == 4 && p != 2.0 && p != 1.0) {  // other orders: the same bits (NaN: both NaN)
    const bool both_nan = n_mine.norm != n_mine.norm && n_ref.norm != n_ref.norm;
    if (!both_nan && std::memcmp(&n_mine.norm, &n_ref.norm, sizeof n_mine.norm) != 0)
      __builtin_trap();
    if (n_mine.finite != n_ref.finite || n_mine.nan_count != n_ref.nan_count ||
        n_mine.inf_count != n_ref.inf_count)
      __builtin_trap();
  } else if (c.op == 4) {
    const NormOrder order = p == 1.0 ? NormOrder::one : NormOrder::two;
    if (c.exact) {
      if (!same_value(p_mine, p_ref)) __builtin_trap();
    } else {  // the fast partial: its finalised norm, when certified, is the exact one
      const NormResult a = finalize(p_mine, order), b = finalize(p_ref, order);
      if (!a.needs_exact && std::memcmp(&a.norm, &b.norm, sizeof a.norm) != 0) __builtin_trap();
    }
  }
  return 0;
}
