// The synthetic data of stepcore-demo: initial weights and the per-step token counts,
// target norms, gradient magnitudes and gradient streams, over the counter-based
// random streams of synthetic.hpp.
#include "synthetic.hpp"

#include <cmath>
#include <iterator>

namespace stepcore_demo {

namespace {

/// Random-stream domains, so parameters and gradients never share a stream.
enum Domain : std::uint64_t { kInitDomain = 1, kGradDomain = 2, kTokenDomain = 3, kNormDomain = 4 };

}  // namespace

void fill_init_range(float* out, std::size_t begin, std::size_t end, std::uint64_t seed,
                     std::size_t t, TensorKind k) {
  if (k == TensorKind::norm || k == TensorKind::attn_bias) {
    std::fill(out + begin, out + end, k == TensorKind::norm ? 1.0f : 0.0f);
    return;
  }
  fill_gauss_range(out, begin, end, stream_key(seed, kInitDomain, t), 0.02f);
}

void fill_init(float* out, std::size_t n, std::uint64_t seed, std::size_t t, TensorKind k) {
  fill_init_range(out, 0, n, seed, t, k);
}

std::vector<std::int64_t> micro_batch_tokens(std::uint64_t seed, std::int64_t step,
                                             std::int64_t micro_batches) {
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(micro_batches));
  const std::uint64_t key = stream_key(seed, kTokenDomain, static_cast<std::uint64_t>(step));
  for (std::int64_t k = 0; k < micro_batches; ++k) {
    const double frac = 0.20 + 0.35 * uniform(key, static_cast<std::uint64_t>(k));
    tokens[static_cast<std::size_t>(k)] = static_cast<std::int64_t>(8 * 2048 * frac);
  }
  return tokens;
}

double target_norm(std::uint64_t seed, std::int64_t step) {
  static constexpr double kCycle[] = {2.2, 0.6, 1.5, 0.75, 0.45, 3.5, 0.85, 1.3};
  const double base = kCycle[static_cast<std::size_t>(step) % std::size(kCycle)];
  const double jitter =
      0.9 + 0.2 * uniform(stream_key(seed, kNormDomain, 0), static_cast<std::uint64_t>(step));
  return base * jitter;
}

std::vector<double> grad_sigmas(std::span<const TensorSpec> layout, bool tied,
                                std::span<const std::int64_t> tokens, double target) {
  double weighted = 0.0;  // sum over tensors of numel * w^2
  for (const TensorSpec& t : layout) {
    const double w = grad_weight(t.kind, tied);
    weighted += static_cast<double>(t.numel()) * w * w;
  }
  double total = 0.0, squares = 0.0;
  for (const std::int64_t n : tokens) {
    total += static_cast<double>(n);
    squares += static_cast<double>(n) * static_cast<double>(n);
  }
  // E|sum_k sigma_t n_k z / T|^2 summed over elements = c^2 W Q / T^2 = target^2.
  const double c = target * total / std::sqrt(weighted * squares);
  std::vector<double> sigma;
  sigma.reserve(layout.size());
  for (const TensorSpec& t : layout) sigma.push_back(c * grad_weight(t.kind, tied));
  return sigma;
}

std::uint64_t grad_key(std::uint64_t seed, std::int64_t step, std::int64_t k, std::size_t t) {
  return stream_key(seed, kGradDomain, static_cast<std::uint64_t>(step),
                    static_cast<std::uint64_t>(k), t);
}

float grad_value(std::uint64_t seed, std::int64_t step, std::int64_t k, std::size_t t,
                 std::size_t i, float stddev) {
  return stddev * gauss(grad_key(seed, step, k, t), i);
}

}  // namespace stepcore_demo
