// The GPU benchmark's body, over device::Device so that it runs on the CUDA device (the
// stepcore-bench-gpu program) and on the host device (a small smoke test in the test
// suite, so a harness bug cannot stop a scarce GPU run): it builds the model's tensor
// list and a 2,000-tensor list, sizes one workspace for every list it uses, validates
// every kernel against the scalar reference, then times each kernel (the norm, the fused
// scale + norm, accumulate, and every optimizer of the table with its default
// hyper-parameters) and a same-traffic device-to-device copy (the probe) in the same run.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "bench/model_sizes.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/device.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"

namespace stepcore::bench {

/// What to run: the bf16 gradient elements of the model list, the tensors of the
/// small-tensor list (host time per call), repetitions per timing and the calls each
/// repetition issues back to back.
struct GpuBenchOptions {
  std::size_t total_elements = std::size_t{1} << 29;  // 1 GiB of bf16
  std::size_t small_tensors = 2000;
  int reps = 10;
  int batch = 10;
};

/// One timed kernel: best device time per call, the bytes it moves, and the host's time
/// to issue one call (its checks, plan and launches: the host cost, timed apart).
struct GpuBenchRow {
  std::string name;
  double ms = 0.0;
  double bytes = 0.0;
  double host_us = 0.0;
  bool optimizer = false;  ///< an optimizer's step (one row per optimizer of the table)
};

/// The run: the probe, the kernels, the host enqueue time per call, and the first
/// validation failure ("" when every kernel matched the reference).
struct GpuBenchResult {
  double probe_ms = 0.0;
  double probe_bytes = 0.0;
  std::vector<GpuBenchRow> rows;
  double host_us_per_small_call = 0.0;
  std::size_t tensors = 0, elements = 0, blocks = 0;
  std::string failure;
};

/// Times fn on the device: the best of `reps` repetitions, each `batch` calls issued back
/// to back (so the device runs while the host issues the next: device work, not the
/// host's), in ms per call.
using BestMs = std::function<double(const std::function<void()>& fn, int reps, int batch)>;

namespace harness_detail {

/// A device allocation freed with its owner.
class DeviceMemory {
 public:
  DeviceMemory(device::Device& d, std::size_t bytes) : dev_(d), p_(d.allocate(bytes)) {}
  ~DeviceMemory() { dev_.deallocate(p_); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  device::Device& dev_;
  void* p_;
};

inline void upload(device::Device& dev, void* d, const void* h, std::size_t bytes) {
  dev.copy(device::Queue::compute, d, h, bytes);
  dev.synchronize();
}
inline void download(device::Device& dev, void* h, const void* d, std::size_t bytes) {
  dev.copy(device::Queue::compute, h, d, bytes);
  dev.synchronize();
}

/// Every optimizer the library implements, with its default hyper-parameters (one
/// OptimizerConfig per alternative, in the order of optimizer_table()).
inline std::vector<OptimizerConfig> default_configs() {
  return []<std::size_t... I>(std::index_sequence<I...>) {
    return std::vector<OptimizerConfig>{OptimizerConfig(std::in_place_index<I>)...};
  }
  (std::make_index_sequence<std::variant_size_v<OptimizerConfig>>{});
}

}  // namespace harness_detail

/// Runs the benchmark on `dev`; stops at the first validation failure (result.failure).
inline GpuBenchResult run_gpu_bench(device::Device& dev, const BestMs& best_ms,
                                    const GpuBenchOptions& o) {
  using device::Queue;
  using harness_detail::DeviceMemory;
  using harness_detail::download;
  using harness_detail::upload;
  GpuBenchResult res;
  const std::vector<std::size_t> sizes = model_sizes(o.total_elements);
  std::size_t total = 0;
  for (std::size_t s : sizes) total += s;
  res.tensors = sizes.size();
  res.elements = total;

  DeviceMemory d_grad(dev, total * 2), d_copy(dev, total * 4), d_acc(dev, total * 4);
  // The optimizers' state: as many f32 slot arrays as the defaults of any optimizer use.
  const std::vector<OptimizerConfig> configs = harness_detail::default_configs();
  std::size_t max_slots = 0;
  for (const OptimizerConfig& c : configs)
    max_slots = std::max(max_slots, optimizer_slot_names(c).size());
  DeviceMemory d_p(dev, total * 4);
  std::vector<std::unique_ptr<DeviceMemory>> d_slots;
  for (std::size_t k = 0; k < max_slots; ++k)
    d_slots.push_back(std::make_unique<DeviceMemory>(dev, total * 4));
  DeviceMemory d_out(dev, total * 2), d_steps(dev, sizes.size() * 4);
  DeviceMemory d_words(dev, 256);  // scale, clip, hyper
  std::vector<std::uint16_t> h_grad(total);
  std::vector<float> h_p(total);
  {
    // Cheap uniform values in (-1, 1) (splitmix64): 1.5 G of them must not take minutes.
    std::uint64_t state = 1;
    auto uniform = [&state] {
      std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      return static_cast<float>(static_cast<std::int64_t>(z) >> 40) * 0x1p-23f;
    };
    for (auto& x : h_grad) x = f32_to_bf16_bits(uniform() * 1e-3f);
    for (auto& x : h_p) x = uniform() * 0.05f;
  }
  upload(dev, d_grad.as<void>(), h_grad.data(), total * 2);
  upload(dev, d_p.as<void>(), h_p.data(), total * 4);

  auto* g16 = d_grad.as<std::uint16_t>();
  std::vector<TensorView> views;
  std::vector<ConstTensorView> cviews;
  std::vector<AccumulatePair> pairs;
  // optimizer_tensors(c): the model list as c's tensors on the device (its slots, its
  // counters when it counts steps), bf16 gradients and bf16 compute-weight outputs.
  auto optimizer_tensors = [&](const OptimizerConfig& c) {
    const std::size_t nslots = optimizer_slot_names(c).size();
    const bool counts = optimizer_table()[c.index()].counts_steps;
    std::vector<OptimizerTensor> ts;
    std::size_t at = 0;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t s = sizes[k];
      OptimizerTensor t{{d_p.as<float>() + at, s, DType::f32},
                        {},
                        counts ? d_steps.as<float>() + k : nullptr,
                        {g16 + at, s, DType::bf16},
                        {d_out.as<std::uint16_t>() + at, s, DType::bf16}};
      for (std::size_t j = 0; j < nslots; ++j)
        t.state[j] = TensorView{d_slots[j]->as<float>() + at, s, DType::f32};
      ts.push_back(t);
      at += s;
    }
    return ts;
  };
  std::size_t off = 0;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    const std::size_t s = sizes[k];
    views.push_back({g16 + off, s, DType::bf16});
    cviews.push_back({g16 + off, s, DType::bf16});
    pairs.push_back({{d_acc.as<float>() + off, s, DType::f32}, {g16 + off, s, DType::bf16}, false});
    off += s;
  }
  // The small-tensor list for the host time per call.
  std::vector<TensorView> small;
  const std::size_t each = std::max<std::size_t>(1, total / o.small_tensors);
  for (std::size_t i = 0; i < o.small_tensors && (i + 1) * each <= total; ++i)
    small.push_back({g16 + i * each, each, DType::bf16});

  // One workspace for every list the run uses (the largest block count wins).
  const std::size_t ws = std::max(dev.norm_workspace_bytes(views), dev.norm_workspace_bytes(small));
  res.blocks = dev.norm_workspace_bytes(views) / sizeof(NormPartial);
  DeviceMemory d_ws(dev, ws), d_partial(dev, sizeof(NormPartial));

  // Device scalars: scale 1, clip 1, and each optimizer's table (gpu::make_optimizer_table:
  // AdamW's and Adam's bias corrections; empty for the others).
  const float ones[2] = {1.0f, 1.0f};
  upload(dev, d_words.as<void>(), ones, sizeof ones);
  const float* d_one = d_words.as<float>();
  std::vector<std::unique_ptr<DeviceMemory>> d_tables;
  std::vector<OptimizerDeviceArgs> dargs;
  for (const OptimizerConfig& c : configs) {
    const std::vector<double> table = gpu::make_optimizer_table(c);
    d_tables.push_back(
        std::make_unique<DeviceMemory>(dev, std::max<std::size_t>(8, table.size() * 8)));
    if (!table.empty()) upload(dev, d_tables.back()->as<void>(), table.data(), table.size() * 8);
    dargs.push_back({d_one, d_one + 1, nullptr, nullptr,
                     table.empty() ? nullptr : d_tables.back()->as<double>()});
  }

  auto fail = [&](std::string what) {
    res.failure = std::move(what);
    return res;
  };
  auto read_partial = [&] {
    NormPartial p;
    download(dev, &p, d_partial.as<void>(), sizeof p);
    return p;
  };

  // ---- validation, before anything is timed ------------------------------------------
  const std::size_t nv = std::min<std::size_t>(3, sizes.size());
  std::size_t head = 0;  // elements of the first nv tensors
  for (std::size_t k = 0; k < nv; ++k) head += sizes[k];
  {
    // The norm of the first 100 tensors (more than one launch of 64) against the
    // reference, which is literal and slow: not the whole 1 GiB.
    const std::size_t nt = std::min<std::size_t>(100, sizes.size());
    std::size_t n = 0;
    for (std::size_t k = 0; k < nt; ++k) n += sizes[k];
    const ConstTensorView hv{h_grad.data(), n, DType::bf16};
    const NormResult ref = finalize(reference::norm_partial({&hv, 1}, GradientRead{1.0f, 1.0f}));
    const std::vector<ConstTensorView> first(cviews.begin(),
                                             cviews.begin() + static_cast<long>(nt));
    dev.norm_partial(first, GradientRead{}, d_partial.as<NormPartial>(), d_ws.as<void>(), ws);
    if (f32_bits(finalize(read_partial()).norm) != f32_bits(ref.norm))
      return fail("norm of the model list's first tensors differs from the reference");
    const NormResult ref_small = [&] {
      std::vector<ConstTensorView> hs;
      for (std::size_t i = 0; i < small.size(); ++i)
        hs.push_back({h_grad.data() + i * each, each, DType::bf16});
      return finalize(reference::norm_partial(hs, GradientRead{}));
    }();
    dev.scale_and_norm_partial(small, 1.0f, d_partial.as<NormPartial>(), d_ws.as<void>(), ws);
    if (f32_bits(finalize(read_partial()).norm) != f32_bits(ref_small.norm))
      return fail("scale+norm of the small-tensor list differs from the reference");
  }
  {  // scale+norm with a scale: the head tensors' stored values and the norm
    std::vector<std::uint16_t> ref(h_grad.begin(), h_grad.begin() + static_cast<long>(head));
    const TensorView rv{ref.data(), head, DType::bf16};
    reference::scale_({&rv, 1}, 0.37f);
    const ConstTensorView rc{ref.data(), head, DType::bf16};
    const NormResult want = finalize(reference::norm_partial({&rc, 1}));
    const std::vector<TensorView> hv(views.begin(), views.begin() + static_cast<long>(nv));
    dev.scale_and_norm_partial(hv, 0.37f, d_partial.as<NormPartial>(), d_ws.as<void>(), ws);
    const NormResult got = finalize(read_partial());
    std::vector<std::uint16_t> back(head);
    download(dev, back.data(), g16, head * 2);
    if (back != ref || f32_bits(got.norm) != f32_bits(want.norm))
      return fail("scale+norm (scale 0.37) differs from the reference");
    upload(dev, g16, h_grad.data(), head * 2);  // restore
  }
  {  // accumulate (copy, then add) into the head accumulators
    std::vector<float> ref(head, 0.0f);
    std::vector<AccumulatePair> hp(pairs.begin(), pairs.begin() + static_cast<long>(nv));
    for (auto& p : hp) p.copy = true;
    dev.accumulate(hp);
    for (auto& p : hp) p.copy = false;
    dev.accumulate(hp);
    for (std::size_t i = 0; i < head; ++i) {
      const float x = bf16_bits_to_f32(h_grad[i]);
      ref[i] = x + x;
    }
    std::vector<float> back(head);
    download(dev, back.data(), d_acc.as<void>(), head * 4);
    if (std::memcmp(back.data(), ref.data(), head * 4) != 0)
      return fail("accumulate differs from the reference");
  }
  // One step of every optimizer over the head tensors, each from the same parameters and
  // zero state, against the reference: parameters, compute weights, state and counters.
  for (std::size_t u = 0; u < configs.size(); ++u) {
    const OptimizerConfig& c = configs[u];
    const char* name = optimizer_table()[u].name;
    const std::size_t nslots = optimizer_slot_names(c).size();
    const bool counts = optimizer_table()[u].counts_steps;
    std::vector<float> p(h_p.begin(), h_p.begin() + static_cast<long>(head));
    std::vector<std::vector<float>> st(nslots, std::vector<float>(head, 0.0f));
    std::vector<std::uint16_t> out(head);
    std::vector<float> steps(nv, 0.0f);
    std::vector<OptimizerTensor> ht;
    std::size_t at = 0;
    for (std::size_t k = 0; k < nv; ++k) {
      const std::size_t s = sizes[k];
      OptimizerTensor t{{p.data() + at, s, DType::f32},
                        {},
                        counts ? &steps[k] : nullptr,
                        {h_grad.data() + at, s, DType::bf16},
                        {out.data() + at, s, DType::bf16}};
      for (std::size_t j = 0; j < nslots; ++j) t.state[j] = {st[j].data() + at, s, DType::f32};
      ht.push_back(t);
      at += s;
    }
    upload(dev, d_p.as<void>(), p.data(), head * 4);
    for (std::size_t j = 0; j < nslots; ++j)
      upload(dev, d_slots[j]->as<void>(), st[j].data(), head * 4);
    upload(dev, d_steps.as<void>(), steps.data(), nv * 4);
    reference::optimizer_step(ht, c, GradientRead{});
    const std::vector<OptimizerTensor> all = optimizer_tensors(c);
    const std::vector<OptimizerTensor> dt(all.begin(), all.begin() + static_cast<long>(nv));
    dev.optimizer_step(dt, c, dargs[u]);
    std::vector<float> back(head);
    std::vector<std::uint16_t> oback(head);
    download(dev, back.data(), d_p.as<void>(), head * 4);
    download(dev, oback.data(), d_out.as<void>(), head * 2);
    if (std::memcmp(back.data(), p.data(), head * 4) != 0 || oback != out)
      return fail(std::string(name) + " differs from the reference");
    for (std::size_t j = 0; j < nslots; ++j) {
      download(dev, back.data(), d_slots[j]->as<void>(), head * 4);
      if (std::memcmp(back.data(), st[j].data(), head * 4) != 0)
        return fail(std::string(name) + "'s state differs from the reference");
    }
    std::vector<float> dsteps(nv);
    download(dev, dsteps.data(), d_steps.as<void>(), nv * 4);
    if (dsteps != steps)
      return fail(std::string(name) + "'s step counters differ from the reference");
  }

  // ---- timing --------------------------------------------------------------------------
  const double g_bytes = static_cast<double>(total) * 2.0;
  // The host's time to issue one call: `batch` calls, no wait between them (the first
  // fills the cache of validated calls; a trainer repeats its calls every step).
  auto host_us = [&](const std::function<void()>& fn) {
    fn();
    dev.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < o.batch; ++k) fn();
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    dev.synchronize();
    return us / o.batch;
  };
  // The probe: a device-to-device copy of the gradients (read + write of 2 bytes each).
  res.probe_ms = best_ms([&] { dev.copy(Queue::compute, d_copy.as<void>(), g16, total * 2); },
                         o.reps, o.batch);
  res.probe_bytes = 2.0 * g_bytes;
  // A row: `calls` kernel calls per fn (the time and host cost are per call).
  auto row = [&](const char* name, const std::function<void()>& fn, double bytes, int calls = 1) {
    const double ms = best_ms(fn, o.reps, o.batch) / calls;
    res.rows.push_back({name, ms, bytes, host_us(fn) / calls});
  };
  row(
      "norm only (bf16, read)",
      [&] {
        dev.norm_partial(cviews, GradientRead{1.0f / 3000.0f, 1.0f}, d_partial.as<NormPartial>(),
                         d_ws.as<void>(), ws);
      },
      g_bytes);
  // With scale 1 the fused pass writes nothing; time a power-of-two scale and its inverse
  // so the data stays as it was.
  row(
      "scale+norm (bf16, scale 2^-12)",
      [&] {
        dev.scale_and_norm_partial(views, 0x1p-12f, d_partial.as<NormPartial>(), d_ws.as<void>(),
                                   ws);
        dev.scale_and_norm_partial(views, 0x1p12f, d_partial.as<NormPartial>(), d_ws.as<void>(),
                                   ws);
      },
      2.0 * g_bytes, 2);
  row(
      "accumulate bf16 -> f32", [&] { dev.accumulate(pairs); }, static_cast<double>(total) * 10.0);
  // Each optimizer: param f32 read + write, bf16 gradient read, bf16 output write, and
  // each of its f32 slots read + written.
  for (std::size_t u = 0; u < configs.size(); ++u) {
    const std::vector<OptimizerTensor> ts = optimizer_tensors(configs[u]);
    const std::size_t nslots = optimizer_slot_names(configs[u]).size();
    const std::string name = std::string(optimizer_table()[u].name) + " (f32 state, bf16 g/out)";
    row(
        name.c_str(), [&] { dev.optimizer_step(ts, configs[u], dargs[u]); },
        static_cast<double>(total) * static_cast<double>(12 + 8 * nslots));
    res.rows.back().optimizer = true;
  }

  // Host time per call for the small-tensor list (enqueue only; the device runs meanwhile).
  {
    const int reps = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r)
      dev.scale_and_norm_partial(small, 1.0f, d_partial.as<NormPartial>(), d_ws.as<void>(), ws);
    res.host_us_per_small_call =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e6 / reps;
    dev.synchronize();
  }
  return res;
}

}  // namespace stepcore::bench
