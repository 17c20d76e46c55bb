// The NEON kernel table (aarch64 builds): the generic body over ArchOps<xsimd::neon64>
// (arch_neon.hpp). Its out-of-place kernels come from isa_neon_streamed.cpp, a unit of
// their own as on x86 (isa_sse2.cpp explains why).
#include "cpu/arch_neon.hpp"

namespace stepcore::cpu::detail {

const KernelTable& kernel_table_neon() {
  static const KernelTable table = [] {
    KernelTable t = Body<xsimd::neon64>::make_table("neon");
    fill_streamed_neon(t);
    return t;
  }();
  return table;
}

}  // namespace stepcore::cpu::detail
