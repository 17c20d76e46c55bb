// stepcore-bench-checkpoint: what a checkpoint costs against the same traffic done plainly.
// A full-offload manager (host state, saved in place) and a mode-none manager (device
// state, copied out parameter by parameter) of N million parameters save and load one
// rank's file; the probes write the same bytes with write() + fsync() into the same
// directory, and read them back with read() into memory. Loads and read probes are timed
// twice: from the page cache (the file just written: the read is a kernel memcpy), and
// from storage (the file's pages evicted first with posix_fadvise(DONTNEED), as a load of
// a checkpoint from its disk reads it; each probe read is evicted the same way). The
// import alone (the verified state handed to import_parameter, the part of a load after
// its verification) is timed too, to show what the verification and the read cost beyond
// it. CRC-32C (the file's checksum) is timed against a plain read of the same buffer.
// Every load is validated first: the loaded state equals the saved one bit for bit. The
// peak resident memory a save and a load add (VmHWM after /proc/self/clear_refs reset it to
// the resident size, Linux >= 4.0) is printed beside each.
//
// Usage: stepcore-bench-checkpoint [million parameters = 64] [directory = /tmp] [repeats = 3]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "host/crc32c.hpp"
#include "stepcore/device.hpp"
#include "stepcore/managers.hpp"

namespace {

using namespace stepcore;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Builds a manager of `mode` over `sizes` (AdamW) with deterministic state, stepped
// once so moments and counters are not zero.
std::unique_ptr<GradientManager> make(OffloadMode mode, const std::vector<std::size_t>& sizes,
                                      device::Device& dev) {
  ManagerConfig cfg;
  cfg.mode = mode;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    ParamSpec p;
    p.name = "layers." + std::to_string(i) + ".weight";
    p.numel = sizes[i];
    cfg.params.push_back(p);
  }
  cfg.device = &dev;
  auto m = make_gradient_manager(cfg);
  std::vector<float> w;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    w.resize(sizes[i]);
    for (std::size_t j = 0; j < w.size(); ++j)
      w[j] = 1e-3f * static_cast<float>((i * 131 + j) % 977);
    m->load_parameter(i, w);
  }
  std::vector<std::uint16_t> g;
  m->begin_step(1e-3f, false);
  m->begin_backward(true);
  for (std::size_t i = sizes.size(); i-- > 0;) {
    const TensorView v = m->gradient(i);
    g.assign(v.numel, static_cast<std::uint16_t>(0x3C00 + (i % 7)));
    dev.copy(device::Queue::compute, v.data, g.data(), v.bytes());
    dev.synchronize();
    m->gradient_ready(i);
  }
  m->finish_backward();
  m->step();
  (void)m->report();
  return m;
}

// Returns every parameter's master, moments and step counter, as bytes.
std::vector<std::uint8_t> state_of(GradientManager& m) {
  std::vector<std::uint8_t> out;
  for (std::size_t i = 0; i < m.config().params.size(); ++i) {
    const std::size_t n = m.config().params[i].numel;
    std::vector<float> a(n), b(n), c(n);
    m.read_parameter(i, a, b, c, {});
    for (const auto* v : {&a, &b, &c}) {
      const auto* p = reinterpret_cast<const std::uint8_t*>(v->data());
      out.insert(out.end(), p, p + 4 * n);
    }
    const float s = m.step_count(i);
    const auto* p = reinterpret_cast<const std::uint8_t*>(&s);
    out.insert(out.end(), p, p + 4);
  }
  return out;
}

// The probe: `bytes` written with write() in 8 MiB pieces, fsync'ed, renamed (a save's
// system calls without its format), then read back.
double probe_write(const std::string& path, const std::vector<char>& buf, std::size_t bytes) {
  const auto t0 = Clock::now();
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) std::exit(1);
  for (std::size_t at = 0; at < bytes;) {
    const std::size_t n = std::min(buf.size(), bytes - at);
    const ssize_t w = ::write(fd, buf.data(), n);
    if (w <= 0) std::exit(1);
    at += static_cast<std::size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) std::exit(1);
  std::filesystem::rename(tmp, path);
  return seconds_since(t0);
}

// Reads the whole file into `dst` (as large as the file): the file's bytes into memory,
// the traffic a load cannot avoid.
double probe_read(const std::string& path, std::vector<char>& dst) {
  const auto t0 = Clock::now();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) std::exit(1);
  for (std::size_t at = 0; at < dst.size();) {
    const ssize_t r = ::read(fd, dst.data() + at, dst.size() - at);
    if (r <= 0) break;
    at += static_cast<std::size_t>(r);
  }
  ::close(fd);
  return seconds_since(t0);
}

// Resets the process's peak resident size (VmHWM) to its current one (VmRSS); false when
// /proc/self/clear_refs cannot be written.
bool reset_peak_rss() {
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "5", 1) == 1;
  ::close(fd);
  return ok;
}

// Returns the field `key` ("VmHWM:", "VmRSS:") of /proc/self/status in bytes (0 if absent).
std::size_t status_bytes(const char* key) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  std::size_t kb = 0;
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::strncmp(line, key, std::strlen(key)) == 0)
      kb = std::strtoull(line + std::strlen(key), nullptr, 10);
  std::fclose(f);
  return kb * 1024;
}

// Runs `f` and returns how far the peak resident size rose above the resident size before
// it (bytes; 0 when the peak cannot be reset).
template <class F>
std::size_t peak_growth(F&& f) {
  if (!reset_peak_rss()) {
    f();
    return 0;
  }
  const std::size_t before = status_bytes("VmRSS:");
  f();
  const std::size_t peak = status_bytes("VmHWM:");
  return peak > before ? peak - before : 0;
}

// Drops `path`'s clean pages from the page cache (written and fsync'ed: all are clean), so
// the next read comes from storage.
void evict(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) std::exit(1);
  if (::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) std::exit(1);
  ::close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  const double millions = argc > 1 ? std::atof(argv[1]) : 64.0;
  const std::string dir = argc > 2 ? argv[2] : "/tmp";
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 3;
  const auto total = static_cast<std::size_t>(millions * 1e6);
  // A transformer-like mix: a few large matrices and many small vectors.
  std::vector<std::size_t> sizes;
  for (std::size_t left = total; left > 0;) {
    const std::size_t n = std::min<std::size_t>(left, sizes.size() % 4 == 3 ? 4096 : 4u << 20);
    sizes.push_back(n);
    left -= n;
  }
  const std::string path = dir + "/stepcore-bench-" + std::to_string(::getpid()) + ".stepcore";
  const std::string probe = path + ".probe";
  std::printf(
      "checkpoint of %.1f M parameters (%zu tensors, AdamW: master, exp_avg, exp_avg_sq) "
      "in %s, median of %d\n",
      static_cast<double>(total) * 1e-6, sizes.size(), dir.c_str(), repeats);
  std::vector<char> buf(8u << 20, 1);
  auto dev = device::make_host_device();
  for (OffloadMode mode : {OffloadMode::full, OffloadMode::none}) {
    auto saver = make(mode, sizes, *dev);
    auto loader =
        make(mode == OffloadMode::full ? OffloadMode::none : OffloadMode::full, sizes, *dev);
    // Validate: what is loaded is what was saved (and the loader's state differed before).
    saver->save_checkpoint(path);
    const auto want = state_of(*saver);
    loader->load_checkpoint(path);
    if (state_of(*loader) != want) {
      std::printf("FAILED: the loaded state differs from the saved one\n");
      return 1;
    }
    const std::size_t bytes = std::filesystem::file_size(path);
    std::vector<char> whole(bytes);
    // The saved state as arrays, for the import probe.
    std::vector<std::vector<float>> arrays;
    std::vector<float> steps;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      arrays.emplace_back(sizes[i]);
      arrays.emplace_back(sizes[i]);
      arrays.emplace_back(sizes[i]);
      saver->read_parameter(i, arrays[3 * i], arrays[3 * i + 1], arrays[3 * i + 2], {});
      steps.push_back(saver->step_count(i));
    }
    std::vector<double> save_s, load_s, pw_s, pr_s, import_s, cold_load_s, cold_pr_s;
    // The peak resident memory a save and a load add (the largest over the repeats).
    std::size_t save_peak = 0, load_peak = 0;
    for (int r = 0; r < repeats; ++r) {
      auto t0 = Clock::now();
      save_peak = std::max(save_peak, peak_growth([&] { saver->save_checkpoint(path); }));
      save_s.push_back(seconds_since(t0));
      pw_s.push_back(probe_write(probe, buf, bytes));
      t0 = Clock::now();
      load_peak = std::max(load_peak, peak_growth([&] { loader->load_checkpoint(path); }));
      load_s.push_back(seconds_since(t0));
      pr_s.push_back(probe_read(probe, whole));
      evict(path);
      t0 = Clock::now();
      loader->load_checkpoint(path);
      cold_load_s.push_back(seconds_since(t0));
      evict(probe);
      cold_pr_s.push_back(probe_read(probe, whole));
      // The import alone: the same state handed to import_parameter, the part of a load
      // that follows the verification (what the manager does with verified bytes).
      t0 = Clock::now();
      for (std::size_t i = 0; i < sizes.size(); ++i)
        loader->import_parameter(i, arrays[3 * i], arrays[3 * i + 1], arrays[3 * i + 2], steps[i]);
      import_s.push_back(seconds_since(t0));
    }
    if (state_of(*loader) != want) {
      std::printf("FAILED: the imported state differs from the saved one\n");
      return 1;
    }
    const double gb = static_cast<double>(bytes) * 1e-9;
    std::printf(
        "  save from mode %-4s %7.1f MB: %.3f s = %5.2f GB/s; probe write+fsync %.3f s = "
        "%5.2f GB/s; ratio %.2f\n",
        std::string(offload_mode_name(mode)).c_str(), gb * 1e3, median(save_s), gb / median(save_s),
        median(pw_s), gb / median(pw_s), median(pw_s) / median(save_s));
    std::printf(
        "  load into mode %-4s %7.1f MB: %.3f s = %5.2f GB/s; probe read %.3f s = "
        "%5.2f GB/s; ratio %.2f\n",
        std::string(offload_mode_name(loader->mode())).c_str(), gb * 1e3, median(load_s),
        gb / median(load_s), median(pr_s), gb / median(pr_s), median(pr_s) / median(load_s));
    std::printf(
        "  load into mode %-4s from storage: %.3f s = %5.2f GB/s; probe read from storage "
        "%.3f s = %5.2f GB/s; ratio %.2f\n",
        std::string(offload_mode_name(loader->mode())).c_str(), median(cold_load_s),
        gb / median(cold_load_s), median(cold_pr_s), gb / median(cold_pr_s),
        median(cold_pr_s) / median(cold_load_s));
    std::printf(
        "    the import alone (import_parameter of the same state) %.3f s; "
        "read probe + import %.3f s = %.2f of the load\n",
        median(import_s), median(pr_s) + median(import_s),
        (median(pr_s) + median(import_s)) / median(load_s));
    std::printf("    peak resident memory added: save %.1f MB, load %.1f MB%s\n",
                static_cast<double>(save_peak) * 1e-6, static_cast<double>(load_peak) * 1e-6,
                reset_peak_rss() ? "" : " (not measured: /proc/self/clear_refs not writable)");
    saver->close();
    loader->close();
  }
  std::filesystem::remove(path);
  std::filesystem::remove(probe);
  // The checksum against a plain pass over the same bytes.
  std::vector<std::byte> data(256u << 20);
  for (std::size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<std::byte>(i * 2654435761u >> 24);
  std::vector<double> crc_s, sum_s;
  std::uint32_t crc = 0;
  std::uint64_t sum = 0;
  for (int r = 0; r < std::max(repeats, 3); ++r) {
    auto t0 = Clock::now();
    crc ^= stepcore::detail::crc32c(data);
    crc_s.push_back(seconds_since(t0));
    t0 = Clock::now();
    const auto* w = reinterpret_cast<const std::uint64_t*>(data.data());
    for (std::size_t i = 0; i < data.size() / 8; ++i) sum += w[i];
    sum_s.push_back(seconds_since(t0));
  }
  const double gb = static_cast<double>(data.size()) * 1e-9;
  std::printf(
      "  crc32c 256 MiB: %5.2f GB/s; probe (64-bit sum, one thread) %5.2f GB/s; ratio "
      "%.2f  [%08x %016llx]\n",
      gb / median(crc_s), gb / median(sum_s), median(sum_s) / median(crc_s), crc,
      static_cast<unsigned long long>(sum));
  return 0;
}
