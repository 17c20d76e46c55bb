// stepcore-demo's training state: instantiating the model, allocating (and, with a
// NUMA placement, first-touching) the buffers, the initial weights, the argument
// lists, and each micro-batch's synthetic gradients.
#include "state.hpp"

#include <algorithm>
#include <limits>
#include <utility>

#include "stepcore/error.hpp"
#include "stepcore/numa.hpp"
#include "synthetic.hpp"

namespace stepcore_demo {

namespace {

/// Returns one f32 array family (params, a moment, the accumulators) for `m` in a
/// numa::HostBuffer bound to the backend's node, first-touched by the engine: one
/// first_touch per list of `calls` (tensor indexes), the lists the kernels that use the
/// family most are called with, so each page is placed by the worker that will read and
/// write it. Under --strict-numa a buffer the kernel refuses to bind is an error.
AlignedArray<float> placed_f32(const Model& m, const Backend& b, bool strict,
                               std::span<const std::vector<std::size_t>> calls) {
  sc::numa::HostBuffer buf;
  try {
    buf = sc::numa::HostBuffer(m.padded * sizeof(float), b.numa.node, strict);
  } catch (const sc::Error& e) {
    if (strict && e.code() == sc::Errc::not_supported) throw StrictNumaError(e.what());
    throw;
  }
  for (const std::vector<std::size_t>& tensors : calls) {
    std::vector<sc::TensorView> views;
    views.reserve(tensors.size());
    for (const std::size_t t : tensors) {  // carved at the model's 64-byte aligned offsets
      const std::size_t n = m.layout[t].numel();
      views.push_back(sc::f32_view(buf.at<float>(m.offset[t] * sizeof(float), n), n));
    }
    b.engine->first_touch(views);
  }
  return AlignedArray<float>(m.padded, std::move(buf));
}

}  // namespace

Model make_model(const Options& o) {
  Model m;
  m.published = find_model(o.model);
  m.config = *m.published;
  if (o.layers != 0) m.config.layers = o.layers;
  if (o.vocab != 0) m.config.vocab = o.vocab;
  m.layout = build_layout(m.config);
  for (const TensorSpec& t : m.layout) {
    m.offset.push_back(m.padded);
    m.numel += t.numel();
    m.padded += (t.numel() + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  }
  for (std::size_t t = 0; t < m.layout.size(); ++t)
    for (std::size_t b = 0; b < m.layout[t].numel(); b += kFillChunk)
      m.chunks.push_back({t, b, std::min(m.layout[t].numel(), b + kFillChunk)});
  return m;
}

State make_state(const Model& m, const Options& o, const Backend& b) {
  State s;
  if (b.engine && b.numa.bound) {
    // The optimizer is called once per weight-decay group, accumulate and the norm once
    // over all tensors: first-touch each family in the partition of its kernels.
    std::vector<std::vector<std::size_t>> groups(2), all(1);
    for (std::size_t t = 0; t < m.layout.size(); ++t) {
      groups[no_decay(m.layout[t].kind) ? 1 : 0].push_back(t);
      all[0].push_back(t);
    }
    s.param = placed_f32(m, b, o.strict_numa, groups);
    if (o.optimizer == Optimizer::adamw) {
      s.exp_avg = placed_f32(m, b, o.strict_numa, groups);
      s.exp_avg_sq = placed_f32(m, b, o.strict_numa, groups);
    }
    s.acc = placed_f32(m, b, o.strict_numa, all);
  } else {
    s.param = AlignedArray<float>(m.padded);
    if (o.optimizer == Optimizer::adamw) {
      s.exp_avg = AlignedArray<float>(m.padded);
      s.exp_avg_sq = AlignedArray<float>(m.padded);
    }
    s.acc = AlignedArray<float>(m.padded);
  }
  if (o.q8) {  // 0 in 8 bits: the zero codes (127 signed, 0 unsigned), maxima 0
    s.exp_avg_codes = AlignedArray<std::uint8_t>(m.padded);
    s.exp_avg_sq_codes = AlignedArray<std::uint8_t>(m.padded);
    std::fill(s.exp_avg_codes.data(), s.exp_avg_codes.data() + m.padded, std::uint8_t{127});
    std::size_t blocks = 0;
    for (const TensorSpec& t : m.layout) {
      s.block_offset.push_back(blocks);
      blocks += (t.numel() + sc::kQ8BlockSize - 1) / sc::kQ8BlockSize;
    }
    s.exp_avg_max.assign(blocks, 0.0f);
    s.exp_avg_sq_max.assign(blocks, 0.0f);
  }
  s.compute = AlignedArray<sc::bfloat16_t>(m.padded);
  if (o.grad_dtype == sc::DType::bf16)
    s.grad_bf16 = AlignedArray<sc::bfloat16_t>(m.padded);
  else
    s.grad_f32 = AlignedArray<float>(m.padded);
  s.step.assign(m.layout.size(), 0.0f);
  return s;
}

void init_weights(const Model& m, State& s, const Options& o, int threads) {
  const auto chunks = static_cast<std::int64_t>(m.chunks.size());
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (std::int64_t i = 0; i < chunks; ++i) {
    const FillChunk& ch = m.chunks[static_cast<std::size_t>(i)];
    float* p = s.param.data() + m.offset[ch.tensor];
    sc::bfloat16_t* c = s.compute.data() + m.offset[ch.tensor];
    fill_init_range(p, ch.begin, ch.end, o.seed, ch.tensor, m.layout[ch.tensor].kind);
    for (std::size_t j = ch.begin; j < ch.end; ++j) c[j] = sc::from_f32<sc::bfloat16_t>(p[j]);
  }
}

Calls make_calls(const Model& m, State& s, const State& grads, const Options& o) {
  Calls c;
  for (std::size_t t = 0; t < m.layout.size(); ++t) {
    const std::size_t n = m.layout[t].numel();
    const std::size_t off = m.offset[t];
    const sc::TensorView acc = sc::f32_view(s.acc.data() + off, n);
    const sc::ConstTensorView src = o.grad_dtype == sc::DType::bf16
                                        ? sc::const_view(grads.grad_bf16.data() + off, n)
                                        : sc::const_view(grads.grad_f32.data() + off, n);
    c.first.push_back({acc, src, true});
    c.rest.push_back({acc, src, false});
    c.accs.push_back(acc);
    const sc::TensorView param = sc::f32_view(s.param.data() + off, n);
    const sc::TensorView out = sc::view(s.compute.data() + off, n);
    const int group = no_decay(m.layout[t].kind) ? 1 : 0;
    sc::OptimizerTensor ot;
    ot.param = param;
    if (o.optimizer == Optimizer::adamw && o.q8 && n >= kMin8bitSize) {
      ot.q8[0] = {s.exp_avg_codes.data() + off, s.exp_avg_max.data() + s.block_offset[t]};
      ot.q8[1] = {s.exp_avg_sq_codes.data() + off, s.exp_avg_sq_max.data() + s.block_offset[t]};
      ot.step = &s.step[t];
    } else if (o.optimizer == Optimizer::adamw) {
      ot.state[0] = sc::f32_view(s.exp_avg.data() + off, n);
      ot.state[1] = sc::f32_view(s.exp_avg_sq.data() + off, n);
      ot.step = &s.step[t];
    }
    ot.grad = acc;
    ot.compute_param = out;
    c.optimizer[group].push_back(ot);
  }
  return c;
}

void fill_micro_batch(const Model& m, State& s, const Options& o, std::int64_t step, std::int64_t k,
                      std::span<const double> stddev, int threads) {
  std::vector<std::uint64_t> keys(m.layout.size());
  std::vector<float> sds(m.layout.size());
  for (std::size_t t = 0; t < m.layout.size(); ++t) {
    keys[t] = grad_key(o.seed, step, k, t);
    sds[t] = static_cast<float>(stddev[t]);
  }
  const bool bf16 = o.grad_dtype == sc::DType::bf16;
  const auto chunks = static_cast<std::int64_t>(m.chunks.size());
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (std::int64_t i = 0; i < chunks; ++i) {
    const FillChunk& ch = m.chunks[static_cast<std::size_t>(i)];
    if (bf16)
      fill_gauss_range(s.grad_bf16.data() + m.offset[ch.tensor], ch.begin, ch.end, keys[ch.tensor],
                       sds[ch.tensor]);
    else
      fill_gauss_range(s.grad_f32.data() + m.offset[ch.tensor], ch.begin, ch.end, keys[ch.tensor],
                       sds[ch.tensor]);
  }
  for (std::size_t t = 0; t < m.layout.size(); ++t) {
    // Spot check: the vectorised fill gives what regenerating one element gives.
    const std::size_t n = m.layout[t].numel();
    const float x = grad_value(o.seed, step, k, t, n - 1, sds[t]);
    const bool same =
        bf16 ? s.grad_bf16.data()[m.offset[t] + n - 1].bits == sc::from_f32<sc::bfloat16_t>(x).bits
             : sc::f32_bits(s.grad_f32.data()[m.offset[t] + n - 1]) == sc::f32_bits(x);
    if (!same)
      throw sc::Error(sc::Errc::internal, m.layout[t].name,
                      "synthetic gradient fill is not reproducible");
  }
}

std::string inject_inf(const Model& m, State& s, const Options& o) {
  const std::size_t t = m.layout.size() / 2;
  const std::size_t i = m.layout[t].numel() / 2;
  const float inf = std::numeric_limits<float>::infinity();
  if (o.grad_dtype == sc::DType::bf16)
    s.grad_bf16.data()[m.offset[t] + i] = sc::from_f32<sc::bfloat16_t>(inf);
  else
    s.grad_f32.data()[m.offset[t] + i] = inf;
  return m.layout[t].name + "[" + std::to_string(i) + "]";
}

}  // namespace stepcore_demo
