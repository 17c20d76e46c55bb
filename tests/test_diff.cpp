// stepcore-diff (diff/, docs/diff.md) on files crafted byte by byte with a test-only
// writer: identical inputs, ulp distances of f32/bf16/f16 against hand-computed values
// (across zero, next to Inf), the class differences, missing tensors, shape and dtype
// mismatches, the exact median, --max-ulps, the first divergence of a recording, every
// corrupt input refused with exit status 2 naming the file, the same results on 1, 2
// and 3 threads, and the real executable's exit statuses.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "diff/compare.hpp"
#include "diff/diff.hpp"
#include "diff/file_bytes.hpp"
#include "diff/inputs.hpp"
#include "host/testing.hpp"
#include "safetensors_writer.hpp"
#include "stepcore/diff.hpp"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test_support::Bytes;
using test_support::RawTensor;
using test_support::words16;
using test_support::words32;
using test_support::write_safetensors;
using test_support::write_text;

class TempDir {
 public:
  TempDir() {
    std::string pattern = ::testing::TempDir() + "stepcore-diff-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp: " << std::strerror(errno);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

struct Result {
  int status = -1;
  std::string out, err;
  json j;  // the --json object, when asked for
};

// Runs stepcore-diff's entry point with `args`.
Result run_diff(const std::vector<std::string>& args) {
  std::vector<const char*> argv{"stepcore-diff"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  Result r;
  r.status = stepcore::diff::run(static_cast<int>(argv.size()), argv.data(), out, err);
  r.out = out.str();
  r.err = err.str();
  return r;
}

// The same with --json, the output parsed.
Result run_json(std::vector<std::string> args) {
  args.insert(args.begin(), "--json");
  Result r = run_diff(args);
  if (r.status == 0 || r.status == 1) r.j = json::parse(r.out);
  return r;
}

// One tensor `name` in each of two files; returns the JSON result of comparing them.
Result one_tensor(const TempDir& dir, const std::string& dtype, const Bytes& a, const Bytes& b,
                  std::vector<std::int64_t> shape, std::vector<std::string> extra = {}) {
  write_safetensors(dir / "a.safetensors", {{"w", dtype, shape, a}});
  write_safetensors(dir / "b.safetensors", {{"w", dtype, shape, b}});
  extra.push_back(dir / "a.safetensors");
  extra.push_back(dir / "b.safetensors");
  return run_json(extra);
}

// ---- identical inputs ----------------------------------------------------------------

TEST(DiffFiles, IdenticalFilesExitZeroAndSayIdentical) {
  TempDir dir;
  const std::vector<RawTensor> t{
      {"embed.weight", "F32", {2, 3}, words32({0x3F800000, 0x80000000, 0x7FC00001, 1, 2, 3})},
      {"norm", "BF16", {2}, words16({0x3F80, 0xFF80})},
      {"ids", "I64", {1}, Bytes{1, 2, 3, 4, 5, 6, 7, 8}},
      {"mask", "BOOL", {3}, Bytes{1, 0, 1}}};
  write_safetensors(dir / "a.safetensors", t, R"({"step":"3"})");
  write_safetensors(dir / "b.safetensors", t);
  const Result r = run_diff({dir / "a.safetensors", dir / "b.safetensors"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "identical: 4 tensors\n");
  EXPECT_EQ(r.err, "");
  const Result j = run_json({dir / "a.safetensors", dir / "b.safetensors"});
  EXPECT_EQ(j.status, 0);
  EXPECT_EQ(j.j["identical"], true);
  EXPECT_EQ(j.j["exit_status"], 0);
  EXPECT_TRUE(j.j["first_divergence"].is_null());
  EXPECT_EQ(j.j["summary"]["tensors"], 4);
  EXPECT_EQ(j.j["summary"]["identical"], 4);
  ASSERT_EQ(j.j["tensors"].size(), 4u);
  // A's order: ascending data offset.
  EXPECT_EQ(j.j["tensors"][0]["name"], "embed.weight");
  EXPECT_EQ(j.j["tensors"][3]["name"], "mask");
  EXPECT_EQ(j.j["tensors"][0]["differing"], 0);
  EXPECT_TRUE(j.j["tensors"][0]["first_index"].is_null());
  // --all lists the identical tensors in the table too.
  const Result all = run_diff({"--all", dir / "a.safetensors", dir / "b.safetensors"});
  EXPECT_NE(all.out.find("embed.weight"), std::string::npos);
  EXPECT_NE(all.out.find("mask"), std::string::npos);
}

TEST(DiffFiles, JsonTensorFieldsAreTheSharedSchema) {
  TempDir dir;
  const Result r = one_tensor(dir, "F32", words32({1}), words32({2}), {1});
  ASSERT_EQ(r.status, 1) << r.err;
  const nlohmann::ordered_json o = nlohmann::ordered_json::parse(r.out);  // keeps the order
  std::vector<std::string> top, fields;
  for (const auto& [k, v] : o.items()) top.push_back(k);
  for (const auto& [k, v] : o["tensors"][0].items()) fields.push_back(k);
  const std::vector<std::string> want_top{"identical", "exit_status", "first_divergence", "tensors",
                                          "summary"};
  const std::vector<std::string> want{
      "step",          "rank",        "point",       "name",      "key",      "status",
      "dtype",         "shape",       "elements",    "differing", "fraction", "max_ulps",
      "median_ulps",   "first_index", "a_hex",       "b_hex",     "a_value",  "b_value",
      "nan_vs_number", "nan_payload", "signed_zero", "inf"};
  EXPECT_EQ(top, want_top);  // in this order
  EXPECT_EQ(fields, want);
  // Files have no step, rank or point.
  EXPECT_TRUE(r.j["tensors"][0]["step"].is_null());
  EXPECT_TRUE(r.j["tensors"][0]["rank"].is_null());
  EXPECT_TRUE(r.j["tensors"][0]["point"].is_null());
  EXPECT_TRUE(r.j["first_divergence"]["step"].is_null());
  EXPECT_EQ(r.j["first_divergence"]["name"], "w");
  EXPECT_EQ(r.j["tensors"][0]["key"], "w");
}

// ---- f32 distances and classes -----------------------------------------------------------

TEST(DiffFiles, OneUlpApartInF32) {
  TempDir dir;
  const float next = std::nextafter(1.0f, 2.0f);
  std::uint32_t next_bits;
  std::memcpy(&next_bits, &next, 4);
  const Result r = one_tensor(dir, "F32", words32({0x3F800000, 0x40000000}),
                              words32({next_bits, 0x40000000}), {2});
  ASSERT_EQ(r.status, 1) << r.err;
  const json& t = r.j["tensors"][0];
  EXPECT_EQ(t["status"], "different");
  EXPECT_EQ(t["elements"], 2);
  EXPECT_EQ(t["differing"], 1);
  EXPECT_EQ(t["fraction"], 0.5);
  EXPECT_EQ(t["max_ulps"], 1);
  EXPECT_EQ(t["median_ulps"], 1);
  EXPECT_EQ(t["first_index"], 0);
  EXPECT_EQ(t["a_hex"], "0x3f800000");
  EXPECT_EQ(t["b_hex"], "0x3f800001");
  EXPECT_EQ(t["a_value"], 1.0);
  EXPECT_EQ(t["b_value"], 1.0 + std::ldexp(1.0, -23));
  for (const char* c : {"nan_vs_number", "nan_payload", "signed_zero", "inf"})
    EXPECT_EQ(t[c], 0) << c;
  EXPECT_EQ(r.j["identical"], false);
  EXPECT_EQ(r.j["exit_status"], 1);
  EXPECT_EQ(r.j["summary"]["different"], 1);
  // The human output: the table row and the summary line.
  const Result h = run_diff({dir / "a.safetensors", dir / "b.safetensors"});
  EXPECT_EQ(h.status, 1);
  EXPECT_NE(h.out.find("0x3f800000 1"), std::string::npos) << h.out;
  EXPECT_NE(h.out.find("0x3f800001 1.0000001"), std::string::npos) << h.out;
  EXPECT_NE(h.out.find("first divergence: name w\n"), std::string::npos) << h.out;
}

TEST(DiffFiles, NanPayloadsAreAClassDifferenceWithoutUlps) {
  TempDir dir;
  const Result r = one_tensor(dir, "F32", words32({0x7FC00000, 5}), words32({0x7FC00001, 5}), {2});
  ASSERT_EQ(r.status, 1) << r.err;
  const json& t = r.j["tensors"][0];
  EXPECT_EQ(t["status"], "different");
  EXPECT_EQ(t["differing"], 1);
  EXPECT_EQ(t["nan_payload"], 1);
  EXPECT_EQ(t["nan_vs_number"], 0);
  EXPECT_EQ(t["max_ulps"], 0);  // NaNs are outside the ulp statistics
  EXPECT_EQ(t["median_ulps"], 0);
  EXPECT_EQ(t["a_hex"], "0x7fc00000");
  EXPECT_EQ(t["b_hex"], "0x7fc00001");
  EXPECT_EQ(t["a_value"], "nan");
  // A NaN against a number.
  const Result n = one_tensor(dir, "F32", words32({0x7FC00000}), words32({0x3F800000}), {1});
  EXPECT_EQ(n.j["tensors"][0]["nan_vs_number"], 1);
  EXPECT_EQ(n.j["tensors"][0]["nan_payload"], 0);
  EXPECT_EQ(n.j["tensors"][0]["max_ulps"], 0);
  // Even a huge tolerance does not accept a NaN difference.
  const Result tol = one_tensor(dir, "F32", words32({0x7FC00000}), words32({0x7FC00001}), {1},
                                {"--max-ulps", "1000000"});
  EXPECT_EQ(tol.status, 1);
  EXPECT_EQ(tol.j["tensors"][0]["status"], "different");
}

TEST(DiffFiles, MinusZeroAgainstPlusZeroIsASignedZeroAtDistanceZero) {
  TempDir dir;
  const Result r = one_tensor(dir, "F32", words32({0x80000000}), words32({0x00000000}), {1});
  ASSERT_EQ(r.status, 1) << r.err;
  const json& t = r.j["tensors"][0];
  EXPECT_EQ(t["status"], "different");
  EXPECT_EQ(t["signed_zero"], 1);
  EXPECT_EQ(t["differing"], 1);
  EXPECT_EQ(t["max_ulps"], 0);
  EXPECT_EQ(t["a_value"], -0.0);
  EXPECT_TRUE(std::signbit(t["a_value"].get<double>()));
  EXPECT_EQ(t["b_hex"], "0x00000000");
  const Result tol = one_tensor(dir, "F32", words32({0x80000000}), words32({0x00000000}), {1},
                                {"--max-ulps", "5"});
  EXPECT_EQ(tol.status, 1);
  EXPECT_EQ(tol.j["tensors"][0]["status"], "different");
}

TEST(DiffFiles, InfAgainstFltMaxIsOneUlpAndAnInfDifference) {
  TempDir dir;
  const Result r = one_tensor(dir, "F32", words32({0x7F800000}), words32({0x7F7FFFFF}), {1},
                              {"--max-ulps", "1"});
  ASSERT_EQ(r.status, 1) << r.err;
  const json& t = r.j["tensors"][0];
  EXPECT_EQ(t["inf"], 1);
  EXPECT_EQ(t["max_ulps"], 1);
  EXPECT_EQ(t["status"], "different");  // within 1 ulp, but a class difference
  EXPECT_EQ(t["a_value"], "inf");
  EXPECT_EQ(t["b_value"], std::ldexp(2.0 - std::ldexp(1.0, -23), 127));  // FLT_MAX
  // -Inf against +Inf: an Inf difference, 2 * 0x7f800000 ulps.
  const Result s = one_tensor(dir, "F32", words32({0xFF800000}), words32({0x7F800000}), {1});
  EXPECT_EQ(s.j["tensors"][0]["inf"], 1);
  EXPECT_EQ(s.j["tensors"][0]["max_ulps"], 2ull * 0x7F800000);
  EXPECT_EQ(s.j["tensors"][0]["a_value"], "-inf");
}

TEST(DiffUlps, DistancesAgainstHandComputedValues) {
  using stepcore::diff::DType;
  using stepcore::diff::ulp_distance;
  EXPECT_EQ(ulp_distance(DType::f32, 0x3F800000, 0x3F800001), 1u);
  EXPECT_EQ(ulp_distance(DType::f32, 0x80000001, 0x00000001), 2u);  // -tiny, +tiny
  EXPECT_EQ(ulp_distance(DType::f32, 0x80000000, 0x00000000), 0u);  // -0, +0
  EXPECT_EQ(ulp_distance(DType::f32, 0xBF800000, 0x3F800000), 2u * 0x3F800000);
  EXPECT_EQ(ulp_distance(DType::f32, 0x7F800000, 0x7F7FFFFF), 1u);
  EXPECT_EQ(ulp_distance(DType::f32, 0x7FC00000, 0x3F800000), std::nullopt);
  EXPECT_EQ(ulp_distance(DType::bf16, 0x3F80, 0x3F82), 2u);
  EXPECT_EQ(ulp_distance(DType::bf16, 0x8001, 0x0001), 2u);
  EXPECT_EQ(ulp_distance(DType::bf16, 0x7FC1, 0x7FC0), std::nullopt);
  EXPECT_EQ(ulp_distance(DType::f16, 0x3C00, 0x3BFF), 1u);
  EXPECT_EQ(ulp_distance(DType::f16, 0x7BFF, 0x7C00), 1u);
  EXPECT_EQ(ulp_distance(DType::f16, 0x8001, 0x0002), 3u);
  EXPECT_EQ(ulp_distance(DType::f16, 0x7E00, 0x3C00), std::nullopt);
}

TEST(DiffFiles, Bf16DistancesInAFile) {
  TempDir dir;
  // 1.0 vs 1.015625 (2 ulps); -tiny vs +tiny (2 ulps across zero); equal.
  const Result r = one_tensor(dir, "BF16", words16({0x3F80, 0x8001, 0x4000}),
                              words16({0x3F82, 0x0001, 0x4000}), {3});
  ASSERT_EQ(r.status, 1) << r.err;
  const json& t = r.j["tensors"][0];
  EXPECT_EQ(t["differing"], 2);
  EXPECT_EQ(t["max_ulps"], 2);
  EXPECT_EQ(t["median_ulps"], 2);
  EXPECT_EQ(t["first_index"], 0);
  EXPECT_EQ(t["a_hex"], "0x3f80");
  EXPECT_EQ(t["b_hex"], "0x3f82");
  EXPECT_EQ(t["b_value"], 1.015625);  // 1 + 2/128
  EXPECT_EQ(t["signed_zero"], 0);
  const Result tol = one_tensor(dir, "BF16", words16({0x3F80, 0x8001, 0x4000}),
                                words16({0x3F82, 0x0001, 0x4000}), {3}, {"--max-ulps", "2"});
  EXPECT_EQ(tol.status, 0);
  EXPECT_EQ(tol.j["tensors"][0]["status"], "within_tolerance");
}

TEST(DiffFiles, F16DistancesInAFile) {
  TempDir dir;
  // 1.0 vs the float below it (1 ulp); 65504 vs +Inf (1 ulp and an Inf difference).
  const Result r =
      one_tensor(dir, "F16", words16({0x3C00, 0x7BFF}), words16({0x3BFF, 0x7C00}), {2});
  ASSERT_EQ(r.status, 1) << r.err;
  const json& t = r.j["tensors"][0];
  EXPECT_EQ(t["differing"], 2);
  EXPECT_EQ(t["max_ulps"], 1);
  EXPECT_EQ(t["median_ulps"], 1);
  EXPECT_EQ(t["inf"], 1);
  EXPECT_EQ(t["a_value"], 1.0);
  EXPECT_EQ(t["b_value"], 1.0 - std::ldexp(1.0, -11));  // 0x3bff = 1 - 2^-11
  const Result inf = one_tensor(dir, "F16", words16({0x7BFF}), words16({0x7C00}), {1});
  EXPECT_EQ(inf.j["tensors"][0]["a_value"], 65504.0);
  EXPECT_EQ(inf.j["tensors"][0]["b_value"], "inf");
}

TEST(DiffFiles, BitwiseDtypesCountDifferencesWithoutUlps) {
  TempDir dir;
  const Result r = one_tensor(dir, "I32", words32({1, 0xFFFFFFFF, 3}), words32({1, 0xFFFFFFFE, 4}),
                              {3}, {"--max-ulps", "10"});
  ASSERT_EQ(r.status, 1) << r.err;
  const json& t = r.j["tensors"][0];
  EXPECT_EQ(t["status"], "different");  // no tolerance for integers
  EXPECT_EQ(t["differing"], 2);
  EXPECT_EQ(t["first_index"], 1);
  EXPECT_EQ(t["a_value"], -1);
  EXPECT_EQ(t["b_value"], -2);
  EXPECT_EQ(t["a_hex"], "0xffffffff");
  EXPECT_TRUE(t["max_ulps"].is_null());
  EXPECT_TRUE(t["median_ulps"].is_null());
  EXPECT_TRUE(t["nan_payload"].is_null());
  // F64 is bitwise too: a NaN payload is just a difference.
  const Result d = one_tensor(dir, "F64", Bytes{0, 0, 0, 0, 0, 0, 0xF8, 0x7F},
                              Bytes{1, 0, 0, 0, 0, 0, 0xF8, 0x7F}, {1});
  EXPECT_EQ(d.j["tensors"][0]["differing"], 1);
  EXPECT_EQ(d.j["tensors"][0]["a_hex"], "0x7ff8000000000000");
  EXPECT_EQ(d.j["tensors"][0]["b_hex"], "0x7ff8000000000001");
  EXPECT_TRUE(d.j["tensors"][0]["max_ulps"].is_null());
  const Result u = one_tensor(dir, "U8", Bytes{200, 7}, Bytes{201, 7}, {2});
  EXPECT_EQ(u.j["tensors"][0]["a_value"], 200);
  EXPECT_EQ(u.j["tensors"][0]["b_hex"], "0xc9");
  const Result b = one_tensor(dir, "BOOL", Bytes{1, 0}, Bytes{1, 1}, {2});
  EXPECT_EQ(b.j["tensors"][0]["first_index"], 1);
}

// ---- pairing ------------------------------------------------------------------------------

TEST(DiffFiles, MissingTensorsInBothDirections) {
  TempDir dir;
  write_safetensors(dir / "a.safetensors",
                    {{"w", "F32", {1}, words32({1})}, {"only_a", "F32", {1}, words32({2})}});
  write_safetensors(dir / "b.safetensors",
                    {{"only_b", "F16", {2}, words16({1, 2})}, {"w", "F32", {1}, words32({1})}});
  const Result r = run_json({dir / "a.safetensors", dir / "b.safetensors"});
  ASSERT_EQ(r.status, 1) << r.err;
  ASSERT_EQ(r.j["tensors"].size(), 3u);
  EXPECT_EQ(r.j["tensors"][0]["name"], "w");
  EXPECT_EQ(r.j["tensors"][0]["status"], "identical");
  EXPECT_EQ(r.j["tensors"][1]["name"], "only_a");
  EXPECT_EQ(r.j["tensors"][1]["status"], "missing_in_b");
  EXPECT_EQ(r.j["tensors"][2]["name"], "only_b");
  EXPECT_EQ(r.j["tensors"][2]["status"], "missing_in_a");
  EXPECT_EQ(r.j["tensors"][2]["dtype"], "F16");  // B's, the side that has it
  EXPECT_TRUE(r.j["tensors"][2]["differing"].is_null());
  EXPECT_EQ(r.j["first_divergence"]["name"], "only_a");
  EXPECT_EQ(r.j["summary"]["missing_in_a"], 1);
  EXPECT_EQ(r.j["summary"]["missing_in_b"], 1);
  EXPECT_EQ(r.j["summary"]["identical"], 1);
  // Only extra tensors in B: they diverge too.
  write_safetensors(dir / "c.safetensors", {{"w", "F32", {1}, words32({1})}});
  const Result extra = run_json({dir / "c.safetensors", dir / "b.safetensors"});
  EXPECT_EQ(extra.status, 1);
  EXPECT_EQ(extra.j["first_divergence"]["name"], "only_b");
}

TEST(DiffFiles, ShapeAndDtypeMismatches) {
  TempDir dir;
  const Bytes six = words32({1, 2, 3, 4, 5, 6});
  write_safetensors(dir / "a.safetensors", {{"s", "F32", {2, 3}, six}, {"d", "F32", {6}, six}});
  write_safetensors(dir / "b.safetensors", {{"s", "F32", {3, 2}, six}, {"d", "I32", {6}, six}});
  const Result r = run_json({dir / "a.safetensors", dir / "b.safetensors"});
  ASSERT_EQ(r.status, 1) << r.err;
  EXPECT_EQ(r.j["tensors"][0]["name"], "s");
  EXPECT_EQ(r.j["tensors"][0]["status"], "shape_mismatch");
  EXPECT_EQ(r.j["tensors"][0]["shape"], json::array({2, 3}));
  EXPECT_EQ(r.j["tensors"][1]["status"], "dtype_mismatch");
  EXPECT_EQ(r.j["tensors"][1]["dtype"], "F32");
  EXPECT_TRUE(r.j["tensors"][1]["differing"].is_null());
  EXPECT_EQ(r.j["summary"]["shape_mismatch"], 1);
  EXPECT_EQ(r.j["summary"]["dtype_mismatch"], 1);
  const Result h = run_diff({dir / "a.safetensors", dir / "b.safetensors"});
  EXPECT_NE(h.out.find("[2,3]/[3,2]"), std::string::npos) << h.out;
  EXPECT_NE(h.out.find("F32/I32"), std::string::npos) << h.out;
}

// ---- the median and the tolerance -------------------------------------------------------------

// A tensor of 1.0f against 1.0f moved by d[i] ulps (up when i is even, down when odd).
void write_distances(const TempDir& dir, const std::vector<std::uint32_t>& d) {
  std::vector<std::uint32_t> a(d.size(), 0x3F800000), b(d.size());
  for (std::size_t i = 0; i < d.size(); ++i) b[i] = i % 2 ? 0x3F800000 - d[i] : 0x3F800000 + d[i];
  write_safetensors(dir / "a.safetensors",
                    {{"w", "F32", {static_cast<std::int64_t>(d.size())}, words32(a)}});
  write_safetensors(dir / "b.safetensors",
                    {{"w", "F32", {static_cast<std::int64_t>(d.size())}, words32(b)}});
}

TEST(DiffMedian, ExactOverACraftedDistribution) {
  TempDir dir;
  struct Case {
    std::vector<std::uint32_t> d;
    std::uint64_t median;  // the lower median: the ((k - 1) / 2)-th smallest of k
    std::uint64_t max, differing, first;
  };
  const std::vector<Case> cases{
      // differing {3,1,7,2,5,1,100000,200000} sorted 1 1 2 [3] 5 7 100000 200000
      {{0, 0, 3, 1, 7, 2, 0, 5, 1, 0, 100000, 200000}, 3, 200000, 8, 2},
      // odd count, the middle one in a wide (>= 2^16) range: 1 70000 [70001] 70005 300000
      {{70000, 1, 70005, 300000, 70001}, 70001, 300000, 5, 0},
      // the two middle ones straddle 2^16: 1 [65535] 65536 131073
      {{65535, 65536, 1, 131073}, 65535, 131073, 4, 0},
      // both in wide ranges: [70000] 140000
      {{0, 140000, 70000}, 70000, 140000, 2, 1},
      // the middle ones in the same wide range: 1 2 3 [65540] 65541 65542 70000 70001
      {{65542, 1, 70001, 65540, 2, 65541, 3, 70000}, 65540, 70001, 8, 0},
      // the lower median itself in a wide range resolved by the second pass: 65536 [65537] 65538
      // 70000
      {{65538, 65536, 70000, 65537}, 65537, 70000, 4, 0},
  };
  for (const Case& c : cases) {
    write_distances(dir, c.d);
    const Result r = run_json({dir / "a.safetensors", dir / "b.safetensors"});
    ASSERT_EQ(r.status, 1) << r.err;
    const json& t = r.j["tensors"][0];
    EXPECT_EQ(t["median_ulps"], c.median) << t.dump();
    EXPECT_EQ(t["max_ulps"], c.max) << t.dump();
    EXPECT_EQ(t["differing"], c.differing);
    EXPECT_EQ(t["first_index"], c.first);
  }
}

TEST(DiffTolerance, MaxUlpsAcceptsTensorsWithinIt) {
  TempDir dir;
  write_distances(dir, {0, 1, 3, 2});
  const Result three = run_json({"--max-ulps", "3", dir / "a.safetensors", dir / "b.safetensors"});
  EXPECT_EQ(three.status, 0) << three.err;
  EXPECT_EQ(three.j["tensors"][0]["status"], "within_tolerance");
  EXPECT_EQ(three.j["identical"], false);  // accepted (exit 0), but not bitwise identical
  EXPECT_EQ(three.j["summary"]["within_tolerance"], 1);
  EXPECT_TRUE(three.j["first_divergence"].is_null());
  const Result h = run_diff({"--max-ulps=3", dir / "a.safetensors", dir / "b.safetensors"});
  EXPECT_EQ(h.status, 0);
  // Accepted by the tolerance, not identical: the summary says so.
  EXPECT_EQ(h.out.find("identical: 1 tensor"), std::string::npos) << h.out;
  EXPECT_NE(h.out.find("within tolerance: 1 tensor (0 identical, 1 within 3 ulps)\n"),
            std::string::npos)
      << h.out;
  const Result two = run_json({"--max-ulps", "2", dir / "a.safetensors", dir / "b.safetensors"});
  EXPECT_EQ(two.status, 1);
  EXPECT_EQ(two.j["tensors"][0]["status"], "different");
  const Result none = run_json({dir / "a.safetensors", dir / "b.safetensors"});
  EXPECT_EQ(none.status, 1);
}

// ---- recordings -------------------------------------------------------------------------------

struct Entry {
  int step;
  std::string point;
  std::string name;
  int rank;
  std::string file;
  std::string key;
  std::string dtype = "F32";
  std::vector<std::int64_t> shape{2};
};

std::string entry_json(const Entry& e) {
  std::string s = "{\"step\": " + std::to_string(e.step) + ", \"point\": \"" + e.point +
                  "\", \"name\": \"" + e.name + "\", \"rank\": " + std::to_string(e.rank) +
                  ", \"file\": \"" + e.file + "\", \"key\": \"" + e.key + "\", \"dtype\": \"" +
                  e.dtype + "\", \"shape\": [";
  for (std::size_t i = 0; i < e.shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(e.shape[i]);
  return s + "]}";
}

std::string manifest(
    const std::vector<Entry>& entries,
    const std::string& head = "\"format\": \"stepcore-recording\", \"version\": 1") {
  std::string s = "{" + head + ", \"run\": {\"model\": \"tiny\", \"seed\": 1}, \"entries\": [";
  for (std::size_t i = 0; i < entries.size(); ++i)
    s += (i ? ",\n  " : "\n  ") + entry_json(entries[i]);
  return s + "]}\n";
}

// A recording of 3 steps x 2 points ("after_backward", "after_step") of tensor "w" on
// ranks 0 and 1, one file per step and rank; value(step, rank, point_index) gives the
// bits of w's two elements. Entries are listed in recording order, or reversed.
template <class Value>
void write_recording(const std::string& dir, Value value, bool reversed = false) {
  fs::create_directories(dir);
  std::vector<Entry> entries;
  for (int step = 1; step <= 3; ++step)
    for (int rank = 0; rank < 2; ++rank) {
      const std::string file =
          "step00000" + std::to_string(step) + "-rank" + std::to_string(rank) + ".safetensors";
      std::vector<RawTensor> tensors;
      for (int p = 0; p < 2; ++p) {
        const std::string point = p == 0 ? "after_backward" : "after_step";
        tensors.push_back({point + "/w", "F32", {2}, words32(value(step, rank, p))});
        entries.push_back({step, point, "w", rank, file, point + "/w"});
      }
      write_safetensors(fs::path(dir) / file, tensors);
    }
  if (reversed) std::reverse(entries.begin(), entries.end());
  write_text(fs::path(dir) / "manifest.json", manifest(entries));
}

std::vector<std::uint32_t> base_value(int step, int rank, int p) {
  return {0x3F800000u + static_cast<std::uint32_t>(100 * step + 10 * rank + p), 0x40000000u};
}

TEST(DiffRecordings, FirstDivergenceIsTheFirstEntryInRecordingOrder) {
  TempDir dir;
  write_recording(dir / "a", base_value);
  // B (entries listed in reverse): step 2's second point differs by 1 ulp on rank 1, and
  // step 3's first point by 5 ulps on rank 0.
  write_recording(
      dir / "b",
      [](int step, int rank, int p) {
        std::vector<std::uint32_t> v = base_value(step, rank, p);
        if (step == 2 && rank == 1 && p == 1) v[1] += 1;
        if (step == 3 && rank == 0 && p == 0) v[0] += 5;
        return v;
      },
      true);
  const Result r = run_json({dir / "a", dir / "b"});
  ASSERT_EQ(r.status, 1) << r.err;
  EXPECT_EQ(r.j["first_divergence"],
            json({{"step", 2}, {"point", "after_step"}, {"name", "w"}, {"rank", 1}}));
  ASSERT_EQ(r.j["tensors"].size(), 12u);
  // A's recording order: step 1 rank 0 after_backward, after_step, rank 1 ...
  EXPECT_EQ(r.j["tensors"][0]["step"], 1);
  EXPECT_EQ(r.j["tensors"][0]["point"], "after_backward");
  EXPECT_EQ(r.j["tensors"][7]["step"], 2);
  EXPECT_EQ(r.j["tensors"][7]["rank"], 1);
  EXPECT_EQ(r.j["tensors"][7]["point"], "after_step");
  EXPECT_EQ(r.j["tensors"][7]["key"], "after_step/w");
  EXPECT_EQ(r.j["tensors"][7]["status"], "different");
  EXPECT_EQ(r.j["tensors"][7]["first_index"], 1);
  EXPECT_EQ(r.j["tensors"][8]["status"], "different");
  EXPECT_EQ(r.j["tensors"][8]["max_ulps"], 5);
  EXPECT_EQ(r.j["summary"]["identical"], 10);
  EXPECT_EQ(r.j["summary"]["different"], 2);
  const Result h = run_diff({dir / "a", dir / "b"});
  EXPECT_EQ(h.status, 1);
  EXPECT_NE(h.out.find("first divergence: step 2, point after_step, name w, rank 1\n"),
            std::string::npos)
      << h.out;
  EXPECT_NE(h.out.find("12 tensors: 10 identical, 2 different\n"), std::string::npos) << h.out;
  // Within 1 ulp accepted: the first divergence moves to step 3.
  const Result tol = run_json({"--max-ulps", "1", dir / "a", dir / "b"});
  EXPECT_EQ(tol.status, 1);
  EXPECT_EQ(tol.j["first_divergence"],
            json({{"step", 3}, {"point", "after_backward"}, {"name", "w"}, {"rank", 0}}));
  EXPECT_EQ(tol.j["tensors"][7]["status"], "within_tolerance");
  // Identical recordings.
  const Result same = run_diff({dir / "a", dir / "a"});
  EXPECT_EQ(same.status, 0);
  EXPECT_EQ(same.out, "identical: 12 tensors\n");
}

TEST(DiffRecordings, EntriesMissingOnEitherSide) {
  TempDir dir;
  write_recording(dir / "a", base_value);
  fs::create_directories(dir / "b");
  fs::copy(dir / "a/step000001-rank0.safetensors", dir / "b/step000001-rank0.safetensors");
  write_text(
      dir / "b/manifest.json",
      manifest({{1, "after_step", "w", 0, "step000001-rank0.safetensors", "after_step/w"},
                {1, "after_step", "v", 0, "step000001-rank0.safetensors", "after_backward/w"}}));
  const Result r = run_json({dir / "a", dir / "b"});
  ASSERT_EQ(r.status, 1) << r.err;
  EXPECT_EQ(r.j["first_divergence"],
            json({{"step", 1}, {"point", "after_backward"}, {"name", "w"}, {"rank", 0}}));
  EXPECT_EQ(r.j["tensors"][0]["status"], "missing_in_b");
  EXPECT_EQ(r.j["tensors"][1]["status"], "identical");
  EXPECT_EQ(r.j["summary"]["missing_in_b"], 11);
  EXPECT_EQ(r.j["summary"]["missing_in_a"], 1);
  EXPECT_EQ(r.j["tensors"].back()["name"], "v");
  EXPECT_EQ(r.j["tensors"].back()["key"], "after_backward/w");
}

// ---- corrupt input: exit status 2, the file and the problem named, nothing on stdout ----

void cut_to_size(const std::string& path, off_t size) {
  ASSERT_EQ(::truncate(path.c_str(), size), 0) << std::strerror(errno);
}

void expect_refused(const std::vector<std::string>& args, const std::string& file,
                    const std::string& problem) {
  const Result r = run_diff(args);
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_EQ(r.out, "") << "nothing is printed before the inputs are checked";
  EXPECT_NE(r.err.find(file), std::string::npos) << "does not name " << file << ": " << r.err;
  EXPECT_NE(r.err.find(problem), std::string::npos)
      << "does not say '" << problem << "': " << r.err;
}

// Writes a corrupt file (header text and data as given) and expects it refused as A and as B.
void expect_corrupt_file(const TempDir& dir, const test_support::Bytes& bytes,
                         const std::string& problem) {
  const std::string bad = dir / "bad.safetensors", good = dir / "good.safetensors";
  test_support::write_bytes(bad, bytes);
  write_safetensors(good, {{"w", "F32", {1}, words32({1})}});
  SCOPED_TRACE(problem);
  expect_refused({bad, good}, bad, problem);
  expect_refused({"--json", good, bad}, bad, problem);
}

using test_support::file_bytes;

TEST(DiffCorrupt, TheFileItself) {
  TempDir dir;
  expect_corrupt_file(dir, {1, 2, 3}, "shorter than the 8-byte header length");
  expect_corrupt_file(dir, {}, "shorter than the 8-byte header length");
  expect_corrupt_file(dir, file_bytes("{}", {}, 100),
                      "the header length 100 runs past the end of the file");
  expect_corrupt_file(dir, file_bytes("{}", {}, 0xFFFFFFFFFFFFFFFFull),
                      "runs past the end of the file");
  expect_corrupt_file(dir, file_bytes("{\"w\": ", {}), "the header is not valid JSON");
  expect_corrupt_file(dir, file_bytes("[1, 2]", {}), "the header is an array, not a JSON object");
  expect_corrupt_file(dir, file_bytes("\"w\"", {}), "the header is a string, not a JSON object");
  expect_corrupt_file(
      dir,
      file_bytes(
          R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
          Bytes(8, 0)),
      "has the key \"w\" twice");
}

TEST(DiffCorrupt, TensorEntries) {
  TempDir dir;
  const Bytes eight(8, 0);
  const auto entry = [&](const std::string& e, const Bytes& data = Bytes(4, 0)) {
    return file_bytes("{\"w\":" + e + "}", data);
  };
  expect_corrupt_file(dir, entry("[1]"), "tensor 'w': its entry is an array, not an object");
  expect_corrupt_file(dir, entry(R"({"shape":[1],"data_offsets":[0,4]})"),
                      "tensor 'w': no \"dtype\"");
  expect_corrupt_file(dir, entry(R"({"dtype":"F32","data_offsets":[0,4]})"),
                      "tensor 'w': no \"shape\"");
  expect_corrupt_file(dir, entry(R"({"dtype":"F32","shape":[1]})"),
                      "tensor 'w': no \"data_offsets\"");
  expect_corrupt_file(dir, entry(R"({"dtype":5,"shape":[1],"data_offsets":[0,4]})"),
                      "\"dtype\" is an integer, not a string");
  expect_corrupt_file(dir, entry(R"({"dtype":"F32","shape":"1","data_offsets":[0,4]})"),
                      "\"shape\" is a string, not an array");
  expect_corrupt_file(dir, entry(R"({"dtype":"F32","shape":[1.0],"data_offsets":[0,4]})"),
                      "shape[0] is a non-integer number, not an integer");
  expect_corrupt_file(dir, entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0]})"),
                      "\"data_offsets\" is [0], not an array of two non-negative integers");
  expect_corrupt_file(dir, entry(R"({"dtype":"F32","shape":[1],"data_offsets":["0",4]})"),
                      "not an array of two non-negative integers");
  expect_corrupt_file(dir, entry(R"({"dtype":"F32","shape":[1],"data_offsets":[-4,4]})"),
                      "not an array of two non-negative integers");
  expect_corrupt_file(dir, entry(R"({"dtype":"F32","shape":[2,-3],"data_offsets":[0,4]})"),
                      "tensor 'w': shape[1] is -3, negative");
  expect_corrupt_file(
      dir, entry(R"({"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,4]})"),
      "the element count of shape [4294967296, 4294967296] overflows 64 bits");
  expect_corrupt_file(
      dir, entry(R"({"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,4]})"),
      "overflows 64 bits");  // elements fit, bytes (x4) do not
  expect_corrupt_file(dir, entry(R"({"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]})"),
                      "tensor 'w': unknown dtype \"F8_E4M3\"");
  expect_corrupt_file(
      dir, entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0,8]})"),
      "data_offsets [0, 8] run past the end of the data (4 bytes after the header)");
  expect_corrupt_file(dir, entry(R"({"dtype":"F32","shape":[1],"data_offsets":[4,0]})"),
                      "data_offsets [4, 0]: begin > end");
  expect_corrupt_file(dir, entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0,8]})", eight),
                      "data_offsets [0, 8] hold 8 bytes, but shape [1] of F32 needs 4");
  expect_corrupt_file(
      dir,
      file_bytes(
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
          eight),
      "tensors 'a' [0, 8) and 'b' [4, 8) overlap");
  expect_corrupt_file(dir, file_bytes(R"({"__metadata__":[1]})", {}),
                      "\"__metadata__\" is an array, not an object");
  expect_corrupt_file(dir, file_bytes(R"({"__metadata__":{"k":1}})", {}),
                      "\"__metadata__\" entry 'k' is an integer, not a string");
}

TEST(DiffCorrupt, EmptyRangesAndGapsAreAccepted) {
  TempDir dir;
  // A zero-element tensor inside another's range, and unused bytes between tensors.
  const std::string h =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"e":{"dtype":"F32","shape":[0,3],"data_offsets":[2,2]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  test_support::write_bytes(dir / "a.safetensors", file_bytes(h, Bytes(12, 0)));
  const Result r = run_json({dir / "a.safetensors", dir / "a.safetensors"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.j["summary"]["tensors"], 3);
}

TEST(DiffCorrupt, Recordings) {
  TempDir dir;
  write_recording(dir / "good", base_value);
  const std::string rec = dir / "r";
  const std::string m = rec + "/manifest.json";
  const std::string f1 = "step000001-rank0.safetensors";
  fs::create_directories(rec);
  fs::copy(dir / ("good/" + f1), rec + "/" + f1);
  const Entry ok{1, "after_step", "w", 0, f1, "after_step/w"};
  const auto expect_bad = [&](const std::string& text, const std::string& file,
                              const std::string& problem) {
    write_text(m, text);
    SCOPED_TRACE(problem);
    expect_refused({rec, dir / "good"}, file, problem);
    expect_refused({dir / "good", rec}, file, problem);
  };
  // No manifest at all.
  const std::string empty = dir / "empty";
  fs::create_directories(empty);
  expect_refused({empty, dir / "good"}, empty, "not a recording: no manifest.json");
  expect_bad("{\"format\": ", m, "the manifest is not valid JSON");
  expect_bad("[]", m, "the manifest is an array, not a JSON object");
  expect_bad("{\"version\": 1, \"entries\": []}", m, "no \"format\"");
  expect_bad(manifest({ok}, "\"format\": \"other\", \"version\": 1"), m,
             "\"format\" is \"other\", not \"stepcore-recording\"");
  expect_bad(manifest({ok}, "\"format\": \"stepcore-recording\", \"version\": 3"), m,
             "\"version\" is 3; this stepcore-diff reads versions 1 to 2");
  expect_bad(manifest({ok}, "\"format\": \"stepcore-recording\""), m, "no \"version\"");
  expect_bad("{\"format\": \"stepcore-recording\", \"version\": 1}", m, "no \"entries\"");
  expect_bad("{\"format\": \"stepcore-recording\", \"version\": 1, \"entries\": {}}", m,
             "\"entries\" is an object, not an array");
  expect_bad("{\"format\": \"stepcore-recording\", \"version\": 1, \"run\": 3, \"entries\": []}", m,
             "\"run\" is an integer, not an object");
  expect_bad("{\"format\": \"stepcore-recording\", \"version\": 1, \"entries\": [7]}", m,
             "entries[0]: is an integer, not an object");
  Entry e = ok;
  e.step = 2;
  e.file = "step000009-rank0.safetensors";
  expect_bad(manifest({ok, e}), m,
             "entries[1] (step 2, rank 0, point after_step, name w): its file");
  expect_bad(manifest({ok, e}), m, "step000009-rank0.safetensors does not exist");
  e = ok;
  e.key = "after_step/nope";
  expect_bad(manifest({e}), m, "key 'after_step/nope' is not in " + rec + "/" + f1);
  expect_bad(manifest({ok, {2, "x", "y", 0, f1, "after_backward/w"}, ok}), m,
             "entries[2] (step 1, rank 0, point after_step, name w): repeats the (step, rank, "
             "point, name) of entries[0]");
  e = ok;
  e.dtype = "BF16";
  expect_bad(manifest({e}), m, "the manifest says dtype BF16, shape [2], but");
  expect_bad(manifest({e}), m, "with dtype F32, shape [2]");
  e = ok;
  e.shape = {1, 2};
  expect_bad(manifest({e}), m, "the manifest says dtype F32, shape [1, 2]");
  e = ok;
  e.dtype = "Q4";
  expect_bad(manifest({e}), m, "unknown dtype \"Q4\"");
  e = ok;
  for (const std::string& outside :
       {"../good/" + f1, "sub/../../good/" + f1, "/" + rec + "/" + f1}) {
    e.file = outside;
    expect_bad(manifest({e}), m, "is not a relative path inside the recording");
  }
  std::string bad_step = manifest({ok});
  bad_step.replace(bad_step.find("\"step\": 1"), 9, "\"step\": \"1\"");
  expect_bad(bad_step, m, "entries[0]: \"step\" is \"1\", not a non-negative integer");
  // An entry's file that is itself corrupt: its own path is named.
  test_support::write_bytes(rec + "/broken.safetensors", {1, 2});
  e = ok;
  e.file = "broken.safetensors";
  expect_bad(manifest({e}), rec + "/broken.safetensors", "shorter than the 8-byte header length");
}

TEST(DiffCorrupt, BadArguments) {
  TempDir dir;
  write_recording(dir / "r", base_value);
  write_safetensors(dir / "f.safetensors", {{"w", "F32", {1}, words32({1})}});
  expect_refused({dir / "r", dir / "f.safetensors"}, dir / "r",
                 "must both be recordings or both safetensors files");
  expect_refused({dir / "f.safetensors"}, "", "needs two inputs A and B, got 1");
  expect_refused({dir / "nothing", dir / "f.safetensors"}, dir / "nothing", "cannot read");
  expect_refused({"--threads", "0", dir / "f.safetensors", dir / "f.safetensors"}, "--threads",
                 "needs an integer in [1, 4096], not '0'");
  expect_refused({"--max-ulps", "-1", dir / "f.safetensors", dir / "f.safetensors"}, "--max-ulps",
                 "not '-1'");
  expect_refused({dir / "f.safetensors", dir / "f.safetensors", "--max-ulps"}, "--max-ulps",
                 "needs a value");
  expect_refused({"--frobnicate", dir / "f.safetensors", dir / "f.safetensors"}, "--frobnicate",
                 "unknown option");
  const Result help = run_diff({"--help"});
  EXPECT_EQ(help.status, 0);
  EXPECT_NE(help.out.find("usage: stepcore-diff"), std::string::npos);
}

// ---- threads ------------------------------------------------------------------------------------

TEST(DiffThreads, TheSameResultsOnOneTwoAndThreeThreads) {
  TempDir dir;
  // "big": 3,000,000 f32 (12 MB, compared in chunks across threads). Elements 7 + 100003 k
  // (k < 30) are moved by 70000 + k ulps, the last one is a NaN with another payload.
  const std::uint32_t n = 3000000;
  std::vector<std::uint32_t> a(n), b(n);
  for (std::uint32_t i = 0; i < n; ++i) a[i] = 0x3F800000u + (i % 1000);
  b = a;
  for (std::uint32_t k = 0; k < 30; ++k) b[7 + 100003 * k] += 70000 + k;
  a[n - 1] = 0x7FC00000;
  b[n - 1] = 0x7FC00001;
  // "half": 5,000,000 f16 (10 MB): every 1000th element 1 ulp up, every 3000th 3 ulps.
  const std::uint32_t m = 5000000;
  std::vector<std::uint16_t> ha(m, 0x3C00), hb(m, 0x3C00);
  for (std::uint32_t i = 0; i < m; i += 1000) hb[i] = i % 3000 == 0 ? 0x3C03 : 0x3C01;
  std::vector<RawTensor> ta{{"big", "F32", {1000, 3000}, words32(a)},
                            {"half", "F16", {m}, words16(ha)}};
  std::vector<RawTensor> tb{{"big", "F32", {1000, 3000}, words32(b)},
                            {"half", "F16", {m}, words16(hb)}};
  // And 40 small tensors, every third one differing in one element.
  for (int s = 0; s < 40; ++s) {
    const std::string name = "small." + std::to_string(s);
    std::vector<std::uint32_t> v(100, 0x40000000u + static_cast<std::uint32_t>(s));
    ta.push_back({name, "F32", {100}, words32(v)});
    if (s % 3 == 0) v[s] += static_cast<std::uint32_t>(s + 1);
    tb.push_back({name, "F32", {100}, words32(v)});
  }
  write_safetensors(dir / "a.safetensors", ta);
  write_safetensors(dir / "b.safetensors", tb);
  std::string first;
  for (const char* threads : {"1", "2", "3"}) {
    const Result r =
        run_diff({"--json", "--threads", threads, dir / "a.safetensors", dir / "b.safetensors"});
    ASSERT_EQ(r.status, 1) << r.err;
    if (first.empty()) {
      first = r.out;
    } else {
      EXPECT_EQ(r.out, first) << threads << " threads";
    }
  }
  const json j = json::parse(first);
  const json& big = j["tensors"][0];
  EXPECT_EQ(big["name"], "big");
  EXPECT_EQ(big["differing"], 31);
  EXPECT_EQ(big["nan_payload"], 1);
  EXPECT_EQ(big["first_index"], 7);
  EXPECT_EQ(big["max_ulps"], 70029);
  EXPECT_EQ(big["median_ulps"], 70014);  // the lower median of 70000..70029 (30 values)
  const json& half = j["tensors"][1];
  EXPECT_EQ(half["differing"], 5000);
  EXPECT_EQ(half["max_ulps"], 3);
  EXPECT_EQ(half["median_ulps"], 1.0);  // 3333 ones, 1667 threes
  EXPECT_EQ(half["first_index"], 0);
  EXPECT_EQ(j["summary"]["different"], 2 + 14);  // s = 0, 3, ..., 39
  EXPECT_EQ(j["tensors"][5]["name"], "small.3");
  EXPECT_EQ(j["tensors"][5]["first_index"], 3);
  EXPECT_EQ(j["tensors"][5]["max_ulps"], 4);
}

// ---- recordings of version 2: a journal, sharded tensors ---------------------------------

// A version-2 recording in `dir`: manifest.json naming entries.jsonl, whose text is `journal`.
void write_v2(const std::string& dir, const std::string& journal) {
  fs::create_directories(dir);
  write_text(fs::path(dir) / "manifest.json",
             "{\"format\": \"stepcore-recording\", \"version\": 2, \"run\": {}, "
             "\"journal\": \"entries.jsonl\"}\n");
  write_text(fs::path(dir) / "entries.jsonl", journal);
}

// One journal line: entry `e`, with a placement when `global_shape` is not empty.
std::string line(const Entry& e, const std::vector<std::int64_t>& global_shape = {},
                 const std::vector<std::int64_t>& offset = {}) {
  std::string s = entry_json(e);
  if (!global_shape.empty()) {
    const auto list = [](const std::vector<std::int64_t>& v) {
      std::string t = "[";
      for (std::size_t i = 0; i < v.size(); ++i) t += (i ? ", " : "") + std::to_string(v[i]);
      return t + "]";
    };
    s.pop_back();
    s += ", \"global_shape\": " + list(global_shape) + ", \"global_offset\": " + list(offset) + "}";
  }
  return s + "\n";
}

TEST(DiffJournal, EntriesAreReadALineEachAndATornLastLineIsNotYetWritten) {
  TempDir dir;
  const std::string f = "step000001-rank0.safetensors";
  const std::string rec = dir / "r";
  fs::create_directories(rec);
  write_safetensors(fs::path(rec) / f,
                    {{"p/w", "F32", {2}, words32({1, 2})}, {"p/v", "F32", {2}, words32({3, 4})}});
  const std::string w = line({1, "p", "w", 0, f, "p/w"});
  const std::string v = line({1, "p", "v", 0, f, "p/v"});
  // The second line torn at every length: only the first entry is read.
  for (std::size_t cut = 0; cut < v.size(); ++cut) {
    write_v2(rec, w + v.substr(0, cut));
    const Result r = run_json({rec, rec});
    ASSERT_EQ(r.status, 0) << cut << ": " << r.err;
    EXPECT_EQ(r.j["summary"]["tensors"], 1) << cut;
  }
  write_v2(rec, w + v);
  EXPECT_EQ(run_json({rec, rec}).j["summary"]["tensors"], 2);
  // A complete line that is not an entry is an error naming the journal and the line.
  const std::string journal = rec + "/entries.jsonl";
  write_v2(rec, w + "{\"step\": \n" + v);
  expect_refused({rec, rec}, journal, "line 2 of the journal is not valid JSON");
  write_v2(rec, w + "\n" + v);
  expect_refused({rec, rec}, journal, "line 2 of the journal is empty");
  write_v2(rec, w + "[1]\n");
  expect_refused({rec, rec}, journal, "line 2 of the journal is an array, not a JSON object");
  write_v2(rec, w + w);
  expect_refused({rec, rec}, journal,
                 "line 2 (step 1, rank 0, point p, name w): repeats the (step, rank, point, "
                 "name) of line 1");
  fs::remove(journal);
  expect_refused({rec, rec}, rec + "/manifest.json", "entries.jsonl does not exist");
}

// A 2-rank recording of a [4, 3] tensor "w" split by rows (rank 0: rows 0-1, rank 1: rows
// 2-3) and a [2, 4] tensor "c" split by columns, against a 1-process recording holding
// them whole. `value(i)` is the bits of global flat element i of w (c: 100 + i).
template <class Value>
void write_sharded(const std::string& two, const std::string& one, Value value) {
  std::vector<std::uint32_t> w(12), c(8);
  for (std::uint32_t i = 0; i < 12; ++i) w[i] = value(i);
  for (std::uint32_t i = 0; i < 8; ++i) c[i] = 0x3F800000u + 100 + i;
  const std::string f0 = "step000001-rank0.safetensors", f1 = "step000001-rank1.safetensors";
  fs::create_directories(two);
  write_safetensors(fs::path(two) / f0,
                    {{"p/w", "F32", {2, 3}, words32({w.begin(), w.begin() + 6})},
                     {"p/c", "F32", {2, 2}, words32({c[0], c[1], c[4], c[5]})}});
  write_safetensors(fs::path(two) / f1,
                    {{"p/w", "F32", {2, 3}, words32({w.begin() + 6, w.end()})},
                     {"p/c", "F32", {2, 2}, words32({c[2], c[3], c[6], c[7]})}});
  write_v2(two, line({1, "p", "w", 0, f0, "p/w", "F32", {2, 3}}, {4, 3}, {0, 0}) +
                    line({1, "p", "c", 0, f0, "p/c", "F32", {2, 2}}, {2, 4}, {0, 0}) +
                    line({1, "p", "w", 1, f1, "p/w", "F32", {2, 3}}, {4, 3}, {2, 0}) +
                    line({1, "p", "c", 1, f1, "p/c", "F32", {2, 2}}, {2, 4}, {0, 2}));
  fs::create_directories(one);
  std::vector<std::uint32_t> whole(12);
  for (std::uint32_t i = 0; i < 12; ++i) whole[i] = 0x3F800000u + i;
  write_safetensors(fs::path(one) / f0,
                    {{"p/w", "F32", {4, 3}, words32(whole)}, {"p/c", "F32", {2, 4}, words32(c)}});
  write_v2(one, line({1, "p", "w", 0, f0, "p/w", "F32", {4, 3}}) +
                    line({1, "p", "c", 0, f0, "p/c", "F32", {2, 4}}));
}

TEST(DiffRecordings, ShardsAreGatheredByTheirRecordedPlacement) {
  TempDir dir;
  const auto same = [](std::uint32_t i) { return 0x3F800000u + i; };
  write_sharded(dir / "two", dir / "one", same);
  for (const auto& [a, b] :
       {std::pair(dir / "two", dir / "one"), std::pair(dir / "one", dir / "two")}) {
    const Result r = run_json({a, b});
    ASSERT_EQ(r.status, 0) << r.err << r.out;
    ASSERT_EQ(r.j["summary"]["tensors"], 2);
    EXPECT_EQ(r.j["summary"]["identical"], 2);
    EXPECT_EQ(r.j["tensors"][0]["shape"], json({4, 3}));
    EXPECT_EQ(r.j["tensors"][0]["rank"], 0);
    EXPECT_EQ(r.j["tensors"][1]["shape"], json({2, 4}));
  }
  // One element differs: global (3, 1) of w, element (1, 1) of rank 1's shard.
  write_sharded(dir / "two", dir / "one",
                [&](std::uint32_t i) { return same(i) + (i == 10 ? 2 : 0); });
  const Result r = run_json({dir / "two", dir / "one"});
  ASSERT_EQ(r.status, 1) << r.err;
  EXPECT_EQ(r.j["tensors"][0]["status"], "different");
  EXPECT_EQ(r.j["tensors"][0]["differing"], 1);
  EXPECT_EQ(r.j["tensors"][0]["first_index"], 10);
  EXPECT_EQ(r.j["tensors"][0]["max_ulps"], 2);
  EXPECT_EQ(r.j["tensors"][1]["status"], "identical");
  const Result h = run_diff({dir / "two", dir / "one"});
  EXPECT_NE(h.out.find("10 (3,1)"), std::string::npos) << h.out;
  EXPECT_NE(h.out.find("first divergence: step 1, point p, name w, rank 0\n"), std::string::npos)
      << h.out;
}

TEST(DiffRecordings, ShardsThatDoNotTileTheWholeAreRefused) {
  TempDir dir;
  const std::string rec = dir / "r", journal = rec + "/entries.jsonl";
  const std::string f0 = "step000001-rank0.safetensors", f1 = "step000001-rank1.safetensors";
  fs::create_directories(rec);
  write_safetensors(fs::path(rec) / f0, {{"p/w", "F32", {2}, words32({1, 2})}});
  write_safetensors(fs::path(rec) / f1, {{"p/w", "F32", {2}, words32({3, 4})}});
  const Entry r0{1, "p", "w", 0, f0, "p/w"}, r1{1, "p", "w", 1, f1, "p/w"};
  write_v2(rec, line(r0, {5}, {0}) + line(r1, {5}, {2}));
  expect_refused({rec, rec}, journal, "global index 4 of [5] is in none of its ranks' shards");
  write_v2(rec, line(r0, {4}, {0}) + line(r1, {4}, {1}));
  expect_refused({rec, rec}, journal,
                 "line 2 (step 1, rank 1, point p, name w): its shard and an earlier rank's "
                 "differ at global index 1");
  write_v2(rec, line(r0, {4}, {0}) + line(r1, {4}, {3}));
  expect_refused({rec, rec}, journal, "does not lie inside the global shape [4]");
  write_v2(rec, line(r0, {4}, {0}) + line(r1, {5}, {2}));
  expect_refused({rec, rec}, journal, "its shard is of dtype F32, shape [5], but");
  write_v2(rec, line(r0, {4, 1}, {0}) + line(r1, {4}, {2}));
  expect_refused({rec, rec}, journal, "have different lengths");
  // Equal copies of an element two shards hold (a replicated mesh dimension) are fine.
  write_safetensors(fs::path(rec) / f1, {{"p/w", "F32", {2}, words32({2, 4})}});
  write_v2(rec, line(r0, {3}, {0}) + line(r1, {3}, {1}));
  const Result ok = run_json({rec, rec});
  EXPECT_EQ(ok.status, 0) << ok.err;
  EXPECT_EQ(ok.j["tensors"][0]["shape"], json({3}));
}

// ---- a file truncated while it is read: an error, never a signal --------------------------

TEST(DiffTruncation, ALoadRacingATruncationIsAnErrorNeverASignal) {
  TempDir dir;
  // ~1.2 MB over three tensors of A; B is A's copy, left alone.
  std::vector<RawTensor> tensors;
  std::mt19937_64 fill(5);
  for (const std::int64_t n : {200000, 100000, 7}) {
    std::vector<std::uint32_t> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = static_cast<std::uint32_t>(fill()) & 0x3FFFFFFFu;
    tensors.push_back({"t" + std::to_string(n), "F32", {n}, words32(v)});
  }
  const std::string master = dir / "master.safetensors", a = dir / "a.safetensors",
                    b = dir / "b.safetensors";
  write_safetensors(master, tensors);
  write_safetensors(b, tensors);
  const Bytes bytes = [&] {
    std::ifstream in(master, std::ios::binary);
    return Bytes(std::istreambuf_iterator<char>(in), {});
  }();
  const auto write_copy = [&] { test_support::write_bytes(a, bytes); };
  const auto cut_to = [&](off_t cut) {
    ASSERT_EQ(::truncate(a.c_str(), cut), 0) << std::strerror(errno);
  };
  // A comparison that ran compared the whole file: identical to B.
  const auto expect_identical = [&](const Result& r, int run) {
    ASSERT_EQ(r.status, 0) << "run " << run << ": " << r.err;
    EXPECT_EQ(r.j["summary"]["identical"], 3) << "run " << run;
  };
  write_copy();
  expect_identical(run_json({a, b}), -1);
  // The racer cuts within twice the time a warm load of A takes (the fastest of 5).
  std::int64_t load_ns = INT64_MAX;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    (void)stepcore::diff::load_input(a);
    load_ns = std::min<std::int64_t>(load_ns, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                  std::chrono::steady_clock::now() - t0)
                                                  .count());
  }
  load_ns = std::max<std::int64_t>(load_ns, 1000);
  std::mt19937_64 rng(27);
  int compared = 0, shrank = 0, short_file = 0, raced_whole = 0;
  for (int run = 0; run < 1000; ++run) {
    write_copy();
    const auto cut = static_cast<off_t>(rng() % bytes.size());
    const int kind = run % 4;
    std::atomic<bool> go{false};
    std::thread racer;
    Result r;
    if (kind == 0) {  // before the comparison
      cut_to(cut);
      r = run_json({a, b});
    } else if (kind == 1) {  // between two reads of A
      const std::size_t chunk = 4096 + rng() % 65536;
      const std::size_t at = rng() % bytes.size();
      bool done = false;
      const stepcore::detail::testing::ScopedReadHook hook(chunk, [&](std::uint64_t offset) {
        if (!done && offset + chunk > at) {
          cut_to(cut);
          done = true;
        }
      });
      r = run_json({a, b});
      EXPECT_EQ(r.status, 2) << "run " << run << ": a file cut while read compared";
      EXPECT_NE(r.err.find("while being read"), std::string::npos) << r.err;
    } else if (kind == 2) {  // after the load, before the comparison
      const stepcore::diff::Input ia = stepcore::diff::load_input(a);
      const stepcore::diff::Input ib = stepcore::diff::load_input(b);
      cut_to(cut);
      const stepcore::diff::DiffResult d = stepcore::diff::diff_inputs(ia, ib, {});
      EXPECT_EQ(d.counts[0], 3u) << "run " << run << ": the loaded bytes changed";
      r.status = d.exit_status();
      r.j["summary"]["identical"] = d.counts[0];
    } else {  // from another thread, at a random moment of the comparison
      const auto delay = std::chrono::nanoseconds(static_cast<std::int64_t>(rng() % (2 * load_ns)));
      std::atomic<bool> ready{false};
      racer = std::thread([&, delay] {  // delay by value: it leaves scope before the join
        ready.store(true, std::memory_order_release);
        while (!go.load(std::memory_order_acquire)) {
        }
        const auto until = std::chrono::steady_clock::now() + delay;
        while (std::chrono::steady_clock::now() < until) {
        }
        cut_to(cut);
      });
      while (!ready.load(std::memory_order_acquire)) {  // the racer is running
      }
      go.store(true, std::memory_order_release);
      r = run_json({a, b});
    }
    if (racer.joinable()) racer.join();
    if (r.status == 2) {
      EXPECT_NE(kind, 2);
      EXPECT_NE(r.err.find(a), std::string::npos) << "run " << run << ": " << r.err;
      ++(r.err.find("while being read") != std::string::npos ? shrank : short_file);
    } else {
      expect_identical(r, run);
      ++compared;
      if (kind == 3) ++raced_whole;
    }
    if (HasFailure()) return;
  }
  std::printf(
      "[ diff ] 1,000 comparisons around a truncation: %d compared whole (%d of the 250 "
      "raced), %d shrank while read, %d refused as short\n",
      compared, raced_whole, shrank, short_file);
  EXPECT_GE(shrank, 250) << "every truncation between two reads is seen while reading";
  EXPECT_GE(short_file, 200) << "every truncation before the comparison is a short file";
}

TEST(DiffTruncation, FileBytesReadsWholeOrThrowsNamingTheFile) {
  TempDir dir;
  const std::string p = dir / "f";
  test_support::write_bytes(p, Bytes(100000, 7));
  const stepcore::diff::FileBytes whole(p);
  ASSERT_EQ(whole.size(), 100000u);
  EXPECT_EQ(whole.data()[99999], std::byte{7});
  std::uint64_t calls = 0;
  try {
    const stepcore::detail::testing::ScopedReadHook hook(4096, [&](std::uint64_t offset) {
      ++calls;
      if (offset == 8192) cut_to_size(p, 5000);
    });
    (void)stepcore::diff::FileBytes(p);
    ADD_FAILURE() << "a file that shrank to 5000 bytes while read was read";
  } catch (const stepcore::diff::InputError& e) {
    EXPECT_NE(std::string(e.what()).find(p + ": ends at byte 8192 while being read"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(calls, 3u);
  test_support::write_bytes(p, {});
  EXPECT_EQ(stepcore::diff::FileBytes(p).size(), 0u);
  EXPECT_THROW(stepcore::diff::FileBytes(dir / "nothing"), stepcore::diff::InputError);
  EXPECT_THROW(stepcore::diff::FileBytes(dir / ""), stepcore::diff::InputError);  // a directory
}

// ---- the executable
// -------------------------------------------------------------------------------

int exit_status_of(const std::string& args) {
  const std::string cmd = std::string(STEPCORE_DIFF_EXE) + " " + args + " >/dev/null 2>&1";
  const int s = std::system(cmd.c_str());
  return WIFEXITED(s) ? WEXITSTATUS(s) : -1;
}

TEST(DiffExecutable, ExitStatuses) {
  TempDir dir;
  write_safetensors(dir / "a.safetensors", {{"w", "F32", {2}, words32({1, 2})}});
  write_safetensors(dir / "b.safetensors", {{"w", "F32", {2}, words32({1, 3})}});
  test_support::write_bytes(dir / "c.safetensors", {0, 1});
  const std::string a = dir / "a.safetensors", b = dir / "b.safetensors", c = dir / "c.safetensors";
  EXPECT_EQ(exit_status_of(a + " " + a), 0);
  EXPECT_EQ(exit_status_of(a + " " + b), 1);
  EXPECT_EQ(exit_status_of("--max-ulps 1 " + a + " " + b), 0);
  EXPECT_EQ(exit_status_of("--json " + a + " " + c), 2);
  EXPECT_EQ(exit_status_of(a), 2);
}

}  // namespace
