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
/// The code of the signed (non_negative false) or unsigned map nearest to y: N(y) of
/// docs/numerics.md 8f (ties away from zero, NaN to the zero code).
std::uint8_t q8_nearest(float y, bool non_negative);
/// torchao's quantizer of the same map (docs/numerics.md 8f.1) on y = x / max(a, 1e-12).
std::uint8_t q8_torchao(float y, bool non_negative);

}  // namespace stepcore::reference::testing
