// Test hooks of the scalar reference (internal, not installed).
#pragma once

#include <cstdint>

namespace stepcore::reference::testing {

/// Returns the exact binary32 value of x^2 * 2^298 split as M^2 * 2^shift: the spec's
/// per-element contribution to the norm. x must be finite.
void square_units(float x, std::uint64_t& mantissa_squared, int& shift);
/// Returns the exact binary32 value of |x| * 2^149 split as M * 2^shift: the 1-norm's
/// per-element contribution. x must be finite.
void abs_units(float x, std::uint64_t& mantissa, int& shift);

}  // namespace stepcore::reference::testing
