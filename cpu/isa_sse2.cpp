// The SSE2 kernel table: the generic body over ArchOps<xsimd::sse2>
// (arch_sse2.hpp), compiled with the ISA's -m flags. Its out-of-place kernels (streaming
// stores) come from isa_sse2_streamed.cpp, a unit of their own, so that the in-place
// kernels compiled here, and the compiler's inlining budget for them, stay as they are.
#include "cpu/arch_sse2.hpp"

namespace stepcore::cpu::detail {

const KernelTable& kernel_table_sse2() {
  static const KernelTable table = [] {
    KernelTable t = Body<xsimd::sse2>::make_table("sse2");
    fill_streamed_sse2(t);
    return t;
  }();
  return table;
}

}  // namespace stepcore::cpu::detail
