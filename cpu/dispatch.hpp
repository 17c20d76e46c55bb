// The engine's internal view of its ISAs: which ones this processor runs, the kernel
// table in force for each (the built-in one, or a test's replacement: registry.cpp), the
// once-per-ISA warning of a failed self-test, and the self-test itself. Not installed.
#pragma once

#include "cpu/kernel_table.hpp"
#include "stepcore/cpu.hpp"

namespace stepcore::cpu::detail {

/// Returns true when this processor can run `isa`'s kernels.
bool isa_supported(Isa isa);

/// Returns the kernel table the engine runs for `isa` (the caller checked support).
const KernelTable& kernel_table(Isa isa);

/// Returns true the first time it is called for `isa` in this process (or since a
/// test replaced that ISA's table): the caller then prints its warning.
bool warn_once_about(Isa isa);

/// Runs the known-answer self-test of `isa`'s kernels in `table` (cpu/self_test.cpp) and
/// returns its result, timed. cpu::self_test records it once per process (registry.cpp).
SelfTestResult run_self_test(Isa isa, const KernelTable& table);

}  // namespace stepcore::cpu::detail
