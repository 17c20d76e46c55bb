// libFuzzer harness: every CPU engine entry point family (the step of every optimizer unit
// of the table, OptimizerConfig's alternatives in core/optimizers/all.hpp's order, its
// configuration decoded field by field from OptimizerTraits<C>::kFields; accumulate,
// scale_, norm_partial of order 2 or 1, p_norm of the other orders, the order a fuzzed
// choice), and the generic device step (Device::optimizer_step on the host device: the GPU
// kernels' plans and block bodies, its inputs in "device memory" it reads when it runs) on
// random tensor lists carved from one arena: random sizes and dtypes, overlapping, adjacent
// and misaligned ranges, null pointers, state slots and step counters the unit does or does
// not keep, hyper-parameters including NaN/Inf/subnormal/huge, found-inf flags, the param
// and state dtype (f32, bf16, f16; sometimes mixed), state slots in 8 bits (codes and block
// maxima anywhere in the arena, misaligned, null, beside state views), every ISA the
// machine runs.
// Differential oracle: the scalar reference (reference::optimizer_step: each optimizer's
// literal function) on a copy of the arena. Either both succeed with identical bits, or both
// throw the same Errc and the engine's arena is unchanged (all-or-nothing).
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "fuzz/fuzz_input.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/managers.hpp"  // optimizer_slot_names, optimizer_counts_steps, optimizer_name
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

/// The optimizer units: OptimizerConfig's alternatives, in core/optimizers/all.hpp's order.
constexpr std::size_t kUnits = std::variant_size_v<OptimizerConfig>;

/// Ops 0, 1, 5, 6 and 7 (five of the eight op values) are the optimizer step; 2 accumulate,
/// 3 scale_, 4 the norms.
bool optimizer_op(int op) { return op == 0 || op == 1 || op >= 5; }

// One hyper-parameter from the input, by its kind: a double from the specials, a flag, a
// count as a torch tail width (8, or -2..17: none, torch's widths and widths the
// configuration refuses), a formula (AdamW's, Adam's).
void decode_field(fuzz::Input& in, double& v) { v = fuzz::special(in); }
void decode_field(fuzz::Input& in, bool& v) { v = in.flag(); }
void decode_field(fuzz::Input& in, int& v) {
  v = in.flag() ? 8 : static_cast<int>(in.byte() % 20) - 2;
}
void decode_field(fuzz::Input& in, AdamWFormula& v) {
  // native, torch, torchao, or a value no formula has (refused by both).
  v = static_cast<AdamWFormula>(in.byte() % (std::size(kAdamWFormulaNames) + 1));
}

// Unit I's configuration: each field of OptimizerTraits<C>::kFields, in its order.
template <std::size_t I>
OptimizerConfig decode_unit_config(fuzz::Input& in) {
  using C = std::variant_alternative_t<I, OptimizerConfig>;
  C c{};
  for (const HyperField<C>& f : OptimizerTraits<C>::kFields)
    std::visit([&](auto member) { decode_field(in, c.*member); }, f.member);
  return OptimizerConfig(std::in_place_index<I>, c);
}

using ConfigDecoder = OptimizerConfig (*)(fuzz::Input&);
template <std::size_t... I>
constexpr std::array<ConfigDecoder, kUnits> config_decoders(std::index_sequence<I...>) {
  return {&decode_unit_config<I>...};
}

// The configuration of the unit a byte picks among all of them.
OptimizerConfig decode_config(fuzz::Input& in) {
  static constexpr auto decoders = config_decoders(std::make_index_sequence<kUnits>{});
  return decoders[in.byte() % kUnits](in);
}

// The views of one tensor of a case. Ops 2-4 use `param` (accumulate's acc, the tensor of
// scale_ and the norms) and `grad` (accumulate's src).
struct TensorSlots {
  Slot param;
  std::array<Slot, kMaxOptimizerSlots> state;
  // 8-bit state (docs/numerics.md 8f), when Case::q8: codes (bytes) and block maxima (f32).
  std::array<Slot, kMaxOptimizerSlots> codes, absmax;
  Slot step;  // one f32 counter at the slot's offset
  Slot grad;
  Slot compute;
};

struct Case {
  int op = 0;
  int n = 0;
  std::array<TensorSlots, kMaxTensors> slots;
  // Optimizer ops: how many state slots each tensor is given, and whether a step counter.
  std::array<int, kMaxTensors> state_slots{};
  std::array<bool, kMaxTensors> has_step{};
  std::array<bool, kMaxTensors> has_compute{};
  std::array<bool, kMaxTensors> copy{};
  OptimizerConfig config;  // optimizer ops: the unit and its hyper-parameters
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
  // Optimizer ops: a tensor's slots in 8 bits (its state views then given only when
  // q8_and_state: refused), decoded last so older corpus inputs keep their meaning.
  std::array<bool, kMaxTensors> q8{};
  std::array<bool, kMaxTensors> q8_and_state{};
};

Case decode(fuzz::Input& in) {
  Case c;
  c.op = in.byte() % 8;
  c.n = in.byte() % (kMaxTensors + 1);
  const int pd = in.byte() % 4;  // f32 half the time, else bf16 or f16
  c.param_dtype = pd == 2 ? DType::bf16 : pd == 3 ? DType::f16 : DType::f32;
  int own_slots = 0;
  bool counts_steps = false;
  if (optimizer_op(c.op)) {
    c.config = decode_config(in);
    own_slots = static_cast<int>(optimizer_slot_names(c.config).size());
    counts_steps = optimizer_counts_steps(c.config);
  }
  for (int i = 0; i < c.n; ++i) {
    TensorSlots& t = c.slots[i];
    if (optimizer_op(c.op)) {
      // Mostly the state slots and counter the unit keeps (its variant's); now and then
      // another number of slots, or a counter it does not keep, or none it needs.
      const std::uint8_t shape = in.byte();
      c.state_slots[i] = shape % 4 != 0 ? own_slots : shape / 4 % (kMaxOptimizerSlots + 1);
      c.has_step[i] = (shape / 16 % 8 == 0) != counts_steps;
      // param and state (param dtype), step (one f32), grad, compute.
      t.param = decode_slot(in, c.param_dtype);
      for (int k = 0; k < c.state_slots[i]; ++k) t.state[k] = decode_slot(in, c.param_dtype);
      if (c.has_step[i]) t.step = decode_slot(in, DType::f32);
      t.grad = decode_slot(in, std::nullopt);
      t.compute = decode_slot(in, std::nullopt);
      if (in.byte() % 4 != 0) {  // mostly consistent sizes
        for (Slot& s : t.state) s.numel = t.param.numel;
        t.grad.numel = t.compute.numel = t.param.numel;
        t.step.numel = 1;
      }
      c.has_compute[i] = in.flag();
    } else if (c.op == 2) {  // accumulate: acc (f32), src
      t.param = decode_slot(in, DType::f32);
      t.grad = decode_slot(in, std::nullopt);
      if (in.byte() % 4 != 0) t.grad.numel = t.param.numel;
      c.copy[i] = in.flag();
    } else {  // scale_, norm_partial: one tensor each
      t.param = decode_slot(in, std::nullopt);
    }
    // Keep every slot inside the arena after the size fix-ups; a step counter is one f32
    // whatever its slot's size (an empty slot may sit at the arena's end).
    const auto inside = [](Slot& s) {
      const std::size_t bytes = s.numel * dtype_size(s.dtype);
      if (s.offset + bytes > kArenaBytes) s.offset = kArenaBytes - bytes;
    };
    inside(t.param);
    for (Slot& s : t.state) inside(s);
    inside(t.step), inside(t.grad), inside(t.compute);
    if (t.step.offset + 4 > kArenaBytes) t.step.offset = kArenaBytes - 4;
  }
  c.read.scale = static_cast<float>(fuzz::special(in));
  c.read.clip = static_cast<float>(fuzz::special(in));
  c.factor = static_cast<float>(fuzz::special(in));
  c.found_inf_given = in.flag();
  c.found_inf = static_cast<std::int32_t>(in.byte() % 3);
  c.exact = in.flag();
  c.device = in.flag();
  c.hyper = in.flag();
  c.norm_kind = static_cast<std::uint8_t>(in.byte() % (sizeof kNormKinds / sizeof kNormKinds[0]));
  c.read.as_f32 = in.flag();  // products rounded in f32 (the device cases reset the read)
  for (int i = 0; i < c.n && optimizer_op(c.op); ++i) {
    const std::uint8_t q = in.byte();
    c.q8[i] = q % 3 == 1;
    c.q8_and_state[i] = q % 32 == 4;
    if (!c.q8[i]) continue;
    TensorSlots& t = c.slots[i];
    for (int k = 0; k < kMaxOptimizerSlots; ++k) {
      // Codes: one byte per element (sometimes another count); maxima: one f32 per block of
      // 256 (numel <= 100 here: one), mostly aligned; either sometimes null.
      Slot& codes = t.codes[k];
      codes.dtype = DType::bf16;  // unused: codes are bytes
      codes.numel = in.byte() % 8 != 0 ? t.param.numel : t.param.numel + 1;
      codes.offset = in.below(static_cast<std::uint32_t>(kArenaBytes - codes.numel + 1));
      codes.null = in.byte() % 32 == 0;
      Slot& max = t.absmax[k];
      max.numel = 1;
      max.offset = in.below(static_cast<std::uint32_t>(kArenaBytes - 4 + 1));
      if (in.byte() % 4 != 0) max.offset -= max.offset % 4;
      max.null = in.byte() % 32 == 0;
    }
  }
  return c;
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
  static const std::vector<std::uint32_t> books = gpu::q8_codebooks();
  d.q8_codebooks = books.data();  // 8-bit slots: the kernels' block bodies (q8_bodies.hpp)
  host_device().optimizer_step(t, config, d);
}

// Runs the case on `a` with the engine (nullptr: the reference); returns the Errc thrown
// or nullopt, and the norm partial for op 4.
std::optional<Errc> run(const Case& c, Arena& a, const cpu::Engine* e, NormPartial& partial,
                        const std::vector<double>* table, NormResult& p_norm) {
  try {
    const std::int32_t* fi = c.found_inf_given ? &c.found_inf : nullptr;
    if (optimizer_op(c.op)) {
      std::vector<OptimizerTensor> t(c.n);
      for (int i = 0; i < c.n; ++i) {
        const TensorSlots& s = c.slots[i];
        t[i].param = view(a, s.param);
        for (int k = 0; k < c.state_slots[i]; ++k) {
          if (!c.q8[i] || c.q8_and_state[i]) t[i].state[k] = view(a, s.state[k]);
          if (c.q8[i])
            t[i].q8[k] = Q8Slot{
                s.codes[k].null
                    ? nullptr
                    : reinterpret_cast<std::uint8_t*>(a.bytes.data() + s.codes[k].offset),
                s.absmax[k].null ? nullptr
                                 : reinterpret_cast<float*>(a.bytes.data() + s.absmax[k].offset)};
        }
        if (c.has_step[i] && !s.step.null)
          t[i].step = reinterpret_cast<float*>(a.bytes.data() + s.step.offset);
        t[i].grad = view(a, s.grad);
        if (c.has_compute[i]) t[i].compute_param = view(a, s.compute);
      }
      const std::span<const OptimizerTensor> ts(t);
      if (e && c.device)
        device_step(ts, c.config, c, *table);
      else if (e)
        std::visit([&](const auto& config) { e->step(ts, config, c.read, fi); }, c.config);
      else
        reference::optimizer_step(ts, c.config, c.read, fi);
      return std::nullopt;
    }
    switch (c.op) {
      case 2: {
        std::vector<AccumulatePair> p(c.n);
        for (int i = 0; i < c.n; ++i) {
          p[i].acc = view(a, c.slots[i].param);
          p[i].src = view(a, c.slots[i].grad);
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
        for (int i = 0; i < c.n; ++i) t[i] = view(a, c.slots[i].param);
        if (e)
          e->scale_(t, c.factor);
        else
          reference::scale_(t, c.factor);
        break;
      }
      default: {
        std::vector<ConstTensorView> t(c.n);
        for (int i = 0; i < c.n; ++i) t[i] = view(a, c.slots[i].param);
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
  auto add = [&](const Slot& s, std::size_t numel) {
    if (s.null || s.dtype != DType::f32 || s.offset % 4 != 0) return;
    for (std::size_t k = 0; k < numel; ++k) out.push_back(s.offset + 4 * k);
  };
  for (int i = 0; i < c.n; ++i) {
    const TensorSlots& t = c.slots[i];
    if (optimizer_op(c.op)) {
      add(t.param, t.param.numel);
      for (int k = 0; k < c.state_slots[i]; ++k) {
        if (!c.q8[i] || c.q8_and_state[i]) add(t.state[k], t.state[k].numel);
        if (c.q8[i]) add(t.absmax[k], 1);
      }
      if (c.has_step[i]) add(t.step, 1);
      if (c.has_compute[i]) add(t.compute, t.compute.numel);
    } else if (c.op == 2 || c.op == 3) {
      add(t.param, t.param.numel);
    }  // the norms write nothing
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
  const bool optimizer = optimizer_op(c.op);
  // The device steps f32 params only (docs/numerics.md 7.3: the CPU engine's bf16/f16).
  if (!optimizer || c.param_dtype != DType::f32) c.device = false;
  for (int i = 0; i < c.n; ++i)  // a mixed list: one param in another dtype
    if (c.slots[i].param.dtype != DType::f32) c.device = false;
  if (c.device) {
    c.read = GradientRead{0.5f, 0.75f};
    for (int i = 0; i < c.n; ++i) {
      const Slot& st = c.slots[i].step;
      if (c.has_step[i] && !st.null && st.offset % 4 == 0) {
        const float three = 3.0f;
        std::memcpy(original.bytes.data() + st.offset, &three, 4);
      }
    }
    try {
      table = gpu::make_optimizer_table(c.config);
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
    std::fprintf(stderr, "fuzz_engine: op %d (%s, device %d): engine %d, reference %d\n", c.op,
                 optimizer ? std::string(optimizer_name(c.config)).c_str() : "-", c.device ? 1 : 0,
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
