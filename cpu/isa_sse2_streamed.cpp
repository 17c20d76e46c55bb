// The SSE2 out-of-place kernels (UnitKernels::streamed of every unit):
// the generic body's streamed entry points over ArchOps<xsimd::sse2>, compiled with the
// ISA's -m flags apart from isa_sse2.cpp (see there).
#include "cpu/arch_sse2.hpp"

namespace stepcore::cpu::detail {

void fill_streamed_sse2(KernelTable& t) { Body<xsimd::sse2>::fill_streamed(t); }

}  // namespace stepcore::cpu::detail
