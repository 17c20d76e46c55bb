// The AVX2 + FMA3 out-of-place kernels (UnitKernels::streamed of every unit):
// the generic body's streamed entry points over ArchOps<Avx2>, compiled with the
// ISA's -m flags apart from isa_avx2.cpp (see there).
#include "cpu/arch_avx2.hpp"

namespace stepcore::cpu::detail {

void fill_streamed_avx2(KernelTable& t) { Body<Avx2>::fill_streamed(t); }

}  // namespace stepcore::cpu::detail
