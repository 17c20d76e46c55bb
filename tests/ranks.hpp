// One thread per rank of an in-process communicator group, for the multi-rank tests: the
// body runs on every rank; a rank that throws records its message and aborts the group, so
// its peers fail fast instead of waiting for their timeout.
#pragma once

#include <chrono>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "stepcore/comm.hpp"

namespace test_support {

/// Runs body(rank, communicator) on `ranks` threads of one in-process group; returns per
/// rank "" or the message of what it threw.
template <class Body>
std::vector<std::string> on_ranks(int ranks, Body&& body) {
  auto comms = stepcore::comm::make_in_process_group(ranks, std::chrono::seconds(60));
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      const auto ru = static_cast<std::size_t>(r);
      try {
        body(r, *comms[ru]);
      } catch (const std::exception& e) {
        errors[ru] = e.what();
        comms[ru]->abort();  // wake the peers instead of leaving them to time out
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace test_support
