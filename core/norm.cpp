// The host entry points of norm.hpp: merging and normalising partials (the digit arithmetic
// of core/superaccumulator.hpp) and the final rounding of the exact 2- and 1-norms (the
// shared __host__ __device__ body in core/norm_finalize.hpp) under the spec's
// floating-point environment.
#include "stepcore/norm.hpp"

#include <cstring>

#include "core/fp_env.hpp"
#include "core/norm_finalize.hpp"
#include "core/superaccumulator.hpp"

namespace stepcore {

void merge(NormPartial& a, const NormPartial& b) noexcept { detail::merge_partials(a, b); }

bool normalize(NormPartial& partial) noexcept { return detail::normalize_digits(partial.digits); }

NormResult finalize(const NormPartial& partial) { return finalize(partial, NormOrder::two); }

NormResult finalize(const NormPartial& partial, NormOrder order) {
  const detail::FpEnvGuard env;
  return detail::finalize_partial(partial, order);
}

bool same_value(const NormPartial& a, const NormPartial& b) {
  std::uint64_t da[kNormDigits], db[kNormDigits];
  std::memcpy(da, a.digits, sizeof da);
  std::memcpy(db, b.digits, sizeof db);
  detail::normalize_digits(da);
  detail::normalize_digits(db);
  return std::memcmp(da, db, sizeof da) == 0 && a.nan_count == b.nan_count &&
         a.inf_count == b.inf_count && a.max_abs_bits == b.max_abs_bits;
}

}  // namespace stepcore
