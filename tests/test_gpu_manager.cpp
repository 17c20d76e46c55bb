// The device-resident gradient managers (mode none, eager and lazy scale; mode optimizer
// with streamed state) on the host device: bit-identical to an independent reference
// simulation with and without clipping and overlap, non-finite steps skipped and rolled
// back, sharded over in-process ranks, sequence refusals, errors of queued work, close.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "device/host_device.hpp"
#include "gpu_manager_cases.hpp"
#include "managers/factories.hpp"
#include "ranks.hpp"
#include "stepcore/error.hpp"

namespace {

using namespace gpu_manager_cases;

auto host_device() { return device::make_host_device(); }

TEST(GpuManager, EveryVariantGivesTheReferenceBitsAfterEveryStep) { differential(host_device); }

TEST(GpuManager, NonFiniteGradientsSkipTheStepOrOnlyTheirChunk) { non_finite(host_device); }

// Rank r's shard of parameter i: rank 0 holds nothing of odd parameters (with 4 ranks,
// nothing at all); the others split the rest unevenly, the last taking the remainder.
Shard shard_of(int ranks, int r) {
  const std::vector<ParamSpec> params = model(DType::bf16);
  Shard s;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::size_t numel = params[i].numel;
    std::size_t at = 0, len = 0;
    for (int q = 0; q <= r; ++q) {
      at += len;
      const bool empty = q == 0 && (ranks == 4 || i % 2 == 1);
      len =
          empty ? 0 : numel * static_cast<std::size_t>(q + 1) / static_cast<std::size_t>(2 * ranks);
      if (q == ranks - 1) len = numel - at;
    }
    s.offset.push_back(at);
    s.numel.push_back(len);
  }
  return s;
}

TEST(GpuManager, ShardedOverInProcessRanksGivesTheUnshardedBits) {
  for (int ranks : {2, 4})
    for (std::optional<float> mn : {std::optional<float>{}, std::optional<float>{0.05f}})
      for (const Variant& v : kVariants) {
        // native: its update is element-wise; torch's tail form follows each shard's own end.
        const Scenario sc{DType::bf16, AdamWConfig{}, mn, false, {}, AdamWFormula::native};
        SCOPED_TRACE(std::to_string(ranks) + " ranks, " + v.label + ", " + sc.label());
        const auto want = run_reference(sc);
        std::vector<std::vector<StepOut>> got(static_cast<std::size_t>(ranks));
        std::vector<Shard> shards;
        for (int r = 0; r < ranks; ++r) shards.push_back(shard_of(ranks, r));
        const auto errors = test_support::on_ranks(ranks, [&](int r, comm::Communicator& comm) {
          auto dev = device::make_host_device();
          const auto ru = static_cast<std::size_t>(r);
          got[ru] = run_manager(*dev, sc, v.mode, v.lazy, &comm, &shards[ru]);
        });
        for (int r = 0; r < ranks; ++r) {
          const auto ru = static_cast<std::size_t>(r);
          ASSERT_EQ(errors[ru], "") << "rank " << r;
          expect_same(got[ru], want, "rank " + std::to_string(r), &shards[ru]);
        }
      }
}

// A manager of the test model on `dev`, parameters loaded.
std::unique_ptr<GradientManager> make_loaded(device::Device& dev, OffloadMode mode,
                                             comm::Communicator* comm = nullptr,
                                             std::uint64_t fingerprint = kFingerprint) {
  ManagerConfig cfg;
  cfg.mode = mode;
  cfg.params = model(DType::bf16);
  cfg.chunk_elements = kManagerChunkElements;
  cfg.device = &dev;
  cfg.comm = comm;
  cfg.layout_fingerprint = fingerprint;
  auto m = make_gradient_manager(cfg);
  for (std::size_t i = 0; i < cfg.params.size(); ++i) {
    std::vector<float> init(cfg.params[i].numel);
    for (std::size_t j = 0; j < init.size(); ++j) init[j] = initial_master(i, j);
    m->load_parameter(i, init);
  }
  return m;
}

// One micro-batch with every gradient, written through the compute queue.
void backward(GradientManager& m, device::Device& dev, bool final_backward) {
  const Scenario sc;
  m.begin_backward(final_backward);
  for (std::size_t i = m.config().params.size(); i-- > 0;) {
    const TensorView g = m.gradient(i);
    const auto bytes = gradient_bytes(sc, 0, 0, i, 0, g.numel);
    if (g.numel) {
      dev.copy(device::Queue::compute, g.data, bytes.data(), bytes.size());
      dev.synchronize(dev.record(device::Queue::compute));
    }
    m.gradient_ready(i);
  }
  m.finish_backward();
}

TEST(GpuManager, ClipTwiceWithOverlapIsRefusedBeforeAnythingChanges) {
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.label);
    auto dev = device::make_host_device();
    auto m = make_loaded(*dev, v.mode);
    m->begin_step(0.5f, /*overlap_optimizer=*/true);
    backward(*m, *dev, true);
    (void)m->clip_grad_norm(1e9f);  // allowed with overlap; does not clip
    const float before = m->effective_gradient_scale();
    try {
      m->clip_grad_norm(1.0f);
      ADD_FAILURE() << "a second clip accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_EQ(e.argument(), "clip_grad_norm");
    }
    EXPECT_EQ(m->effective_gradient_scale(), before);
    m->step();
    const StepReport rep = m->report();
    EXPECT_TRUE(rep.stepped);
    EXPECT_EQ(rep.chunks_committed, rep.chunks_speculated);
    EXPECT_EQ(rep.chunks_rolled_back, 0u);
    m->close();
    m->close();
    EXPECT_THROW(m->begin_step(1.0f, false), Error);
    EXPECT_THROW(m->report(), Error);
  }
}

TEST(GpuManager, ComputeWeightsAreTheDeviceCopyReadParameterReturns) {
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.label);
    auto dev = device::make_host_device();
    auto m = make_loaded(*dev, v.mode);
    m->begin_step(1e-3f, false);
    backward(*m, *dev, false);
    backward(*m, *dev, true);
    EXPECT_TRUE(std::isfinite(m->clip_grad_norm(0.01f)));
    m->step();
    m->synchronize();
    for (std::size_t i = 0; i < m->config().params.size(); ++i) {
      const ParamSpec& p = m->config().params[i];
      const ConstTensorView w = m->compute_weights(i);
      if (!p.has_compute_weights) continue;
      ASSERT_EQ(w.numel, p.numel);
      ASSERT_EQ(w.dtype, p.compute_dtype);
      std::vector<std::uint8_t> direct(w.bytes()), read(w.bytes());
      if (w.numel) {
        dev->copy(device::Queue::compute, direct.data(), w.data, w.bytes());
        dev->synchronize();
      }
      m->read_parameter(i, {}, {}, {}, read);
      EXPECT_EQ(direct, read) << "parameter " << i;
    }
    EXPECT_TRUE(m->report().stepped);
    m->close();
  }
}

TEST(GpuManager, LayoutDisagreementFailsOnEveryRank) {
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.label);
    auto comms = comm::make_in_process_group(2, std::chrono::seconds(60));
    std::vector<std::string> args(2), errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        const auto ru = static_cast<std::size_t>(r);
        try {
          auto dev = device::make_host_device();
          auto m = make_loaded(*dev, v.mode, comms[ru].get(), kFingerprint + ru);
          m->begin_step(1e-3f, false);
          backward(*m, *dev, true);
          try {
            m->clip_grad_norm(1.0f);
          } catch (const Error& e) {
            args[ru] = e.argument();
          }
          m->close();
        } catch (const std::exception& e) {
          errors[ru] = e.what();
          comms[ru]->abort();
        }
      });
    for (auto& t : threads) t.join();
    for (std::size_t r = 0; r < 2; ++r) {
      EXPECT_EQ(errors[r], "") << "rank " << r;
      EXPECT_EQ(args[r], "layout") << "rank " << r;
    }
  }
}

TEST(GpuManager, AFailedCopyIsRaisedOnceAndCloseDoesNotHang) {
  for (device::Queue q : {device::Queue::h2d, device::Queue::d2h}) {
    auto dev = device::make_host_device();
    auto m = make_loaded(*dev, OffloadMode::optimizer);
    device::detail::inject_copy_failure(*dev, q, 1);
    m->begin_step(1e-3f, false);
    backward(*m, *dev, true);
    bool raised = false;
    try {
      m->step();
      m->report();
    } catch (const Error& e) {
      raised = true;
      EXPECT_EQ(e.code(), Errc::internal) << e.what();
    }
    EXPECT_TRUE(raised);
    // The interrupted step cannot be trusted: the manager stays failed.
    try {
      m->begin_step(1e-3f, false);
      ADD_FAILURE() << "a failed manager started a step";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::internal) << e.what();
    }
    EXPECT_NO_THROW(m->close());
    EXPECT_NO_THROW(m->close());
  }
}

TEST(GpuManager, CloseRaisesAPendingErrorOnce) {
  auto dev = device::make_host_device();
  auto m = make_loaded(*dev, OffloadMode::optimizer);
  device::detail::inject_copy_failure(*dev, device::Queue::d2h, 0);
  m->begin_step(1e-3f, false);
  backward(*m, *dev, true);
  // step() enqueues; the failure surfaces at its next enqueue or at close, exactly once.
  int raised = 0;
  for (int call = 0; call < 3; ++call) try {
      if (call == 0)
        m->step();
      else
        m->close();
    } catch (const Error& e) {
      ++raised;
      EXPECT_EQ(e.code(), Errc::internal) << e.what();
    }
  EXPECT_EQ(raised, 1);
}

TEST(GpuManager, EmptyModelsStep) {
  for (std::size_t params : {0, 1})
    for (const Variant& v : kVariants)
      for (bool overlap : {false, true}) {
        SCOPED_TRACE(std::to_string(params) + " empty parameters, " + v.label);
        auto dev = device::make_host_device();
        ManagerConfig cfg;
        cfg.mode = v.mode;
        cfg.lazy_gpu_scale = v.lazy;
        cfg.params.resize(params);  // numel 0
        cfg.device = dev.get();
        auto m = make_gradient_manager(cfg);
        m->begin_step(0.5f, overlap);
        m->begin_backward(true);
        m->finish_backward();
        EXPECT_EQ(m->clip_grad_norm(1.0f), 0.0f);
        m->step();
        const StepReport rep = m->report();
        EXPECT_TRUE(rep.stepped);
        EXPECT_FALSE(rep.skipped);
        m->close();
      }
}

TEST(GpuManager, RefusesTheFullMode) {
  auto dev = device::make_host_device();
  ManagerConfig cfg;
  cfg.mode = OffloadMode::full;
  cfg.params = model(DType::bf16);
  cfg.device = dev.get();
  EXPECT_THROW(detail::make_gpu_gradient_manager(cfg), Error);
}

}  // namespace
