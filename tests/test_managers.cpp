// The differential test of the gradient managers: one synthetic gradient stream (several
// steps and micro-batches, bf16 and f32 gradients, SFT- and RL-like flows, max_norm
// none / 0.05 / 100, AdamW and SignSGD, with and without optimizer overlap) through the
// three modes — none (GpuGradientManager, eager and lazy scale), optimizer (streamed
// state) and full (OffloadGradientManager) — on the host device, must give identical
// norms, clip coefficients, parameters, moments and compute weights after every step,
// and equal an independent simulation built from stepcore::reference alone. Also the
// same stream sharded over 2 and 4 in-process ranks, the factory's refusals, and the
// fault behaviour. Every optimizer unit in every mode, and resumed across modes, is the
// optimizer matrix's (tests/test_optimizer_matrix.cpp).
#include <gtest/gtest.h>
#include <malloc.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <thread>

#include "device/host_device.hpp"
#include "expect_error.hpp"
#include "host/crc32c.hpp"
#include "managers/checkpoint_file.hpp"
#include "managers/testing.hpp"
#include "managers_cases.hpp"
#include "optimizer_records.hpp"
#include "sanitized.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/reference.hpp"

namespace {

using namespace managers_cases;

// A manager of `cfg` with the stream's initial masters loaded.
std::unique_ptr<GradientManager> make_initial(const ManagerConfig& cfg) {
  auto m = make_gradient_manager(cfg);
  for (std::size_t i = 0; i < cfg.params.size(); ++i) {
    std::vector<float> init(cfg.params[i].numel);
    for (std::size_t j = 0; j < init.size(); ++j) init[j] = initial_master(i, j);
    m->load_parameter(i, init);
  }
  return m;
}

// A manager of `mode` (AdamW) over parameters "w<i>" of `sizes`, groups in turn.
std::unique_ptr<GradientManager> make_sized(OffloadMode mode, device::Device& dev,
                                            const std::vector<std::size_t>& sizes) {
  ManagerConfig cfg = config_of(mode, dev);
  cfg.params.clear();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    ParamSpec p;
    p.name = "w" + std::to_string(i);
    p.numel = sizes[i];
    p.group = i % 2;
    cfg.params.push_back(p);
  }
  return make_gradient_manager(cfg);
}

// Distinct values per parameter and array ([3 * i + a]): master, exp_avg, exp_avg_sq >= 0.
std::vector<std::vector<float>> distinct_state(const std::vector<std::size_t>& sizes) {
  std::vector<std::vector<float>> want;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    for (int a = 0; a < 3; ++a) {
      std::vector<float> v(sizes[i]);
      for (std::size_t j = 0; j < v.size(); ++j)
        v[j] = static_cast<float>((i * 7919 + j * 31 + static_cast<std::size_t>(a) * 101) % 4099) *
               (a == 1 ? -1e-4f : 1e-4f);
      want.push_back(std::move(v));
    }
  return want;
}

// Expects m's arrays to be `want` (distinct_state) bit for bit and parameter i's step
// counter i + 3.
void expect_state(GradientManager& m, const std::vector<std::vector<float>>& want) {
  for (std::size_t i = 0; i < m.config().params.size(); ++i) {
    const std::size_t n = m.config().params[i].numel;
    std::vector<float> a(n), b(n), c(n);
    m.read_parameter(i, a, b, c, {});
    for (int k = 0; k < 3; ++k) {
      const std::vector<float>& got = k == 0 ? a : k == 1 ? b : c;
      ASSERT_EQ(got.size(), want[3 * i + k].size());
      EXPECT_TRUE(got.empty() ||  // memcmp's pointers must not be null, even for 0 bytes
                  std::memcmp(got.data(), want[3 * i + k].data(), 4 * got.size()) == 0)
          << "parameter " << i << " array " << k;
    }
    EXPECT_EQ(m.step_count(i), static_cast<float>(i + 3)) << i;
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (DType d : {DType::bf16, DType::f32})
    for (OptimizerConfig opt : std::vector<OptimizerConfig>{AdamWConfig{}, SignSgdConfig{}})
      for (std::optional<float> mn :
           {std::optional<float>{}, std::optional<float>{0.05f}, std::optional<float>{100.0f}})
        for (Flow f : {Flow::sft, Flow::rl}) cases.push_back({d, opt, mn, f, false});
  for (DType d : {DType::bf16, DType::f32})
    for (OptimizerConfig opt : std::vector<OptimizerConfig>{AdamWConfig{}, SignSgdConfig{}})
      for (Flow f : {Flow::sft, Flow::rl}) cases.push_back({d, opt, {}, f, true});
  return cases;
}

TEST(Managers, ThreeModesGiveTheReferenceBitsAfterEveryStep) {
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(c.label());
    const auto want = run_reference(c);
    // The stream must do something: the state changes and, when clipping, the norm is set.
    ASSERT_NE(want[0].state[0], want[2].state[0]);
    if (c.max_norm) ASSERT_NE(want[0].norm_bits, 0u);
    expect_same(run_mode(OffloadMode::none, c), want, "none");
    expect_same(run_mode(OffloadMode::none, c, /*lazy=*/true), want, "none (lazy scale)");
    expect_same(run_mode(OffloadMode::optimizer, c), want, "optimizer");
    expect_same(run_mode(OffloadMode::full, c), want, "full");
    if (HasFatalFailure()) return;
  }
}

/// The model sharded over `ranks` in-process ranks (uneven shards, rank 0's shard of
/// parameter 0 empty): every rank's norm bits equal the unsharded single-process run's,
/// and each rank's state is its slice of that run's.
void sharded_case(int ranks, OffloadMode mode, const Case& c) {
  const std::vector<StreamParam> model = stream_model(c.grad_dtype);
  const auto whole = run_mode(OffloadMode::none, c);
  const Sharding sh = shard_model(model, ranks);
  const auto got = run_sharded(ranks, mode, c, sh);
  if (::testing::Test::HasFailure()) return;
  for (int r = 0; r < ranks; ++r)
    expect_shard_of(got[static_cast<std::size_t>(r)], whole, model, sh, r,
                    manager_model::initial_slots(c.optimizer).size());
}

TEST(Managers, ShardedOverInProcessRanksGivesTheUnshardedBits) {
  for (int ranks : {2, 4})
    for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
      SCOPED_TRACE(std::to_string(ranks) + " ranks, mode " + std::string(offload_mode_name(mode)));
      // native: its update is element-wise; torch's tail form follows each shard's own end.
      sharded_case(ranks, mode,
                   Case{DType::bf16, AdamWConfig{}, 0.05f, Flow::rl, false, AdamWFormula::native});
      if (HasFatalFailure()) return;
    }
}

TEST(Managers, NonFiniteGradientsSkipTheStepInEveryMode) {
  for (bool overlap : {false, true}) {
    Case c{DType::bf16, AdamWConfig{},
           overlap ? std::optional<float>{} : std::optional<float>{1.0f}, Flow::sft, overlap};
    std::vector<std::vector<StepRecord>> runs;
    for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
      auto dev = device::make_host_device();
      ManagerConfig cfg = config_of(mode, *dev);
      cfg.speculation = Speculation::always;
      auto m = make_gradient_manager(cfg);
      for (std::size_t i = 0; i < cfg.params.size(); ++i) {
        std::vector<float> init(cfg.params[i].numel, 0.01f);
        m->load_parameter(i, init);
      }
      StreamOptions o;
      o.max_norm = c.max_norm;
      o.overlap = overlap;
      o.poison = std::tuple{1, 1, std::size_t{4}};  // step 1, micro-batch 1, the 4097 param
      runs.push_back(run_stream(*m, *dev, o));
      m->close();
    }
    for (const auto& r : runs) {
      // With or without overlap, the whole step is skipped: no chunk changes.
      EXPECT_FALSE(r[0].skipped);
      EXPECT_TRUE(r[1].skipped);
      EXPECT_EQ(r[1].state, r[0].state) << "a skipped step changes nothing";
      EXPECT_FALSE(r[2].skipped);
      if (overlap) {
        EXPECT_GT(r[1].speculated, 0u);
        EXPECT_EQ(r[1].rolled_back, r[1].speculated) << "every speculated chunk is restored";
        EXPECT_EQ(r[2].committed, r[2].speculated);
      }
      expect_same(r, runs[0], "modes agree");
    }
  }
}

// Returns the bytes of the file at `path`.
std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A copy that fails in the middle of an overlapped, speculated and clipped step fails the
// manager; load_checkpoint of the state saved before that step recovers it (in the
// middle of the step), and the run continues with the bits of a run that never failed.
TEST(Managers, LoadCheckpointRecoversAFailedManagerInTheMiddleOfASpeculatedStep) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("stepcore-recover-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    const std::string path = (dir / (std::string(offload_mode_name(mode)) + ".ckpt")).string();
    auto make = [&](device::Device& dev) {
      ManagerConfig cfg = config_of(mode, dev);
      cfg.speculation = Speculation::always;
      auto m = make_gradient_manager(cfg);
      for (std::size_t i = 0; i < cfg.params.size(); ++i) {
        std::vector<float> init(cfg.params[i].numel);
        for (std::size_t j = 0; j < init.size(); ++j) init[j] = initial_master(i, j);
        m->load_parameter(i, init);
      }
      return m;
    };
    StreamOptions o;
    o.max_norm = 0.05f;  // clips: every speculated chunk rolls back
    o.overlap = true;
    // The run that never fails: steps 0..2.
    auto clean_dev = device::make_host_device();
    auto clean = make(*clean_dev);
    o.steps = 3;
    const std::vector<StepRecord> want = run_stream(*clean, *clean_dev, o);
    clean->close();

    auto dev = device::make_host_device();
    auto m = make(*dev);
    o.steps = 1;
    (void)run_stream(*m, *dev, o);
    m->save_checkpoint(path);
    // A copy of the manager's own fails in the middle of the step. The manager meets the
    // failure through the event it records after the copy even when this driver's own
    // next call takes the device's stored error first. Modes none and optimizer:
    // clip_grad_norm's summary download; full: the step's first gradient copy to staging
    // (on the host device a step writes compute weights in place: no upload).
    device::detail::inject_copy_failure(*dev, device::Queue::d2h, 0);
    o.first_step = 1;
    EXPECT_THROW((void)run_stream(*m, *dev, o), Error);
    EXPECT_THROW(m->synchronize(), Error) << "the manager is failed";
    m->load_checkpoint(path);  // recovers, whatever phase the failure left
    o.steps = 2;
    const std::vector<StepRecord> got = run_stream(*m, *dev, o);
    m->close();
    expect_same(got, std::vector<StepRecord>(want.begin() + 1, want.end()),
                "recovered run vs one that never failed");
  }
  fs::remove_all(dir);
}

// Everything is verified before anything is imported: a file spoiled in its very last
// payload bytes (the last element of the last parameter's exp_avg_sq, read last) is
// refused with its typed error and the manager's state keeps every bit — a flipped bit
// (the checksum disagrees), and, with the checksum made right again, a NaN and a
// negative second moment (the value checks, in the same pass as the checksum).
TEST(Managers, ACheckpointSpoiledInItsLastByteLeavesTheStateUntouched) {
  namespace fs = std::filesystem;
  namespace ckpt = stepcore::detail::checkpoint;
  const fs::path dir =
      fs::temp_directory_path() / ("stepcore-lastbyte-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string good = (dir / "good.stepcore").string();
  const std::string bad = (dir / "bad.stepcore").string();
  auto write_bytes = [](const std::string& path, const std::vector<char>& b) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(b.data(), static_cast<std::streamsize>(b.size()));
  };
  // Every parameter's master, moments and step counter, as bits.
  auto state_of = [](GradientManager& m) {
    std::vector<std::uint32_t> bits;
    for (std::size_t i = 0; i < m.config().params.size(); ++i) {
      const std::size_t n = m.config().params[i].numel;
      std::vector<float> a(n), b(n), c(n);
      m.read_parameter(i, a, b, c, {});
      for (const auto* v : {&a, &b, &c})
        for (float x : *v) bits.push_back(std::bit_cast<std::uint32_t>(x));
      bits.push_back(std::bit_cast<std::uint32_t>(m.step_count(i)));
    }
    return bits;
  };
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    auto dev = device::make_host_device();
    auto make = [&] {
      ManagerConfig cfg = config_of(mode, *dev);
      auto m = make_gradient_manager(cfg);
      for (std::size_t i = 0; i < cfg.params.size(); ++i) {
        std::vector<float> init(cfg.params[i].numel);
        for (std::size_t j = 0; j < init.size(); ++j) init[j] = initial_master(i, j);
        m->load_parameter(i, init);
      }
      return m;
    };
    StreamOptions o;
    o.steps = 1;
    auto saver = make();
    (void)run_stream(*saver, *dev, o);
    saver->save_checkpoint(good);
    saver->close();
    auto m = make();  // fresh from its initial masters: anything imported would show
    const std::vector<std::uint32_t> before = state_of(*m);

    const std::vector<char> bytes = read_bytes(good);
    const ckpt::ParsedFile parsed = ckpt::parse(std::as_bytes(std::span<const char>(bytes)), good);
    const std::size_t last = parsed.header.params.size() - 1;
    // Arrays: master, exp_avg, exp_avg_sq, then (format 3) their block maxima, empty here.
    const std::size_t arrays = parsed.header.arrays();
    ASSERT_EQ(arrays, 5u);
    ASSERT_GT(parsed.header.params[last].numel, 0u);
    const std::size_t last_float = parsed.payload_start + parsed.array_offsets[last * arrays + 2] +
                                   4 * (parsed.header.params[last].numel - 1);
    ASSERT_LE(last_float + 4, bytes.size());
    ASSERT_TRUE(std::all_of(bytes.begin() + static_cast<std::ptrdiff_t>(last_float + 4),
                            bytes.end(), [](char c) { return c == 0; }))
        << "the writer puts that array last, then only the alignment's zeros";
    const std::string arg = "checkpoint.params[" + std::to_string(last) + "].exp_avg_sq";
    struct Spoil {
      const char* what;
      std::uint32_t bits;  // the last float's new bits; 0: flip a bit of the last byte
      Errc code;
      std::string arg;
    };
    for (const Spoil& sp : {Spoil{"a flipped bit", 0, Errc::corrupt_file, "path"},
                            Spoil{"a NaN", 0x7FC00000u, Errc::non_finite, arg},
                            Spoil{"a negative value", 0xBF800000u, Errc::invalid_argument, arg}}) {
      SCOPED_TRACE(sp.what);
      std::vector<char> b = bytes;
      if (sp.bits == 0) {
        b.back() = static_cast<char>(b.back() ^ 0x01);
      } else {
        std::memcpy(b.data() + last_float, &sp.bits, 4);
        const std::uint32_t crc = stepcore::detail::crc32c(
            std::as_bytes(std::span<const char>(b).subspan(parsed.payload_start)));
        std::memcpy(b.data() + 36, &crc, 4);  // the preamble's payload CRC-32C
      }
      write_bytes(bad, b);
      test_support::expect_error([&] { m->load_checkpoint(bad); }, sp.code, sp.arg);
      EXPECT_EQ(state_of(*m), before) << "a refused checkpoint changed the manager";
    }
    m->load_checkpoint(good);  // the unspoiled file loads
    EXPECT_NE(state_of(*m), before);
    m->close();
  }
  fs::remove_all(dir);
}

// A file that changes between load_checkpoint's verifying and importing passes (cut
// short, rewritten with another checkpoint of the same layout, a payload bit flipped in
// place) is refused with its typed error naming the file; the manager is then failed
// (every call raises that error) and a load of a good file recovers it: the run
// continues with the bits of a run that never met the changed file.
TEST(Managers, ACheckpointChangedBetweenTheLoadsPassesFailsTheManagerUntilALoad) {
  namespace fs = std::filesystem;
  namespace ckpt = stepcore::detail::checkpoint;
  const fs::path dir =
      fs::temp_directory_path() / ("stepcore-between-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  // Rewrites the file in place (the same inode: what the load's open file reads).
  auto overwrite = [](const std::string& path, const std::vector<char>& b) {
    std::fstream out(path, std::ios::binary | std::ios::in | std::ios::out);
    out.write(b.data(), static_cast<std::streamsize>(b.size()));
  };
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    const std::string mode_name(offload_mode_name(mode));
    const std::string good = (dir / (mode_name + "-good.ckpt")).string();
    const std::string later = (dir / (mode_name + "-later.ckpt")).string();
    const std::string victim = (dir / (mode_name + "-victim.ckpt")).string();
    auto make = [&](device::Device& dev) { return make_initial(config_of(mode, dev)); };
    StreamOptions o;
    auto clean_dev = device::make_host_device();
    auto clean = make(*clean_dev);
    o.steps = 3;
    const std::vector<StepRecord> want = run_stream(*clean, *clean_dev, o);
    clean->close();

    auto dev = device::make_host_device();
    auto m = make(*dev);
    o.steps = 1;
    (void)run_stream(*m, *dev, o);
    m->save_checkpoint(good);
    {  // the same layout, a step later: another file of the same size
      auto other = make(*dev);
      o.steps = 2;
      (void)run_stream(*other, *dev, o);
      other->save_checkpoint(later);
      other->close();
    }
    const std::vector<char> good_bytes = read_bytes(good);
    const std::vector<char> later_bytes = read_bytes(later);
    ASSERT_EQ(good_bytes.size(), later_bytes.size());
    ASSERT_NE(good_bytes, later_bytes);
    struct Change {
      const char* what;
      std::function<void(const std::string&)> apply;
      Errc code;
    };
    const std::vector<Change> changes = {
        {"cut short", [&](const std::string& p) { ASSERT_EQ(::truncate(p.c_str(), 100), 0); },
         Errc::io_error},
        {"rewritten", [&](const std::string& p) { overwrite(p, later_bytes); }, Errc::corrupt_file},
        {"a payload bit flipped",
         [&](const std::string& p) {
           std::vector<char> b = good_bytes;
           b.back() = static_cast<char>(b.back() ^ 0x10);
           overwrite(p, b);
         },
         Errc::corrupt_file},
    };
    for (const Change& c : changes) {
      SCOPED_TRACE(c.what);
      fs::copy_file(good, victim, fs::copy_options::overwrite_existing);
      {
        const ckpt::testing::ScopedBetweenPassesHook hook([&](const std::string& p) {
          EXPECT_EQ(p, victim);
          c.apply(p);
        });
        test_support::expect_error([&] { m->load_checkpoint(victim); }, c.code, "path");
      }
      // Failed: every call raises the load's error, naming the file.
      test_support::expect_error([&] { m->synchronize(); }, c.code, "path");
      test_support::expect_error([&] { (void)m->step_count(0); }, c.code, "path");
      test_support::expect_error([&] { m->save_checkpoint(victim); }, c.code, "path");
      m->load_checkpoint(good);  // recovers
    }
    o.first_step = 1;
    o.steps = 2;
    const std::vector<StepRecord> got = run_stream(*m, *dev, o);
    m->close();
    expect_same(got, std::vector<StepRecord>(want.begin() + 1, want.end()),
                "recovered run vs one that never met a changed file");
  }
  fs::remove_all(dir);
}

// save_checkpoint from device state copies the next large parameter out on a helper
// thread while this one is written (two buffer sets in turn): parameters of 2^18
// elements and more, between small ones, round-trip bit for bit into modes none and full.
TEST(Managers, ASaveOfLargeDeviceParametersCopiedOutAheadRoundTrips) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("stepcore-ahead-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "ahead.stepcore").string();
  const std::vector<std::size_t> sizes = {300000, 5, 262144, 400001, 262144, 7};
  const std::vector<std::vector<float>> want = distinct_state(sizes);
  auto dev = device::make_host_device();
  auto saver = make_sized(OffloadMode::none, *dev, sizes);
  for (std::size_t i = 0; i < sizes.size(); ++i)
    saver->import_parameter(i, want[3 * i], want[3 * i + 1], want[3 * i + 2],
                            static_cast<float>(i + 3));
  saver->save_checkpoint(path);
  saver->close();
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::full}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    auto m = make_sized(mode, *dev, sizes);
    m->load_checkpoint(path);
    expect_state(*m, want);
    m->close();
  }
  fs::remove_all(dir);
}

// Large parameters (a device save copies them out in several ranges; the file has several
// blocks) round-trip bit for bit into every mode; a bit flipped in the file's last block
// between the load's passes is met after the earlier blocks were imported: the manager
// is failed, and the next load of the good file restores every bit.
TEST(Managers, ALargeCheckpointChangedInItsLastBlockFailsTheManagerUntilALoad) {
  namespace fs = std::filesystem;
  namespace ckpt = stepcore::detail::checkpoint;
  const fs::path dir =
      fs::temp_directory_path() / ("stepcore-blocks-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string good = (dir / "good.stepcore").string();
  const std::string victim = (dir / "victim.stepcore").string();
  const std::vector<std::size_t> sizes = {2300001, 5, 0, 400001, 262144};
  const std::vector<std::vector<float>> want = distinct_state(sizes);
  auto dev = device::make_host_device();
  {
    auto saver = make_sized(OffloadMode::none, *dev, sizes);
    for (std::size_t i = 0; i < sizes.size(); ++i)
      saver->import_parameter(i, want[3 * i], want[3 * i + 1], want[3 * i + 2],
                              static_cast<float>(i + 3));
    saver->save_checkpoint(good);
    saver->close();
  }
  ASSERT_GT(fs::file_size(good), 3 * ckpt::kLoadPieceBytes);
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    auto m = make_sized(mode, *dev, sizes);
    m->load_checkpoint(good);
    expect_state(*m, want);
    fs::copy_file(good, victim, fs::copy_options::overwrite_existing);
    {
      const ckpt::testing::ScopedBetweenPassesHook hook([&](const std::string& p) {
        std::fstream f(p, std::ios::binary | std::ios::in | std::ios::out);
        f.seekg(-1, std::ios::end);
        const char last = static_cast<char>(f.get() ^ 0x01);
        f.seekp(-1, std::ios::end);
        f.put(last);
      });
      test_support::expect_error([&] { m->load_checkpoint(victim); }, Errc::corrupt_file, "path");
    }
    test_support::expect_error([&] { m->synchronize(); }, Errc::corrupt_file, "path");
    m->load_checkpoint(good);
    expect_state(*m, want);
    m->close();
  }
  fs::remove_all(dir);
}

// Returns the process's peak resident bytes after the peak was reset to the resident size
// just before `f` ran, over the resident size then; -1 when the peak cannot be reset
// (/proc/self/clear_refs, Linux >= 4.0).
template <class F>
long long peak_rss_growth(F&& f) {
  auto field = [](const char* key) {
    std::ifstream in("/proc/self/status");
    std::string line;
    long long kb = -1;
    while (std::getline(in, line))
      if (line.rfind(key, 0) == 0) kb = std::stoll(line.substr(std::strlen(key)));
    return kb * 1024;
  };
  ::malloc_trim(0);  // freed heap memory back to the system: f's buffers are counted
  {
    std::ofstream clear("/proc/self/clear_refs");
    if (!clear) return -1;
    clear << "5";
    clear.flush();
    if (!clear) return -1;
  }
  const long long before = field("VmRSS:");
  f();
  return field("VmHWM:") - before;
}

// A checkpoint of 32 M parameters (SignSGD, mode none on the host device: the state is
// resident host memory) saves and loads with the peak resident memory growing by no more
// than the bounded buffers (managers/checkpoint_buffers.hpp) and a little slack, not by a
// fraction of the 128 MB file.
TEST(Managers, ALargeCheckpointSavesAndLoadsWithinTheBoundedBuffers) {
#if STEPCORE_TEST_SANITIZED
  GTEST_SKIP() << "the sanitizers' quarantine keeps freed blocks resident: the resident set "
                  "measures the allocator, not the buffers";
#endif
  namespace fs = std::filesystem;
  namespace ckpt = stepcore::detail::checkpoint;
  const fs::path dir = fs::temp_directory_path() / ("stepcore-rss-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "big.stepcore").string();
  auto dev = device::make_host_device();
  ManagerConfig cfg = config_of(OffloadMode::none, *dev, SignSgdConfig{});
  cfg.params.clear();
  for (std::size_t i = 0; i < 8; ++i) {
    ParamSpec p;
    p.name = "w" + std::to_string(i);
    p.numel = std::size_t{4} << 20;
    p.group = i % 2;
    p.gradient_buffer = false;
    cfg.params.push_back(p);
  }
  auto m = make_gradient_manager(cfg);
  std::vector<float> init(std::size_t{4} << 20);
  for (std::size_t i = 0; i < cfg.params.size(); ++i) {
    for (std::size_t j = 0; j < init.size(); ++j) init[j] = initial_master(i, j);
    m->load_parameter(i, init);
  }
  init = {};
  init.shrink_to_fit();
  const long long save = peak_rss_growth([&] { m->save_checkpoint(path); });
  const long long load = peak_rss_growth([&] { m->load_checkpoint(path); });
  if (save < 0 || load < 0) GTEST_SKIP() << "/proc/self/clear_refs cannot be written";
  ASSERT_GT(fs::file_size(path), std::uintmax_t{128} << 20);
  constexpr long long kSlack = 8 << 20;  // threads' stacks, the header, the allocator
  std::printf("[ checkpoint ] 128 MiB file: peak growth save %.1f MiB, load %.1f MiB\n",
              static_cast<double>(save) / (1 << 20), static_cast<double>(load) / (1 << 20));
  EXPECT_LT(save, static_cast<long long>(ckpt::kSaveBufferBytes) + kSlack);
  EXPECT_LT(load, static_cast<long long>(ckpt::kLoadBufferBytes) + kSlack);
  m->close();
  fs::remove_all(dir);
}

TEST(Managers, FactoryRefusesWhatItCannotDo) {
  EXPECT_EQ(parse_offload_mode("none"), OffloadMode::none);
  EXPECT_EQ(parse_offload_mode("optimizer"), OffloadMode::optimizer);
  EXPECT_EQ(parse_offload_mode("full"), OffloadMode::full);
  for (const char* bad : {"fsdp", "Full", "", "cpu", "none "})
    test_support::expect_error([&] { parse_offload_mode(bad); }, Errc::invalid_argument,
                               "offload_mode");
  // The optimizer is named like the mode: exact names (each unit's), anything else refused
  // with them. Each name gives its optimizer's default configuration.
  EXPECT_TRUE(std::holds_alternative<AdamWConfig>(parse_optimizer("adamw")));
  EXPECT_TRUE(std::holds_alternative<SignSgdConfig>(parse_optimizer("sign_sgd")));
  EXPECT_TRUE(std::holds_alternative<AdamConfig>(parse_optimizer("adam")));
  EXPECT_TRUE(std::holds_alternative<SgdConfig>(parse_optimizer("sgd")));
  EXPECT_TRUE(std::holds_alternative<AdagradConfig>(parse_optimizer("adagrad")));
  EXPECT_EQ(std::get<AdagradConfig>(parse_optimizer("adagrad")).lr, AdagradConfig{}.lr);
  EXPECT_TRUE(std::holds_alternative<LionConfig>(parse_optimizer("lion")));
  for (const char* name : {"adamw", "sign_sgd", "adam", "sgd", "adagrad", "lion"})
    EXPECT_EQ(optimizer_name(parse_optimizer(name)), name);
  for (const char* bad : {"muon", "AdamW", "", "SGD", "adamw ", "Lion"}) {
    test_support::expect_error([&] { parse_optimizer(bad); }, Errc::invalid_argument, "optimizer");
    try {
      parse_optimizer(bad);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("adamw, sign_sgd, adam, sgd, adagrad, lion"),
                std::string::npos)
          << e.what();
    }
  }
  // Every mode builds every optimizer (each mode's bits: the tests below).
  auto dev = device::make_host_device();
  ManagerConfig cfg;
  cfg.groups = groups_of();
  cfg.params = param_specs(stream_model(DType::bf16));
  cfg.device = dev.get();
  cfg.engine.threads = 1;
  AdamWConfig amsgrad, maximize;
  amsgrad.amsgrad = true;
  maximize.maximize = true;
  SgdConfig momentum;
  momentum.momentum = 0.9;
  for (const OptimizerConfig& opt : std::vector<OptimizerConfig>{
           AdamConfig{}, SgdConfig{}, momentum, AdagradConfig{}, amsgrad, maximize, LionConfig{}}) {
    SCOPED_TRACE(std::string(optimizer_name(opt)));
    cfg.optimizer = opt;
    for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
      cfg.mode = mode;
      make_gradient_manager(cfg)->close();
    }
  }
  cfg.optimizer = AdamWConfig{};
  cfg.device = nullptr;
  EXPECT_THROW(make_gradient_manager(cfg), Error);
}

TEST(Managers, ClipTwiceOrAfterStepIsRefusedAndCloseIsIdempotent) {
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    auto dev = device::make_host_device();
    ManagerConfig cfg;
    cfg.mode = mode;
    cfg.groups = groups_of();
    cfg.params = param_specs(stream_model(DType::bf16));
    cfg.chunk_elements = kChunk;
    cfg.device = dev.get();
    cfg.engine.threads = 1;
    auto m = make_gradient_manager(cfg);
    m->begin_step(0.5f, /*overlap_optimizer=*/true);
    m->begin_backward(true);
    m->finish_backward();
    EXPECT_EQ(m->clip_grad_norm(1.0f), 0.0f);  // no gradient: a zero norm, allowed with overlap
    const float before = m->effective_gradient_scale();
    test_support::expect_error([&] { m->clip_grad_norm(0.5f); }, Errc::invalid_argument,
                               "clip_grad_norm");
    EXPECT_EQ(m->effective_gradient_scale(), before);
    m->step();  // still usable after the refusal
    test_support::expect_error([&] { m->clip_grad_norm(0.5f); }, Errc::invalid_argument,
                               "clip_grad_norm");
    EXPECT_EQ(m->effective_gradient_scale(), before);
    EXPECT_TRUE(m->report().stepped);
    m->close();
    m->close();
    EXPECT_THROW(m->begin_step(1.0f, false), Error);
  }
}

// The trainer's ordering, taken explicitly and never by a host synchronisation: the
// trainer writes each gradient on its own queue (h2d stands in for its stream), held
// back by a gate the test opens only later, and hands the write's event to
// gradient_ready; the next micro-batch's write waits for gradient_released. The
// manager must read each gradient after its write and before the next write lands (a
// manager that read at gradient_ready, or released at once, would see zeros or the
// second gradient twice). Every mode, against the reference's accumulate + AdamW.
TEST(Managers, GradientReadsFollowTheTrainersEventsWithoutAHostSynchronisation) {
  constexpr std::size_t n = 1000;
  const float scale = 1.0f / 3.0f;
  std::vector<std::uint16_t> g1(n), g2(n), poison(n, f32_to_bf16_bits(1000.0f));
  std::vector<float> init(n);
  for (std::size_t j = 0; j < n; ++j) {
    g1[j] = f32_to_bf16_bits(0.01f * static_cast<float>(j % 17) - 0.07f);
    g2[j] = f32_to_bf16_bits(0.003f * static_cast<float>(j % 23) + 0.01f);
    init[j] = 0.001f * static_cast<float>(j % 29);
  }
  // Two micro-batches (accumulated), and one (in full offload a holding step: its norm
  // partial at arrival and the step read the device buffer again, on the host device in
  // place), each written by the trainer's queue only once a gate opens.
  for (const std::size_t micro : {std::size_t{2}, std::size_t{1}}) {
    const std::vector<const std::vector<std::uint16_t>*> grads =
        micro == 2 ? std::vector<const std::vector<std::uint16_t>*>{&g1, &g2}
                   : std::vector<const std::vector<std::uint16_t>*>{&g1};
    // The reference: acc = f32(g1) (+ f32(g2)), its norm read with the step's scale, then
    // AdamW reading it with that scale.
    std::vector<float> acc(n), master = init, m(n, 0.0f), v(n, 0.0f);
    std::vector<std::uint16_t> compute(n);
    float step = 0.0f;
    for (std::size_t k = 0; k < grads.size(); ++k) {
      const std::vector<AccumulatePair> pair{
          {f32_view(acc.data(), n), {grads[k]->data(), n, DType::bf16}, k == 0}};
      reference::accumulate(pair);
    }
    const ConstTensorView acc_view(acc.data(), n, DType::f32);
    const NormResult want_norm =
        finalize(reference::norm_partial({&acc_view, 1}, GradientRead{scale, 1.0f}));
    {
      const std::vector<OptimizerTensor> t{test_support::adamw_tensor(
          f32_view(master.data(), n), f32_view(m.data(), n), f32_view(v.data(), n), &step, acc_view,
          {compute.data(), n, DType::bf16})};
      reference::adamw_step(t, AdamWConfig{}, GradientRead{scale, 1.0f});
    }
    for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
      SCOPED_TRACE(std::string(offload_mode_name(mode)) + ", " + std::to_string(micro) +
                   " micro-batch(es)");
      auto dev = device::make_host_device();
      ManagerConfig cfg;
      cfg.mode = mode;
      cfg.params = {ParamSpec{"w", n, DType::bf16, DType::bf16}};
      cfg.device = dev.get();
      cfg.engine.threads = 1;
      auto mgr = make_gradient_manager(cfg);
      mgr->load_parameter(0, init);
      mgr->begin_step(scale, false);
      for (const std::vector<std::uint16_t>* g : grads) {
        mgr->begin_backward(g == grads.back());
        // The buffer first holds other values (a read before the gate opens sees them),
        // then the trainer's stream is busy for a while before it writes the gradient.
        dev->wait(device::Queue::h2d, mgr->gradient_released(0));
        dev->copy(device::Queue::h2d, mgr->gradient(0).data, poison.data(), n * 2);
        dev->synchronize();
        const device::Event gate = device::detail::make_manual_event();
        dev->wait(device::Queue::h2d, gate);
        dev->copy(device::Queue::h2d, mgr->gradient(0).data, g->data(), n * 2);
        const device::Event written = dev->record(device::Queue::h2d);
        std::thread opener([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(30));
          device::detail::complete_manual_event(gate);
        });
        mgr->gradient_ready(0, written);
        mgr->finish_backward();
        opener.join();
      }
      const float got_norm = mgr->clip_grad_norm(1e30f);
      mgr->step();
      EXPECT_TRUE(mgr->report().stepped);
      EXPECT_EQ(std::bit_cast<std::uint32_t>(got_norm),
                std::bit_cast<std::uint32_t>(want_norm.norm));
      std::vector<float> got_master(n), got_m(n), got_v(n);
      std::vector<std::uint8_t> got_compute(n * 2);
      mgr->read_parameter(0, got_master, got_m, got_v, got_compute);
      EXPECT_EQ(std::memcmp(got_master.data(), master.data(), n * 4), 0);
      EXPECT_EQ(std::memcmp(got_v.data(), v.data(), n * 4), 0);
      EXPECT_EQ(std::memcmp(got_compute.data(), compute.data(), n * 2), 0);
      mgr->close();
    }
  }
}

}  // namespace
