// The AVX-512 kernel table: the generic body over ArchOps<Avx512>
// (arch_avx512.hpp), compiled with the ISA's -m flags. Its out-of-place kernels (streaming
// stores) come from isa_avx512_streamed.cpp, a unit of their own, so that the in-place
// kernels compiled here, and the compiler's inlining budget for them, stay as they are.
#include "cpu/arch_avx512.hpp"

namespace stepcore::cpu::detail {

const KernelTable& kernel_table_avx512() {
  static const KernelTable table = [] {
    KernelTable t = Body<Avx512>::make_table("avx512");
    fill_streamed_avx512(t);
    return t;
  }();
  return table;
}

}  // namespace stepcore::cpu::detail
