// The synthetic data of stepcore-demo: counter-based random streams (every value a
// pure function of its coordinates, so any split or thread count gives the same bits),
// the initial weights, and each step's loss-token counts, target norm and gradients.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <vector>

#include "model.hpp"
#include "stepcore/convert.hpp"

namespace stepcore_demo {

// ---- counter-based randomness (inline: the fills below vectorise over it) ---------

/// Returns the splitmix64 finaliser of `x`: a bijective 64-bit mix.
inline std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

/// Returns the key of one random stream, a hash of its coordinates.
inline std::uint64_t stream_key(std::uint64_t seed, std::uint64_t domain, std::uint64_t a,
                                std::uint64_t b = 0, std::uint64_t c = 0) {
  std::uint64_t k = mix64(seed + 0x9E3779B97F4A7C15ull);
  for (const std::uint64_t v : {domain, a, b, c}) k = mix64(k ^ (v + 0x9E3779B97F4A7C15ull));
  return k;
}

/// Returns a value uniform in [0, 1) for counter `i` of stream `key`.
inline double uniform(std::uint64_t key, std::uint64_t i) {
  return static_cast<double>(mix64(key + (i + 1) * 0x9E3779B97F4A7C15ull) >> 11) * 0x1.0p-53;
}

/// Returns a 32-bit hash of `x`: a two-round multiply-xorshift bijection that
/// compilers vectorise (32-bit multiplies), unlike mix64.
inline std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

/// The two 32-bit keys of one 2^32-element block of a stream.
struct BlockKeys {
  std::uint32_t k0;
  std::uint32_t k1;
};

/// Returns the keys of block `block` (counters block * 2^32 ...) of stream `key`.
inline BlockKeys block_keys(std::uint64_t key, std::uint64_t block) {
  const std::uint64_t h = mix64(key ^ mix64(block + 0x9E3779B97F4A7C15ull));
  return {static_cast<std::uint32_t>(h), static_cast<std::uint32_t>(h >> 32)};
}

/// Returns an approximately standard normal value for counter `j` of a block:
/// the Irwin-Hall sum of the four 16-bit lanes of two hashes, centred and
/// scaled to unit variance (|z| <= 3.47).
inline float gauss_in_block(BlockKeys k, std::uint32_t j) {
  const std::uint32_t x = j * 0x9E3779B9u;
  const std::uint32_t a = mix32(x + k.k0);
  const std::uint32_t b = mix32(x + k.k1);
  const std::int32_t s =
      static_cast<std::int32_t>((a & 0xFFFFu) + (a >> 16) + (b & 0xFFFFu) + (b >> 16));
  // Four uniforms on {0..65535}: mean 131070, variance 4 * (65536^2 - 1) / 12.
  constexpr float kInvStd = 1.0f / 37837.23f;
  return static_cast<float>(s - 131070) * kInvStd;
}

/// Returns the approximately standard normal value of counter `i` of stream `key`.
inline float gauss(std::uint64_t key, std::uint64_t i) {
  return gauss_in_block(block_keys(key, i >> 32), static_cast<std::uint32_t>(i));
}

/// Writes out[i] = from_f32<T>(stddev * gauss(key, i)) for begin <= i < end (out
/// points at element 0 of the stream): the same values as the per-element form, in
/// loops the compiler vectorises. Each element depends only on (key, i), so any
/// split of [0, n) into ranges, filled in any order or in parallel, gives the same
/// bits as one sequential fill.
template <class T>
void fill_gauss_range(T* out, std::size_t begin, std::size_t end, std::uint64_t key, float stddev) {
  constexpr std::uint64_t kBlock = 0x100000000ull;
  std::uint64_t i = begin;
  while (i < end) {
    const std::uint64_t block = i / kBlock;
    const std::uint64_t stop = std::min<std::uint64_t>(end, (block + 1) * kBlock);
    const BlockKeys k = block_keys(key, block);
    T* o = out + block * kBlock;
    const std::uint64_t j0 = i - block * kBlock, j1 = stop - block * kBlock;
    for (std::uint64_t j = j0; j < j1; ++j)
      o[j] = stepcore::from_f32<T>(stddev * gauss_in_block(k, static_cast<std::uint32_t>(j)));
    i = stop;
  }
}

// ---- the initial weights and the synthetic step -----------------------------------

/// Writes elements [begin, end) of the initial values of tensor t of kind k (out
/// points at its element 0): N(0, 0.02) (approximately) for matrices and
/// embeddings, 1 for norms, 0 for biases. Pure in (seed, t, i), like fill_gauss_range.
void fill_init_range(float* out, std::size_t begin, std::size_t end, std::uint64_t seed,
                     std::size_t t, TensorKind k);

/// Writes the n initial values of tensor t of kind k.
void fill_init(float* out, std::size_t n, std::uint64_t seed, std::size_t t, TensorKind k);

/// The loss-token counts of one step's micro-batches (SFT: known before the
/// step, from the batch's loss mask): each micro-batch of 8 sequences x 2048
/// positions has 20-55 % of its positions as response tokens.
std::vector<std::int64_t> micro_batch_tokens(std::uint64_t seed, std::int64_t step,
                                             std::int64_t micro_batches);

/// Returns the step's intended global norm (after the 1/tokens scale): a fixed
/// cycle with spikes, jittered by +-10 % per seed. Designed around max_norm 1:
/// steps 1 and 3 clip, steps 2 and 4 do not.
double target_norm(std::uint64_t seed, std::int64_t step);

/// Returns the per-tensor standard deviations sigma[t] * tokens[k] of one step's
/// micro-batch gradients, chosen so that the scaled accumulated gradient has
/// expected norm target: each micro-batch gradient is a sum over its tokens.
/// Element i of micro-batch k of tensor t is sigma[t] * tokens[k] * gauss(...).
std::vector<double> grad_sigmas(std::span<const TensorSpec> layout, bool tied,
                                std::span<const std::int64_t> tokens, double target);

/// Returns the key of the gradient stream of tensor t in micro-batch k of `step`.
std::uint64_t grad_key(std::uint64_t seed, std::int64_t step, std::int64_t k, std::size_t t);

/// Returns the synthetic gradient (before rounding to its dtype) of element i
/// of tensor t in micro-batch k of `step`, given that micro-batch's stddev: any
/// element can be regenerated from (seed, step, micro-batch, tensor, element).
float grad_value(std::uint64_t seed, std::int64_t step, std::int64_t k, std::size_t t,
                 std::size_t i, float stddev);

}  // namespace stepcore_demo
