// GPU (label gpu): the NCCL communicator with one GPU (nranks = 1, from ncclCommInitAll
// and from a unique id). A device NormPartial is reduced on the caller's stream and
// finalised on the device (gpu::finalize_and_clip) to the reference's bits; host buffers
// are staged; the layout check survives the reduction unchanged; a communicator whose
// second rank never joins ends in Errc::timeout. Skips without a device.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "comm_cases.hpp"
#include "stepcore/comm_nccl.hpp"
#include "stepcore/cuda.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"

#if defined(STEPCORE_WITH_CUDA)
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace {

using namespace comm_cases;
using namespace std::chrono_literals;

#define SKIP_WITHOUT_DEVICE() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason()

#if defined(STEPCORE_WITH_CUDA)

struct OneGpu {
  ncclComm_t nccl = nullptr;
  cudaStream_t stream = nullptr;
  OneGpu() {
    int dev = 0;
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(ncclCommInitAll(&nccl, 1, &dev), ncclSuccess);
    EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  }
  ~OneGpu() {
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
    if (nccl) ncclCommDestroy(nccl);
  }
};

TEST(Nccl, DevicePartialIsReducedOnTheStreamAndFinalisedOnTheDevice) {
  SKIP_WITHOUT_DEVICE();
  OneGpu g;
  auto c = comm::make_nccl_communicator(g.nccl, g.stream, 30s);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->memory(), comm::MemorySpace::device);
  const Logical& l = logical_for(DType::f32);
  std::vector<ConstTensorView> all;
  for (const auto& t : l.tensors) all.push_back(t.slice(0, t.numel));
  const NormPartial partial = reference::norm_partial(all);
  const comm::LayoutCheck check = comm::make_layout_check(0xfeed);

  NormPartial* d_partial = nullptr;
  comm::LayoutCheck* d_check = nullptr;
  NormResult* d_result = nullptr;
  float* d_clip = nullptr;
  std::int32_t* d_found_inf = nullptr;
  ASSERT_EQ(cudaMalloc(&d_partial, sizeof *d_partial), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_check, sizeof *d_check), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_result, sizeof *d_result), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_clip, sizeof *d_clip), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_found_inf, sizeof *d_found_inf), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_partial, &partial, sizeof partial, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_check, &check, sizeof check, cudaMemcpyHostToDevice), cudaSuccess);

  c->all_reduce_partial(d_partial, d_check);  // enqueued, no host synchronisation
  gpu::finalize_and_clip(d_partial, 1.0f, d_result, d_clip, d_found_inf, g.stream);
  c->synchronize();

  NormPartial reduced;
  comm::LayoutCheck reduced_check;
  NormResult result;
  ASSERT_EQ(cudaMemcpy(&reduced, d_partial, sizeof reduced, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&reduced_check, d_check, sizeof reduced_check, cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&result, d_result, sizeof result, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(same_value(reduced, partial));
  EXPECT_EQ(std::memcmp(&reduced_check, &check, sizeof check), 0);
  EXPECT_NO_THROW(comm::check_reduced(reduced_check, 0xfeed));
  EXPECT_TRUE(same_result(result, l.expected));
  for (void* p :
       {static_cast<void*>(d_partial), static_cast<void*>(d_check), static_cast<void*>(d_result),
        static_cast<void*>(d_clip), static_cast<void*>(d_found_inf)})
    cudaFree(p);
}

TEST(Nccl, HostBuffersAreStagedForTheGlobalNorm) {
  SKIP_WITHOUT_DEVICE();
  OneGpu g;
  auto c = comm::make_nccl_communicator(g.nccl, g.stream, 30s);
  for (const auto& [name, scenario] : scenarios()) {
    SCOPED_TRACE(name);
    check_scenario(*c, scenario, DType::bf16);
  }
  const auto [r, exact_calls] = tie_norm(*c);
  EXPECT_EQ(r.norm, 16777216.0f);
  EXPECT_EQ(exact_calls, 1);
  double d = 2.5;
  c->all_reduce(&d, 1, comm::Word::f64, comm::Op::max);
  EXPECT_EQ(d, 2.5);
}

TEST(Nccl, OwnedCommunicatorFromAUniqueId) {
  SKIP_WITHOUT_DEVICE();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  {
    auto c = comm::make_nccl_communicator(comm::nccl_unique_id(), 0, 1, 0, stream, 60s);
    std::uint64_t* d = nullptr;
    ASSERT_EQ(cudaMalloc(&d, 8), cudaSuccess);
    const std::uint64_t v = 42;
    ASSERT_EQ(cudaMemcpy(d, &v, 8, cudaMemcpyHostToDevice), cudaSuccess);
    c->all_reduce(d, 1, comm::Word::u64, comm::Op::sum);
    c->synchronize();
    std::uint64_t out = 0;
    ASSERT_EQ(cudaMemcpy(&out, d, 8, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(out, 42u);
    cudaFree(d);
  }
  cudaStreamDestroy(stream);
}

TEST(Nccl, ARankThatNeverJoinsIsATimeout) {
  SKIP_WITHOUT_DEVICE();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const auto start = std::chrono::steady_clock::now();
  try {
    comm::make_nccl_communicator(comm::nccl_unique_id(), 0, 2, 0, stream, 2s);
    ADD_FAILURE() << "a two-rank communicator with one rank was created";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::timeout) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  cudaStreamDestroy(stream);
}

#else

TEST(Nccl, NeedsCuda) { GTEST_SKIP() << "stepcore was built without CUDA"; }

#endif

TEST(Nccl, Arguments) {
  if (!comm::built_with_nccl()) GTEST_SKIP() << "stepcore was built without NCCL";
  try {
    comm::make_nccl_communicator(nullptr, nullptr);
    ADD_FAILURE() << "accepted a null ncclComm_t";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::null_pointer);
  }
  try {
    comm::make_nccl_communicator(comm::NcclUniqueId{}, 1, 1, 0, nullptr);
    ADD_FAILURE() << "accepted rank 1 of 1";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::out_of_range);
  }
}

}  // namespace
