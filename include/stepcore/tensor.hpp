// Non-owning views of contiguous tensors and of lists of them.
#pragma once

#include <cstddef>
#include <span>

#include "stepcore/dtype.hpp"

namespace stepcore {

/// A contiguous, writable tensor: `numel` elements of `dtype` starting at `data`.
/// `data` may be null only when `numel` is 0.
struct TensorView {
  void* data = nullptr;
  std::size_t numel = 0;
  DType dtype = DType::f32;

  /// Returns the size of the viewed memory in bytes.
  std::size_t bytes() const noexcept { return numel * dtype_size(dtype); }
};

/// A contiguous, read-only tensor.
struct ConstTensorView {
  const void* data = nullptr;
  std::size_t numel = 0;
  DType dtype = DType::f32;

  ConstTensorView() = default;
  ConstTensorView(const void* d, std::size_t n, DType t) : data(d), numel(n), dtype(t) {}
  ConstTensorView(const TensorView& v) : data(v.data), numel(v.numel), dtype(v.dtype) {}  // NOLINT

  /// Returns the size of the viewed memory in bytes.
  std::size_t bytes() const noexcept { return numel * dtype_size(dtype); }
};

/// Returns a view of `n` floats at `p`.
inline TensorView f32_view(float* p, std::size_t n) { return {p, n, DType::f32}; }
/// Returns a read-only view of `n` elements of T at `p`.
template <class T>
ConstTensorView const_view(const T* p, std::size_t n) {
  return {p, n, dtype_of_v<T>};
}
/// Returns a writable view of `n` elements of T at `p`.
template <class T>
TensorView view(T* p, std::size_t n) {
  return {p, n, dtype_of_v<T>};
}

}  // namespace stepcore
