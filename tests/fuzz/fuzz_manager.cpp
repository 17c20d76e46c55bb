// libFuzzer harness: a gradient manager as a state machine, checked against a serial
// twin. Each input builds a manager on the host device (mode none, optimizer or full;
// any optimizer unit of the table, its hyper-parameters decoded field by field from
// OptimizerTraits<C>::kFields; 1-3 parameters of fuzzed sizes, gradient dtypes and
// buffers; 1-2 groups; the speculation policy; a rollback budget of 0, a few chunks'
// bytes or kAllChunks; eager or lazy GPU scaling; full offload's rings) and drives it
// through up to 32 calls
// with fuzzed arguments in any order, overlapped steps among them (clipped, unclipped,
// non-finite: speculated chunks committed, rolled back or skipped). Every call succeeds or
// throws stepcore::Error; it never crashes, hangs or corrupts memory (ASan, UBSan); and
// after an Error from validation (a bad argument or call sequence) the parameters' state
// is what it was.
//
// The serial twin: a second manager of the same configuration gets the same calls with
// the same arguments (the same input bytes, replayed), except that its begin_step always
// passes overlap_optimizer = false (8-bit state slots among the configurations).
// Overlap changes no bit, so whenever the primary can be
// read (between steps) after calls that changed the state, the two must agree bit for bit
// on every parameter's master, moments, compute weights and step counter and on the
// report's norm, clip coefficient, skipped and stepped (not its chunk counts or timing).
// Which calls the twin gets:
//  * one the primary refuses by validation: none. An overlapped step refuses calls the
//    serial step accepts (set_hyperparameters between begin_backward(true) and step();
//    a failed reservation of rollback space in begin_step), and a refused call changes
//    nothing (checked above), so skipping it keeps the twin where the primary is;
//  * one the primary accepts: the same, which the twin must accept too (overlap may
//    refuse more than the serial step, never less); any Error from the twin traps;
//  * after the primary fails otherwise (a runtime error: it is failed for good), the
//    twin gets nothing more and the rest of the input is not compared.
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "fuzz/fuzz_input.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/optim.hpp"

namespace {

using namespace stepcore;

// A validation error: the manager promises nothing changed.
bool validation(Errc c) {
  switch (c) {
    case Errc::invalid_argument:
    case Errc::null_pointer:
    case Errc::size_mismatch:
    case Errc::unsupported_dtype:
    case Errc::overlap:
    case Errc::non_finite:
    case Errc::out_of_range:
    case Errc::not_supported:
      return true;
    default:
      return false;
  }
}

// Every parameter's master, moments, compute weights and step counter as bytes.
using Snapshot = std::vector<std::vector<std::uint8_t>>;

template <class T>
std::vector<std::uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<std::uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// The manager's state, or nullopt when it cannot be read now (mid-step, or failed).
std::optional<Snapshot> snapshot(GradientManager& m) {
  Snapshot s;
  try {
    const auto& params = m.config().params;
    const std::vector<std::string_view>& names = m.state_slot_names();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const ParamSpec& p = params[i];
      const std::size_t n = p.numel;
      // An 8-bit parameter's slots as codes and block maxima.
      const bool q8 = m.q8_parameter(i);
      std::vector<float> master(n);
      std::vector<std::vector<float>> slots(names.size(), std::vector<float>(q8 ? 0 : n));
      std::vector<std::vector<std::uint8_t>> codes(names.size(),
                                                   std::vector<std::uint8_t>(q8 ? n : 0));
      std::vector<std::vector<float>> maxima(names.size(),
                                             std::vector<float>(q8 ? q8_blocks(n) : 0));
      std::vector<SlotOut> named;
      for (std::size_t k = 0; k < names.size(); ++k)
        named.push_back({names[k], slots[k], codes[k], maxima[k]});
      std::vector<std::uint8_t> compute(p.has_compute_weights ? n * dtype_size(p.compute_dtype)
                                                              : 0);
      m.read_parameter(i, master, named, compute);
      s.push_back(bytes_of(master));
      for (std::size_t k = 0; k < names.size(); ++k) {
        s.push_back(bytes_of(slots[k]));
        s.push_back(codes[k]);
        s.push_back(bytes_of(maxima[k]));
      }
      s.push_back(std::move(compute));
      s.push_back(bytes_of(std::vector<float>{m.step_count(i)}));
    }
  } catch (const Error&) {
    return std::nullopt;
  }
  return s;
}

// What overlap must not change in report(): stepped, skipped, the norm's result and the
// clip coefficient (bits), or nullopt when report() throws.
std::optional<std::vector<std::uint8_t>> report_bits(GradientManager& m) {
  try {
    const StepReport r = m.report();
    const NormResult& n = r.norm;
    std::vector<std::uint8_t> b(2 * sizeof(float) + 2 * sizeof(std::uint64_t) + sizeof(float));
    std::uint8_t* at = b.data();
    for (const void* field :
         {static_cast<const void*>(&n.norm), static_cast<const void*>(&n.max_abs)}) {
      std::memcpy(at, field, sizeof(float));
      at += sizeof(float);
    }
    std::memcpy(at, &n.nan_count, sizeof n.nan_count);
    std::memcpy(at + 8, &n.inf_count, sizeof n.inf_count);
    std::memcpy(at + 16, &r.clip_coefficient, sizeof(float));
    b.push_back(r.stepped);
    b.push_back(r.skipped);
    b.push_back(n.finite);
    b.push_back(n.needs_exact);
    return b;
  } catch (const Error&) {
    return std::nullopt;
  }
}

// The betas every input draws from (one byte picks a pair). They are restricted because a
// GPU-mode manager of an optimizer with a bias table (AdamW, Adam) has an entry per step
// until 1 - beta^t rounds to 1: 37,000 pow calls for beta2 = 0.999 (the default; one input
// in 32 here), which would otherwise be most of an input's time. A NaN beta2 is a refused
// configuration.
struct Betas {
  double beta1, beta2;
};
Betas decode_betas(std::uint8_t shape) {
  static const double beta1s[] = {0.9, 0.0, 0.5, 0.8};
  static const double beta2s[] = {0.95, 0.98, 0.9, 0.5, 0.0, 0.7, 0.8, __builtin_nan("")};
  return {beta1s[(shape >> 4) % 4], (shape & 0xCE) == 0xC0 ? 0.999 : beta2s[(shape >> 1) % 8]};
}

// The input's bits, least significant first, a byte read from it whenever they run out.
class Bits {
 public:
  explicit Bits(fuzz::Input& in) : in_(in) {}
  unsigned take(int n) {
    unsigned v = 0;
    for (int k = 0; k < n; ++k) {
      if (left_ == 0) byte_ = in_.byte(), left_ = 8;
      v |= static_cast<unsigned>(byte_ & 1) << k;
      byte_ >>= 1, --left_;
    }
    return v;
  }

 private:
  fuzz::Input& in_;
  std::uint8_t byte_ = 0;
  int left_ = 0;
};

// Plausible values of one hyper-parameter (the harness fuzzes the manager, not the
// optimizers' validation): beta1 and beta2 from the betas above; other numbers the
// default, 0.1 or 0.9 (each field accepts both on its own); flags from a bit; counts
// (torch's tail width) the default, 8, 4 or 0; a formula (AdamW's, Adam's) any of three.
void decode_field(Bits& bits, std::string_view name, const Betas& betas, double& v) {
  if (name == "beta1" || name == "beta2") {
    v = name == "beta1" ? betas.beta1 : betas.beta2;
    return;
  }
  static const double values[] = {0.1, 0.9};
  const unsigned k = bits.take(2);
  if (k >= 2) v = values[k - 2];
}
void decode_field(Bits& bits, std::string_view, const Betas&, bool& v) { v = bits.take(1) != 0; }
void decode_field(Bits& bits, std::string_view, const Betas&, int& v) {
  static const int widths[] = {8, 4, 0};
  const unsigned k = bits.take(2);
  if (k != 0) v = widths[k - 1];
}
void decode_field(Bits& bits, std::string_view, const Betas&, AdamWFormula& v) {
  static const AdamWFormula formulas[] = {AdamWFormula::torch, AdamWFormula::native,
                                          AdamWFormula::torchao, AdamWFormula::torch};
  v = formulas[bits.take(2)];
}

// The member of a group that holds hyper-parameter `name` of role betas (beta1, beta2,
// eps: each group's), or none.
double ParamGroup::*group_member(std::string_view name) {
  if (name == "beta1") return &ParamGroup::beta1;
  if (name == "beta2") return &ParamGroup::beta2;
  if (name == "eps") return &ParamGroup::eps;
  return nullptr;
}

// Unit I's configuration, each field of OptimizerTraits<C>::kFields decoded in its order,
// except the schedule's (lr, weight decay), which come from the groups (ParamGroup's
// defaults, or the configuration's without groups; then set_hyperparameters' values).
// A field of role betas is set in every group too.
template <std::size_t I>
OptimizerConfig decode_unit_config(Bits& bits, const Betas& betas,
                                   std::vector<ParamGroup>& groups) {
  using C = std::variant_alternative_t<I, OptimizerConfig>;
  C c{};
  for (const HyperField<C>& f : OptimizerTraits<C>::kFields) {
    if (f.role == HyperRole::schedule) continue;
    std::visit(
        [&](auto member) {
          decode_field(bits, f.name, betas, c.*member);
          if constexpr (std::is_same_v<decltype(member), double C::*>)
            if (double ParamGroup::*g = f.role == HyperRole::betas ? group_member(f.name) : nullptr)
              for (ParamGroup& group : groups) group.*g = c.*member;
        },
        f.member);
  }
  return OptimizerConfig(std::in_place_index<I>, c);
}

using ConfigDecoder = OptimizerConfig (*)(Bits&, const Betas&, std::vector<ParamGroup>&);
template <std::size_t... I>
constexpr std::array<ConfigDecoder, sizeof...(I)> config_decoders(std::index_sequence<I...>) {
  return {&decode_unit_config<I>...};
}

// The configuration of the optimizer unit a byte picks (OptimizerConfig's alternatives, in
// core/optimizers/all.hpp's order).
OptimizerConfig decode_config(std::uint8_t unit, Bits& bits, const Betas& betas,
                              std::vector<ParamGroup>& groups) {
  constexpr std::size_t kUnits = std::variant_size_v<OptimizerConfig>;
  static constexpr auto decoders = config_decoders(std::make_index_sequence<kUnits>{});
  return decoders[unit % kUnits](bits, betas, groups);
}

// One manager and the caller's gradient buffers handed to it (declared first: freed last).
struct Side {
  std::vector<std::vector<std::byte>> caller;
  std::unique_ptr<GradientManager> m;
};

// Makes call `op` (parameter index i) on s, its other arguments read from `in`. `serial`
// (the twin): begin_step's overlap flag is read but false is passed.
void call(Side& s, int op, std::size_t i, fuzz::Input& in, bool serial) {
  GradientManager& m = *s.m;
  const std::vector<ParamSpec>& params = m.config().params;
  switch (op) {
    case 0: {
      const auto scale = static_cast<float>(fuzz::special(in));
      const bool overlap = in.flag();
      m.begin_step(scale, overlap && !serial);
      break;
    }
    case 1:
      m.begin_backward(in.flag());
      break;
    case 2: {
      const TensorView g = m.gradient(i);
      // Backward rewrites the buffer only once the manager's reads of it are done.
      m.gradient_released(i).wait();
      for (std::size_t k = 0; k < g.numel * dtype_size(g.dtype); ++k)
        static_cast<std::byte*>(g.data)[k] = static_cast<std::byte>(in.byte());
      m.gradient_ready(i);
      break;
    }
    case 3: {
      // A buffer is freed (and replaced) only once gradient_released of its parameter is
      // complete, as the contract allows: ASan then reports any later read by the manager.
      const std::size_t k = i < params.size() ? i : 0;
      const std::size_t numel = params[k].numel + (in.byte() % 8 == 0 ? 1 : 0);
      const DType dt = in.byte() % 8 == 0 ? DType::f16 : params[k].grad_dtype;
      m.gradient_released(k).wait();
      s.caller[k] = std::vector<std::byte>(numel * dtype_size(dt) + 2);
      for (auto& b : s.caller[k]) b = static_cast<std::byte>(in.byte());
      const std::size_t shift = in.byte() % 8 == 0 ? 1 : 0;  // sometimes misaligned
      m.gradient_ready(i, ConstTensorView{s.caller[k].data() + shift, numel, dt});
      break;
    }
    case 4:
      m.finish_backward();
      break;
    case 5:
      m.clip_grad_norm(static_cast<float>(fuzz::special(in)));
      break;
    case 6:
      m.step();
      break;
    case 7:
      (void)m.report();
      break;
    case 8:
      m.set_hyperparameters(i % 3, {fuzz::special(in), fuzz::special(in)});
      break;
    case 9: {
      const std::size_t k = i < params.size() ? i : 0;
      std::vector<float> v(params[k].numel + (in.byte() % 8 == 0 ? 1 : 0));
      for (float& x : v) x = static_cast<float>(fuzz::special(in));
      if (in.flag()) {
        m.load_parameter(i, v);
      } else {
        // Every slot by name (sometimes one short, or one unknown name): f32 values, or
        // an 8-bit parameter's codes and block maxima (sometimes a block short, or values
        // instead).
        const auto& names = m.state_slot_names();
        const bool q8 = i < params.size() && m.q8_parameter(i) && in.byte() % 8 != 0;
        std::vector<std::vector<float>> values(names.size(), std::vector<float>(q8 ? 0 : v.size()));
        std::vector<std::vector<std::uint8_t>> codes(names.size(),
                                                     std::vector<std::uint8_t>(q8 ? v.size() : 0));
        std::vector<std::vector<float>> maxima(names.size());
        std::vector<SlotIn> state;
        for (std::size_t k = 0; k < names.size(); ++k) {
          for (float& x : values[k]) x = static_cast<float>(fuzz::special(in));
          for (std::uint8_t& c : codes[k]) c = in.byte();
          if (q8) {
            maxima[k].resize(q8_blocks(v.size()) - (in.byte() % 16 == 0 && !v.empty() ? 1 : 0));
            for (float& x : maxima[k]) x = static_cast<float>(fuzz::special(in));
          }
          state.push_back({names[k], values[k], codes[k], maxima[k]});
        }
        const std::uint8_t how = in.byte();
        if (how % 16 == 0 && !state.empty()) state.pop_back();
        if (how % 16 == 1) state.push_back({"unknown", v});
        m.import_parameter(i, v, state, static_cast<float>(fuzz::special(in)));
      }
      break;
    }
    case 10:
      m.synchronize();
      break;
    default:
      (void)m.step_count(i);
      break;
  }
}

// Traps unless the twin's state and report equal the primary's (whose state is `state`).
void expect_twin(const Snapshot& state, Side& primary, Side& twin) {
  const std::optional<Snapshot> t = snapshot(*twin.m);
  if (!t || *t != state) __builtin_trap();  // overlap changed a bit of the state
  if (report_bits(*primary.m) != report_bits(*twin.m)) __builtin_trap();  // or of the report
}

}  // namespace

// LLVM's libomp keeps an idle team spinning for 200 ms after each parallel region; with a
// new manager (and its engine's team) per input, those spins took a quarter of the
// harness's time from the fuzzer's own thread. 0: idle workers sleep at once. An
// explicit setting in the environment wins.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("KMP_BLOCKTIME", "0", 0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Input in(data, size);
  static const std::unique_ptr<device::Device> dev =
      device::make_host_device(32, device::HostDeviceMemory::any_host_memory);
  static const std::size_t sizes[] = {0, 1, 7, 33, 100, 257};

  ManagerConfig c;
  // The first byte's base-3 digits: the mode, the speculation policy, the budget (all
  // chunks, none, or a few small chunks' bytes), then its bits: the small budget's size,
  // lazy GPU scaling and (full offload) device staging. (The twin never speculates: only the
  // primary's overlap differs.)
  const std::uint8_t mode = in.byte();
  c.mode = static_cast<OffloadMode>(mode % 3);
  static const Speculation policies[] = {Speculation::automatic, Speculation::always,
                                         Speculation::never};
  c.speculation = policies[mode / 3 % 3];
  const std::int64_t budgets[] = {ManagerConfig::kAllChunks, 0, mode / 27 % 2 ? 2048 : 512};
  c.speculation_bytes = budgets[mode / 9 % 3];
  c.lazy_gpu_scale = mode / 54 % 2 != 0;
  // Full offload: device staging of speculated compute weights, all or a few chunks'.
  if (c.mode == OffloadMode::full && mode / 108 % 2 != 0)
    c.speculation_device_bytes = mode / 27 % 2 ? ManagerConfig::kAllChunks : 256;
  // One byte picks the optimizer unit (its fields are decoded once the groups exist),
  // one the groups and the betas.
  const std::uint8_t unit = in.byte();
  const std::uint8_t shape = in.byte();
  const Betas betas = decode_betas(shape);
  const int groups = 1 + shape % 2;
  for (int g = 0; g < groups && groups > 1; ++g) c.groups.push_back({"g" + std::to_string(g)});
  const int n = 1 + in.byte() % 3;
  for (int i = 0; i < n; ++i) {
    ParamSpec p;
    p.name = "p" + std::to_string(i);
    p.numel = sizes[in.byte() % (sizeof sizes / sizeof sizes[0])];
    p.grad_dtype = in.flag() ? DType::f32 : DType::bf16;
    p.has_compute_weights = in.flag();
    p.gradient_buffer = in.byte() % 4 != 0;
    p.group = static_cast<std::size_t>(in.byte()) % static_cast<std::size_t>(groups);
    c.params.push_back(p);
  }
  c.chunk_elements = 1 + in.byte() % 300;
  // Full offload's rings (every mode validates them): the default, 1-3 slots, or a refused
  // count (0, more than the model fills); slots of 1-148 elements (rounded up to 64: a
  // parameter of 257 elements moves in pieces) or the default.
  const std::uint8_t ring = in.byte();
  static const std::int64_t ring_slots[] = {ManagerConfig::kDefaultRing, 1, 2, 3, 0, 1000};
  c.ring_slots = ring_slots[ring % 6];
  if (ring / 6 % 2 != 0) c.ring_slot_elements = ring / 12 % 4 == 0 ? 0 : 1 + ring / 12 * 7;
  // Every mode steps every optimizer (its state slots named as its unit names them).
  Bits bits(in);
  c.optimizer = decode_config(unit, bits, betas, c.groups);
  // The ring byte's high bits: 8-bit state for an optimizer with it, in any mode (the
  // other optimizers' refusal is a unit test's), from parameters of 0, 7 or 100 elements
  // up. Full offload's rings then hold whole blocks.
  if (ring / 48 % 2 != 0 && optimizer_table()[c.optimizer.index()].q8) {
    static const std::size_t mins[] = {0, 7, 100};
    c.q8_state = true;
    c.min_8bit_size = mins[ring / 96 % 3];
  }
  c.device = dev.get();
  c.engine.threads = 1 + in.byte() % 2;
  Side primary, twin;
  try {
    primary.m = make_gradient_manager(c);
  } catch (const Error&) {
    return 0;  // a refused configuration
  }
  twin.m = make_gradient_manager(c);  // accepted once: accepted again
  primary.caller.resize(c.params.size());
  twin.caller.resize(c.params.size());
  // The primary's state before each call. Reading it synchronises the device, so it is
  // read again only when a call may have changed it: after a call that succeeded and is
  // not a pure read (report, synchronize, step_count), or one that failed other than by
  // validation. The twin is read (and compared) then too, when a call both accepted since
  // the last comparison may have changed it.
  std::optional<Snapshot> before;
  bool before_is_now = false, comparing = true, twin_changed = false;
  for (int step = 0; step < 32 && !in.empty(); ++step) {
    if (!before_is_now) {
      before = snapshot(*primary.m);
      before_is_now = before.has_value();
      if (before && comparing && twin_changed) {
        expect_twin(*before, primary, twin);
        twin_changed = false;
      }
    }
    const std::size_t i = in.byte() % (c.params.size() + 1);  // sometimes out of range
    const int op = in.byte() % 12;
    const bool pure_read = op == 7 || op == 10 || op == 11;
    const std::size_t args = in.position();
    bool accepted = false;
    try {
      call(primary, op, i, in, /*serial=*/false);
      accepted = true;
      if (!pure_read) before_is_now = false;
    } catch (const Error& e) {
      if (validation(e.code()) && before) {
        const std::optional<Snapshot> after = snapshot(*primary.m);
        if (after && *before != *after) __builtin_trap();  // refused but changed
      } else {
        before_is_now = false;
      }
      if (!validation(e.code())) comparing = false;  // the primary is failed
    }
    if (accepted && comparing) {
      fuzz::Input replay(data + args, in.position() - args);  // the same arguments
      try {
        call(twin, op, i, replay, /*serial=*/true);
      } catch (const Error&) {
        __builtin_trap();  // the serial twin refused what the overlapped primary accepted
      }
      if (!pure_read) twin_changed = true;
    }
  }
  if (comparing && twin_changed) {
    if (const std::optional<Snapshot> last = snapshot(*primary.m))
      expect_twin(*last, primary, twin);
  }
  for (Side* s : {&primary, &twin}) {
    try {
      s->m->close();
    } catch (const Error&) {
    }
    s->m.reset();  // before the caller's buffers: a failed close may have left reads queued
  }
  return 0;
}
