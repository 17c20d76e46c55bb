// stepcore-demo's report: timing, number formatting, the checksums (FNV-1a 64 over
// bit patterns), and the printed lines -- header, numa, phases, checksum, summary.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "backends.hpp"
#include "options.hpp"
#include "state.hpp"

namespace stepcore_demo {

using Clock = std::chrono::steady_clock;

/// Returns the seconds since `t0`.
double seconds_since(Clock::time_point t0);

/// Returns n with thousands separators ("37,174,144").
std::string grouped(std::uint64_t n);

/// Returns a byte count in MiB or GiB.
std::string human_bytes(double b);

/// Returns "%.9g [0xXXXXXXXX]": the value and its f32 bit pattern.
std::string f32_text(float x);

/// Prints one timed phase: name, milliseconds, GB/s of `bytes` touched, and a note.
void print_phase(const char* name, double sec, double bytes, const std::string& note);

/// Prints "stepcore: warning: <message>" to stderr, once per distinct message.
void warn_once(const std::string& message);

/// Prints the backend, the model, its layout summary, the size of the state and the run.
void print_header(const Model& m, const Options& o, const Backend& b);

/// Prints the "numa" line: the rank, its GPU, the node and cores chosen and where the
/// state's pages are (checked on a sample), or why nothing was placed.
void print_numa(const State& s, const Backend& b);

/// What a run did, for the summary line.
struct Totals {
  std::int64_t applied = 0, skipped = 0, clipped = 0;
  double phases = 0.0;  ///< seconds in accumulate, norm and optimizer
  double check = 0.0;   ///< seconds of the bitwise cross-check (not in phases)
  std::int64_t checked = 0, mismatched = 0;
};

/// Prints the "checksum" line: the hashes of the final params, compute weights and
/// (AdamW) moments.
void print_checksums(const Model& m, const State& s, const Options& o);

/// Prints the "summary" line: steps applied, skipped and clipped, the phase and check
/// seconds, and `total_seconds`.
void print_summary(const Options& o, const Totals& totals, double total_seconds);

}  // namespace stepcore_demo
