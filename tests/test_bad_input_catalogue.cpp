// Unit: the bad-input catalogue. One table of bad (and borderline good) arguments runs
// through every entry point family that takes the argument: the reference, the CPU
// engine, the host device, the gpu:: launchers (CUDA builds), the plans and executor
// (gpu::make_*_plan, gpu::emulate::), the communicators' norm and the gradient managers.
// Each row has one outcome (docs/numerics.md section 9): the same Errc and the same
// argument name from every entry point, and every buffer of the call byte for byte
// unchanged; or, for a value the rules accept (FLT_MAX where finite values are fine, a
// zero where zero is in range), acceptance everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/optimizers/all.hpp"
#include "kernels/plans.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"

namespace {

using namespace stepcore;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr std::size_t kN = 40;                       // elements of every tensor
constexpr std::size_t kHuge = std::size_t{1} << 61;  // beyond the 2^60 element limit
const DType kBadDType = static_cast<DType>(7);

// ---- The arguments of one call, in a family's memory ----------------------------------

/// Everything any entry point of the catalogue takes. Optimizer tensors, accumulate pairs
/// and the gradient list hold two entries each; [0] is the one rows spoil.
struct Args {
  AdamWConfig adamw;
  SignSgdConfig sgd;
  GradientRead read;
  float scale = 0.5f;
  float max_norm = 1.0f;
  std::vector<OptimizerTensor> adamw_t;  ///< AdamW: state[0] exp_avg, state[1] exp_avg_sq
  std::vector<OptimizerTensor> sgd_t;    ///< SignSGD: the param only
  std::vector<AccumulatePair> pairs;
  std::vector<TensorView> grads;  ///< scaled in place, or read by the norms
  // Outputs and device-memory inputs of the device-style entry points.
  NormPartial* partial = nullptr;
  NormResult* result = nullptr;
  float* clip_out = nullptr;
  std::int32_t* found_inf = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  float* d_scale = nullptr;
  float* d_clip = nullptr;
  const double* bias_table = nullptr;

  std::vector<ConstTensorView> read_only() const { return {grads.begin(), grads.end()}; }
  /// The device inputs of an AdamW step (SignSGD needs none).
  OptimizerDeviceArgs adamw_device() const {
    return OptimizerDeviceArgs{d_scale, d_clip, nullptr, nullptr, bias_table};
  }
};

/// Which parts of Args an entry point takes from the host (and validates there): a row
/// runs through an entry point when it spoils a part the entry point takes.
enum Part : unsigned {
  kReadScale = 1u << 0,
  kReadClip = 1u << 1,
  kScale = 1u << 2,
  kMaxNorm = 1u << 3,
  kAdamWConfig = 1u << 4,
  kSgdConfig = 1u << 5,
  kAdamWLists = 1u << 6,
  kStepValues = 1u << 7,  ///< the counters' values (host memory; devices never read them)
  kSgdLists = 1u << 8,
  kPairs = 1u << 9,
  kGrads = 1u << 10,
  kStepHyper = 1u << 11,  ///< lr and weight decay alone (a manager's set_hyperparameters)
};
constexpr unsigned kRead = kReadScale | kReadClip;

/// What an entry point does, for rows whose outcome depends on it. The optimizer steps of
/// the devices, launchers and plans take f32 params only (kOpAdamW, kOpSignSgd); the
/// reference and the CPU engine take them in the model's dtype too (kOpModelAdamW,
/// kOpModelSignSgd; docs/numerics.md 7.3).
enum Op : unsigned {
  kOpAdamW = 1u << 0,
  kOpSignSgd = 1u << 1,
  kOpAccumulate = 1u << 2,
  kOpInPlace = 1u << 3,   ///< scales the gradient list in place
  kOpReadOnly = 1u << 4,  ///< reads the gradient list (norms)
  kOpFinalize = 1u << 5,  ///< takes max_norm
  kOpBeginStep = 1u << 6,
  kOpModelAdamW = 1u << 7,
  kOpTable = 1u << 8,  ///< builds an optimizer's device table (no tensors)
  kOpModelSignSgd = 1u << 9,
  kOpAll = ~0u,
};

/// Carves aligned pieces out of one block of memory (a family's host or device memory).
class Arena {
 public:
  Arena(std::byte* base, std::size_t size) : base_(base), size_(size) {}
  template <class T>
  T* take(std::size_t n) {
    used_ = (used_ + 255) & ~std::size_t{255};
    T* p = reinterpret_cast<T*>(base_ + used_);
    used_ += n * sizeof(T) + 256;  // a gap: separate pieces never touch
    if (used_ > size_) throw std::runtime_error("catalogue arena too small");
    return p;
  }

 private:
  std::byte* base_;
  std::size_t size_;
  std::size_t used_ = 0;
};

const std::vector<double>& default_bias_table() {
  static const std::vector<double> table = gpu::make_optimizer_table(AdamWConfig{});
  return table;
}

std::size_t arena_bytes() { return (std::size_t{64} << 10) + default_bias_table().size() * 8; }

/// Fills `size` bytes at `base` with the same small positive values every time (no NaN,
/// no Inf) and lays the valid arguments of every entry point out in them.
Args lay_out(std::byte* base, std::size_t size) {
  static const std::vector<std::byte> pattern = [] {
    std::vector<std::byte> p(arena_bytes());
    std::mt19937 rng(7);
    for (std::byte& b : p) b = static_cast<std::byte>(rng() & 0x3F);
    return p;
  }();
  std::memcpy(base, pattern.data(), std::min(size, pattern.size()));
  Arena c(base, size);
  Args a;
  for (int t = 0; t < 2; ++t) {
    const DType g = t == 0 ? DType::bf16 : DType::f32;
    OptimizerTensor w;
    w.param = {c.take<float>(kN), kN, DType::f32};
    w.state[0] = {c.take<float>(kN), kN, DType::f32};
    w.state[1] = {c.take<float>(kN), kN, DType::f32};
    w.step = c.take<float>(1);
    *w.step = 3.0f;
    w.grad = {c.take<float>(kN), kN, g};
    w.compute_param = {c.take<float>(kN), kN, DType::bf16};
    a.adamw_t.push_back(w);
    OptimizerTensor s;
    s.param = {c.take<float>(kN), kN, DType::f32};
    s.grad = {c.take<float>(kN), kN, g};
    s.compute_param = {c.take<float>(kN), kN, DType::bf16};
    a.sgd_t.push_back(s);
    a.pairs.push_back({{c.take<float>(kN), kN, DType::f32}, {c.take<float>(kN), kN, g}, t == 1});
    a.grads.push_back({c.take<float>(kN), kN, g});
  }
  a.partial = c.take<NormPartial>(1);
  a.result = c.take<NormResult>(1);
  a.clip_out = c.take<float>(1);
  a.found_inf = c.take<std::int32_t>(1);
  *a.found_inf = 0;
  a.workspace_bytes = gpu::scale_and_norm_workspace_bytes(a.grads);
  a.workspace = c.take<std::byte>(a.workspace_bytes);
  a.d_scale = c.take<float>(1);
  a.d_clip = c.take<float>(1);
  *a.d_scale = *a.d_clip = 1.0f;
  const std::vector<double>& bias = default_bias_table();
  double* table = c.take<double>(bias.size());
  std::memcpy(table, bias.data(), bias.size() * sizeof(double));
  a.bias_table = table;
  return a;
}

// ---- Families ---------------------------------------------------------------------------

/// One entry point: what it takes, what it does, and how to call it with Args.
struct Entry {
  std::string label;
  unsigned parts;
  Op op;
  std::function<void(Args&)> call;
  /// The entry point's own name for an argument where its API names it differently
  /// ({"read.scale", "gradient_scale"}: a manager's begin_step; a first part ending in '.'
  /// renames a prefix: {"config.", "hyper."}); empty otherwise.
  std::pair<std::string, std::string> rename = {};
  /// Brings the family into the state the call needs (before the snapshot).
  std::function<void()> prepare = {};
};

class Family {
 public:
  virtual ~Family() = default;
  /// Returns the valid arguments, freshly laid out (every row starts from the same bytes).
  virtual Args fresh() = 0;
  /// Returns every byte a call of this family could write.
  virtual std::vector<std::byte> snapshot() = 0;
  /// Surfaces errors of work the call queued.
  virtual void settle() {}

  std::string name;
  std::vector<Entry> entries;
  /// True for the gpu:: launchers given host memory: a call that passes validation is then
  /// refused by the device-memory check that follows it (Errc::invalid_argument naming a
  /// pointer), so acceptance shows as that refusal.
  bool memory_refused = false;
};

/// A family whose memory is one host block (the reference, the engine, the executor, the
/// launchers' host-side checks, the communicators).
class HostMemoryFamily : public Family {
 public:
  HostMemoryFamily() : mem_(arena_bytes()) {}
  Args fresh() override { return lay_out(mem_.data(), mem_.size()); }
  std::vector<std::byte> snapshot() override { return mem_; }

 private:
  std::vector<std::byte> mem_;
};

std::unique_ptr<Family> reference_family() {
  auto f = std::make_unique<HostMemoryFamily>();
  f->name = "reference";
  f->entries = {
      {"reference::adamw_step", kAdamWConfig | kAdamWLists | kStepValues | kRead, kOpModelAdamW,
       [](Args& a) { reference::adamw_step(a.adamw_t, a.adamw, a.read); }},
      {"reference::sign_sgd_step", kSgdConfig | kSgdLists | kRead, kOpModelSignSgd,
       [](Args& a) { reference::sign_sgd_step(a.sgd_t, a.sgd, a.read); }},
      {"reference::accumulate", kPairs, kOpAccumulate,
       [](Args& a) { reference::accumulate(a.pairs); }},
      {"reference::scale_", kScale | kGrads, kOpInPlace,
       [](Args& a) { reference::scale_(a.grads, a.scale); }},
      {"reference::norm_partial", kRead | kGrads, kOpReadOnly,
       [](Args& a) { *a.partial = reference::norm_partial(a.read_only(), a.read); }},
  };
  return f;
}

std::unique_ptr<Family> engine_family() {
  auto f = std::make_unique<HostMemoryFamily>();
  auto engine = std::make_shared<cpu::Engine>();
  f->name = "cpu::Engine (" + std::string(engine->isa_name()) + ")";
  f->entries = {
      {"Engine::step (AdamW)", kAdamWConfig | kAdamWLists | kStepValues | kRead, kOpModelAdamW,
       [engine](Args& a) { engine->step(a.adamw_t, a.adamw, a.read); }},
      {"Engine::step (SignSGD)", kSgdConfig | kSgdLists | kRead, kOpModelSignSgd,
       [engine](Args& a) { engine->step(a.sgd_t, a.sgd, a.read); }},
      {"Engine::accumulate", kPairs, kOpAccumulate,
       [engine](Args& a) { engine->accumulate(a.pairs); }},
      {"Engine::scale_", kScale | kGrads, kOpInPlace,
       [engine](Args& a) { engine->scale_(a.grads, a.scale); }},
      {"Engine::norm_partial", kRead | kGrads, kOpReadOnly,
       [engine](Args& a) { *a.partial = engine->norm_partial(a.read_only(), a.read); }},
      {"Engine::norm", kRead | kGrads, kOpReadOnly,
       [engine](Args& a) { *a.result = engine->norm(a.read_only(), a.read); }},
  };
  return f;
}

/// The entry points of device.hpp's kernels, shared by the host device and the gpu::
/// launchers (same arguments): `k` holds the device-specific calls.
struct DeviceKernels {
  std::function<void(Args&)> accumulate, scale_and_norm, norm, exact_norm, finalize, finalize_exact,
      adamw, sign_sgd;
};
std::vector<Entry> device_entries(const std::string& prefix, const DeviceKernels& k) {
  return {
      {prefix + "accumulate", kPairs, kOpAccumulate, k.accumulate},
      {prefix + "scale_and_norm_partial", kScale | kGrads, kOpInPlace, k.scale_and_norm},
      {prefix + "norm_partial", kRead | kGrads, kOpReadOnly, k.norm},
      {prefix + "exact_norm_partial_if_needed", kRead | kGrads, kOpReadOnly, k.exact_norm},
      {prefix + "finalize_and_clip", kMaxNorm, kOpFinalize, k.finalize},
      {prefix + "finalize_exact_and_clip", kMaxNorm, kOpFinalize, k.finalize_exact},
      // Device steps read the scale, clip and step counters from device memory.
      {prefix + "optimizer_step (AdamW)", kAdamWConfig | kAdamWLists, kOpAdamW, k.adamw},
      {prefix + "optimizer_step (SignSGD)", kSgdConfig | kSgdLists, kOpSignSgd, k.sign_sgd},
  };
}

/// The host device: its "device memory" (one allocate()) is host memory, so the snapshot
/// reads it directly.
class HostDeviceFamily : public Family {
 public:
  HostDeviceFamily() : dev_(device::make_host_device()), size_(arena_bytes()) {
    base_ = static_cast<std::byte*>(dev_->allocate(size_));
    name = "host device";
    device::Device* d = dev_.get();
    entries = device_entries(
        "Device::",
        {[d](Args& a) { d->accumulate(a.pairs); },
         [d](Args& a) {
           d->scale_and_norm_partial(a.grads, a.scale, a.partial, a.workspace, a.workspace_bytes);
         },
         [d](Args& a) {
           d->norm_partial(a.read_only(), a.read, a.partial, a.workspace, a.workspace_bytes);
         },
         [d](Args& a) {
           d->exact_norm_partial_if_needed(a.read_only(), a.read, a.found_inf, a.partial,
                                           a.workspace, a.workspace_bytes);
         },
         [d](Args& a) {
           d->finalize_and_clip(a.partial, a.max_norm, a.result, a.clip_out, a.found_inf);
         },
         [d](Args& a) {
           d->finalize_exact_and_clip(a.partial, a.max_norm, a.result, a.clip_out, a.found_inf);
         },
         [d](Args& a) { d->optimizer_step(a.adamw_t, a.adamw, a.adamw_device()); },
         [d](Args& a) { d->optimizer_step(a.sgd_t, a.sgd, OptimizerDeviceArgs{}); }});
  }
  ~HostDeviceFamily() override { dev_->deallocate(base_); }
  Args fresh() override {
    dev_->synchronize();
    return lay_out(base_, size_);
  }
  std::vector<std::byte> snapshot() override {
    dev_->synchronize();
    return {base_, base_ + size_};
  }
  void settle() override { dev_->synchronize(); }

 private:
  std::unique_ptr<device::Device> dev_;
  std::size_t size_;
  std::byte* base_ = nullptr;
};

/// The CUDA launchers, given host memory: they validate every host-side argument before
/// asking the runtime about a pointer (with or without a GPU), then refuse host memory.
std::unique_ptr<Family> launcher_family() {
  auto f = std::make_unique<HostMemoryFamily>();
  f->name = "gpu:: launchers";
  f->memory_refused = true;
  f->entries = device_entries(
      "gpu::",
      {[](Args& a) { gpu::accumulate(a.pairs, nullptr); },
       [](Args& a) {
         gpu::scale_and_norm_partial(a.grads, a.scale, a.partial, a.workspace, a.workspace_bytes,
                                     nullptr);
       },
       [](Args& a) {
         gpu::norm_partial(a.read_only(), a.read, a.partial, a.workspace, a.workspace_bytes,
                           nullptr);
       },
       [](Args& a) {
         gpu::exact_norm_partial_if_needed(a.read_only(), a.read, a.found_inf, a.partial,
                                           a.workspace, a.workspace_bytes, nullptr);
       },
       [](Args& a) {
         gpu::finalize_and_clip(a.partial, a.max_norm, a.result, a.clip_out, a.found_inf, nullptr);
       },
       [](Args& a) {
         gpu::finalize_exact_and_clip(a.partial, a.max_norm, a.result, a.clip_out, a.found_inf,
                                      nullptr);
       },
       [](Args& a) { gpu::optimizer_step(a.adamw_t, a.adamw, a.adamw_device(), nullptr); },
       [](Args& a) { gpu::optimizer_step(a.sgd_t, a.sgd, OptimizerDeviceArgs{}, nullptr); }});
  f->entries.push_back({"gpu::scale_ (device factor)", kGrads, kOpInPlace,
                        [](Args& a) { gpu::scale_(a.grads, a.d_scale, nullptr); }});
  return f;
}

/// The plans and the CPU executor (gpu.hpp): host memory standing for device memory.
std::unique_ptr<Family> executor_family() {
  auto f = std::make_unique<HostMemoryFamily>();
  f->name = "gpu plans + emulate::";
  namespace em = gpu::emulate;
  f->entries = {
      {"make_optimizer_plan + emulate::optimizer_step (AdamW)", kAdamWConfig | kAdamWLists,
       kOpAdamW,
       [](Args& a) {
         em::optimizer_step(gpu::make_optimizer_plan<::stepcore::detail::AdamW>(a.adamw_t, a.adamw),
                            a.adamw_device());
       }},
      {"make_optimizer_plan + emulate::optimizer_step (SignSGD)", kSgdConfig | kSgdLists,
       kOpSignSgd,
       [](Args& a) {
         em::optimizer_step(gpu::make_optimizer_plan<::stepcore::detail::SignSgd>(a.sgd_t, a.sgd),
                            OptimizerDeviceArgs{});
       }},
      {"make_optimizer_table", kAdamWConfig, kOpTable,
       [](Args& a) { (void)gpu::make_optimizer_table(a.adamw); }},
      {"emulate::scale_and_norm_partial", kScale, kOpInPlace,
       [](Args& a) { *a.partial = em::scale_and_norm_partial(gpu::make_plan(a.grads), a.scale); }},
      {"emulate::scale_",
       kScale,
       kOpInPlace,
       [](Args& a) { em::scale_(gpu::make_plan(a.grads), a.scale); },
       {"scale", "factor"}},
      {"emulate::norm_partial", kRead, kOpReadOnly,
       [](Args& a) { *a.partial = em::norm_partial(gpu::make_plan(a.grads), a.read); }},
      {"emulate::exact_norm_partial_if_needed", kRead, kOpReadOnly,
       [](Args& a) {
         *a.partial = em::exact_norm_partial_if_needed(gpu::make_plan(a.grads), a.read,
                                                       gpu::kFoundInfNeedsExact);
       }},
      {"emulate::finalize_and_clip", kMaxNorm, kOpFinalize,
       [](Args& a) {
         em::finalize_and_clip(*a.partial, a.max_norm, *a.result, *a.clip_out, *a.found_inf);
       }},
      {"emulate::finalize_exact_and_clip", kMaxNorm, kOpFinalize,
       [](Args& a) {
         em::finalize_exact_and_clip(*a.partial, a.max_norm, *a.result, *a.clip_out, *a.found_inf);
       }},
  };
  return f;
}

/// The global norm over a one-rank in-process group: the layout takes the tensors, the
/// engine-backed global_norm the read.
std::unique_ptr<Family> comm_family() {
  auto f = std::make_unique<HostMemoryFamily>();
  f->name = "comm";
  auto comms = std::make_shared<std::vector<std::unique_ptr<comm::Communicator>>>(
      comm::make_in_process_group(1));
  auto engine = std::make_shared<cpu::Engine>();
  const comm::GroupLayout group{"g", 2 * kN, 1, 1};
  f->entries = {
      {"comm::NormLayout::add", kGrads, kOpReadOnly,
       [group](Args& a) {
         comm::NormLayout layout;
         layout.add(group, {}, a.read_only());
       }},
      {"comm::global_norm", kRead, kOpReadOnly,
       [group, comms, engine](Args& a) {
         comm::NormLayout layout;
         layout.add(group, {}, a.read_only());
         *a.result = comm::global_norm(*(*comms)[0], layout, *engine, a.read);
       }},
  };
  return f;
}

/// A gradient manager of one mode on the host device, made afresh for every row.
class ManagerFamily : public Family {
 public:
  explicit ManagerFamily(OffloadMode mode) : dev_(device::make_host_device()) {
    name = "manager (" + std::string(offload_mode_name(mode)) + ")";
    cfg_.mode = mode;
    cfg_.device = dev_.get();
    cfg_.engine.threads = 1;
    cfg_.chunk_elements = kN;
    for (const char* n : {"w", "b"}) {
      ParamSpec p;
      p.name = n;
      p.numel = kN;
      cfg_.params.push_back(p);
    }
    entries = {
        {"GradientManager::begin_step",
         kReadScale,
         kOpBeginStep,
         [this](Args& a) { m_->begin_step(a.read.scale, false); },
         {"read.scale", "gradient_scale"}},
        {"GradientManager::clip_grad_norm",
         kMaxNorm,
         kOpFinalize,
         [this](Args& a) { (void)m_->clip_grad_norm(a.max_norm); },
         {},
         [this] { run_backward(); }},
        {"GradientManager::set_hyperparameters",
         kStepHyper,
         kOpAdamW,
         [this](Args& a) {
           m_->set_hyperparameters(0, {a.adamw.lr, a.adamw.weight_decay});
         },
         {"config.", "hyper."}},
    };
  }
  ~ManagerFamily() override {
    if (m_) m_->close();
  }
  Args fresh() override {
    if (m_) m_->close();
    m_ = make_gradient_manager(cfg_);
    idle_ = true;
    std::vector<float> master(kN);
    for (std::size_t i = 0; i < cfg_.params.size(); ++i) {
      for (std::size_t k = 0; k < kN; ++k) master[k] = 0.01f * static_cast<float>(k + i);
      m_->load_parameter(i, master);
    }
    return Args{};
  }
  /// The scale the manager holds, its compute weights and, between steps, its state.
  std::vector<std::byte> snapshot() override {
    m_->synchronize();
    std::vector<std::byte> s(sizeof(float) + 2 * sizeof(double));
    const float eff = m_->effective_gradient_scale();
    std::memcpy(s.data(), &eff, sizeof eff);
    std::memcpy(s.data() + sizeof eff, &m_->group(0).lr, sizeof(double));
    std::memcpy(s.data() + sizeof eff + sizeof(double), &m_->group(0).weight_decay, sizeof(double));
    for (std::size_t i = 0; i < cfg_.params.size(); ++i) {
      const ConstTensorView w = m_->compute_weights(i);
      const auto* p = static_cast<const std::byte*>(w.data);
      s.insert(s.end(), p, p + w.bytes());
      if (!idle_) continue;
      std::vector<float> master(kN), m1(kN), m2(kN);
      m_->read_parameter(i, master, m1, m2, {});
      for (const auto* v : {&master, &m1, &m2}) {
        const auto* b = reinterpret_cast<const std::byte*>(v->data());
        s.insert(s.end(), b, b + v->size() * sizeof(float));
      }
    }
    return s;
  }
  void settle() override { m_->synchronize(); }

 private:
  // One step up to clip_grad_norm: every gradient written and ready.
  void run_backward() {
    m_->begin_step(1.0f, false);
    idle_ = false;
    m_->begin_backward(true);
    std::vector<std::uint16_t> g(kN, 0x3C00);  // bf16 0.0078125
    for (std::size_t i = 0; i < cfg_.params.size(); ++i) {
      const TensorView v = m_->gradient(i);
      dev_->copy(device::Queue::compute, v.data, g.data(), v.bytes());
      dev_->synchronize();
      m_->gradient_ready(i);
    }
    m_->finish_backward();
  }

  std::unique_ptr<device::Device> dev_;
  ManagerConfig cfg_;
  std::unique_ptr<GradientManager> m_;
  bool idle_ = true;
};

std::vector<std::unique_ptr<Family>> all_families() {
  std::vector<std::unique_ptr<Family>> f;
  f.push_back(reference_family());
  f.push_back(engine_family());
  f.push_back(std::make_unique<HostDeviceFamily>());
  if (cuda::built_with_cuda())
    f.push_back(launcher_family());
  else
    std::printf(
        "note: gpu:: launchers skipped: %s, so they throw Errc::not_supported before any "
        "validation\n",
        cuda::unavailable_reason().c_str());
  f.push_back(executor_family());
  f.push_back(comm_family());
  for (OffloadMode m : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full})
    f.push_back(std::make_unique<ManagerFamily>(m));
  return f;
}

// ---- The catalogue ----------------------------------------------------------------------

using Spoil = void (*)(Args&, double);

/// One bad (or borderline good) input: `spoil` writes `value` into the part(s) `parts`;
/// every entry point taking one of them (and doing one of `ops`) must refuse it with
/// `code` naming `argument`, or accept it when `code` is empty.
struct Row {
  const char* argument;
  unsigned parts;
  Spoil spoil;
  double value;
  std::optional<Errc> code;
  const char* what = "";
  unsigned ops = kOpAll;
};

void read_scale(Args& a, double v) { a.read.scale = static_cast<float>(v); }
void read_clip(Args& a, double v) { a.read.clip = static_cast<float>(v); }
void scale(Args& a, double v) { a.scale = static_cast<float>(v); }
void max_norm(Args& a, double v) { a.max_norm = static_cast<float>(v); }
void lr(Args& a, double v) { a.adamw.lr = a.sgd.lr = v; }
void lr_no_decay(Args& a, double v) {
  lr(a, v);
  a.adamw.weight_decay = a.sgd.weight_decay = 0.0;
}
void weight_decay(Args& a, double v) { a.adamw.weight_decay = a.sgd.weight_decay = v; }
void lr_times_decay(Args& a, double v) {
  lr(a, 0.5);
  weight_decay(a, v);
}
void beta1(Args& a, double v) { a.adamw.beta1 = v; }
void beta1_native(Args& a, double v) {
  a.adamw.formula = AdamWFormula::native;  // the formula that rounds beta1 to f32
  beta1(a, v);
}
void beta2(Args& a, double v) { a.adamw.beta2 = v; }
void eps(Args& a, double v) { a.adamw.eps = v; }
void formula(Args& a, double v) { a.adamw.formula = static_cast<AdamWFormula>(v); }
void tail_width(Args& a, double v) { a.adamw.torch_tail_width = static_cast<int>(v); }
void amsgrad(Args& a, double v) { a.adamw.amsgrad = v != 0.0; }

// Spoils the same field of tensors[0] of both optimizers.
template <class F>
void both_optimizers(Args& a, F f) {
  f(a.adamw_t[0].param, a.adamw_t[0].grad, a.adamw_t[0].compute_param);
  f(a.sgd_t[0].param, a.sgd_t[0].grad, a.sgd_t[0].compute_param);
}
void grad_null(Args& a, double) {
  both_optimizers(a, [](TensorView&, ConstTensorView& g, TensorView&) { g.data = nullptr; });
}
void grad_short(Args& a, double) {
  both_optimizers(a, [](TensorView&, ConstTensorView& g, TensorView&) { g.numel = kN - 1; });
}
void grad_dtype(Args& a, double) {
  both_optimizers(a, [](TensorView&, ConstTensorView& g, TensorView&) { g.dtype = kBadDType; });
}
void param_bf16(Args& a, double) {
  both_optimizers(a, [](TensorView& p, ConstTensorView&, TensorView&) { p.dtype = DType::bf16; });
}
void param_null(Args& a, double) {
  both_optimizers(a, [](TensorView& p, ConstTensorView&, TensorView&) { p.data = nullptr; });
}
void param_huge(Args& a, double) {
  both_optimizers(a, [](TensorView& p, ConstTensorView&, TensorView&) { p.numel = kHuge; });
}
void compute_inside_param(Args& a, double) {
  both_optimizers(a, [](TensorView& p, ConstTensorView&, TensorView& o) {
    o.data = static_cast<std::byte*>(p.data) + 4;  // kN bf16 values end inside the param
  });
}
void compute_long(Args& a, double) {
  both_optimizers(a, [](TensorView&, ConstTensorView&, TensorView& o) { o.numel = kN + 1; });
}
void param_misaligned(Args& a, double) {  // f32 data two bytes off its alignment
  both_optimizers(a, [](TensorView& p, ConstTensorView&, TensorView&) {
    p.data = static_cast<std::byte*>(p.data) + 2;
    p.numel -= 1;
  });
}
void grad_misaligned(Args& a, double) {  // one byte off: misaligned for every dtype
  both_optimizers(a, [](TensorView& p, ConstTensorView& g, TensorView& o) {
    g.data = static_cast<const std::byte*>(g.data) + 1;
    g.numel = p.numel = o.numel = g.numel - 1;
  });
}
// Gives tensors[0] of both optimizers an out-of-place param source: f(param, param_src).
template <class F>
void both_sources(Args& a, F f) {
  f(a.adamw_t[0].param, a.adamw_t[0].param_src);
  f(a.sgd_t[0].param, a.sgd_t[0].param_src);
}
// A separate f32 buffer of kN elements that no optimizer call writes (grads[1]).
const float* spare(const Args& a) { return static_cast<const float*>(a.grads[1].data); }
void src_separate(Args& a, double) {
  both_sources(a, [&](TensorView&, ConstTensorView& s) { s = {spare(a), kN, DType::f32}; });
}
void src_is_param(Args& a, double) {
  both_sources(a, [](TensorView& p, ConstTensorView& s) { s = p; });
}
void src_f16(Args& a, double) {
  both_sources(a, [&](TensorView&, ConstTensorView& s) { s = {spare(a), kN, DType::f16}; });
}
void src_long(Args& a, double) {
  both_sources(a, [&](TensorView&, ConstTensorView& s) { s = {spare(a), kN + 1, DType::f32}; });
}
void src_null_data(Args& a, double) {
  both_sources(a, [](TensorView&, ConstTensorView& s) { s = {nullptr, kN, DType::f32}; });
}
void src_misaligned(Args& a, double) {
  both_sources(a, [&](TensorView&, ConstTensorView& s) {
    s = {reinterpret_cast<const std::byte*>(spare(a)) + 2, kN, DType::f32};
  });
}
void src_inside_param(Args& a, double) {  // starts one element into its own destination
  both_sources(a, [](TensorView& p, ConstTensorView& s) {
    s = {static_cast<const float*>(p.data) + 1, kN, DType::f32};
  });
}
void exp_avg_src_in_other_param(Args& a, double) {  // inside tensors[1].param (written)
  a.adamw_t[0].state_src[0] = {static_cast<const float*>(a.adamw_t[1].param.data) + 1, kN,
                               DType::f32};
}
void exp_avg_sq_src_in_compute(Args& a, double) {  // inside its own compute output
  a.adamw_t[0].state_src[1] = {static_cast<const float*>(a.adamw_t[0].compute_param.data) + 1, kN,
                               DType::f32};
}
void exp_avg_sq_src_bf16(Args& a, double) {
  a.adamw_t[0].state_src[1] = {spare(a), kN, DType::bf16};
}
void exp_avg_short(Args& a, double) { a.adamw_t[0].state[0].numel = kN - 1; }
void exp_avg_sq_f16(Args& a, double) { a.adamw_t[0].state[1].dtype = DType::f16; }
void step_null(Args& a, double) { a.adamw_t[0].step = nullptr; }
void step_inside_exp_avg(Args& a, double) {
  a.adamw_t[0].step = static_cast<float*>(a.adamw_t[0].state[0].data) + 1;
  *a.adamw_t[0].step = 3.0f;  // a valid count: only the overlap is wrong
}
void step_value(Args& a, double v) { *a.adamw_t[0].step = static_cast<float>(v); }
void step_misaligned(Args& a, double) {
  a.adamw_t[0].step = reinterpret_cast<float*>(reinterpret_cast<std::byte*>(a.adamw_t[0].step) + 2);
}
void acc_bf16(Args& a, double) { a.pairs[0].acc.dtype = DType::bf16; }
void acc_null(Args& a, double) { a.pairs[0].acc.data = nullptr; }
void acc_misaligned(Args& a, double) {
  a.pairs[0].acc.data = static_cast<std::byte*>(a.pairs[0].acc.data) + 2;
  a.pairs[0].acc.numel = a.pairs[0].src.numel = kN - 1;
}
void src_null(Args& a, double) { a.pairs[0].src.data = nullptr; }
void src_short(Args& a, double) { a.pairs[0].src.numel = kN - 1; }
void src_dtype(Args& a, double) { a.pairs[0].src.dtype = kBadDType; }
void src_inside_acc(Args& a, double) {
  a.pairs[0].src.data = static_cast<const std::byte*>(a.pairs[0].acc.data) + 4;
}
void grads_dtype(Args& a, double) { a.grads[0].dtype = kBadDType; }
void grads_null(Args& a, double) { a.grads[0].data = nullptr; }
void grads_misaligned(Args& a, double) {
  a.grads[0].data = static_cast<std::byte*>(a.grads[0].data) + 1;
  a.grads[0].numel -= 1;
}
void grads_null_empty(Args& a, double) { a.grads[0] = {nullptr, 0, DType::bf16}; }
void grads_huge(Args& a, double) { a.grads[0].numel = kHuge; }
void grads_overlap(Args& a, double) {
  a.grads[1] = {static_cast<std::byte*>(a.grads[0].data) + 4, 10, DType::bf16};
}

/// A value of a scalar row and its outcome (empty: accepted).
struct Value {
  double value;
  std::optional<Errc> code;
  const char* what = "";
  unsigned ops = kOpAll;
};

/// Appends the rows of a scalar: NaN, +Inf and -Inf (Errc::non_finite for every scalar),
/// then `values`.
void scalar_rows(std::vector<Row>& rows, const char* argument, unsigned parts, Spoil spoil,
                 std::initializer_list<Value> values) {
  for (double v : {kNaN, kInf, -kInf})
    rows.push_back({argument, parts, spoil, v, Errc::non_finite});
  for (const Value& v : values)
    rows.push_back({argument, parts, spoil, v.value, v.code, v.what, v.ops});
}

std::vector<Row> make_catalogue() {
  const double fmax = FLT_MAX;  // finite: accepted wherever large values are in range
  const double tiny = std::numeric_limits<float>::denorm_min();
  const std::optional<Errc> ok;
  const Errc invalid = Errc::invalid_argument, range = Errc::out_of_range;
  constexpr unsigned kOpt = kAdamWConfig | kSgdConfig;
  constexpr unsigned kOptT = kAdamWLists | kSgdLists;
  std::vector<Row> rows;
  scalar_rows(rows, "read.scale", kReadScale, read_scale,
              {{fmax, ok}, {tiny, ok}, {-1.0, invalid}, {0.0, invalid}});
  scalar_rows(rows, "read.clip", kReadClip, read_clip,
              {{fmax, invalid},
               {1.5, invalid},
               {-0.5, invalid},
               {0.0, ok, "", ~unsigned{kOpSignSgd | kOpModelSignSgd}},
               {0.0, invalid, "SignSGD", kOpSignSgd | kOpModelSignSgd}});
  scalar_rows(rows, "scale", kScale, scale, {{fmax, ok}, {0.0, ok}, {-1.0, invalid}});
  scalar_rows(rows, "max_norm", kMaxNorm, max_norm, {{fmax, ok}, {0.0, ok}, {-1.0, invalid}});
  // Hyper-parameters: AdamW and SignSGD alike where both have them.
  scalar_rows(rows, "config.lr", kOpt | kStepHyper, lr, {{-1e-3, invalid}});
  scalar_rows(rows, "config.lr", kOpt | kStepHyper, lr_no_decay,
              {{1e300, range, "f32 overflows"}, {fmax, ok, "weight decay 0"}});
  scalar_rows(rows, "config.weight_decay", kOpt | kStepHyper, weight_decay, {{-0.01, invalid}});
  rows.push_back(
      {"config.weight_decay", kOpt | kStepHyper, lr_times_decay, 2.5, invalid, "lr 0.5"});
  scalar_rows(rows, "config.beta1", kAdamWConfig, beta1,
              {{1.0, invalid}, {-0.1, invalid}, {fmax, invalid}});
  rows.push_back(
      {"config.beta1", kAdamWConfig, beta1_native, 1.0 - 1e-10, range, "native, 1 in f32"});
  scalar_rows(rows, "config.beta2", kAdamWConfig, beta2, {{1.0, invalid}, {0.0, ok}});
  scalar_rows(rows, "config.eps", kAdamWConfig, eps,
              {{0.0, invalid},
               {-1e-8, invalid},
               {1e-50, range, "0 in f32"},
               {1e300, range, "f32 overflows"},
               {fmax, ok}});
  rows.push_back({"config.formula", kAdamWConfig, formula, 7, invalid});
  rows.push_back({"config.torch_tail_width", kAdamWConfig, tail_width, 65, range});
  // amsgrad keeps max_exp_avg_sq in state slot 2 (docs/numerics.md 8a): a step finds that
  // slot missing; a table does not depend on it (test_gpu_units).
  rows.push_back({"tensors[0].max_exp_avg_sq", kAdamWConfig, amsgrad, 1, Errc::size_mismatch,
                  "amsgrad, two slots", kOpAdamW | kOpModelAdamW});
  scalar_rows(rows, "tensors[0].step", kStepValues, step_value,
              {{1.5, range}, {-1.0, range}, {16777216.0, range}, {0.0, ok}});
  // Tensors, grouped by the argument at fault.
  struct Bad {
    Spoil spoil;
    std::optional<Errc> code;
    const char* what;
    unsigned ops = kOpAll;
  };
  struct Group {
    const char* argument;
    unsigned parts;
    std::vector<Bad> bad;
  };
  const Errc null = Errc::null_pointer, size = Errc::size_mismatch, dtype = Errc::unsupported_dtype;
  const Errc misaligned = Errc::invalid_argument;
  const Group groups[] = {
      {"tensors[0].grad",
       kOptT,
       {{grad_null, null, "null data"},
        {grad_short, size, "one element short"},
        {grad_dtype, dtype, "dtype 7"},
        {grad_misaligned, misaligned, "one byte off"}}},
      {"tensors[0].param",
       kOptT,
       {{param_bf16, dtype, "bf16", ~unsigned{kOpModelAdamW | kOpModelSignSgd}},
        {param_null, null, "null data"},
        {param_huge, range, "2^61"},
        {param_misaligned, misaligned, "two bytes off"}}},
      {"tensors[0].compute_param",
       kOptT,
       {{compute_inside_param, Errc::overlap, "in param"},
        {compute_long, size, "too long"},
        // The model's bf16 param takes no compute output (the f32-only steps name the param).
        {param_bf16, invalid, "bf16 param", kOpModelAdamW | kOpModelSignSgd}}},
      {"tensors[0].param_src",
       kOptT,
       {{src_separate, ok, "a separate f32 buffer"},
        {src_is_param, ok, "the param itself"},
        {src_f16, dtype, "f16"},
        {src_long, size, "one element long"},
        {src_null_data, null, "null data"},
        {src_misaligned, misaligned, "two bytes off"},
        {src_inside_param, Errc::overlap, "one element into its param"}}},
      {"tensors[0].exp_avg_src",
       kAdamWLists,
       {{exp_avg_src_in_other_param, Errc::overlap, "in tensors[1].param"}}},
      {"tensors[0].exp_avg_sq_src",
       kAdamWLists,
       {{exp_avg_sq_src_bf16, dtype, "bf16"},
        {exp_avg_sq_src_in_compute, Errc::overlap, "in its compute_param"}}},
      {"tensors[0].exp_avg", kAdamWLists, {{exp_avg_short, size, "one element short"}}},
      {"tensors[0].exp_avg_sq", kAdamWLists, {{exp_avg_sq_f16, dtype, "f16"}}},
      {"tensors[0].step",
       kAdamWLists,
       {{step_null, null, "null counter"},
        {step_inside_exp_avg, Errc::overlap, "in exp_avg"},
        {step_misaligned, misaligned, "two bytes off"}}},
      {"pairs[0].acc",
       kPairs,
       {{acc_bf16, dtype, "bf16"},
        {acc_null, null, "null data"},
        {acc_misaligned, misaligned, "two bytes off"}}},
      {"pairs[0].src",
       kPairs,
       {{src_null, null, "null data"},
        {src_short, size, "one element short"},
        {src_dtype, dtype, "dtype 7"},
        {src_inside_acc, Errc::overlap, "in acc"}}},
      {"tensors[0]",
       kGrads,
       {{grads_dtype, dtype, "dtype 7"},
        {grads_null, null, "null data"},
        {grads_null_empty, ok, "null and empty"},
        {grads_misaligned, misaligned, "one byte off"},
        {grads_huge, range, "2^61 elements"}}},
      {"tensors[1]",
       kGrads,
       {{grads_overlap, Errc::overlap, "inside tensors[0]", kOpInPlace},
        {grads_overlap, ok, "inside tensors[0], read only", kOpReadOnly}}},
  };
  for (const Group& g : groups)
    for (const Bad& b : g.bad)
      rows.push_back({g.argument, g.parts, b.spoil, 0, b.code, b.what, b.ops});
  return rows;
}

const std::vector<Row>& catalogue() {
  static const std::vector<Row> rows = make_catalogue();
  return rows;
}

std::string row_label(const Row& r) {
  std::string s = r.argument;
  if (r.parts & (kRead | kScale | kMaxNorm | kAdamWConfig | kSgdConfig | kStepValues)) {
    char buf[48];
    std::snprintf(buf, sizeof buf, " = %.9g", r.value);
    s += buf;
  }
  if (*r.what) s += std::string(" (") + r.what + ")";
  return s + (r.code ? std::string(": ") + std::string(errc_name(*r.code)) : ": accepted");
}

std::string first_difference(const std::vector<std::byte>& a, const std::vector<std::byte>& b) {
  if (a.size() != b.size()) return "snapshot sizes differ";
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return "first changed byte at offset " + std::to_string(i);
  return "";
}

// Runs `row` through entry point `e` of family `f` and checks its one outcome.
void run(Family& f, const Entry& e, const Row& row) {
  Args args = f.fresh();
  if (e.prepare) e.prepare();
  row.spoil(args, row.value);
  const std::vector<std::byte> before = f.snapshot();
  std::string name = row.argument;
  if (!e.rename.first.empty() && e.rename.first.back() == '.' && name.rfind(e.rename.first, 0) == 0)
    name = e.rename.second + name.substr(e.rename.first.size());
  else if (!e.rename.first.empty() && name == e.rename.first)
    name = e.rename.second;
  std::optional<Error> got;
  try {
    e.call(args);
    f.settle();
  } catch (const Error& err) {
    got = err;
  }
  if (row.code) {
    if (!got) {
      ADD_FAILURE() << "accepted; expected " << errc_name(*row.code) << " naming " << name;
      return;
    }
    EXPECT_EQ(errc_name(got->code()), errc_name(*row.code)) << got->what();
    EXPECT_EQ(got->argument(), name) << got->what();
    EXPECT_EQ(first_difference(before, f.snapshot()), "") << "a buffer changed on an error";
  } else if (f.memory_refused) {
    // Past validation, the launcher asks the runtime about a pointer: host memory.
    if (!got) {
      ADD_FAILURE() << "a launcher accepted host memory";
      return;
    }
    EXPECT_EQ(got->code(), Errc::invalid_argument) << got->what();
    EXPECT_NE(got->argument(), name) << "refused the value itself: " << got->what();
    EXPECT_EQ(first_difference(before, f.snapshot()), "");
  } else {
    EXPECT_FALSE(got.has_value()) << "refused: " << got->what();
  }
}

TEST(BadInputCatalogue, OneCodeAndOneNameFromEveryEntryPoint) {
  const std::vector<std::unique_ptr<Family>> families = all_families();
  std::size_t entries = 0, calls = 0;
  for (const auto& f : families) entries += f->entries.size();
  for (const Row& row : catalogue()) {
    std::size_t takers = 0;
    std::vector<const Family*> seen;
    for (const auto& f : families)
      for (const Entry& e : f->entries) {
        if ((row.parts & e.parts) == 0 || (row.ops & e.op) == 0) continue;
        SCOPED_TRACE(row_label(row) + " | " + f->name + ": " + e.label);
        run(*f, e, row);
        ++takers;
        if (seen.empty() || seen.back() != f.get()) seen.push_back(f.get());
      }
    calls += takers;
    // A row is a comparison: at least two families must take the argument.
    EXPECT_GE(seen.size(), 2u) << row_label(row) << " reaches " << takers << " entry points";
  }
  std::printf("catalogue: %zu rows x %zu families (%zu entry points): %zu checked calls\n",
              catalogue().size(), families.size(), entries, calls);
}

}  // namespace
