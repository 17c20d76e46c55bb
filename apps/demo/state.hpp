// stepcore-demo's training state: the instantiated model (the layout with each
// tensor's slice of the flat buffers), the buffers themselves, the stepcore argument
// lists over them, and the synthetic micro-batch gradients written into them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "backends.hpp"
#include "memory.hpp"
#include "model.hpp"
#include "options.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore_demo {

/// Elements [begin, end) of tensor `tensor`: one unit of the parallel synthetic fills.
struct FillChunk {
  std::size_t tensor;
  std::size_t begin;
  std::size_t end;
};

/// Elements per fill chunk.
constexpr std::size_t kFillChunk = std::size_t{1} << 16;

/// Elements each tensor's slice of a flat buffer is aligned to: 128 bytes of f32, 64 of
/// bf16, so every per-tensor view starts on a 64-byte boundary (a cache line, an
/// AVX-512 vector) of its page-aligned buffer.
constexpr std::size_t kSliceAlign = 32;

/// The instantiated model: config with overrides, tensor table and offsets.
struct Model {
  ModelConfig config;  ///< with --layers/--vocab applied
  const ModelConfig* published = nullptr;
  std::vector<TensorSpec> layout;
  std::vector<std::size_t> offset;  ///< element offset of each tensor, kSliceAlign-aligned
  std::size_t numel = 0;            ///< parameters
  std::size_t padded = 0;           ///< elements of each flat buffer
  std::vector<FillChunk> chunks;    ///< every tensor cut into kFillChunk pieces, in order
};

/// Returns the model of the options: the published config, scaled down as asked.
Model make_model(const Options& o);

/// The training state: flat buffers, one slice per tensor.
struct State {
  AlignedArray<float> param;               ///< f32 master parameters
  AlignedArray<float> exp_avg;             ///< AdamW first moment (empty for SignSGD)
  AlignedArray<float> exp_avg_sq;          ///< AdamW second moment (empty for SignSGD)
  AlignedArray<float> acc;                 ///< f32 gradient accumulators
  AlignedArray<sc::bfloat16_t> compute;    ///< bf16 compute weights (the model's copy)
  AlignedArray<sc::bfloat16_t> grad_bf16;  ///< one micro-batch's gradients, bf16
  AlignedArray<float> grad_f32;            ///< one micro-batch's gradients, f32
  std::vector<float> step;                 ///< per-tensor AdamW step counters
  /// --optimizer adamw8bit: the 8-bit moments of the tensors of at least kMin8bitSize
  /// elements (codes at the tensors' offsets, one f32 maximum per block of 256 at
  /// block_offset[t]; the f32 moments of those tensors are unused).
  AlignedArray<std::uint8_t> exp_avg_codes, exp_avg_sq_codes;
  std::vector<float> exp_avg_max, exp_avg_sq_max;
  std::vector<std::size_t> block_offset;
};

/// Allocates the (zeroed, touched) state for `m`. With a NUMA placement the f32
/// families are placed and first-touched by the engine's workers (placed_f32); the
/// rest, and everything without a placement, is pre-faulted anonymous memory.
State make_state(const Model& m, const Options& o, const Backend& b);

/// Sets the initial f32 weights and their bf16 compute copies, on `threads`
/// threads (pure functions of the coordinates: the same bits for any count).
void init_weights(const Model& m, State& s, const Options& o, int threads);

/// The stepcore argument lists of a run, built once over the state's buffers.
struct Calls {
  std::vector<sc::AccumulatePair> first;  ///< copy pairs (first micro-batch)
  std::vector<sc::AccumulatePair> rest;   ///< add pairs
  std::vector<sc::ConstTensorView> accs;  ///< accumulators, for the norm
  /// The optimizer's tensors, [0]: decayed, [1]: no decay. AdamW: state[0] exp_avg,
  /// state[1] exp_avg_sq, a step counter each; SignSGD: the param alone.
  std::vector<sc::OptimizerTensor> optimizer[2];
};

/// Returns the argument lists over `s` for the model `m`, reading the micro-batch
/// gradients from `grads` (s itself, or the state a checking copy was taken of).
Calls make_calls(const Model& m, State& s, const State& grads, const Options& o);

/// Writes micro-batch k of `step` into the gradient buffer: element i of tensor
/// t is stddev[t] * gauss(grad_key(seed, step, k, t), i), rounded to the dtype.
/// Runs a static parallel-for over the model's chunks on `threads` threads; every
/// value is a pure function of its coordinates, so the bits do not depend on it.
void fill_micro_batch(const Model& m, State& s, const Options& o, std::int64_t step, std::int64_t k,
                      std::span<const double> stddev, int threads);

/// Sets one element (middle of the middle tensor) of the gradient buffer to +Inf;
/// returns a description of where.
std::string inject_inf(const Model& m, State& s, const Options& o);

}  // namespace stepcore_demo
