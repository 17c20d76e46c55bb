// The known-answer self-test of the CPU engine's ISAs: it passes on every ISA this
// processor runs; a deliberately faulty kernel (injected through the test hook) is
// caught for every kernel kind, makes an engine that chose its ISA itself fall back to
// the best lower ISA with one warning, and makes an ISA asked for an Error naming the
// ISA and the kernel.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu/testing.hpp"
#include "isa_list.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/error.hpp"

namespace {

using namespace stepcore;
using cpu::detail::KernelTable;

class SelfTest : public ::testing::TestWithParam<cpu::Isa> {};

TEST_P(SelfTest, PassesOnTheBuiltInKernels) {
  STEPCORE_SKIP_UNLESS_ISA(GetParam());
  cpu::testing::override_kernel_table(GetParam(), nullptr);  // a fresh run, timed
  const cpu::SelfTestResult r = cpu::self_test(GetParam());
  EXPECT_TRUE(r.passed) << r.kernel << ": " << r.detail;
  EXPECT_EQ(r.isa, GetParam());
  EXPECT_TRUE(r.kernel.empty());
  EXPECT_GT(r.seconds, 0.0);
  std::printf("[ info     ] %s self-test: %.3f ms\n",
              std::string(cpu::isa_name(GetParam())).c_str(), r.seconds * 1e3);
  // Recorded once: a second call returns the same result without running again.
  const cpu::SelfTestResult again = cpu::self_test(GetParam());
  EXPECT_EQ(again.seconds, r.seconds);
}

INSTANTIATE_TEST_SUITE_P(EveryIsa, SelfTest, ::testing::ValuesIn(testing_support::kAllIsas),
                         [](const ::testing::TestParamInfo<cpu::Isa>& i) {
                           return std::string(cpu::isa_name(i.param));
                         });

// ---- faulty kernels: each calls the real one, then changes one bit of its output -------
const KernelTable* g_real = nullptr;

void flip_f32(float* p) {
  std::uint32_t u;
  std::memcpy(&u, p, 4);
  u ^= 1u;
  std::memcpy(p, &u, 4);
}
using AdamWUnit = ::stepcore::detail::AdamW;
using SignSgdUnit = ::stepcore::detail::SignSgd;
void bad_adamw(const cpu::detail::UnitRange<AdamWUnit>& r, std::size_t b, std::size_t e) {
  g_real->units.of<AdamWUnit>().step[0][1][2](r, b, e);  // grad bf16, output bf16
  for (std::size_t i = b; i < e; ++i) flip_f32(static_cast<float*>(r.dst[1]) + i);  // exp_avg
}
void bad_sign_sgd(const cpu::detail::UnitRange<SignSgdUnit>& r, std::size_t b, std::size_t e) {
  g_real->units.of<SignSgdUnit>().step[0][2][0](r, b, e);  // grad f16, no output
  for (std::size_t i = b; i < e; ++i) flip_f32(static_cast<float*>(r.dst[0]) + i);
}
void bad_adamw_streamed(const cpu::detail::UnitRange<AdamWUnit>& r, std::size_t b, std::size_t e) {
  g_real->units.of<AdamWUnit>().streamed[2][0](r, b, e);  // grad f16, no output, out of place
  for (std::size_t i = b; i < e; ++i) flip_f32(static_cast<float*>(r.dst[2]) + i);  // exp_avg_sq
}
void bad_sign_sgd_streamed(const cpu::detail::UnitRange<SignSgdUnit>& r, std::size_t b,
                           std::size_t e) {
  g_real->units.of<SignSgdUnit>().streamed[0][2](r, b, e);  // grad f32, output bf16, out of place
  for (std::size_t i = b; i < e; ++i) flip_f32(static_cast<float*>(r.dst[0]) + i);
}
void bad_accumulate(float* acc, const void* src, bool copy, std::size_t b, std::size_t e) {
  g_real->accumulate[0](acc, src, copy, b, e);
  for (std::size_t i = b; i < e; ++i) flip_f32(acc + i);
}
void bad_scale(void* data, float s, std::size_t b, std::size_t e) {
  g_real->scale[1](data, s, b, e);
  for (std::size_t i = b; i < e; ++i) static_cast<std::uint16_t*>(data)[i] ^= 1u;
}
void bad_norm(const void* d, const GradientRead& read, std::size_t b, std::size_t e,
              NormPartial& out) {
  g_real->norm[0][2](d, read, b, e, out);
  out.max_abs_bits += 1;
}
void bad_norm_exact(const void* d, const GradientRead& read, std::size_t b, std::size_t e,
                    NormPartial& out) {
  g_real->norm_exact[1][0](d, read, b, e, out);
  out.digits[0] += 1;
}

struct Fault {
  const char* name;  // what the self-test must name
  void (*install)(KernelTable&);
};
const Fault kFaults[] = {
    {"adamw", [](KernelTable& t) { t.units.of<AdamWUnit>().step[0][1][2] = &bad_adamw; }},
    {"sign_sgd", [](KernelTable& t) { t.units.of<SignSgdUnit>().step[0][2][0] = &bad_sign_sgd; }},
    {"accumulate", [](KernelTable& t) { t.accumulate[0] = &bad_accumulate; }},
    {"scale_", [](KernelTable& t) { t.scale[1] = &bad_scale; }},
    {"norm_partial fast", [](KernelTable& t) { t.norm[0][2] = &bad_norm; }},
    {"norm_partial exact", [](KernelTable& t) { t.norm_exact[1][0] = &bad_norm_exact; }},
    {"adamw streamed",
     [](KernelTable& t) { t.units.of<AdamWUnit>().streamed[2][0] = &bad_adamw_streamed; }},
    {"sign_sgd streamed",
     [](KernelTable& t) { t.units.of<SignSgdUnit>().streamed[0][2] = &bad_sign_sgd_streamed; }},
};

/// Installs a table with one faulty kernel for `isa` for the scope's lifetime.
class ScopedFault {
 public:
  ScopedFault(cpu::Isa isa, const Fault& fault) : isa_(isa) {
    g_real = &cpu::testing::builtin_kernel_table(isa);
    table_ = *g_real;
    fault.install(table_);
    cpu::testing::override_kernel_table(isa, &table_);
  }
  ~ScopedFault() { cpu::testing::override_kernel_table(isa_, nullptr); }

 private:
  cpu::Isa isa_;
  KernelTable table_;
};

TEST(SelfTestFaults, EveryKernelKindIsCaughtAndNamed) {
  for (const cpu::Isa isa : testing_support::isas_under_test()) {
    for (const Fault& f : kFaults) {
      const ScopedFault scope(isa, f);
      const cpu::SelfTestResult r = cpu::self_test(isa);
      EXPECT_FALSE(r.passed) << cpu::isa_name(isa) << " " << f.name;
      EXPECT_NE(r.kernel.find(f.name), std::string::npos)
          << cpu::isa_name(isa) << ": expected '" << f.name << "', got '" << r.kernel << "'";
      EXPECT_FALSE(r.detail.empty());
    }
    EXPECT_TRUE(cpu::self_test(isa).passed) << "the built-in table is back";
  }
}

TEST(SelfTestFaults, AChosenIsaFallsBackWithOneWarning) {
  ::unsetenv("STEPCORE_ISA");
  const auto isas = cpu::supported_isas();
  const cpu::Isa best = isas.back();
  const ScopedFault scope(best, kFaults[0]);
  if (isas.size() == 1) {  // nothing lower to fall back to
    EXPECT_THROW(cpu::Engine{}, Error);
    std::printf("[ NOT RUN  ] fallback: this processor runs only %s\n",
                std::string(cpu::isa_name(best)).c_str());
    return;
  }
  ::testing::internal::CaptureStderr();
  const cpu::Engine first;
  const cpu::Engine second;
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(first.isa(), isas[isas.size() - 2]) << "the best lower ISA";
  EXPECT_TRUE(first.self_test().passed);
  ASSERT_EQ(first.rejected_isas().size(), 1u);
  EXPECT_EQ(first.rejected_isas()[0].isa, best);
  EXPECT_NE(first.rejected_isas()[0].kernel.find("adamw"), std::string::npos);
  const std::string best_name(cpu::isa_name(best));
  EXPECT_NE(err.find("stepcore: warning: the " + best_name + " kernels failed"), std::string::npos)
      << err;
  EXPECT_NE(err.find("adamw"), std::string::npos) << err;
  std::size_t warnings = 0;
  for (std::size_t p = err.find("warning"); p != std::string::npos; p = err.find("warning", p + 1))
    ++warnings;
  EXPECT_EQ(warnings, 1u) << "warned once per process, not per engine:\n" << err;
  EXPECT_EQ(second.isa(), first.isa());
}

TEST(SelfTestFaults, AnIsaAskedForIsAnErrorNamingIsaAndKernel) {
  for (const cpu::Isa isa : testing_support::isas_under_test()) {
    const ScopedFault scope(isa, kFaults[4]);
    const std::string name(cpu::isa_name(isa));
    try {
      cpu::Engine e(cpu::EngineConfig{isa, 1});
      ADD_FAILURE() << name << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::not_supported);
      EXPECT_EQ(e.argument(), "config.isa");
      EXPECT_NE(std::string(e.what()).find(name + " failed its known-answer self-test"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("norm_partial fast"), std::string::npos) << e.what();
    }
    ::setenv("STEPCORE_ISA", name.c_str(), 1);
    try {
      cpu::Engine e;
      ADD_FAILURE() << name << ": no error through STEPCORE_ISA";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::not_supported);
      EXPECT_EQ(e.argument(), "STEPCORE_ISA");
    }
    ::unsetenv("STEPCORE_ISA");
  }
}

}  // namespace
