// MPI fault test (label mpi; run by run_killed_rank.sh under a real mpirun that does not
// take the job down when a rank dies): every rank builds a full-offload manager on the host
// device over the MPI communicator and starts a step; the last rank SIGKILLs itself after
// its backward, in the middle of the step. Each survivor's clip_grad_norm must end in
// stepcore::Error (Errc::timeout) within the communicator's timeout plus a margin, never
// hang; it prints "rank R: timeout after N ms" and exits 0 (1 on any other outcome).
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "stepcore/comm_mpi.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

int main(int argc, char** argv) {
  using namespace stepcore;
  using namespace std::chrono;
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const milliseconds timeout(argc > 1 ? std::atoi(argv[1]) : 1500);
  int status = 1;
  try {
    auto comm = comm::make_mpi_communicator(MPI_COMM_WORLD, timeout);
    auto dev = device::make_host_device(32);
    ManagerConfig c;
    c.mode = OffloadMode::full;
    for (int i = 0; i < 3; ++i) {
      ParamSpec p;
      p.name = "p" + std::to_string(i);
      p.numel = 1000 + 37 * i;
      p.grad_dtype = DType::f32;
      c.params.push_back(p);
    }
    c.device = dev.get();
    c.comm = comm.get();
    c.engine.threads = 1;
    auto m = make_gradient_manager(c);
    m->begin_step(1.0f / 64, false);
    m->begin_backward(true);
    for (std::size_t i = 0; i < c.params.size(); ++i) {
      const TensorView g = m->gradient(i);
      for (std::size_t k = 0; k < g.numel; ++k)
        static_cast<float*>(g.data)[k] = 0.001f * static_cast<float>((k * 7 + i) % 13);
      m->gradient_ready(i);
    }
    m->finish_backward();
    if (rank == size - 1) raise(SIGKILL);  // dies in the middle of the step
    const auto start = steady_clock::now();
    try {
      m->clip_grad_norm(1.0f);
      std::printf("rank %d: clip_grad_norm returned with a dead peer\n", rank);
    } catch (const Error& e) {
      const auto waited = duration_cast<milliseconds>(steady_clock::now() - start).count();
      const bool in_time = waited >= timeout.count() && waited < timeout.count() + 5000;
      std::printf("rank %d: %s after %lld ms (%s)\n", rank, errc_name(e.code()).data(),
                  static_cast<long long>(waited), in_time ? "in time" : "NOT in time");
      if (e.code() == Errc::timeout && in_time) status = 0;
    }
    try {
      m->close();
    } catch (const Error&) {
    }
  } catch (const std::exception& e) {
    std::printf("rank %d: unexpected %s\n", rank, e.what());
  }
  std::fflush(stdout);
  _exit(status);  // MPI_Finalize would wait for the dead rank
}
