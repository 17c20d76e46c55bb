// One host slab per dtype for CUDA transfers (staging, compute-weight uploads):
// allocated once up front, placed on the rank's NUMA node, carved into 256-byte-aligned
// views, and page-locked with CUDA when a device is present. Many small pinned
// allocations are slow and can deadlock against collectives; one slab cannot.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "stepcore/numa.hpp"

namespace stepcore {

/// Alignment of every view carved from a slab.
inline constexpr std::size_t kSlabViewAlignment = 256;

/// Byte offsets of views carved from one slab, in order, each aligned to `alignment`.
struct SlabLayout {
  std::vector<std::size_t> offsets;
  std::size_t total_bytes = 0;
};

/// Returns the layout of views of the given byte sizes (zero-sized views get an offset
/// too). Throws Errc::invalid_argument when alignment is not a power of two.
SlabLayout layout_slab(std::span<const std::size_t> view_bytes,
                       std::size_t alignment = kSlabViewAlignment);

/// Whether a slab is page-locked for CUDA.
enum class PinMode {
  if_available,  ///< pin when a CUDA device is present, else plain placed memory
  required,      ///< throw Errc::not_supported when it cannot be pinned
  never,         ///< plain placed memory (CPU-only tests)
};

/// A NUMA-placed host slab carved into aligned views.
class HostSlab {
 public:
  /// Allocates and lays out the views; touches every page (zero-fill) from the calling
  /// thread so the slab is resident on `numa_node` before pinning; pins per `mode`.
  HostSlab(std::span<const std::size_t> view_bytes, int numa_node = -1,
           PinMode mode = PinMode::if_available);
  HostSlab(HostSlab&&) noexcept;
  HostSlab& operator=(HostSlab&&) noexcept;
  ~HostSlab();

  /// Returns the start of view `i` (256-byte aligned).
  void* view(std::size_t i) const;
  /// Returns the size of view `i` in bytes.
  std::size_t view_bytes(std::size_t i) const;
  std::size_t views() const noexcept { return sizes_.size(); }
  /// Returns true when the slab is page-locked with CUDA.
  bool pinned() const noexcept { return pinned_; }
  const numa::HostBuffer& buffer() const noexcept { return buffer_; }

 private:
  numa::HostBuffer buffer_;
  SlabLayout layout_;
  std::vector<std::size_t> sizes_;
  bool pinned_ = false;
};

}  // namespace stepcore
