// stepcore-bench-comm: the cost of combining the exact global norm across ranks against a
// plain float all-reduce (what torch.nn.utils.clip_grad_norm_ does under FSDP). Run it
// under mpirun (1..N processes). MPI on the CPU; NCCL on GPUs when the build has NCCL
// and the machine a device (skipped otherwise, with a message).
//
//   mpirun -n 4 build/bench/bench/stepcore-bench-comm [--iters N] [--elements N]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "stepcore/comm.hpp"
#include "stepcore/comm_mpi.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/cuda_host.hpp"

#if defined(STEPCORE_BENCH_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>

#include "stepcore/comm_nccl.hpp"
#include "stepcore/gpu.hpp"
#endif

namespace {

using namespace stepcore;

int g_rank = 0;
int g_size = 1;

/// Times `op` in `batches` batches of `iters` calls (a barrier before each batch) and
/// returns {median, min} microseconds per call as the slowest rank saw them.
std::pair<double, double> time_op(const std::function<void()>& op, int iters, int batches = 15) {
  for (int i = 0; i < std::max(10, iters / 10); ++i) op();  // warm-up
  std::vector<double> per_call;
  for (int b = 0; b < batches; ++b) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    for (int i = 0; i < iters; ++i) op();
    double t = (MPI_Wtime() - t0) / iters * 1e6;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    per_call.push_back(t);
  }
  std::sort(per_call.begin(), per_call.end());
  return {per_call[per_call.size() / 2], per_call.front()};
}

void report(const char* what, std::pair<double, double> t, double baseline = 0) {
  if (g_rank != 0) return;
  std::printf("| %-58s | %2d | %9.2f | %9.2f |", what, g_size, t.first, t.second);
  if (baseline > 0)
    std::printf(" %5.2fx |\n", t.first / baseline);
  else
    std::printf("   1.00x |\n");
}

void header(const char* title) {
  if (g_rank != 0) return;
  std::printf("\n%s\n\n", title);
  std::printf("| %-58s | np | median us | min us    | vs float |\n", "operation");
  std::printf("|%s|----|-----------|-----------|----------|\n", std::string(60, '-').c_str());
}

void bench_mpi(int iters, std::size_t elements) {
  auto comm = comm::make_mpi_communicator(MPI_COMM_WORLD);
  header("MPI, host memory (latency per call; slowest rank; median and best of 15 batches)");
  float f = 1.0f;
  const auto plain = time_op(
      [&] { MPI_Allreduce(MPI_IN_PLACE, &f, 1, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); }, iters);
  report("MPI_Allreduce, 1 float (the torch baseline)", plain);
  report("comm::all_reduce, 1 f32 (nonblocking + timeout + confirm)",
         time_op([&] { comm->all_reduce(&f, 1, comm::Word::f32, comm::Op::sum); }, iters),
         plain.first);
  // What the communicator is built from: Open MPI's nonblocking collectives, polled.
  MPI_Comm dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  auto iallreduce = [&](void* data, int count, MPI_Datatype type, MPI_Op op) {
    MPI_Request request;
    MPI_Iallreduce(MPI_IN_PLACE, data, count, type, op, dup, &request);
    int done = 0;
    while (!done) MPI_Test(&request, &done, MPI_STATUS_IGNORE);
  };
  report("MPI_Iallreduce + MPI_Test loop, 1 float",
         time_op([&] { iallreduce(&f, 1, MPI_FLOAT, MPI_SUM); }, iters), plain.first);
  std::uint64_t flag = 0;
  report("  ... then a second one (1 uint64 max: the confirmation)",
         time_op(
             [&] {
               iallreduce(&f, 1, MPI_FLOAT, MPI_SUM);
               iallreduce(&flag, 1, MPI_UINT64_T, MPI_MAX);
             },
             iters),
         plain.first);
  MPI_Comm_free(&dup);
  std::uint64_t record[27] = {};
  report(
      "MPI_Allreduce, 27 uint64 (the record's size, builtin sum)",
      time_op(
          [&] { MPI_Allreduce(MPI_IN_PLACE, record, 27, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD); },
          iters),
      plain.first);
  NormPartial p;
  p.digits[3] = 12345;
  comm::LayoutCheck check = comm::make_layout_check(0xabcdef);
  report("comm::all_reduce_partial + check (one collective + confirm)",
         time_op(
             [&] {
               NormPartial q = p;
               comm->all_reduce_partial(&q, &check);
             },
             iters),
         plain.first);
  report("  ... + finalize (the exact combination, end to end)",
         time_op(
             [&] {
               NormPartial q = p;
               comm->all_reduce_partial(&q, &check);
               comm::check_reduced(check, 0xabcdef);
               volatile float n = finalize(q).norm;
               (void)n;
             },
             iters),
         plain.first);

  // In context: a sharded f32 gradient set of `elements` in total, local partials on the
  // CPU engine.
  const std::size_t local = (elements + g_size - 1) / g_size;
  std::vector<float> grad(local);
  for (std::size_t i = 0; i < local; ++i)
    grad[i] = 1e-3f * static_cast<float>((i * 2654435761u) % 1000) - 0.5f;
  const ConstTensorView view = const_view(grad.data(), grad.size());
  comm::NormLayout layout;
  layout.add({"grad", static_cast<std::uint64_t>(local) * g_size, g_size, 1}, {g_rank, 0},
             {&view, 1});
  comm::validate_layout(*comm, layout);
  // The ranks of one node share its cores.
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const cpu::Engine engine{cpu::EngineConfig{std::nullopt, std::max(1, cores / g_size), {}}};
  const int big_iters = std::max(3, iters / 200);
  char what[128];
  std::snprintf(what, sizeof what,
                "torch-style: local partial + 1-float all-reduce, %zu Mi f32/rank", local >> 20);
  const auto torch_style = time_op(
      [&] {
        float s = static_cast<float>(engine.norm_partial({&view, 1}).digits[0]);
        MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      },
      big_iters, 5);
  report(what, torch_style);
  report("comm::global_norm (same partial + exact combination)",
         time_op(
             [&] {
               volatile float n = comm::global_norm(*comm, layout, engine).norm;
               (void)n;
             },
             big_iters, 5),
         torch_style.first);
}

#if defined(STEPCORE_BENCH_NCCL)
void bench_nccl(int iters) {
  const int devices = cuda::device_count();
  int any_missing = devices == 0;
  MPI_Allreduce(MPI_IN_PLACE, &any_missing, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any_missing) {
    if (g_rank == 0)
      std::printf("\nNCCL: skipped (no CUDA device: %s)\n", cuda::unavailable_reason().c_str());
    return;
  }
  cudaSetDevice(g_rank % devices);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  const auto id = comm::share_nccl_unique_id(MPI_COMM_WORLD);
  auto comm = comm::make_nccl_communicator(id, g_rank, g_size, g_rank % devices, stream);
  float* d_f = nullptr;
  NormPartial* d_p = nullptr;
  comm::LayoutCheck* d_check = nullptr;
  NormResult* d_result = nullptr;
  float* d_clip = nullptr;
  std::int32_t* d_found_inf = nullptr;
  cudaMalloc(&d_f, sizeof(float));
  cudaMalloc(&d_p, sizeof(NormPartial));
  cudaMalloc(&d_check, sizeof(comm::LayoutCheck));
  cudaMalloc(&d_result, sizeof(NormResult));
  cudaMalloc(&d_clip, sizeof(float));
  cudaMalloc(&d_found_inf, sizeof(std::int32_t));
  cudaMemset(d_f, 0, sizeof(float));
  cudaMemset(d_p, 0, sizeof(NormPartial));
  const comm::LayoutCheck check = comm::make_layout_check(0xabcdef);
  cudaMemcpy(d_check, &check, sizeof check, cudaMemcpyHostToDevice);
  header("NCCL, device memory (enqueue + stream synchronisation per call)");
  const auto plain = time_op(
      [&] {
        comm->all_reduce(d_f, 1, comm::Word::f32, comm::Op::sum);
        comm->synchronize();
      },
      iters);
  report("ncclAllReduce, 1 float (the torch baseline)", plain);
  report("comm::all_reduce_partial + check (one NCCL group)",
         time_op(
             [&] {
               comm->all_reduce_partial(d_p, d_check);
               comm->synchronize();
             },
             iters),
         plain.first);
  report("  ... + gpu::finalize_and_clip",
         time_op(
             [&] {
               comm->all_reduce_partial(d_p, d_check);
               gpu::finalize_and_clip(d_p, 1.0f, d_result, d_clip, d_found_inf, stream);
               comm->synchronize();
             },
             iters),
         plain.first);
  for (void* p :
       {static_cast<void*>(d_f), static_cast<void*>(d_p), static_cast<void*>(d_check),
        static_cast<void*>(d_result), static_cast<void*>(d_clip), static_cast<void*>(d_found_inf)})
    cudaFree(p);
  comm.reset();
  cudaStreamDestroy(stream);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  int iters = 2000;
  std::size_t elements = std::size_t{16} << 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--iters") == 0) iters = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--elements") == 0) elements = std::strtoull(argv[i + 1], nullptr, 10);
  }
  int rc = 0;
  try {
    bench_mpi(iters, elements);
#if defined(STEPCORE_BENCH_NCCL)
    bench_nccl(iters);
#else
    if (g_rank == 0) std::printf("\nNCCL: skipped (stepcore was built without NCCL)\n");
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", g_rank, e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
