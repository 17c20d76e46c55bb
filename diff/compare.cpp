// compare_arrays: a block-wise memcmp finds the equal stretches at memory speed; only
// blocks that differ are walked element by element. The median ulp distance is exact:
// a histogram with one bucket per distance below 2^16 and one per 2^16-wide range above
// (f32 distances are below 2^32); a median that lands in a wide range is resolved by a
// second pass over that array counting the low 16 bits of the distances in that range.
#include "diff/compare.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>

namespace stepcore::diff {

// The data are read in place: safetensors is little-endian.
static_assert(std::endian::native == std::endian::little,
              "stepcore-diff needs a little-endian host");

namespace {

constexpr std::uint64_t kBuckets = 1u << 16;
constexpr std::uint64_t kChunk = 1u << 20;  // elements per chunk of a large array
constexpr std::uint64_t kSmallBytes = 8u << 20;
constexpr std::uint64_t kBlockBytes = 4096;  // memcmp granularity
constexpr std::uint64_t kNone = std::numeric_limits<std::uint64_t>::max();

// An exact histogram of distances below 2^32 (see the file comment). Its 1 MiB of
// buckets is allocated at the first add, and cleared through the lists of touched
// buckets, so a clear costs what was used.
class UlpHistogram {
 public:
  void add(std::uint64_t d, std::uint64_t n = 1) {
    if (fine_.empty()) {
      fine_.assign(kBuckets, 0);
      coarse_.assign(kBuckets, 0);
    }
    if (d < kBuckets) {
      if (fine_[d] == 0) fine_touched_.push_back(static_cast<std::uint32_t>(d));
      fine_[d] += n;
    } else {
      const std::uint64_t c = d >> 16;
      if (coarse_[c] == 0) coarse_touched_.push_back(static_cast<std::uint32_t>(c));
      coarse_[c] += n;
    }
    count_ += n;
  }
  std::uint64_t count() const { return count_; }

  // Adds everything to `dst` and clears this one.
  void drain_into(UlpHistogram& dst) {
    for (std::uint32_t d : fine_touched_) dst.add(d, fine_[d]);
    for (std::uint32_t c : coarse_touched_) dst.add(std::uint64_t{c} << 16, coarse_[c]);
    clear();
  }
  void clear() {
    for (std::uint32_t d : fine_touched_) fine_[d] = 0;
    for (std::uint32_t c : coarse_touched_) coarse_[c] = 0;
    fine_touched_.clear();
    coarse_touched_.clear();
    count_ = 0;
  }

  // Where the value of 0-based rank k (k < count()) lies: an exact value, or the wide
  // bucket (distance >> 16) holding it and its rank among that bucket's values.
  struct Place {
    bool exact;
    std::uint64_t value;
    std::uint64_t rank_in_bucket;
  };
  Place locate(std::uint64_t k) {
    std::sort(fine_touched_.begin(), fine_touched_.end());
    std::sort(coarse_touched_.begin(), coarse_touched_.end());
    for (std::uint32_t d : fine_touched_) {
      if (k < fine_[d]) return {true, d, 0};
      k -= fine_[d];
    }
    for (std::uint32_t c : coarse_touched_) {
      if (k < coarse_[c]) return {false, c, k};
      k -= coarse_[c];
    }
    return {true, 0, 0};  // unreachable for k < count()
  }

 private:
  std::vector<std::uint64_t> fine_, coarse_;
  std::vector<std::uint32_t> fine_touched_, coarse_touched_;
  std::uint64_t count_ = 0;
};

// One thread's running totals over the ranges it compared.
struct Accum {
  std::uint64_t differing = 0, first = kNone;
  std::uint64_t nan_vs_number = 0, nan_payload = 0, inf = 0, signed_zero = 0, max_ulps = 0;
  std::array<std::uint64_t, 34> log2{};
  UlpHistogram hist;

  void reset() {
    differing = nan_vs_number = nan_payload = inf = signed_zero = max_ulps = 0;
    first = kNone;
    log2.fill(0);
    hist.clear();
  }
  // Adds `o` into this one and resets `o`.
  void absorb(Accum& o) {
    differing += o.differing;
    first = std::min(first, o.first);
    nan_vs_number += o.nan_vs_number;
    nan_payload += o.nan_payload;
    inf += o.inf;
    signed_zero += o.signed_zero;
    max_ulps = std::max(max_ulps, o.max_ulps);
    for (std::size_t k = 0; k < log2.size(); ++k) log2[k] += o.log2[k];
    o.hist.drain_into(hist);
    o.reset();
  }
};

// Per thread: the totals and the histogram of a median's second pass.
struct Workspace {
  Accum acc;
  UlpHistogram fine;
};

template <class U, U kSign, U kInf>
struct FloatBits {
  using Bits = U;
  static constexpr U sign = kSign;
  static constexpr U mag = static_cast<U>(kSign - 1);
  static constexpr U inf = kInf;
  static std::int64_t ordered(U u) {
    return (u & sign) ? -static_cast<std::int64_t>(u & mag) : static_cast<std::int64_t>(u);
  }
};
using F32 = FloatBits<std::uint32_t, 0x80000000u, 0x7F800000u>;
using BF16 = FloatBits<std::uint16_t, 0x8000u, 0x7F80u>;
using F16 = FloatBits<std::uint16_t, 0x8000u, 0x7C00u>;

template <class U>
U load(const std::byte* p, std::uint64_t i) {
  U u;
  std::memcpy(&u, p + i * sizeof(U), sizeof(U));
  return u;
}

// Calls f(i) for every index in [begin, end) whose element's bytes differ, in order.
template <std::size_t S, class F>
void for_each_difference(const ArrayPair& p, std::uint64_t begin, std::uint64_t end, F&& f) {
  constexpr std::uint64_t block = kBlockBytes / S;
  for (std::uint64_t i0 = begin; i0 < end; i0 += block) {
    const std::uint64_t i1 = std::min(end, i0 + block);
    if (std::memcmp(p.a + i0 * S, p.b + i0 * S, (i1 - i0) * S) == 0) continue;
    for (std::uint64_t i = i0; i < i1; ++i)
      if (std::memcmp(p.a + i * S, p.b + i * S, S) != 0) f(i);
  }
}

template <class T>
void scan_float(const ArrayPair& p, std::uint64_t begin, std::uint64_t end, Accum& acc) {
  using U = typename T::Bits;
  for_each_difference<sizeof(U)>(p, begin, end, [&](std::uint64_t i) {
    const U ua = load<U>(p.a, i), ub = load<U>(p.b, i);
    ++acc.differing;
    acc.first = std::min(acc.first, i);
    const U ma = ua & T::mag, mb = ub & T::mag;
    const bool na = ma > T::inf, nb = mb > T::inf;
    if (na || nb) {
      ++(na && nb ? acc.nan_payload : acc.nan_vs_number);
      return;
    }
    if (ma == T::inf || mb == T::inf) {
      ++acc.inf;
    } else if (ma == 0 && mb == 0) {
      ++acc.signed_zero;
    }
    const std::int64_t d = T::ordered(ua) - T::ordered(ub);
    const std::uint64_t ad = d < 0 ? static_cast<std::uint64_t>(-d) : static_cast<std::uint64_t>(d);
    acc.max_ulps = std::max(acc.max_ulps, ad);
    ++acc.log2[static_cast<std::size_t>(std::bit_width(ad))];
    acc.hist.add(ad);
  });
}

// The second pass of a median: the low 16 bits of every ulp distance in wide bucket `c`.
template <class T>
void refine_float(const ArrayPair& p, std::uint64_t begin, std::uint64_t end, std::uint64_t c,
                  UlpHistogram& fine) {
  using U = typename T::Bits;
  for_each_difference<sizeof(U)>(p, begin, end, [&](std::uint64_t i) {
    const U ua = load<U>(p.a, i), ub = load<U>(p.b, i);
    if ((ua & T::mag) > T::inf || (ub & T::mag) > T::inf) return;
    const std::int64_t d = T::ordered(ua) - T::ordered(ub);
    const std::uint64_t ad = d < 0 ? static_cast<std::uint64_t>(-d) : static_cast<std::uint64_t>(d);
    if ((ad >> 16) == c) fine.add(ad & 0xFFFFu);
  });
}

template <std::size_t S>
void scan_bits(const ArrayPair& p, std::uint64_t begin, std::uint64_t end, Accum& acc) {
  for_each_difference<S>(p, begin, end, [&](std::uint64_t i) {
    ++acc.differing;
    acc.first = std::min(acc.first, i);
  });
}

void scan(const ArrayPair& p, std::uint64_t begin, std::uint64_t end, Accum& acc) {
  switch (p.dtype) {
    case DType::f32:
      return scan_float<F32>(p, begin, end, acc);
    case DType::bf16:
      return scan_float<BF16>(p, begin, end, acc);
    case DType::f16:
      return scan_float<F16>(p, begin, end, acc);
    default:
      break;
  }
  switch (dtype_size(p.dtype)) {
    case 1:
      return scan_bits<1>(p, begin, end, acc);
    case 2:
      return scan_bits<2>(p, begin, end, acc);
    case 4:
      return scan_bits<4>(p, begin, end, acc);
    default:
      return scan_bits<8>(p, begin, end, acc);
  }
}

void refine(const ArrayPair& p, std::uint64_t begin, std::uint64_t end, std::uint64_t c,
            UlpHistogram& fine) {
  // Only f32 has distances of 2^16 and more (bf16 and f16 stay below 0xFF01).
  if (p.dtype == DType::f32) refine_float<F32>(p, begin, end, c, fine);
}

// The statistics of `acc` (all of p's differences merged in). `second_pass(c)` returns
// the histogram of the low 16 bits of p's distances in wide bucket c.
template <class SecondPass>
ElementStats finish(const ArrayPair& p, Accum& acc, SecondPass&& second_pass) {
  ElementStats s;
  s.elements = p.elements;
  s.differing = acc.differing;
  if (acc.first != kNone) s.first_index = acc.first;
  s.nan_vs_number = acc.nan_vs_number;
  s.nan_payload = acc.nan_payload;
  s.inf = acc.inf;
  s.signed_zero = acc.signed_zero;
  s.max_ulps = acc.max_ulps;
  s.ulp_log2 = acc.log2;
  s.ulp_counted = acc.hist.count();
  if (s.ulp_counted == 0) return s;
  std::uint64_t refined = kNone;  // the wide bucket whose second pass is at hand
  UlpHistogram* fine = nullptr;
  const auto value_at = [&](std::uint64_t k) -> std::uint64_t {
    const UlpHistogram::Place at = acc.hist.locate(k);
    if (at.exact) return at.value;
    if (refined != at.value) {
      fine = &second_pass(at.value);
      refined = at.value;
    }
    return (at.value << 16) | fine->locate(at.rank_in_bucket).value;
  };
  // The lower median (an integer, the Python comparer's too): the ((k - 1) / 2)-th smallest.
  s.median_ulps = value_at((s.ulp_counted - 1) / 2);
  return s;
}

}  // namespace

std::int64_t ordered_bits(DType t, std::uint32_t bits) {
  switch (t) {
    case DType::bf16:
      return BF16::ordered(static_cast<std::uint16_t>(bits));
    case DType::f16:
      return F16::ordered(static_cast<std::uint16_t>(bits));
    default:
      return F32::ordered(bits);
  }
}

std::optional<std::uint64_t> ulp_distance(DType t, std::uint32_t a_bits, std::uint32_t b_bits) {
  const std::uint32_t mag = t == DType::f32 ? 0x7FFFFFFFu : 0x7FFFu;
  const std::uint32_t inf = t == DType::f32 ? 0x7F800000u : t == DType::bf16 ? 0x7F80u : 0x7C00u;
  if ((a_bits & mag) > inf || (b_bits & mag) > inf) return std::nullopt;
  const std::int64_t d = ordered_bits(t, a_bits) - ordered_bits(t, b_bits);
  return d < 0 ? static_cast<std::uint64_t>(-d) : static_cast<std::uint64_t>(d);
}

std::vector<ElementStats> compare_arrays(const std::vector<ArrayPair>& pairs, int threads) {
  threads = std::max(threads, 1);
  std::vector<ElementStats> out(pairs.size());
  std::vector<Workspace> ws(static_cast<std::size_t>(threads));
  std::vector<std::size_t> small, large;
  for (std::size_t i = 0; i < pairs.size(); ++i)
    (pairs[i].elements * dtype_size(pairs[i].dtype) < kSmallBytes ? small : large).push_back(i);

  // Small arrays: each compared whole by one thread.
  const auto n_small = static_cast<std::int64_t>(small.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (std::int64_t j = 0; j < n_small; ++j) {
    Workspace& w = ws[static_cast<std::size_t>(omp_get_thread_num())];
    const ArrayPair& p = pairs[small[static_cast<std::size_t>(j)]];
    w.acc.reset();
    scan(p, 0, p.elements, w.acc);
    out[small[static_cast<std::size_t>(j)]] =
        finish(p, w.acc, [&](std::uint64_t c) -> UlpHistogram& {
          w.fine.clear();
          refine(p, 0, p.elements, c, w.fine);
          return w.fine;
        });
  }

  // Large arrays: one at a time, in chunks over all threads, merged into thread 0's.
  for (std::size_t i : large) {
    const ArrayPair& p = pairs[i];
    const auto chunks = static_cast<std::int64_t>((p.elements + kChunk - 1) / kChunk);
    const auto range = [&](std::int64_t c, std::uint64_t& b, std::uint64_t& e) {
      b = static_cast<std::uint64_t>(c) * kChunk;
      e = std::min(p.elements, b + kChunk);
    };
    for (Workspace& w : ws) w.acc.reset();
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (std::int64_t c = 0; c < chunks; ++c) {
      std::uint64_t b, e;
      range(c, b, e);
      scan(p, b, e, ws[static_cast<std::size_t>(omp_get_thread_num())].acc);
    }
    for (std::size_t t = 1; t < ws.size(); ++t) ws[0].acc.absorb(ws[t].acc);
    out[i] = finish(p, ws[0].acc, [&](std::uint64_t wide) -> UlpHistogram& {
      for (Workspace& w : ws) w.fine.clear();
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
      for (std::int64_t c = 0; c < chunks; ++c) {
        std::uint64_t b, e;
        range(c, b, e);
        refine(p, b, e, wide, ws[static_cast<std::size_t>(omp_get_thread_num())].fine);
      }
      for (std::size_t t = 1; t < ws.size(); ++t) ws[t].fine.drain_into(ws[0].fine);
      return ws[0].fine;
    });
  }
  return out;
}

}  // namespace stepcore::diff
