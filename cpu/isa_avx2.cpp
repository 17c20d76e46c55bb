// The AVX2 + FMA3 kernel table: the generic body over ArchOps<Avx2>
// (arch_avx2.hpp), compiled with the ISA's -m flags. Its out-of-place kernels (streaming
// stores) come from isa_avx2_streamed.cpp, a unit of their own, so that the in-place
// kernels compiled here, and the compiler's inlining budget for them, stay as they are.
#include "cpu/arch_avx2.hpp"

namespace stepcore::cpu::detail {

const KernelTable& kernel_table_avx2() {
  static const KernelTable table = [] {
    KernelTable t = Body<Avx2>::make_table("avx2");
    fill_streamed_avx2(t);
    return t;
  }();
  return table;
}

}  // namespace stepcore::cpu::detail
