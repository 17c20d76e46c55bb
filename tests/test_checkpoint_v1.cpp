// Checkpoint format versions 1 and 2 still load: the files in tests/data/checkpoint_v1 and
// tests/data/checkpoint_v2, written by the library before format versions 2 and 3 existed
// (their READMEs say how), load into today's managers of every mode that steps their
// optimizer and give back every bit the saving manager held (each directory's
// expected.txt): masters, the state slots by name, and step counters. A manager configured
// differently refuses them naming the difference, and the parser reads each as the header
// that means the same today.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "managers/checkpoint_file.hpp"
#include "ranks.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

namespace {

using namespace stepcore;
namespace ckpt = stepcore::detail::checkpoint;

const std::string kDir = std::string(STEPCORE_TEST_DATA_DIR) + "/checkpoint_v1/";
const std::string kDirV2 = std::string(STEPCORE_TEST_DATA_DIR) + "/checkpoint_v2/";

/// expected.txt: per file and parameter, each array's bits (master, exp_avg, exp_avg_sq)
/// and the step counter's.
struct Expected {
  std::map<std::string, std::vector<std::uint32_t>> arrays;
  std::uint32_t step = 0;
};
using ExpectedFile = std::map<std::size_t, Expected>;

std::map<std::string, ExpectedFile> read_expected(const std::string& dir = kDir) {
  std::ifstream in(dir + "expected.txt");
  std::map<std::string, ExpectedFile> out;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string file, what;
    std::size_t param;
    words >> file >> param >> what;
    Expected& e = out[file][param];
    std::vector<std::uint32_t> bits;
    std::string hex;
    while (words >> hex) bits.push_back(static_cast<std::uint32_t>(std::stoul(hex, nullptr, 16)));
    if (what == "step")
      e.step = bits.at(0);
    else
      e.arrays[what] = bits;
  }
  return out;
}

/// The configuration the files were saved with (tests/data/checkpoint_v1/README.md), in
/// `mode`; the parameters' sizes `numel` (a rank's halves, or the whole).
ManagerConfig config_of(OffloadMode mode, device::Device& dev, OptimizerConfig optimizer,
                        const std::vector<std::size_t>& numel, comm::Communicator* comm,
                        std::uint64_t fingerprint = 0x5EED0001) {
  ManagerConfig c;
  c.mode = mode;
  c.optimizer = optimizer;
  ParamGroup decay, no_decay;
  decay.name = "decay";
  decay.lr = 1e-3;
  decay.weight_decay = 0.1;
  decay.beta1 = 0.9;
  decay.beta2 = 0.95;
  decay.eps = 1e-8;
  no_decay.name = "no_decay";
  no_decay.lr = 2e-3;
  no_decay.weight_decay = 0.0;
  no_decay.beta1 = 0.8;
  no_decay.beta2 = 0.999;
  no_decay.eps = 1e-6;
  c.groups = {decay, no_decay};
  for (std::size_t i = 0; i < numel.size(); ++i) {
    ParamSpec p;
    p.name = "layer" + std::to_string(i) + ".weight";
    p.numel = numel[i];
    p.grad_dtype = i % 2 ? DType::f32 : DType::bf16;
    p.compute_dtype = DType::bf16;
    p.group = i == 1 || i == 3 ? 1 : 0;
    c.params.push_back(p);
  }
  c.chunk_elements = 50;
  c.device = &dev;
  c.comm = comm;
  c.layout_fingerprint = fingerprint;
  c.engine.threads = 3;
  return c;
}

const std::vector<std::size_t> kWhole = {33, 1, 0, 9, 40};

std::vector<std::size_t> half(int rank) {
  std::vector<std::size_t> out;
  for (std::size_t n : kWhole) out.push_back(rank == 0 ? n / 2 : n - n / 2);
  return out;
}

/// Loads `file` into a fresh manager of `cfg` and expects every bit of `want`.
void expect_loads(const ManagerConfig& cfg, const std::string& file, const ExpectedFile& want,
                  const std::string& dir = kDir) {
  auto m = make_gradient_manager(cfg);
  m->load_checkpoint(dir + file);
  ASSERT_EQ(want.size(), cfg.params.size()) << file;
  for (std::size_t i = 0; i < cfg.params.size(); ++i) {
    const Expected& e = want.at(i);
    const std::size_t n = cfg.params[i].numel;
    std::vector<float> master(n);
    std::vector<std::vector<float>> slots(m->state_slot_names().size(), std::vector<float>(n));
    std::vector<SlotOut> named;
    for (std::size_t s = 0; s < slots.size(); ++s)
      named.push_back({m->state_slot_names()[s], slots[s]});
    m->read_parameter(i, master, named, {});
    auto bits = [](const std::vector<float>& v) {
      std::vector<std::uint32_t> out;
      for (float x : v) out.push_back(std::bit_cast<std::uint32_t>(x));
      return out;
    };
    EXPECT_EQ(bits(master), e.arrays.at("master")) << file << " parameter " << i;
    ASSERT_EQ(e.arrays.size(), 1 + slots.size()) << file << ": the file's arrays";
    for (std::size_t s = 0; s < slots.size(); ++s)
      EXPECT_EQ(bits(slots[s]), e.arrays.at(std::string(named[s].name)))
          << file << " parameter " << i << " " << named[s].name;
    EXPECT_EQ(std::bit_cast<std::uint32_t>(m->step_count(i)), e.step) << file << " parameter " << i;
  }
  // The groups' lr and weight decay are restored (as saved: the README's values).
  EXPECT_EQ(m->group(1).lr, 2e-3);
  m->close();
}

AdamWConfig adamw(AdamWFormula formula) {
  AdamWConfig a;
  a.formula = formula;
  return a;
}

const OffloadMode kModes[] = {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full};

TEST(CheckpointV1, AdamWAndSignSgdFilesLoadInEveryModeWithTheirBits) {
  const auto expected = read_expected();
  ASSERT_EQ(expected.size(), 4u) << "expected.txt lists the four files";
  for (OffloadMode mode : kModes) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    auto dev = device::make_host_device();
    expect_loads(config_of(mode, *dev, adamw(AdamWFormula::torch), kWhole, nullptr),
                 "adamw_torch_full.ckpt", expected.at("adamw_torch_full.ckpt"));
    expect_loads(config_of(mode, *dev, SignSgdConfig{}, kWhole, nullptr), "sign_sgd_optimizer.ckpt",
                 expected.at("sign_sgd_optimizer.ckpt"));
  }
}

TEST(CheckpointV1, TwoRankFilesLoadOnTheirRanksInEveryMode) {
  const auto expected = read_expected();
  for (OffloadMode mode : kModes) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    const auto errors = test_support::on_ranks(2, [&](int r, comm::Communicator& comm) {
      auto dev = device::make_host_device();
      const std::string file = "adamw_native_none_rank" + std::to_string(r) + "of2.ckpt";
      expect_loads(config_of(mode, *dev, adamw(AdamWFormula::native), half(r), &comm), file,
                   expected.at(file));
    });
    for (const std::string& e : errors) EXPECT_EQ(e, "");
  }
}

TEST(CheckpointV1, ParsesAsItsVersion2Equivalent) {
  auto read = [](const std::string& file) {
    std::ifstream in(kDir + file, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  const std::vector<char> a = read("adamw_torch_full.ckpt");
  const ckpt::Header ha = ckpt::parse(std::as_bytes(std::span<const char>(a)), "a").header;
  EXPECT_EQ(ha.version, ckpt::kFormatVersion1);
  EXPECT_EQ(ha.optimizer, "adamw");
  EXPECT_EQ(ha.slots, (std::vector<std::string>{"exp_avg", "exp_avg_sq"}));
  ASSERT_EQ(ha.hyper.size(), 3u);
  EXPECT_EQ(ha.hyper[0].name, "formula");
  EXPECT_EQ(ha.hyper[0].value, static_cast<double>(AdamWFormula::torch));
  EXPECT_EQ(ha.groups.at(0).beta2, 0.95);
  EXPECT_EQ(ha.world_size, 1);
  const std::vector<char> s = read("sign_sgd_optimizer.ckpt");
  const ckpt::Header hs = ckpt::parse(std::as_bytes(std::span<const char>(s)), "s").header;
  EXPECT_EQ(hs.optimizer, "sign_sgd");
  EXPECT_TRUE(hs.slots.empty());
  EXPECT_TRUE(hs.hyper.empty());
  const std::vector<char> r1 = read("adamw_native_none_rank1of2.ckpt");
  const ckpt::Header h1 = ckpt::parse(std::as_bytes(std::span<const char>(r1)), "r1").header;
  EXPECT_EQ(h1.rank, 1);
  EXPECT_EQ(h1.world_size, 2);
  EXPECT_EQ(h1.hyper.at(0).value, static_cast<double>(AdamWFormula::native));
}

// A manager whose optimizer differs is refused, naming what differs, with nothing loaded.
TEST(CheckpointV1, ADifferentOptimizerIsRefusedNamingTheDifference) {
  auto dev = device::make_host_device();
  AdamWConfig amsgrad, maximize;
  amsgrad.amsgrad = true;
  maximize.maximize = true;
  SgdConfig momentum;
  momentum.momentum = 0.9;
  struct Mismatch {
    OptimizerConfig optimizer;
    const char* argument;
  };
  for (const Mismatch& x :
       {Mismatch{SignSgdConfig{}, "checkpoint.optimizer"},
        Mismatch{momentum, "checkpoint.optimizer"}, Mismatch{amsgrad, "checkpoint.slots"},
        Mismatch{maximize, "checkpoint.hyper.maximize"},
        Mismatch{adamw(AdamWFormula::native), "checkpoint.hyper.formula"}}) {
    auto m =
        make_gradient_manager(config_of(OffloadMode::full, *dev, x.optimizer, kWhole, nullptr));
    std::vector<float> init(33, 0.25f);
    m->load_parameter(0, init);
    test_support::expect_error([&] { m->load_checkpoint(kDir + "adamw_torch_full.ckpt"); },
                               Errc::invalid_argument, x.argument);
    std::vector<float> master(33);
    m->read_parameter(0, master, std::span<const SlotOut>{}, {});
    EXPECT_EQ(master, init) << x.argument << ": nothing loaded";
    m->close();
  }
  auto m =
      make_gradient_manager(config_of(OffloadMode::none, *dev, AdamWConfig{}, kWhole, nullptr));
  test_support::expect_error([&] { m->load_checkpoint(kDir + "sign_sgd_optimizer.ckpt"); },
                             Errc::invalid_argument, "checkpoint.optimizer");
  m->close();
}

// ---- format version 2 ------------------------------------------------------------------

TEST(CheckpointV2, FilesLoadInEveryModeWithTheirBits) {
  const auto expected = read_expected(kDirV2);
  ASSERT_EQ(expected.size(), 3u) << "expected.txt lists the three files";
  AdamConfig adam;
  adam.amsgrad = true;
  SgdConfig sgd;
  sgd.momentum = 0.9;
  const std::pair<const char*, OptimizerConfig> files[] = {
      {"adamw_torch_full.ckpt", adamw(AdamWFormula::torch)},
      {"adam_amsgrad_none.ckpt", adam},
      {"sgd_momentum_optimizer.ckpt", sgd}};
  for (OffloadMode mode : kModes)
    for (const auto& [file, optimizer] : files) {
      SCOPED_TRACE(std::string(offload_mode_name(mode)) + " " + file);
      auto dev = device::make_host_device();
      expect_loads(config_of(mode, *dev, optimizer, kWhole, nullptr, 0x5EED0002), file,
                   expected.at(file), kDirV2);
    }
}

TEST(CheckpointV2, ParsesWithoutEightBitState) {
  std::ifstream in(kDirV2 + "adam_amsgrad_none.ckpt", std::ios::binary);
  const std::vector<char> b{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  const ckpt::Header h = ckpt::parse(std::as_bytes(std::span<const char>(b)), "v2").header;
  EXPECT_EQ(h.version, ckpt::kFormatVersion2);
  EXPECT_EQ(h.slots, (std::vector<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}));
  EXPECT_EQ(h.arrays(), 4u);  // the master and the three slots: no block maxima
  for (const ckpt::ParamRecord& p : h.params) EXPECT_FALSE(p.q8) << p.name;
  // An 8-bit manager refuses it: its parameters' state is f32 in the file.
  auto dev = device::make_host_device();
  ManagerConfig cfg =
      config_of(OffloadMode::full, *dev, AdamConfig{.amsgrad = true}, kWhole, nullptr, 0x5EED0002);
  cfg.q8_state = true;
  cfg.min_8bit_size = 30;
  auto m = make_gradient_manager(cfg);
  test_support::expect_error([&] { m->load_checkpoint(kDirV2 + "adam_amsgrad_none.ckpt"); },
                             Errc::invalid_argument, {"checkpoint.params[0].state"});
  m->close();
}

// A file written before Adam had a formula ran torch's: it reads as formula 1 (torch), so
// an Adam manager with torchao's formula refuses it naming the field.
TEST(CheckpointV2, AdamWithoutAFormulaReadsAsTorchs) {
  std::ifstream in(kDirV2 + "adam_amsgrad_none.ckpt", std::ios::binary);
  const std::vector<char> b{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  const ckpt::Header h = ckpt::parse(std::as_bytes(std::span<const char>(b)), "v2").header;
  int formulas = 0;
  for (const ckpt::HyperRecord& r : h.hyper)
    if (r.name == "formula") {
      ++formulas;
      EXPECT_EQ(r.value, static_cast<double>(AdamWFormula::torch));
    }
  EXPECT_EQ(formulas, 1);
  auto dev = device::make_host_device();
  auto m = make_gradient_manager(config_of(
      OffloadMode::none, *dev, AdamConfig{.amsgrad = true, .formula = AdamWFormula::torchao},
      kWhole, nullptr, 0x5EED0002));
  test_support::expect_error([&] { m->load_checkpoint(kDirV2 + "adam_amsgrad_none.ckpt"); },
                             Errc::invalid_argument, {"checkpoint.hyper.formula"});
  m->close();
}

}  // namespace