// The per-ISA kernel table: plain function pointers filled by each ISA's translation
// units (isa_sse2.cpp, isa_avx2.cpp, isa_avx512.cpp and their *_streamed.cpp) from the
// one generic body in simd_body.hpp. The engine picks a table at run time and resolves
// dtype combinations to entries before it opens a parallel region.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/optimizers/all.hpp"
#include "core/q8.hpp"
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

/// Returns the destinations (bit k: pair k of `count`) that take streaming stores: those
/// out of place (dst[k] != src[k]; validation makes an out-of-place source disjoint from
/// every destination, so nothing reads the line again within the call) whose addresses
/// agree modulo kStreamAlignment with the most out-of-place destinations (the first of
/// them on a tie), so that one peeled head aligns every streamed destination at once.
inline unsigned stream_mask(void* const* dst, const void* const* src, int count) {
  auto offset = [](const void* p) {
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

/// Arguments of one range of unit Opt's step: elements [begin, end) of one tensor. The
/// old parameter and state are read from src (the destinations themselves for an
/// in-place step), the new ones written to dst (index 0 the parameter, 1 + s slot s), all
/// in one storage type (the kernel's: f32, or the model's bf16/f16); `stream` (bit k:
/// dst[k]; stream_mask) names the destinations written with streaming stores, 0 for an
/// in-place step and for 16-bit storage.
template <class Opt>
struct UnitRange {
  static_assert(Opt::kSlots <= kMaxOptimizerSlots, "a unit has at most kMaxOptimizerSlots");
  static constexpr int kArrays = 1 + Opt::kSlots;
  void* dst[kArrays];
  const void* src[kArrays];
  const void* grad;
  void* out;
  typename Opt::Scalars scalars;
  GradientRead read;
  std::size_t tail_begin;  ///< elements >= tail_begin use the unit's tail form
  int variant;             ///< Opt::variant(config)
  unsigned stream;
};

template <class Opt>
using UnitFn = void (*)(const UnitRange<Opt>&, std::size_t begin, std::size_t end);

/// A tensor's 8-bit state slots as a kernel reads them (docs/numerics.md 8f): its used
/// slots (all 8-bit: validation; 0 when it has none), each slot's codes and block maxima
/// (from the tensor's first element), and the codebook of its map under the variant's rule.
struct Q8Slots {
  int slots = 0;
  int grad_dtype = 0;   ///< the gradient's DType, as an int
  int output_kind = 0;  ///< the compute output's kind (output_kind): f32 params only
  std::uint8_t* codes[kMaxOptimizerSlots] = {};
  float* absmax[kMaxOptimizerSlots] = {};
  const ::stepcore::detail::Q8Codebook* codebook[kMaxOptimizerSlots] = {};
};

/// Unit Opt's step over elements [begin, end) of a tensor with 8-bit slots `q` (the range's
/// slot pointers unused); begin on a block boundary (kQ8BlockSize).
template <class Opt>
using Q8Fn = void (*)(const UnitRange<Opt>&, const Q8Slots& q, std::size_t begin, std::size_t end);

/// One unit's kernels: `step` indexed [param and state dtype][gradient dtype][output kind],
/// in place (or out of place with plain stores); bf16/f16 params have only output kind 0
/// (validation refuses a compute output for them). `streamed` ([gradient dtype][output
/// kind], f32 params only) for ranges with streamed destinations (UnitRange::stream != 0:
/// out of place, streaming stores, which the caller must fence (sfence) before another
/// thread reads them; the engine picks per range).
/// `q8` ([param dtype]; units that take 8-bit slots, else null): a tensor whose used slots
/// are 8-bit (docs/numerics.md 8f), in place, the gradient's dtype and the output kind
/// read from its Q8Slots.
template <class Opt>
struct UnitKernels {
  UnitFn<Opt> step[kDTypes][kDTypes][kOutputKinds];
  UnitFn<Opt> streamed[kDTypes][kOutputKinds];
  Q8Fn<Opt> q8[kDTypes];
};

/// The kernels of every unit of a UnitList, found by unit: tables.of<AdamW>().
template <class List>
struct UnitTables;
template <class... Units>
struct UnitTables<::stepcore::detail::UnitList<Units...>> : UnitKernels<Units>... {
  template <class Opt>
  UnitKernels<Opt>& of() {
    return *this;
  }
  template <class Opt>
  const UnitKernels<Opt>& of() const {
    return *this;
  }
};

using AccumulateFn = void (*)(float* acc, const void* src, bool copy, std::size_t begin,
                              std::size_t end);
using ScaleFn = void (*)(void* data, float scale, std::size_t begin, std::size_t end);
/// Adds the norm partial of elements [begin, end) (approximate, block-summed, or exact).
using NormFn = void (*)(const void* data, const GradientRead& read, std::size_t begin,
                        std::size_t end, NormPartial& partial);

/// x[i] = M[codes[i]] * absmax over [0, n) (docs/numerics.md 8f), M: the map's f32 patterns
/// (the q8 kernels dequantize in their own loop; the tests check this one per ISA).
using Q8DequantizeFn = void (*)(const std::uint8_t* codes, float absmax, const std::uint32_t* map,
                                float* x, std::size_t n);
/// Requantizes one block's values x[0, n): writes the codes, returns the stored maximum.
using Q8RequantizeFn = float (*)(const float* x, std::size_t n,
                                 const ::stepcore::detail::Q8Codebook& codebook,
                                 std::uint8_t* codes);

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
  UnitTables<::stepcore::detail::AllUnits> units;  ///< every optimizer unit's step
  Q8DequantizeFn q8_dequantize;                    ///< a block of an 8-bit slot, to f32
  Q8RequantizeFn q8_requantize;                    ///< a block's new f32 values, to codes
  AccumulateFn accumulate[kDTypes];
  ScaleFn scale[kDTypes];
  NormFn norm[kNormOrders][kDTypes];        ///< [NormOrder][dtype]: block-summed partial
  NormFn norm_exact[kNormOrders][kDTypes];  ///< exact partial, one deposit per element
};

/// Each returns its ISA's table; defined in isa_<name>.cpp, compiled with that
/// ISA's -m flags. Callers must check the processor supports the ISA first.
/// x86-64 builds define the first three, aarch64 builds the last.
const KernelTable& kernel_table_sse2();
const KernelTable& kernel_table_avx2();
const KernelTable& kernel_table_avx512();
const KernelTable& kernel_table_neon();
/// Each fills its ISA's streamed unit entries (UnitKernels::streamed); defined in
/// isa_<name>_streamed.cpp, called by kernel_table_<name>().
void fill_streamed_sse2(KernelTable& t);
void fill_streamed_avx2(KernelTable& t);
void fill_streamed_avx512(KernelTable& t);
void fill_streamed_neon(KernelTable& t);

/// Returns the range record of one tensor of unit Opt over `arrays` (the parameter, then
/// each slot: destination and its optional source, all in the param's dtype), its counter
/// holding `step` (after its increment): the engine's calls and the self-test build it
/// the same way. A bf16/f16 param takes torch's reduced-precision tail (twice the f32
/// lanes, docs/numerics.md 7.3) and no streaming stores.
template <class Opt>
UnitRange<Opt> unit_range(const typename Opt::Config& config, float step, GradientRead read,
                          const TensorView* dst, const ConstTensorView* src, const void* grad,
                          const TensorView& out) {
  UnitRange<Opt> r{};
  for (int k = 0; k < UnitRange<Opt>::kArrays; ++k) {
    r.dst[k] = dst[k].data;
    r.src[k] = ::stepcore::detail::source_data_or(src[k], dst[k]);
  }
  const bool f32 = dst[0].dtype == DType::f32;
  r.grad = grad;
  r.out = out.data;
  r.scalars = ::stepcore::detail::unit_scalars<Opt>(config, step);
  r.read = read;
  r.tail_begin = Opt::tail_begin(config, dst[0].numel, f32 ? 1 : 2);
  r.variant = Opt::variant(config);
  r.stream = f32 ? stream_mask(r.dst, r.src, UnitRange<Opt>::kArrays) : 0u;
  return r;
}

/// Elements per norm block: squares (or |x|, the 1-norm) are summed in binary64 within a
/// block and the block sum is deposited exactly. Must not exceed kNormMaxBlockAdditions.
inline constexpr std::size_t kNormBlockElements = 2048;
static_assert(kNormBlockElements <= static_cast<std::size_t>(kNormMaxBlockAdditions));

}  // namespace stepcore::cpu::detail
