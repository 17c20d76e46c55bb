// The ISAs an ISA-looping test runs, and the record of those it cannot: every test that
// loops over ISAs takes its list from here, so a log always names what was not run.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "stepcore/cpu.hpp"

namespace stepcore::testing_support {

/// Every ISA the engine has kernels for, lowest first (a build has its target's: x86-64
/// sse2, avx2, avx512; aarch64 neon; the others are reported as not run).
inline constexpr cpu::Isa kAllIsas[] = {cpu::Isa::sse2, cpu::Isa::avx2, cpu::Isa::avx512,
                                        cpu::Isa::neon};

/// The target's baseline ISA, which every processor of the target runs: sse2 on x86-64,
/// neon on aarch64.
inline cpu::Isa baseline_isa() {
#if defined(__aarch64__)
  return cpu::Isa::neon;
#else
  return cpu::Isa::sse2;
#endif
}

/// Returns the ISAs this processor runs. The first call within each test prints a line
/// per ISA the processor lacks ("[ NOT RUN  ] avx512 ...") so the log shows what this
/// machine could not check.
inline std::vector<cpu::Isa> isas_under_test() {
  static std::string last_test;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name =
      info ? std::string(info->test_suite_name()) + "." + info->name() : std::string("?");
  const bool first = name != last_test;
  last_test = name;
  const auto supported = cpu::supported_isas();
  std::vector<cpu::Isa> run;
  for (const cpu::Isa isa : kAllIsas) {
    bool have = false;
    for (const cpu::Isa s : supported) have = have || s == isa;
    if (have)
      run.push_back(isa);
    else if (first)
      std::printf("[ NOT RUN  ] %s on %s: this processor lacks it\n", name.c_str(),
                  std::string(cpu::isa_name(isa)).c_str());
  }
  return run;
}

/// True under the quick profile (STEPCORE_TEST_PROFILE=quick: the emulated aarch64 run and
/// the sanitizer runs, where a step costs 10-100 times more). It keeps every case, ISA,
/// dtype and boundary size and only repeats less; see by_profile.
inline bool quick_profile() {
  static const bool quick = [] {
    const char* p = std::getenv("STEPCORE_TEST_PROFILE");
    return p != nullptr && std::string(p) == "quick";
  }();
  return quick;
}

/// Returns `full`, or `quick` under the quick profile; then the first call within each test
/// prints "[ QUICK    ] <test>: <what>" so a log shows what was shortened.
template <class T>
T by_profile(T full, T quick, const char* what) {
  if (!quick_profile()) return full;
  static std::string last_test;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name =
      info ? std::string(info->test_suite_name()) + "." + info->name() : std::string("?");
  if (name != last_test) std::printf("[ QUICK    ] %s: %s\n", name.c_str(), what);
  last_test = name;
  return quick;
}

/// Skips the current (ISA-parameterised) test when the processor lacks `isa`.
#define STEPCORE_SKIP_UNLESS_ISA(isa)                                       \
  do {                                                                      \
    bool have_isa_ = false;                                                 \
    for (const ::stepcore::cpu::Isa s_ : ::stepcore::cpu::supported_isas()) \
      have_isa_ = have_isa_ || s_ == (isa);                                 \
    if (!have_isa_)                                                         \
      GTEST_SKIP() << std::string(::stepcore::cpu::isa_name(isa))           \
                   << " not run: this processor lacks it";                  \
  } while (0)

}  // namespace stepcore::testing_support
