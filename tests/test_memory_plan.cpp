// The memory planner (stepcore/plan.hpp) against the managers: for every mode, every
// optimizer of the table and several layouts, plan_memory(config, what has run) equals
// GradientManager::memory() exactly (every kind, bytes and peak) after each phase of a
// run (construction, steps of one micro-batch, of two, overlapped, a checkpoint save and
// load); the resident set of a full-offload manager stays within 3 % of the plan; bad
// options, models and Hugging Face configs are typed errors naming the argument or file.
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "expect_error.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/host_slab.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/plan.hpp"

namespace {

using namespace stepcore;

// A layout: the parameters (sizes, dtypes, groups, buffers) and the manager's knobs.
struct Layout {
  const char* name;
  std::vector<ParamSpec> params;
  std::vector<ParamGroup> groups;
  std::size_t chunk_elements = 2048;
  std::int64_t ring_slots = ManagerConfig::kDefaultRing;
  std::size_t ring_slot_elements = std::size_t{1} << 19;
  std::int64_t speculation_bytes = ManagerConfig::kAllChunks;
  std::int64_t speculation_device_bytes = 0;  // mode full only
  Speculation speculation = Speculation::always;
  bool compute_into = false;  // every parameter with compute weights writes the caller's
};

ParamSpec param(const char* name, std::size_t numel, DType grad, DType compute,
                std::size_t group = 0, bool own_grad = true, bool has_compute = true) {
  ParamSpec p;
  p.name = name;
  p.numel = numel;
  p.grad_dtype = grad;
  p.compute_dtype = compute;
  p.group = group;
  p.gradient_buffer = own_grad;
  p.has_compute_weights = has_compute;
  return p;
}

std::vector<Layout> layouts() {
  const DType bf = DType::bf16, f32 = DType::f32, f16 = DType::f16;
  std::vector<Layout> out;
  out.push_back({"mixed",
                 {param("a", 1000, bf, bf), param("empty", 0, bf, bf), param("one", 1, bf, bf),
                  param("b", 300, bf, bf), param("c", 5000, bf, bf), param("d", 77, bf, bf)}});
  Layout groups{
      "groups_f32_ring",
      {param("w0", 257, f32, f32, 0), param("w1", 1, bf, bf, 1), param("w2", 4096, f32, bf, 1),
       param("w3", 0, bf, f16, 0), param("w4", 333, bf, bf, 0, true, false)},
      {{"decay", 1e-3, 0.1, 0.9, 0.999, 1e-8}, {"no_decay", 2e-3, 0.0, 0.8, 0.99, 1e-6}}};
  groups.chunk_elements = 1000;
  groups.ring_slots = 2;
  groups.ring_slot_elements = 300;
  out.push_back(groups);
  Layout caller{"caller_buffers",
                {param("x", 700, f16, f16, 0, false), param("y", 1, f16, f16, 0, true),
                 param("z", 2500, f16, bf, 0, false), param("n", 0, f16, f16, 0, false)}};
  caller.compute_into = true;
  caller.speculation_bytes = 20000;
  caller.speculation_device_bytes = ManagerConfig::kAllChunks;
  caller.speculation = Speculation::automatic;
  out.push_back(caller);
  Layout never{"never_speculates", {param("p", 4100, bf, bf), param("q", 63, bf, bf)}};
  never.speculation = Speculation::never;
  never.ring_slot_elements = 64;
  out.push_back(never);
  return out;
}

// Every optimizer of the table with its defaults, and the variants with more slots.
std::vector<OptimizerConfig> optimizers() {
  std::vector<OptimizerConfig> out;
  for (const OptimizerInfo& o : optimizer_table()) out.push_back(parse_optimizer(o.name));
  const OptimizerField amsgrad{"amsgrad", 1.0};
  const OptimizerField momentum{"momentum", 0.9};
  out.push_back(make_optimizer_config("adamw", std::span(&amsgrad, 1)));
  out.push_back(make_optimizer_config("sgd", std::span(&momentum, 1)));
  return out;
}

// The caller's memory of a layout on the device: gradient buffers and compute weights.
struct CallerMemory {
  device::Device& dev;
  std::vector<void*> blocks;
  std::vector<ConstTensorView> grads;
  explicit CallerMemory(device::Device& d) : dev(d) {}
  ~CallerMemory() {
    for (void* b : blocks) dev.deallocate(b);
  }
  void* take(std::size_t bytes) {
    blocks.push_back(dev.allocate(std::max<std::size_t>(bytes, 16)));
    return blocks.back();
  }
};

ManagerConfig config_of(const Layout& l, OffloadMode mode, const OptimizerConfig& opt,
                        device::Device* dev, CallerMemory* mem) {
  ManagerConfig c;
  c.mode = mode;
  c.optimizer = opt;
  c.groups = l.groups;
  c.params = l.params;
  c.chunk_elements = l.chunk_elements;
  c.ring_slots = l.ring_slots;
  c.ring_slot_elements = l.ring_slot_elements;
  c.speculation = l.speculation;
  c.speculation_bytes = l.speculation_bytes;
  c.speculation_device_bytes = mode == OffloadMode::full ? l.speculation_device_bytes : 0;
  c.device = dev;
  c.engine.threads = 1;
  for (ParamSpec& p : c.params) {
    if (mem != nullptr) {
      mem->grads.push_back(ConstTensorView{
          p.gradient_buffer ? nullptr : mem->take(p.numel * dtype_size(p.grad_dtype)), p.numel,
          p.grad_dtype});
      if (l.compute_into && p.has_compute_weights && p.numel != 0)
        p.compute_into = {mem->take(p.numel * dtype_size(p.compute_dtype)), p.numel,
                          p.compute_dtype};
    }
  }
  return c;
}

// Steps of `micro` micro-batches: every parameter's gradient in each (zeros).
void run_steps(GradientManager& m, const std::vector<ConstTensorView>& grads, int steps, int micro,
               bool overlap) {
  for (int s = 0; s < steps; ++s) {
    m.begin_step(1.0f, overlap);
    for (int b = 0; b < micro; ++b) {
      m.begin_backward(b == micro - 1);
      for (std::size_t i = 0; i < grads.size(); ++i) {
        if (grads[i].data == nullptr && m.config().params[i].gradient_buffer) {
          m.gradient_ready(i);
        } else {
          m.gradient_ready(i, grads[i]);
        }
      }
      m.finish_backward();
    }
    m.step();
    (void)m.report();
  }
}

void expect_same(const MemoryReport& plan, const MemoryReport& got, const std::string& where) {
  SCOPED_TRACE(where);
  ASSERT_EQ(plan.kinds.size(), got.kinds.size());
  for (std::size_t k = 0; k < plan.kinds.size(); ++k) {
    const MemoryUse &a = plan.kinds[k], &b = got.kinds[k];
    EXPECT_EQ(a.kind, b.kind) << k;
    EXPECT_EQ(a.device, b.device) << a.kind;
    EXPECT_EQ(a.bytes, b.bytes) << a.kind << (a.device ? "@device" : "");
    EXPECT_EQ(a.peak, b.peak) << a.kind << (a.device ? "@device" : "");
  }
  EXPECT_EQ(plan.host_bytes, got.host_bytes);
  EXPECT_EQ(plan.device_bytes, got.device_bytes);
  EXPECT_EQ(plan.host_peak, got.host_peak);
  EXPECT_EQ(plan.device_peak, got.device_peak);
}

std::string scratch_path(const std::string& stem) {
  return (std::filesystem::temp_directory_path() /
          (stem + "." + std::to_string(::getpid()) + ".ckpt"))
      .string();
}

TEST(MemoryPlan, EqualsTheManagersLedgerInEveryModeOptimizerLayoutAndPhase) {
  auto dev = device::make_host_device();
  const std::string path = scratch_path("memory_plan");
  for (const OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full})
    for (const OptimizerConfig& opt : optimizers())
      for (const Layout& l : layouts()) {
        const std::string where = std::string(offload_mode_name(mode)) + "/" +
                                  std::string(optimizer_name(opt)) + "/" + l.name;
        CallerMemory mem(*dev);
        const ManagerConfig c = config_of(l, mode, opt, dev.get(), &mem);
        auto plan = [&](std::size_t micro, bool overlap, CheckpointPhase ck) {
          return plan_memory(c, MemoryPlanOptions{micro, overlap, ck});
        };
        auto m = make_gradient_manager(c);
        expect_same(plan(1, false, CheckpointPhase::none), m->memory(), where + " built");
        run_steps(*m, mem.grads, 2, 1, false);
        expect_same(plan(1, false, CheckpointPhase::none), m->memory(), where + " 1 micro");
        run_steps(*m, mem.grads, 2, 2, false);
        expect_same(plan(2, false, CheckpointPhase::none), m->memory(), where + " 2 micro");
        run_steps(*m, mem.grads, 2, 2, true);
        expect_same(plan(2, true, CheckpointPhase::none), m->memory(), where + " overlap");
        m->save_checkpoint(path);
        expect_same(plan(2, true, CheckpointPhase::save), m->memory(), where + " save");
        m->load_checkpoint(path);
        expect_same(plan(2, true, CheckpointPhase::load), m->memory(), where + " load");
        m->close();
        // Without the host device: the same plan.
        ManagerConfig bare = c;
        bare.device = nullptr;
        expect_same(plan_memory(bare, {2, true, CheckpointPhase::load}), m->memory(),
                    where + " no device");
      }
  std::filesystem::remove(path);
}

TEST(MemoryPlan, OverlapFirstThenAccumulatorsAndASingleMicroBatchFullOffload) {
  // One micro-batch with overlap: rollback space, no accumulators; then two.
  auto dev = device::make_host_device();
  const Layout l = layouts()[0];
  CallerMemory mem(*dev);
  const ManagerConfig c = config_of(l, OffloadMode::full, AdamWConfig{}, dev.get(), &mem);
  auto m = make_gradient_manager(c);
  run_steps(*m, mem.grads, 1, 1, true);
  expect_same(plan_memory(c, {1, true, CheckpointPhase::none}), m->memory(), "1 micro overlap");
  EXPECT_EQ(m->memory().kind("accumulator").bytes, 0u);
  run_steps(*m, mem.grads, 1, 3, true);
  expect_same(plan_memory(c, {3, true, CheckpointPhase::none}), m->memory(), "3 micro overlap");
  m->close();
}

// ---- the resident set ---------------------------------------------------------------

// Returns VmRSS of this process in bytes, or -1 when /proc is not there.
long long resident_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

TEST(MemoryPlan, ResidentSetOfAFullOffloadManagerIsWithinThreePercentOfThePlan) {
  if (resident_bytes() < 0) GTEST_SKIP() << "no /proc/self/status: the resident set is unknown";
  // Freed buffers (the other tests', the caller's) go back to the system, not to a heap
  // that keeps them resident.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 20);
  auto dev = device::make_host_device();
  // The model: 40 M bf16 parameters whose gradients and compute weights are the caller's
  // (the model's own tensors, resident before the manager); the manager then holds only
  // what memory() reports on the host.
  auto model = [](std::size_t scale) {
    Layout l{"rss", {}};
    const std::size_t sizes[] = {12000000, 1, 9000000, 4096, 11000000, 0, 7995903};
    for (std::size_t k = 0; k < std::size(sizes); ++k)
      l.params.push_back(param(("p" + std::to_string(k)).c_str(), sizes[k] / scale, DType::bf16,
                               DType::bf16, 0, false));
    l.compute_into = true;
    l.chunk_elements = std::size_t{16} << 20;
    return l;
  };
  auto life = [&](const Layout& l, MemoryReport* planned) {
    CallerMemory mem(*dev);
    const ManagerConfig c = config_of(l, OffloadMode::full, AdamWConfig{}, dev.get(), &mem);
    for (std::size_t b = 0; b < mem.blocks.size(); ++b)  // the model's tensors, resident
      std::memset(mem.blocks[b], 0, 16);
    for (std::size_t i = 0; i < c.params.size(); ++i)
      if (c.params[i].compute_into.numel != 0)
        std::memset(c.params[i].compute_into.data, 0, c.params[i].compute_into.bytes());
    for (const ConstTensorView& g : mem.grads)
      if (g.data != nullptr) std::memset(const_cast<void*>(g.data), 0, g.bytes());
    const long long before = resident_bytes();
    auto m = make_gradient_manager(c);
    run_steps(*m, mem.grads, 2, 2, false);
    const long long after = resident_bytes();
    if (planned != nullptr) *planned = plan_memory(c, {2, false, CheckpointPhase::none});
    m->close();
    return after - before;
  };
  (void)life(model(1000), nullptr);  // the library's code and threads already resident
  MemoryReport plan;
  const long long grown = life(model(1), &plan);
  const double host = static_cast<double>(plan.host_bytes);
  std::printf(
      "resident set grew %lld bytes over the manager's life; planned host %zu bytes "
      "(%.2f %%), device %zu\n",
      grown, plan.host_bytes, 100.0 * (static_cast<double>(grown) - host) / host,
      plan.device_bytes);
  EXPECT_EQ(plan.device_bytes, 0u);  // every device buffer is the caller's
  EXPECT_LE(std::abs(static_cast<double>(grown) - host), 0.03 * host);
}

// ---- bad input ------------------------------------------------------------------------

using test_support::expect_error;

ManagerConfig small_config(OffloadMode mode) {
  ManagerConfig c;
  c.mode = mode;
  c.params = {param("a", 100, DType::bf16, DType::bf16), param("b", 50, DType::bf16, DType::bf16)};
  return c;
}

TEST(MemoryPlan, RefusesWhatTheManagerRefusesNamingTheArgument) {
  for (const OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    auto with = [&](auto&& change) {
      ManagerConfig c = small_config(mode);
      change(c);
      return c;
    };
    expect_error(
        [&] {
          plan_memory(small_config(mode), {0, false, CheckpointPhase::none});
        },
        Errc::out_of_range, "micro_batches");
    expect_error(
        [&] {
          plan_memory(small_config(mode), {1, false, static_cast<CheckpointPhase>(7)});
        },
        Errc::invalid_argument, "checkpoint");
    expect_error([&] { plan_memory(with([](auto& c) { c.ring_slots = 0; }), {}); },
                 Errc::out_of_range, "ring_slots");
    expect_error([&] { plan_memory(with([](auto& c) { c.ring_slots = 1000; }), {}); },
                 Errc::invalid_argument, "ring_slots");
    expect_error([&] { plan_memory(with([](auto& c) { c.ring_slot_elements = 0; }), {}); },
                 Errc::out_of_range, "ring_slot_elements");
    expect_error([&] { plan_memory(with([](auto& c) { c.chunk_elements = 0; }), {}); },
                 Errc::out_of_range, "chunk_elements");
    expect_error([&] { plan_memory(with([](auto& c) { c.speculation_bytes = -2; }), {}); },
                 Errc::out_of_range, "speculation_bytes");
    expect_error([&] { plan_memory(with([](auto& c) { c.params[1].name = "a"; }), {}); },
                 Errc::invalid_argument, "params[1].name");
    expect_error([&] { plan_memory(with([](auto& c) { c.params[0].group = 1; }), {}); },
                 Errc::out_of_range, "params[0].group");
    expect_error(
        [&] { plan_memory(with([](auto& c) { c.optimizer = AdamWConfig{.lr = -1}; }), {}); },
        Errc::invalid_argument, "optimizer.adamw.lr");
    // Each refusal is the manager's too.
    auto dev = device::make_host_device();
    expect_error(
        [&] {
          ManagerConfig c = with([](auto& c) { c.ring_slots = 0; });
          c.device = dev.get();
          make_gradient_manager(c);
        },
        Errc::out_of_range, "ring_slots");
  }
  expect_error(
      [&] {
        ManagerConfig c = small_config(OffloadMode::none);
        c.speculation_device_bytes = 10;
        plan_memory(c, {});
      },
      Errc::invalid_argument, "speculation_device_bytes");
}

TEST(MemoryPlan, ModelsOnRanksAndTheirBadInput) {
  ModelPlanRequest r;
  r.model = {ModelParam{"w", {1000, 3}}, ModelParam{"b", {7}}, ModelParam{"none", {0}}};
  r.ranks = 8;
  r.ranks_per_node = 4;
  r.manager.mode = OffloadMode::full;
  r.host_memory = 1;
  const ModelPlan p = plan_model(r);
  EXPECT_EQ(p.model_params, 3007u);
  EXPECT_EQ(p.params_per_rank, 375u + 1u);  // ceil(3000 / 8), ceil(7 / 8), 0
  EXPECT_EQ(p.tensors, 3u);
  EXPECT_EQ(p.node_host_peak, 4 * p.rank.host_peak);
  EXPECT_EQ(p.fits_host, std::optional<bool>(false));
  EXPECT_FALSE(p.fits_gpu.has_value());
  ManagerConfig same = r.manager;
  same.params = {param("w", 375, DType::bf16, DType::bf16), param("b", 1, DType::bf16, DType::bf16),
                 param("none", 0, DType::bf16, DType::bf16)};
  expect_same(plan_memory(same, r.options), p.rank, "the shards");

  auto refused = [&](auto&& change, Errc code, const char* arg) {
    ModelPlanRequest bad = r;
    change(bad);
    expect_error([&] { plan_model(bad); }, code, arg);
  };
  refused([](auto& b) { b.ranks = 0; }, Errc::out_of_range, "ranks");
  refused([](auto& b) { b.ranks_per_node = 0; }, Errc::out_of_range, "ranks_per_node");
  refused([](auto& b) { b.ranks_per_node = 9; }, Errc::out_of_range, "ranks_per_node");
  refused(
      [](auto& b) {
        b.model[1].shape = {std::uint64_t{1} << 40, std::uint64_t{1} << 30};
      },
      Errc::out_of_range, "model[1].shape");
  // A count: tensors of 2^24 elements, the last less.
  const auto counted = model_of_count(3 * kCountTensorElements + 5);
  ASSERT_EQ(counted.size(), 4u);
  EXPECT_EQ(counted[3].shape, std::vector<std::uint64_t>{5});
  EXPECT_TRUE(model_of_count(0).empty());
}

// ---- the Hugging Face config reader -----------------------------------------------------

std::string data_path(const char* name) {
  return std::string(STEPCORE_TEST_DATA_DIR) + "/hf/" + name;
}

std::uint64_t total(const std::vector<ModelParam>& model) {
  std::uint64_t n = 0;
  for (const ModelParam& p : model) n += model_param_numel(p, "model");
  return n;
}

TEST(MemoryPlan, HuggingFaceConfigsGiveThePublishedParameterCounts) {
  // Llama 3 70B: 70,553,706,496 parameters, 80 layers of 9 tensors, embed, norm, lm_head.
  const DecoderConfig llama = read_decoder_config(data_path("llama3-70b.json"));
  EXPECT_EQ(llama.head_dim, 128u);
  EXPECT_EQ(llama.num_key_value_heads, 8u);
  const auto model = decoder_params(llama);
  EXPECT_EQ(model.size(), 80u * 9 + 3);
  EXPECT_EQ(total(model), 70553706496u);
  EXPECT_EQ(model[2].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(model[2].shape, (std::vector<std::uint64_t>{1024, 8192}));
  // Qwen2.5 0.5B: tied embeddings, q/k/v biases: 494,032,768.
  const auto qwen = decoder_params(read_decoder_config(data_path("qwen2.5-0.5b.json")));
  EXPECT_EQ(total(qwen), 494032768u);
  // Llama 3.2 1B (tied): 1,235,814,400.
  const std::string l32 =
      R"({"vocab_size":128256,"hidden_size":2048,"intermediate_size":8192,)"
      R"("num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,)"
      R"("tie_word_embeddings":true,"head_dim":64,"rope_scaling":{"factor":32.0}})";
  EXPECT_EQ(total(decoder_params(parse_decoder_config(l32, "l32"))), 1235814400u);
  // 70 B parameters on 8 ranks plan in well under a second.
  ModelPlanRequest r;
  r.model = model;
  r.ranks = 8;
  r.manager.mode = OffloadMode::full;
  const auto t0 = std::chrono::steady_clock::now();
  const ModelPlan p = plan_model(r);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.5);
  EXPECT_EQ(p.model_params, 70553706496u);
}

TEST(MemoryPlan, BrokenConfigFilesAreErrorsNamingTheFile) {
  const std::string ok =
      R"({"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":2,)"
      R"("num_attention_heads":2})";
  EXPECT_EQ(total(decoder_params(parse_decoder_config(ok, "ok"))),
            2 * 80u + 2 * (64 + 64 + 64 + 64 + 3 * 128 + 16) + 8);
  const std::pair<const char*, Errc> cases[] = {
      {"", Errc::corrupt_file},
      {"{", Errc::corrupt_file},
      {R"({"vocab_size":10,)", Errc::corrupt_file},
      {R"({"vocab_size":10,})", Errc::corrupt_file},
      {R"({"vocab_size":10} x)", Errc::corrupt_file},
      {R"({"vocab_size":1,"vocab_size":2})", Errc::corrupt_file},
      {R"({"a":"\ud800"})", Errc::corrupt_file},
      {R"({"a":"\q"})", Errc::corrupt_file},
      {"{\"a\":\"\x01\"}", Errc::corrupt_file},
      {R"({"a":01})", Errc::corrupt_file},
      {R"({"a":-})", Errc::corrupt_file},
      {R"({"a":1.})", Errc::corrupt_file},
      {R"({"a":tru})", Errc::corrupt_file},
      {"{\"a\":\"\xff", Errc::corrupt_file},
      {"[1,2]", Errc::invalid_argument},
      {R"({"vocab_size":10})", Errc::invalid_argument},
      {R"({"vocab_size":10.0,"hidden_size":8})", Errc::invalid_argument},
      {R"({"vocab_size":-10,"hidden_size":8})", Errc::invalid_argument},
      {R"({"vocab_size":1e3,"hidden_size":8})", Errc::invalid_argument},
      {R"({"vocab_size":"10","hidden_size":8})", Errc::invalid_argument},
      {R"({"vocab_size":18446744073709551616,"hidden_size":8})", Errc::invalid_argument},
      {R"({"vocab_size":0,"hidden_size":8})", Errc::invalid_argument},
  };
  const std::string path = scratch_path("broken_config");
  for (const auto& [text, code] : cases) {
    SCOPED_TRACE(text);
    { std::ofstream(path, std::ios::binary) << text; }
    expect_error([&] { read_decoder_config(path); }, code, path);
  }
  // Fields that disagree, or sizes whose products overflow.
  auto with = [&](const std::string& layers, const std::string& extra) {
    return R"({"vocab_size":4294967296,"intermediate_size":16,"num_attention_heads":2,)"
           R"("num_hidden_layers":)" +
           layers + "," + extra + "}";
  };
  for (const std::string& bad : {with("2", R"("hidden_size":8,"num_key_value_heads":3)"),
                                 with("1000000", R"("hidden_size":8)"),
                                 with("2", R"("hidden_size":8,"tie_word_embeddings":1)"),
                                 with("2", R"("hidden_size":8,"torch_dtype":"int8")"),
                                 with("2", R"("hidden_size":4294967296)")}) {
    SCOPED_TRACE(bad);
    expect_error([&] { parse_decoder_config(bad, "cfg.json"); }, Errc::invalid_argument,
                 "cfg.json");
  }
  // Nesting: 64 deep is JSON, deeper is refused (not a stack overflow).
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  expect_error([&] { parse_decoder_config(deep, "deep.json"); }, Errc::corrupt_file, "deep.json");
  std::filesystem::remove(path);
  expect_error([&] { read_decoder_config(path); }, Errc::io_error, path);
}

// ---- stepcore-plan ------------------------------------------------------------------

#ifdef STEPCORE_PLAN_EXE
// Runs stepcore-plan with `args`; returns its exit status and what it printed (both streams).
std::pair<int, std::string> plan_cli(const std::string& args) {
  const std::string cmd = std::string(STEPCORE_PLAN_EXE) + " " + args + " 2>&1";
  FILE* f = ::popen(cmd.c_str(), "r");
  if (f == nullptr) return {-1, ""};
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  const int status = ::pclose(f);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(MemoryPlan, TheCliRefusesBadInputWithStatusTwoNamingTheArgument) {
  const std::string config = data_path("llama3-70b.json");
  const std::pair<const char*, const char*> cases[] = {
      {"--params 7e9", "'--params'"},
      {"--params -5", "'--params'"},
      {"--params 7.5B", "'--params'"},
      {"--params 70X", "'--params'"},
      {"--params 99999999999999999999", "'--params'"},
      {"--params", "'--params'"},
      {"", "'--params'"},
      {"--params 1000 --ranks 0", "'--ranks'"},
      {"--params 1000 --ranks 2.5", "'--ranks'"},
      {"--params 1000 --ranks 4 --ranks-per-node 8", "--ranks-per-node"},
      {"--params 1000 --ranks-per-node 0", "'--ranks-per-node'"},
      {"--params 1000 --optimizer muon", "'--optimizer'"},
      {"--params 1000 --optimizer sgd8bit", "'--optimizer'"},
      {"--params 1000 --optimizer adamw8bit --min-8bit-size -1", "'--min-8bit-size'"},
      {"--params 1000 --optimizer adamw8bit --min-8bit-size", "'--min-8bit-size'"},
      {"--params 1000 --offload fsdp", "'--offload'"},
      {"--params 1000 --micro-batches 0", "'--micro-batches'"},
      {"--params 1000 --ring-slots 0", "'--ring-slots'"},
      {"--params 1000 --ring-slots 99", "--ring-slots"},
      {"--params 1000 --ring-slot-elements 0", "'--ring-slot-elements'"},
      {"--params 1000 --speculation-bytes -1", "'--speculation-bytes'"},
      {"--params 1000 --host-memory 1.5TB", "'--host-memory'"},
      {"--params 1000 --gpu-memory 80Gb", "'--gpu-memory'"},
      {"--params 1000 --checkpoint both", "'--checkpoint'"},
      {"--params 1000 --dtype int8", "'--dtype'"},
      {"--params 1000 --shapes x", "'--shapes'"},
      {"--params 1000 --frobnicate", "'--frobnicate'"},
      {"--hf-config /nonexistent/config.json", "'/nonexistent/config.json'"},
  };
  for (const auto& [args, names] : cases) {
    SCOPED_TRACE(args);
    const auto [status, out] = plan_cli(args);
    EXPECT_EQ(status, 2) << out;
    EXPECT_NE(out.find(names), std::string::npos) << out;
    EXPECT_EQ(out.find("stepcore-plan: a prediction"), std::string::npos) << out;
  }
  // A broken config and a broken shapes file name the file.
  const std::string path = scratch_path("cli_config");
  for (const char* text : {"{\"vocab_size\": 1", "{\"vocab_size\": 1}", "4096 x 11008\n12 y\n"}) {
    std::ofstream(path, std::ios::binary) << text;
    const bool shapes = text[0] != '{';
    const auto [status, out] = plan_cli((shapes ? "--shapes " : "--hf-config ") + path);
    EXPECT_EQ(status, 2) << out;
    EXPECT_NE(out.find("'" + path + "'"), std::string::npos) << out;
  }
  std::filesystem::remove(path);
}

TEST(MemoryPlan, TheCliPrintsThePlanAndWhetherItFits) {
  ModelPlanRequest r;
  r.model = decoder_params(read_decoder_config(data_path("llama3-70b.json")));
  r.ranks = 8;
  r.ranks_per_node = 8;
  r.manager.mode = OffloadMode::full;
  r.options = {2, false, CheckpointPhase::load};
  const ModelPlan p = plan_model(r);
  const std::string common = "--hf-config " + data_path("llama3-70b.json") +
                             " --ranks 8 --ranks-per-node 8 --offload full --micro-batches 2";
  auto [status, out] = plan_cli(common + " --host-memory 3840GB --gpu-memory 80GiB");
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find(std::to_string(p.rank.host_bytes)), std::string::npos) << out;
  EXPECT_NE(out.find("fits host memory: yes"), std::string::npos) << out;
  EXPECT_NE(out.find("fits GPU memory:  yes"), std::string::npos) << out;
  std::tie(status, out) = plan_cli(common + " --host-memory 1TiB");
  EXPECT_EQ(status, 1) << out;  // 1.03 TiB per node at the peak
  EXPECT_NE(out.find("fits host memory: no"), std::string::npos) << out;
  // A count with a suffix; a shapes file.
  std::tie(status, out) = plan_cli("--params 70B --offload optimizer --optimizer lion");
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("70000000000 parameters"), std::string::npos) << out;
  // 8-bit state: each shard of at least --min-8bit-size elements keeps two slots of one
  // code byte per element and one f32 maximum per 256 elements (each view aligned), where
  // f32 state keeps 4 bytes per element; the rest of the plan is the same.
  const std::size_t min_q8 = 20000000;  // the MLP and embedding shards, not attention
  std::size_t saved = 0, q8_shards = 0;
  const std::size_t align = stepcore::kSlabViewAlignment;
  auto al = [&](std::size_t b) { return (b + align - 1) / align * align; };
  for (const ModelParam& m : r.model) {
    std::size_t n = 1;
    for (std::uint64_t d : m.shape) n *= d;
    n = (n + 7) / 8;  // rank 0's shard
    if (n < min_q8) continue;
    ++q8_shards;
    saved += 2 * (al(4 * n) - al(n) - al(4 * ((n + 255) / 256)));
  }
  ASSERT_GT(q8_shards, 0u);
  ASSERT_LT(q8_shards, r.model.size());
  std::tie(status, out) =
      plan_cli(common + " --optimizer adamw8bit --min-8bit-size " + std::to_string(min_q8));
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("optimizer adamw8bit"), std::string::npos) << out;
  EXPECT_NE(out.find(std::to_string(p.rank.host_bytes - saved)), std::string::npos) << out;
  const std::string path = scratch_path("cli_shapes");
  std::ofstream(path) << "# embeddings\n32000 4096\n4096x4096\n\n4096, 11008  # mlp\n0\n";
  std::tie(status, out) = plan_cli("--shapes " + path + " --ranks 3");
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("192937984 parameters in 4 tensors"), std::string::npos) << out;
  std::filesystem::remove(path);
}
#endif

}  // namespace
