// The ISA dispatch registry: each ISA's kernel table in force (the built-in one, or a
// test's replacement through cpu/testing.hpp), the once-per-process record of each ISA's
// self-test result (cpu::self_test; the test itself is cpu/self_test.cpp), and the
// once-per-ISA warning of a failed self-test.
#include <atomic>
#include <mutex>
#include <optional>
#include <string>

#include "cpu/dispatch.hpp"
#include "cpu/testing.hpp"
#include "stepcore/error.hpp"

namespace stepcore::cpu {
namespace {

using detail::KernelTable;

struct Registry {
  std::mutex mutex;  ///< guards results and warned (not the hot-path table lookup)
  std::optional<SelfTestResult> results[kIsaCount];
  bool warned[kIsaCount] = {};
  /// A test's replacement tables; read on every engine call, so atomic, not locked.
  std::atomic<const KernelTable*> overrides[kIsaCount] = {};
};

Registry& registry() {
  static Registry r;
  return r;
}

const KernelTable& builtin_table(Isa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case Isa::sse2:
      return detail::kernel_table_sse2();
    case Isa::avx2:
      return detail::kernel_table_avx2();
    case Isa::avx512:
      return detail::kernel_table_avx512();
#elif defined(__aarch64__)
    case Isa::neon:
      return detail::kernel_table_neon();
#endif
    default:
      break;
  }
  throw Error(Errc::not_supported, "isa",
              std::string(isa_name(isa)) + " has no kernels in this build (another target's ISA)");
}

/// The table engines of `isa` run: a test's replacement, else the built-in one.
const KernelTable& table_in_force(Isa isa) {
  const KernelTable* t =
      registry().overrides[static_cast<int>(isa)].load(std::memory_order_acquire);
  return t != nullptr ? *t : builtin_table(isa);
}

}  // namespace

namespace detail {

const KernelTable& kernel_table(Isa isa) { return table_in_force(isa); }

bool warn_once_about(Isa isa) {
  Registry& reg = registry();
  const std::lock_guard<std::mutex> lock(reg.mutex);
  const bool first = !reg.warned[static_cast<int>(isa)];
  reg.warned[static_cast<int>(isa)] = true;
  return first;
}

}  // namespace detail

namespace testing {

void override_kernel_table(Isa isa, const detail::KernelTable* table) {
  Registry& reg = registry();
  const std::lock_guard<std::mutex> lock(reg.mutex);
  reg.overrides[static_cast<int>(isa)].store(table, std::memory_order_release);
  reg.results[static_cast<int>(isa)].reset();
  reg.warned[static_cast<int>(isa)] = false;
}

const detail::KernelTable& builtin_kernel_table(Isa isa) { return builtin_table(isa); }

}  // namespace testing

SelfTestResult self_test(Isa isa) {
  if (static_cast<int>(isa) >= kIsaCount)
    throw Error(Errc::invalid_argument, "isa", "not an Isa enumerator");
  if (!detail::isa_supported(isa))
    throw Error(Errc::not_supported, "isa",
                "this processor cannot run " + std::string(isa_name(isa)));
  Registry& reg = registry();
  const std::lock_guard<std::mutex> lock(reg.mutex);
  std::optional<SelfTestResult>& slot = reg.results[static_cast<int>(isa)];
  if (!slot) slot = detail::run_self_test(isa, table_in_force(isa));
  return *slot;
}

}  // namespace stepcore::cpu
