// The NEON out-of-place kernels (UnitKernels::streamed of every unit): the generic body's
// streamed entry points over ArchOps<xsimd::neon64>, apart from isa_neon.cpp.
#include "cpu/arch_neon.hpp"

namespace stepcore::cpu::detail {

void fill_streamed_neon(KernelTable& t) { Body<xsimd::neon64>::fill_streamed(t); }

}  // namespace stepcore::cpu::detail
