// The AVX-512 out-of-place kernels (UnitKernels::streamed of every unit):
// the generic body's streamed entry points over ArchOps<Avx512>, compiled with the
// ISA's -m flags apart from isa_avx512.cpp (see there).
#include "cpu/arch_avx512.hpp"

namespace stepcore::cpu::detail {

void fill_streamed_avx512(KernelTable& t) { Body<Avx512>::fill_streamed(t); }

}  // namespace stepcore::cpu::detail
