// Thread binding and NUMA-placed host memory (Linux: sched_setaffinity, mmap, mbind,
// madvise(MADV_HUGEPAGE), move_pages), without libnuma.
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

#include "host/warn.hpp"
#include "stepcore/error.hpp"
#include "stepcore/numa.hpp"

namespace stepcore::numa {
namespace {

constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr int kMpolBind = 2;  // MPOL_BIND of <linux/mempolicy.h>

std::size_t page_size() {
  static const std::size_t p = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

}  // namespace

namespace detail {
void warn_once(const std::string& message) {
  static std::mutex mu;
  static std::set<std::string> seen;
  const std::lock_guard<std::mutex> lock(mu);
  if (seen.insert(message).second) std::fprintf(stderr, "stepcore: warning: %s\n", message.c_str());
}
}  // namespace detail

std::string cpu_list_string(const std::vector<int>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size();) {
    std::size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += std::to_string(v[i]);
    if (j > i) s += "-" + std::to_string(v[j]);
    i = j + 1;
  }
  return s.empty() ? "-" : s;
}

bool bind_this_thread(int pu) {
  if (pu < 0 || pu >= CPU_SETSIZE) return false;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(pu, &set);
  return sched_setaffinity(0, sizeof set, &set) == 0;
}

std::vector<int> this_thread_affinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return out;
  for (int i = 0; i < CPU_SETSIZE; ++i)
    if (CPU_ISSET(i, &set)) out.push_back(i);
  return out;
}

HostBuffer::HostBuffer(std::size_t bytes, int numa_node, bool strict) {
  if (bytes == 0) return;
  const bool huge = bytes >= kHugePage;
  const std::size_t align = huge ? kHugePage : page_size();
  const std::size_t size = (bytes + align - 1) / align * align;
  // Over-allocate so the start can be aligned to a huge page, then trim.
  const std::size_t reserve = size + (huge ? kHugePage : 0);
  void* raw = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED)
    throw Error(Errc::out_of_range, "bytes",
                "mmap of " + std::to_string(bytes) + " bytes failed: " + std::strerror(errno));
  auto base = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t start = (base + align - 1) / align * align;
  if (start > base) munmap(raw, start - base);
  const std::uintptr_t end = start + size;
  if (base + reserve > end) munmap(reinterpret_cast<void*>(end), base + reserve - end);
  data_ = reinterpret_cast<void*>(start);
  bytes_ = size;
  if (huge) madvise(data_, bytes_, MADV_HUGEPAGE);  // advice only: ignored without THP
  if (numa_node >= 0) {
    unsigned long mask[16] = {};
    if (numa_node >= static_cast<int>(sizeof(mask) * 8)) {
      munmap(data_, bytes_);
      data_ = nullptr;
      throw Error(Errc::out_of_range, "numa_node", "node index beyond 1023");
    }
    mask[numa_node / 64] = 1ul << (numa_node % 64);
    const long rc = syscall(SYS_mbind, data_, bytes_, kMpolBind, mask, sizeof(mask) * 8, 0);
    if (rc == 0) {
      node_ = numa_node;
    } else {
      const std::string why = "cannot bind memory to NUMA node " + std::to_string(numa_node) +
                              ": " + std::strerror(errno);
      if (strict) {
        munmap(data_, bytes_);
        data_ = nullptr;
        throw Error(Errc::not_supported, "numa_node", why);
      }
      detail::warn_once(why + "; state stays unbound");
    }
  }
}

HostBuffer::HostBuffer(HostBuffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_), node_(o.node_) {
  o.data_ = nullptr;
  o.bytes_ = 0;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    if (data_) munmap(data_, bytes_);
    data_ = o.data_;
    bytes_ = o.bytes_;
    node_ = o.node_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

HostBuffer::~HostBuffer() {
  if (data_) munmap(data_, bytes_);
}

std::vector<int> page_nodes(const void* data, std::size_t bytes) {
  const std::size_t ps = page_size();
  const auto first = reinterpret_cast<std::uintptr_t>(data) / ps * ps;
  const auto last = reinterpret_cast<std::uintptr_t>(data) + bytes;
  std::vector<void*> pages;
  for (std::uintptr_t p = first; p < last; p += ps) pages.push_back(reinterpret_cast<void*>(p));
  std::vector<int> status(pages.size(), -1);
  if (!pages.empty() &&
      syscall(SYS_move_pages, 0, pages.size(), pages.data(), nullptr, status.data(), 0) != 0)
    std::fill(status.begin(), status.end(), -errno);
  return status;
}

}  // namespace stepcore::numa
