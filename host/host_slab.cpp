// Host slabs: layout, NUMA placement and (optional) CUDA page-locking.
#include "stepcore/host_slab.hpp"

#include <cstring>
#include <string>

#include "stepcore/cuda_host.hpp"
#include "stepcore/error.hpp"

namespace stepcore {

SlabLayout layout_slab(std::span<const std::size_t> view_bytes, std::size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    throw Error(Errc::invalid_argument, "alignment", "must be a power of two");
  SlabLayout l;
  std::size_t at = 0;
  for (std::size_t b : view_bytes) {
    at = (at + alignment - 1) / alignment * alignment;
    l.offsets.push_back(at);
    at += b;
  }
  l.total_bytes = at;
  return l;
}

HostSlab::HostSlab(std::span<const std::size_t> view_bytes, int numa_node, PinMode mode)
    : layout_(layout_slab(view_bytes)), sizes_(view_bytes.begin(), view_bytes.end()) {
  const bool can_pin = cuda::device_count() > 0;
  if (mode == PinMode::required && !can_pin)
    throw Error(Errc::not_supported, "mode", "cannot page-lock: " + cuda::unavailable_reason());
  buffer_ = numa::HostBuffer(layout_.total_bytes, numa_node);
  if (buffer_.bytes() != 0) std::memset(buffer_.data(), 0, buffer_.bytes());  // place the pages now
  if (mode != PinMode::never && can_pin && buffer_.bytes() != 0) {
    cuda::host_register(buffer_.data(), buffer_.bytes());
    pinned_ = true;
  }
}

HostSlab::HostSlab(HostSlab&& o) noexcept
    : buffer_(std::move(o.buffer_)),
      layout_(std::move(o.layout_)),
      sizes_(std::move(o.sizes_)),
      pinned_(o.pinned_) {
  o.pinned_ = false;
}

HostSlab& HostSlab::operator=(HostSlab&& o) noexcept {
  if (this != &o) {
    if (pinned_) cuda::host_unregister(buffer_.data());
    buffer_ = std::move(o.buffer_);
    layout_ = std::move(o.layout_);
    sizes_ = std::move(o.sizes_);
    pinned_ = o.pinned_;
    o.pinned_ = false;
  }
  return *this;
}

HostSlab::~HostSlab() {
  if (pinned_) cuda::host_unregister(buffer_.data());
}

void* HostSlab::view(std::size_t i) const {
  if (i >= sizes_.size()) throw Error(Errc::out_of_range, "i", "no view " + std::to_string(i));
  return static_cast<char*>(buffer_.data()) + layout_.offsets[i];
}

std::size_t HostSlab::view_bytes(std::size_t i) const {
  if (i >= sizes_.size()) throw Error(Errc::out_of_range, "i", "no view " + std::to_string(i));
  return sizes_[i];
}

}  // namespace stepcore
