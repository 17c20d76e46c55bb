// MemoryLedger: the bytes a gradient manager holds, by kind, now and at their peaks —
// what GradientManager::memory() reports. The modes set each kind where they allocate it
// (construction, the first step that accumulates or speculates); a transient buffer (a
// checkpoint's) is held for its lifetime by a Hold.
#pragma once

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <string_view>
#include <vector>

#include "stepcore/managers.hpp"

namespace stepcore::detail {

class MemoryLedger {
 public:
  /// Sets the bytes of `kind` held now (declaring it, in report order, on first use).
  void set(std::string_view kind, bool device, std::size_t bytes) {
    const std::lock_guard lock(mu_);
    MemoryUse& k = find(kind, device);
    k.bytes = bytes;
    update(k);
  }
  /// Adds `bytes` to `kind` (add) or takes them away (release).
  void add(std::string_view kind, bool device, std::size_t bytes) {
    const std::lock_guard lock(mu_);
    MemoryUse& k = find(kind, device);
    k.bytes += bytes;
    update(k);
  }
  void release(std::string_view kind, bool device, std::size_t bytes) {
    const std::lock_guard lock(mu_);
    MemoryUse& k = find(kind, device);
    k.bytes -= std::min(k.bytes, bytes);
  }
  MemoryReport report() const {
    const std::lock_guard lock(mu_);
    MemoryReport r;
    r.kinds = kinds_;
    for (const MemoryUse& k : kinds_) (k.device ? r.device_bytes : r.host_bytes) += k.bytes;
    r.host_peak = host_peak_;
    r.device_peak = device_peak_;
    return r;
  }

  /// Holds `bytes` of `kind` while it lives (a transient buffer).
  class Hold {
   public:
    Hold(MemoryLedger& ledger, std::string_view kind, bool device, std::size_t bytes)
        : ledger_(ledger), kind_(kind), device_(device), bytes_(bytes) {
      ledger_.add(kind_, device_, bytes_);
    }
    ~Hold() { ledger_.release(kind_, device_, bytes_); }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    MemoryLedger& ledger_;
    std::string_view kind_;
    bool device_;
    std::size_t bytes_;
  };

 private:
  MemoryUse& find(std::string_view kind, bool device) {
    for (MemoryUse& k : kinds_)
      if (k.kind == kind && k.device == device) return k;
    kinds_.push_back(MemoryUse{std::string(kind), device, 0, 0});
    return kinds_.back();
  }
  // The kind's peak and the space's (host or device) peak of the sum.
  void update(MemoryUse& k) {
    k.peak = std::max(k.peak, k.bytes);
    std::size_t sum = 0;
    for (const MemoryUse& u : kinds_)
      if (u.device == k.device) sum += u.bytes;
    std::size_t& peak = k.device ? device_peak_ : host_peak_;
    peak = std::max(peak, sum);
  }

  mutable std::mutex mu_;
  std::vector<MemoryUse> kinds_;
  std::size_t host_peak_ = 0, device_peak_ = 0;
};

}  // namespace stepcore::detail
