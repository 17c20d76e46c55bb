// A fuzz input read as a stream of typed values (what every harness decodes its case
// from): reads past the end return zeros, so every byte string is a valid case.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace fuzz {

class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  /// The next `n` bytes as a little-endian unsigned integer (n <= 8).
  std::uint64_t bytes(int n) {
    std::uint64_t v = 0;
    for (int k = 0; k < n; ++k) v |= static_cast<std::uint64_t>(byte()) << (8 * k);
    return v;
  }
  std::uint8_t byte() { return at_ < size_ ? data_[at_++] : 0; }
  std::uint32_t u32() { return static_cast<std::uint32_t>(bytes(4)); }
  std::uint64_t u64() { return bytes(8); }
  /// A value in [0, n) (n > 0).
  std::uint32_t below(std::uint32_t n) { return static_cast<std::uint32_t>(bytes(2) % n); }
  bool flag() { return (byte() & 1) != 0; }
  float f32() {
    const std::uint32_t b = u32();
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
  }
  bool empty() const { return at_ >= size_; }
  /// How many bytes have been read (the next byte's offset).
  std::size_t position() const { return at_; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

/// A hyper-parameter from a table of specials (NaN, Inf, subnormal, huge, negative,
/// zero, one) or raw bits.
inline double special(Input& in) {
  static const double table[] = {0.0,   -0.0, 1.0,   -1.0,    1e-3,      0.9,  0.999,
                                 1e-8,  1e30, -1e30, 1e-310,  1e-45,     2.0,  0.5,
                                 1e300, 0.1,  1e-2,  0.99999, 1 - 1e-12, 3e-4, 1e-6};
  const std::uint8_t k = in.byte();
  if (k < 2 * (sizeof table / sizeof table[0])) return table[k / 2];
  if (k < 240) {
    const double nan = __builtin_nan(""), inf = __builtin_inf();
    return (k & 3) == 0   ? nan
           : (k & 3) == 1 ? inf
           : (k & 3) == 2 ? -inf
                          : static_cast<double>(in.f32());
  }
  double d;
  const std::uint64_t b = in.u64();
  std::memcpy(&d, &b, sizeof d);
  return d;
}

}  // namespace fuzz
