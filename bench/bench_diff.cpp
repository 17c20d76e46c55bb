// stepcore-bench-diff: stepcore-diff's comparison against a same-traffic probe. Writes two
// safetensors files of f32 tensors (B differs from A in a known sparse set of elements)
// into a fresh directory, validates the comparison against the known differences, then
// times in alternating rounds (a) the probe: both files read whole into memory as the
// comparer reads them (FileBytes: pread), then summed as 64-bit words on the same threads
// and chunks, and (b) the comparison (load_input + diff_inputs, the files read afresh),
// and deletes the files.
//
// Usage: stepcore-bench-diff [GB per file = 4] [directory = /tmp] [rounds = 3]
#include <omp.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "diff/diff.hpp"
#include "diff/file_bytes.hpp"
#include "diff/inputs.hpp"

namespace {

using namespace stepcore::diff;
using Clock = std::chrono::steady_clock;

constexpr int kTensors = 4;
constexpr std::uint64_t kStride = 1000003;       // every kStride-th element of B differs
constexpr std::uint64_t kChunkBytes = 4u << 20;  // the probe's chunk: the comparer's 2^20 f32

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

double load_average() {
  double l[1] = {0};
  return getloadavg(l, 1) == 1 ? l[0] : -1;
}

// A's element i of tensor t: a float in [1, 2) from a multiplicative hash.
std::uint32_t a_bits(int t, std::uint64_t i) {
  const std::uint64_t h =
      (i + 0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(t + 1)) * 0xD1B54A32D192ED03ull;
  return 0x3F800000u | static_cast<std::uint32_t>(h >> 41);
}
// The k-th differing element of tensor t sits at offset(t) + k * kStride and is moved by
// 1 + k % 7 ulps; the last element of the last tensor is -0 in A and +0 in B.
std::uint64_t first_offset(int t) { return 17 + static_cast<std::uint64_t>(t); }
std::uint32_t moved_by(std::uint64_t k) { return 1 + static_cast<std::uint32_t>(k % 7); }

// What the comparison must find in tensor t, worked out from the construction.
struct Expected {
  std::uint64_t differing = 0, first = 0, max_ulps = 0, signed_zero = 0;
  double median = 0;
};
Expected expected(int t, std::uint64_t n) {
  Expected e;
  std::vector<std::uint64_t> d;
  for (std::uint64_t i = first_offset(t), k = 0; i < n; i += kStride, ++k) d.push_back(moved_by(k));
  if (t == kTensors - 1) {
    d.push_back(0);  // -0 vs +0
    e.signed_zero = 1;
  }
  e.differing = d.size();
  e.first = first_offset(t);
  std::sort(d.begin(), d.end());
  e.max_ulps = d.back();
  e.median =
      (static_cast<double>(d[(d.size() - 1) / 2]) + static_cast<double>(d[d.size() / 2])) / 2;
  return e;
}

void write_all(std::ofstream& f, const void* p, std::size_t n, const std::string& path) {
  f.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
  if (!f) {
    std::fprintf(stderr, "stepcore-bench-diff: cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

// Writes A and B (n f32 per tensor), then fsyncs them so no writeback runs while timing.
void write_files(const std::string& pa, const std::string& pb, std::uint64_t n, int threads) {
  std::string header = "{";
  for (int t = 0; t < kTensors; ++t) {
    const std::uint64_t b0 = 4 * n * static_cast<std::uint64_t>(t);
    header += std::string(t ? "," : "") + "\"layers." + std::to_string(t) +
              ".weight\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string(n) +
              "],\"data_offsets\":[" + std::to_string(b0) + "," + std::to_string(b0 + 4 * n) + "]}";
  }
  header += "}";
  std::ofstream fa(pa, std::ios::binary), fb(pb, std::ios::binary);
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(header.size() >> (8 * i));
  write_all(fa, len, 8, pa);
  write_all(fa, header.data(), header.size(), pa);
  write_all(fb, len, 8, pb);
  write_all(fb, header.data(), header.size(), pb);
  std::vector<std::uint32_t> buf(16u << 20);
  for (int t = 0; t < kTensors; ++t) {
    for (std::uint64_t at = 0; at < n; at += buf.size()) {
      const std::uint64_t m = std::min<std::uint64_t>(buf.size(), n - at);
#pragma omp parallel for num_threads(threads) schedule(static)
      for (std::int64_t j = 0; j < static_cast<std::int64_t>(m); ++j)
        buf[static_cast<std::size_t>(j)] = a_bits(t, at + static_cast<std::uint64_t>(j));
      const bool last = t == kTensors - 1 && at + m == n;
      if (last) buf[m - 1] = 0x80000000u;
      write_all(fa, buf.data(), 4 * m, pa);
      // B: the same with the sparse set moved.
      std::uint64_t k = at <= first_offset(t) ? 0 : (at - first_offset(t) + kStride - 1) / kStride;
      for (std::uint64_t i = first_offset(t) + k * kStride; i < at + m; i += kStride, ++k)
        buf[i - at] += moved_by(k);
      if (last) buf[m - 1] = 0;
      write_all(fb, buf.data(), 4 * m, pb);
    }
  }
  fa.close();
  fb.close();
  for (const std::string& p : {pa, pb}) {
    std::FILE* f = std::fopen(p.c_str(), "rb");
    if (f == nullptr || ::fsync(::fileno(f)) != 0) std::exit(1);
    std::fclose(f);
  }
}

// The sum of the 64-bit words of a[0, n) and b[0, n), n a multiple of 8, compiled for the
// processor (the comparer's memcmp is glibc's run-time choice, AVX2/EVEX here).
__attribute__((target_clones("avx512f", "avx2", "default"))) std::uint64_t sum_words(
    const std::byte* a, const std::byte* b, std::uint64_t n) {
  std::uint64_t s = 0;
  for (std::uint64_t i = 0; i < n; i += 8) {
    std::uint64_t wa, wb;
    std::memcpy(&wa, a + i, 8);
    std::memcpy(&wb, b + i, 8);
    s += wa + wb;
  }
  return s;
}

// The probe: both files read afresh into memory (the comparer's FileBytes), every 64-bit
// word of their data summed, in the comparer's chunks and schedule.
double probe(const std::string& pa, const std::string& pb, std::uint64_t data_start, int threads,
             std::uint64_t& checksum) {
  const auto t0 = Clock::now();
  const FileBytes a(pa), b(pb);
  const std::uint64_t bytes = a.size() - data_start;
  const auto chunks = static_cast<std::int64_t>((bytes + kChunkBytes - 1) / kChunkBytes);
  std::uint64_t sum = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(+ : sum)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::uint64_t lo = static_cast<std::uint64_t>(c) * kChunkBytes;
    const std::uint64_t hi = std::min(bytes, lo + kChunkBytes);
    sum += sum_words(a.data() + data_start + lo, b.data() + data_start + lo, (hi - lo) & ~7ull);
  }
  checksum += sum;
  return seconds_since(t0);
}

double compare(const std::string& pa, const std::string& pb, int threads, DiffResult& out) {
  const auto t0 = Clock::now();
  const Input a = load_input(pa), b = load_input(pb);
  DiffOptions o;
  o.threads = threads;
  out = diff_inputs(a, b, o);
  return seconds_since(t0);
}

int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const double gb = argc > 1 ? std::atof(argv[1]) : 4.0;
  const std::string parent = argc > 2 ? argv[2] : "/tmp";
  const int rounds = argc > 3 ? std::max(1, std::atoi(argv[3])) : 3;
  const auto n = static_cast<std::uint64_t>(gb * 1e9 / 4 / kTensors);  // f32 per tensor
  if (n < 2 * kStride) {
    std::fprintf(stderr, "stepcore-bench-diff: %g GB is too small\n", gb);
    return 2;
  }
  std::string dir = parent + "/stepcore-bench-diff-XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) {
    std::fprintf(stderr, "stepcore-bench-diff: cannot create a directory in %s\n", parent.c_str());
    return 2;
  }
  const std::string pa = dir + "/a.safetensors", pb = dir + "/b.safetensors";
  const int cpus = affinity_cpus();
  std::printf(
      "stepcore-bench-diff: 2 files of %.2f GB (%d f32 tensors of %llu) in %s, load average %.2f\n",
      4.0 * static_cast<double>(n) * kTensors * 1e-9, kTensors, static_cast<unsigned long long>(n),
      dir.c_str(), load_average());
  auto t0 = Clock::now();
  write_files(pa, pb, n, cpus);
  std::printf(
      "  written and fsynced in %.1f s; both stay in the page cache, so every round copies them "
      "from it (pread) and reads the copies\n",
      seconds_since(t0));
  const std::uint64_t data_start = std::filesystem::file_size(pa) - 4 * n * kTensors;
  const double total_gb = 2.0 * 4.0 * static_cast<double>(n) * kTensors * 1e-9;
  int rc = 0;

  // Validate: every tensor's statistics are the known ones.
  DiffResult r;
  compare(pa, pb, cpus, r);
  for (int t = 0; t < kTensors && rc == 0; ++t) {
    const Expected e = expected(t, n);
    const TensorResult& tr = r.tensors[static_cast<std::size_t>(t)];
    const ElementStats& s = *tr.stats;
    if (tr.status != Status::different || s.differing != e.differing || s.first_index != e.first ||
        s.max_ulps != e.max_ulps || s.median_ulps != e.median || s.signed_zero != e.signed_zero ||
        s.nan_payload + s.nan_vs_number + s.inf != 0) {
      std::printf(
          "FAILED: tensor %d: differing %llu (want %llu), max %llu (want %llu), median %g (want "
          "%g)\n",
          t, static_cast<unsigned long long>(s.differing),
          static_cast<unsigned long long>(e.differing), static_cast<unsigned long long>(s.max_ulps),
          static_cast<unsigned long long>(e.max_ulps), s.median_ulps, e.median);
      rc = 1;
    }
  }
  if (rc == 0 && (!r.first_divergence || *r.first_divergence != 0)) {
    std::printf("FAILED: the first divergence is not tensor 0\n");
    rc = 1;
  }
  if (rc == 0)
    std::printf(
        "  validated: %llu + %llu + %llu + %llu differing elements found where they were put\n",
        static_cast<unsigned long long>(r.tensors[0].stats->differing),
        static_cast<unsigned long long>(r.tensors[1].stats->differing),
        static_cast<unsigned long long>(r.tensors[2].stats->differing),
        static_cast<unsigned long long>(r.tensors[3].stats->differing));

  std::uint64_t checksum = 0;
  std::vector<int> thread_counts{cpus};
  if (cpus > 1) thread_counts.push_back(1);
  for (int threads : rc == 0 ? thread_counts : std::vector<int>{}) {
    std::vector<double> ps, cs;
    for (int k = 0; k < rounds; ++k) {
      ps.push_back(probe(pa, pb, data_start, threads, checksum));
      cs.push_back(compare(pa, pb, threads, r));
      std::printf("  %d thread%s, round %d: probe %.3f s (%.1f GB/s), compare %.3f s (%.1f GB/s)\n",
                  threads, threads == 1 ? "" : "s", k + 1, ps.back(), total_gb / ps.back(),
                  cs.back(), total_gb / cs.back());
    }
    const double pb_best = total_gb / *std::min_element(ps.begin(), ps.end());
    const double cb_best = total_gb / *std::min_element(cs.begin(), cs.end());
    const double pm = total_gb / median(ps), cm = total_gb / median(cs);
    std::printf(
        "%d thread%s: probe %.1f GB/s (median %.1f), compare %.1f GB/s (median %.1f), ratio %.2f "
        "(medians %.2f; target >= 0.8)\n",
        threads, threads == 1 ? "" : "s", pb_best, pm, cb_best, cm, cb_best / pb_best, cm / pm);
  }
  std::printf("  load average %.2f [checksum %016llx]\n", load_average(),
              static_cast<unsigned long long>(checksum));
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rc;
}
