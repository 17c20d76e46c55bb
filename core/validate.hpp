// Argument validation shared by every implementation's public entry points.
// Each check throws stepcore::Error naming the argument; none writes anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "stepcore/error.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::detail {

/// Whether validate_adamw reads the step counters (host memory) or checks only their
/// pointers (device memory, which the kernels read).
enum class StepCounters : std::uint8_t { read, unread };

/// Throws unless every AdamW argument is valid (dtypes, sizes, pointers,
/// overlaps, hyper-parameter ranges, step counters, read scalars).
void validate_adamw(std::span<const AdamWTensor> tensors, const AdamWConfig& config,
                    GradientRead read, StepCounters counters = StepCounters::read);
/// Same for SignSGD (scale and clip must be finite and > 0).
void validate_sign_sgd(std::span<const SignSgdTensor> tensors, const SignSgdConfig& config,
                       GradientRead read);
void validate_accumulate(std::span<const AccumulatePair> pairs);
void validate_scale(std::span<const TensorView> tensors, float scale);
void validate_norm(std::span<const ConstTensorView> tensors, GradientRead read);
/// Throws unless scale is finite and > 0 and clip is in [0, 1].
void validate_read(const GradientRead& read, const char* name = "read");

/// The name of an argument, built into a string only when an error reports it
/// ("base", or "base[index].field"): validation of thousands of tensors allocates nothing.
struct Arg {
  const char* base;
  std::size_t index = static_cast<std::size_t>(-1);
  const char* field = nullptr;
  std::string str() const;
};

/// One memory range of a call, for the overlap check.
struct Range {
  std::uintptr_t begin;
  std::uintptr_t end;
  bool written;
  Arg name;
};

/// Throws Errc::overlap if a written range overlaps any other range.
void check_overlaps(std::span<Range> ranges);

/// Builds "base[i].field".
std::string arg_name(const char* base, std::size_t i, const char* field);

}  // namespace stepcore::detail
