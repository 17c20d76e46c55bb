// Element types stepcore reads and writes, and their storage structs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "stepcore/config.hpp"

namespace stepcore {

/// Storage type of a tensor's elements. All arithmetic happens in IEEE binary32.
enum class DType : std::uint8_t {
  f32 = 0,   ///< IEEE binary32
  bf16 = 1,  ///< bfloat16: 1 sign, 8 exponent, 7 fraction bits
  f16 = 2,   ///< IEEE binary16: 1 sign, 5 exponent, 10 fraction bits
};

/// bfloat16 storage: the raw 16 bits. Distinct type so templates can dispatch on it.
struct bfloat16_t {
  std::uint16_t bits;
};

/// IEEE binary16 storage: the raw 16 bits.
struct float16_t {
  std::uint16_t bits;
};

static_assert(sizeof(bfloat16_t) == 2 && sizeof(float16_t) == 2);

/// Returns the size in bytes of one element of `t` (0 for an invalid enumerator).
constexpr std::size_t dtype_size(DType t) noexcept {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 2;
  }
  return 0;
}

/// Returns "f32", "bf16" or "f16" ("invalid" for anything else).
constexpr std::string_view dtype_name(DType t) noexcept {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
  }
  return "invalid";
}

/// Returns true when `t` is one of the enumerators above.
constexpr bool dtype_valid(DType t) noexcept { return dtype_size(t) != 0; }

/// Maps a storage type to its DType.
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<bfloat16_t> {
  static constexpr DType value = DType::bf16;
};
template <>
struct dtype_of<float16_t> {
  static constexpr DType value = DType::f16;
};
template <class T>
inline constexpr DType dtype_of_v = dtype_of<T>::value;

}  // namespace stepcore
