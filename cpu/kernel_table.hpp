// The per-ISA kernel table: plain function pointers filled by each ISA's translation
// units (isa_sse2.cpp, isa_avx2.cpp, isa_avx512.cpp and their *_streamed.cpp) from the
// one generic body in simd_body.hpp. The engine picks a table at run time and resolves
// dtype combinations to entries before it opens a parallel region.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/step_scalars.hpp"
#include "core/validate.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::cpu::detail {

/// Index of an optional output dtype: none, f32, bf16, f16.
inline constexpr int kOutputKinds = 4;
inline constexpr int kDTypes = 3;

/// Returns 0 for "no output", else 1 + dtype.
inline int output_kind(const TensorView& v) {
  if (v.data == nullptr && v.numel == 0) return 0;
  return 1 + static_cast<int>(v.dtype);
}

/// Streaming stores begin at this destination alignment: a cache line, a multiple of
/// every ISA's vector size, so each aligned vector store lies within one line.
inline constexpr std::size_t kStreamAlignment = 64;

/// Bits of AdamWRange::stream: the destinations written with streaming stores.
inline constexpr unsigned kStreamParam = 1, kStreamExpAvg = 2, kStreamExpAvgSq = 4;

/// Returns the destinations (bit k: pair k of `count`) that take streaming stores: those
/// out of place (dst[k] != src[k]; validation makes an out-of-place source disjoint from
/// every destination, so nothing reads the line again within the call) whose addresses
/// agree modulo kStreamAlignment with the most out-of-place destinations (the first of
/// them on a tie), so that one peeled head aligns every streamed destination at once.
inline unsigned stream_mask(const float* const* dst, const float* const* src, int count) {
  auto offset = [](const float* p) {
    return reinterpret_cast<std::uintptr_t>(p) % kStreamAlignment;
  };
  unsigned best = 0;
  int best_count = 0;
  for (int a = 0; a < count; ++a) {
    if (dst[a] == src[a]) continue;  // in place: the line is read anyway
    unsigned mask = 0;
    int n = 0;
    for (int k = 0; k < count; ++k) {
      if (dst[k] != src[k] && offset(dst[k]) == offset(dst[a])) {
        mask |= 1u << k;
        ++n;
      }
    }
    if (n > best_count) {
      best = mask;
      best_count = n;
    }
  }
  return best;
}

/// Arguments of one AdamW range: elements [begin, end) of one tensor. The old state is
/// read from the *_src arrays (the destinations themselves for an in-place step), the
/// new state written to param/exp_avg/exp_avg_sq; `stream` (kStream* bits, stream_mask)
/// names the destinations written with streaming stores, 0 for an in-place step.
struct AdamWRange {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  const float* param_src;
  const float* exp_avg_src;
  const float* exp_avg_sq_src;
  const void* grad;
  void* out;
  AdamWScalars scalars;
  GradientRead read;
  std::size_t tail_begin;  ///< torch formula: elements >= tail_begin use the tail form
  bool torch;
  unsigned stream;
};

/// Arguments of one SignSGD range (param_src: the old parameter; param itself in place);
/// `stream`: param is written with streaming stores (out of place, stream_mask).
struct SignSgdRange {
  float* param;
  const float* param_src;
  const void* grad;
  void* out;
  SignSgdScalars scalars;
  bool stream;
};

using AdamWFn = void (*)(const AdamWRange&, std::size_t begin, std::size_t end);
using SignSgdFn = void (*)(const SignSgdRange&, std::size_t begin, std::size_t end);
using AccumulateFn = void (*)(float* acc, const void* src, bool copy, std::size_t begin,
                              std::size_t end);
using ScaleFn = void (*)(void* data, float scale, std::size_t begin, std::size_t end);
/// Adds the approximate (block-summed) norm partial of elements [begin, end).
using NormFn = void (*)(const void* data, const GradientRead& read, std::size_t begin,
                        std::size_t end, NormPartial& partial);

/// The floating-point primitives every body is built from (simd_body.hpp, ArchOps),
/// exposed per ISA over whole arrays for the primitive tests.
enum class Primitive : std::uint8_t {
  add,     ///< out = a + b
  sub,     ///< out = a - b
  mul,     ///< out = a * b
  div,     ///< out = a / b
  sqrt,    ///< out = sqrt(a)
  fma,     ///< out = RN(a*b + c), one rounding
  gt,      ///< out = a > b ? 1 : 0 (ordered)
  lt,      ///< out = a < b ? 1 : 0 (ordered)
  eq,      ///< out = a == b ? 1 : 0 (ordered)
  is_nan,  ///< out = isnan(a) ? 1 : 0
  select,  ///< out = c < 0 ? a : b (the mask from lt)
};
/// Binary64 primitives: widen (out[2i], out[2i+1] = the lanes' doubles in element
/// order), add_square (out = acc + x*x) and dsum (out[0] = the sum of one vector of
/// acc, out[1..] untouched).
enum class Primitive64 : std::uint8_t { widen, add_square, dsum };
/// Applies `op` lane-wise to elements [0, n) (n a multiple of the ISA's width).
using PrimitiveFn = void (*)(Primitive op, const float* a, const float* b, const float* c,
                             float* out, std::size_t n);
using Primitive64Fn = void (*)(Primitive64 op, const float* x, const double* acc, double* out,
                               std::size_t n);

/// One ISA's kernels, indexed [gradient dtype][output kind] etc.
struct KernelTable {
  const char* isa;
  std::size_t width;  ///< f32 lanes per vector
  PrimitiveFn primitive;
  Primitive64Fn primitive64;
  AdamWFn adamw[kDTypes][kOutputKinds];
  SignSgdFn sign_sgd[kDTypes][kOutputKinds];
  /// The same steps for ranges with streamed destinations (AdamWRange::stream != 0,
  /// SignSgdRange::stream): out of place, streaming stores, which the caller must fence
  /// (sfence) before another thread reads them; the engine picks per range.
  AdamWFn adamw_streamed[kDTypes][kOutputKinds];
  SignSgdFn sign_sgd_streamed[kDTypes][kOutputKinds];
  AccumulateFn accumulate[kDTypes];
  ScaleFn scale[kDTypes];
  NormFn norm[kDTypes];
  NormFn norm_exact[kDTypes];  ///< exact partial, one deposit per element
};

/// Each returns its ISA's table; defined in isa_<name>.cpp, compiled with that
/// ISA's -m flags. Callers must check the processor supports the ISA first.
const KernelTable& kernel_table_sse2();
const KernelTable& kernel_table_avx2();
const KernelTable& kernel_table_avx512();
/// Each fills its ISA's adamw_streamed and sign_sgd_streamed entries; defined in
/// isa_<name>_streamed.cpp, called by kernel_table_<name>().
void fill_streamed_sse2(KernelTable& t);
void fill_streamed_avx2(KernelTable& t);
void fill_streamed_avx512(KernelTable& t);

/// Returns the range record of one AdamW tensor whose counter already holds `step`
/// (after its increment): the engine's calls and the self-test build it the same way.
inline AdamWRange adamw_range(const AdamWTensor& t, const AdamWConfig& config, GradientRead read,
                              float step) {
  const bool torch = config.formula == AdamWFormula::torch;
  const std::size_t w = config.torch_tail_width > 1 ? config.torch_tail_width : 1;
  const std::size_t n = t.param.numel;
  const float* dst[] = {static_cast<const float*>(t.param.data),
                        static_cast<const float*>(t.exp_avg.data),
                        static_cast<const float*>(t.exp_avg_sq.data)};
  const float* src[] = {::stepcore::detail::source_or(t.param_src, t.param),
                        ::stepcore::detail::source_or(t.exp_avg_src, t.exp_avg),
                        ::stepcore::detail::source_or(t.exp_avg_sq_src, t.exp_avg_sq)};
  return AdamWRange{static_cast<float*>(t.param.data),
                    static_cast<float*>(t.exp_avg.data),
                    static_cast<float*>(t.exp_avg_sq.data),
                    src[0],
                    src[1],
                    src[2],
                    t.grad.data,
                    t.compute_param.data,
                    prepare_adamw_scalars(config, step),
                    read,
                    torch ? n - n % w : n,
                    torch,
                    stream_mask(dst, src, 3)};
}

/// Returns the range record of one SignSGD tensor (the engine's and the self-test's).
inline SignSgdRange sign_sgd_range(const SignSgdTensor& t, const SignSgdScalars& scalars) {
  const float* dst = static_cast<const float*>(t.param.data);
  const float* src = ::stepcore::detail::source_or(t.param_src, t.param);
  return SignSgdRange{
      static_cast<float*>(t.param.data), src, t.grad.data, t.compute_param.data, scalars,
      stream_mask(&dst, &src, 1) != 0};
}

/// Elements per norm block: squares are summed in binary64 within a block and the
/// block sum is deposited exactly. Must not exceed kNormMaxBlockAdditions.
inline constexpr std::size_t kNormBlockElements = 2048;
static_assert(kNormBlockElements <= static_cast<std::size_t>(kNormMaxBlockAdditions));

}  // namespace stepcore::cpu::detail
