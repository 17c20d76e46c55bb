// Test hooks of the CPU engine (never installed, not part of the API): replace an
// ISA's kernel table, e.g. with one whose kernel is deliberately wrong, to exercise the
// self-test's fallback and its error.
#pragma once

#include "cpu/kernel_table.hpp"
#include "stepcore/cpu.hpp"

namespace stepcore::cpu::testing {

/// Makes engines (and the self-test) of `isa` use `table` (nullptr: the built-in one
/// again) and forgets that ISA's self-test result and warning, so the next engine or
/// self_test(isa) call runs the self-test afresh. `table` must outlive its use.
void override_kernel_table(Isa isa, const detail::KernelTable* table);

/// Returns the built-in kernel table of `isa` (to copy and modify).
const detail::KernelTable& builtin_kernel_table(Isa isa);

}  // namespace stepcore::cpu::testing
