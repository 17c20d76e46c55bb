// libFuzzer harness: a gradient manager as a state machine. Each input builds a manager
// on the host device (mode none, optimizer or full; AdamW or SignSGD; 1-3 parameters of
// fuzzed sizes, gradient dtypes and buffers; 1-2 groups; AdamW's betas) and drives it
// through up to 32 calls with fuzzed arguments in any order. Every call succeeds or throws
// stepcore::Error; it never crashes, hangs or corrupts memory (ASan, UBSan); and after an
// Error from validation (a bad argument or call sequence) the parameters' state is what
// it was.
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fuzz/fuzz_input.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

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

using Snapshot = std::vector<std::vector<float>>;

// Every parameter's master and moments and step counter, or nullopt when the manager
// cannot be read now (mid-step, or failed).
std::optional<Snapshot> snapshot(GradientManager& m) {
  Snapshot s;
  try {
    const auto& params = m.config().params;
    const bool adamw = m.config().optimizer.kind == OptimizerKind::adamw;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::size_t n = params[i].numel;
      std::vector<float> master(n), m1(adamw ? n : 0), m2(adamw ? n : 0);
      m.read_parameter(i, master, m1, m2, {});
      s.push_back(std::move(master));
      s.push_back(std::move(m1));
      s.push_back(std::move(m2));
      s.push_back({m.step_count(i)});
    }
  } catch (const Error&) {
    return std::nullopt;
  }
  return s;
}

bool same(const Snapshot& a, const Snapshot& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t k = 0; k < a.size(); ++k)
    if (a[k].size() != b[k].size() ||
        (!a[k].empty() && std::memcmp(a[k].data(), b[k].data(), a[k].size() * sizeof(float)) != 0))
      return false;
  return true;
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
  c.mode = static_cast<OffloadMode>(in.byte() % 3);
  c.optimizer.kind = in.flag() ? OptimizerKind::adamw : OptimizerKind::sign_sgd;
  // One byte picks the groups and AdamW's betas. The betas vary because a GPU-mode
  // AdamW manager's bias table has an entry per step until 1 - beta^t rounds to 1:
  // 37,000 pow calls for beta2 = 0.999 (the default; one input in 32 here), which would
  // otherwise be most of an input's time. A NaN beta2 is a refused configuration.
  const std::uint8_t shape = in.byte();
  static const double beta1s[] = {0.9, 0.0, 0.5, 0.8};
  static const double beta2s[] = {0.95, 0.98, 0.9, 0.5, 0.0, 0.7, 0.8, __builtin_nan("")};
  const double beta1 = beta1s[(shape >> 4) % 4];
  const double beta2 = (shape & 0xCE) == 0xC0 ? 0.999 : beta2s[(shape >> 1) % 8];
  c.optimizer.adamw.beta1 = beta1;
  c.optimizer.adamw.beta2 = beta2;
  const int groups = 1 + shape % 2;
  for (int g = 0; g < groups && groups > 1; ++g) {
    ParamGroup group{"g" + std::to_string(g)};
    group.beta1 = beta1;
    group.beta2 = beta2;
    c.groups.push_back(group);
  }
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
  c.device = dev.get();
  c.engine.threads = 1 + in.byte() % 2;
  std::unique_ptr<GradientManager> m;
  try {
    m = make_gradient_manager(c);
  } catch (const Error&) {
    return 0;  // a refused configuration
  }
  // The caller's gradient buffers, one per parameter. A buffer is freed (and replaced)
  // only once gradient_released of its parameter is complete, as the contract allows:
  // ASan then reports any read by the manager after that event.
  std::vector<std::vector<std::byte>> caller(c.params.size());
  // The state before each call. Reading it synchronises the device, so it is read again
  // only when a call may have changed it: after a call that succeeded and is not a pure
  // read (report, synchronize, step_count), or one that failed other than by validation.
  std::optional<Snapshot> before;
  bool before_is_now = false;
  for (int call = 0; call < 32 && !in.empty(); ++call) {
    if (!before_is_now) before = snapshot(*m);
    before_is_now = before.has_value();
    const std::size_t i = in.byte() % (c.params.size() + 1);  // sometimes out of range
    const int op = in.byte() % 12;
    const bool pure_read = op == 7 || op == 10 || op == 11;
    try {
      switch (op) {
        case 0:
          m->begin_step(static_cast<float>(fuzz::special(in)), in.flag());
          break;
        case 1:
          m->begin_backward(in.flag());
          break;
        case 2: {
          const TensorView g = m->gradient(i);
          for (std::size_t k = 0; k < g.numel * dtype_size(g.dtype); ++k)
            static_cast<std::byte*>(g.data)[k] = static_cast<std::byte>(in.byte());
          m->gradient_ready(i);
          break;
        }
        case 3: {
          const std::size_t k = i < c.params.size() ? i : 0;
          const std::size_t numel = c.params[k].numel + (in.byte() % 8 == 0 ? 1 : 0);
          const DType dt = in.byte() % 8 == 0 ? DType::f16 : c.params[k].grad_dtype;
          m->gradient_released(k).wait();
          caller[k] = std::vector<std::byte>(numel * dtype_size(dt) + 2);
          for (auto& b : caller[k]) b = static_cast<std::byte>(in.byte());
          const std::size_t shift = in.byte() % 8 == 0 ? 1 : 0;  // sometimes misaligned
          m->gradient_ready(i, ConstTensorView{caller[k].data() + shift, numel, dt});
          break;
        }
        case 4:
          m->finish_backward();
          break;
        case 5:
          m->clip_grad_norm(static_cast<float>(fuzz::special(in)));
          break;
        case 6:
          m->step();
          break;
        case 7:
          (void)m->report();
          break;
        case 8:
          m->set_hyperparameters(i % 3, {fuzz::special(in), fuzz::special(in)});
          break;
        case 9: {
          const std::size_t k = i < c.params.size() ? i : 0;
          std::vector<float> v(c.params[k].numel + (in.byte() % 8 == 0 ? 1 : 0));
          for (float& x : v) x = static_cast<float>(fuzz::special(in));
          if (in.flag()) {
            m->load_parameter(i, v);
          } else {
            std::vector<float> m1(v.size()), m2(v.size());
            for (float& x : m2) x = static_cast<float>(fuzz::special(in));
            m->import_parameter(i, v, m1, m2, static_cast<float>(fuzz::special(in)));
          }
          break;
        }
        case 10:
          m->synchronize();
          break;
        default:
          (void)m->step_count(i);
          break;
      }
      if (!pure_read) before_is_now = false;
    } catch (const Error& e) {
      if (validation(e.code()) && before) {
        const std::optional<Snapshot> after = snapshot(*m);
        if (after && !same(*before, *after)) __builtin_trap();  // refused but changed
      } else {
        before_is_now = false;
      }
    }
  }
  try {
    m->close();
  } catch (const Error&) {
  }
  m.reset();  // before the caller's buffers: a failed close may have left reads queued
  return 0;
}
