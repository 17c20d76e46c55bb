// The known-answer self-test of the CPU engine's ISAs: it passes on every ISA this
// processor runs; a deliberately faulty kernel (injected through the test hook) is
// caught and named for every kernel of every optimizer unit (generated over AllUnits)
// and every other kernel kind, makes an engine that chose its ISA itself fall back to
// the best lower ISA with one warning, and makes an ISA asked for an Error naming the
// ISA and the kernel.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/optimizers/all.hpp"
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
// Flips the lowest bit of elements [b, e) of an array of `dtype`.
void flip(void* data, DType dtype, std::size_t b, std::size_t e) {
  const std::size_t size = dtype_size(dtype);
  for (std::size_t i = b; i < e; ++i) static_cast<unsigned char*>(data)[i * size] ^= 1u;
}

/// Unit Opt's kernel step[P][G][O] (in place) or streamed[G][O] (P = 0: f32 params), then
/// one bit of each new parameter changed.
template <class Opt, int P, int G, int O>
void bad_step(const cpu::detail::UnitRange<Opt>& r, std::size_t b, std::size_t e) {
  g_real->units.of<Opt>().step[P][G][O](r, b, e);
  flip(r.dst[0], static_cast<DType>(P), b, e);
}
template <class Opt, int G, int O>
void bad_streamed(const cpu::detail::UnitRange<Opt>& r, std::size_t b, std::size_t e) {
  g_real->units.of<Opt>().streamed[G][O](r, b, e);
  flip(r.dst[0], DType::f32, b, e);
}
/// Unit Opt's q8[P] kernel (8-bit slots), then one bit of each new code changed.
template <class Opt, int P>
void bad_q8(const cpu::detail::UnitRange<Opt>& r, const cpu::detail::Q8Slots& q, std::size_t b,
            std::size_t e) {
  g_real->units.of<Opt>().q8[P](r, q, b, e);
  for (std::size_t i = b; i < e; ++i) q.codes[0][i] ^= 1u;
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
  std::string name;    // what the self-test's kernel label must begin with
  std::string dtypes;  // and hold (a unit kernel's dtypes and output), or ""
  void (*install)(KernelTable&);
};

/// The label part of a unit kernel's dtypes: "param f32, grad bf16, output f16)".
std::string unit_dtypes(int p, int g, int o) {
  auto name = [](int d) { return std::string(dtype_name(static_cast<DType>(d))); };
  return "param " + name(p) + ", grad " + name(g) + ", output " +
         (o == 0 ? std::string("none") : name(o - 1)) + ")";
}

template <class Opt, int I>
void add_step_fault(std::vector<Fault>& out) {
  constexpr int P = I / (cpu::detail::kDTypes * cpu::detail::kOutputKinds);
  constexpr int G = I / cpu::detail::kOutputKinds % cpu::detail::kDTypes;
  constexpr int O = I % cpu::detail::kOutputKinds;
  if constexpr (P == 0 || O == 0)  // 16-bit params have no compute output (no kernel)
    out.push_back({std::string(Opt::kName) + " (", unit_dtypes(P, G, O), [](KernelTable& t) {
                     t.units.of<Opt>().step[P][G][O] = &bad_step<Opt, P, G, O>;
                   }});
}
template <class Opt, int I>
void add_streamed_fault(std::vector<Fault>& out) {
  constexpr int G = I / cpu::detail::kOutputKinds;
  constexpr int O = I % cpu::detail::kOutputKinds;
  out.push_back({std::string(Opt::kName) + " streamed (", unit_dtypes(0, G, O), [](KernelTable& t) {
                   t.units.of<Opt>().streamed[G][O] = &bad_streamed<Opt, G, O>;
                 }});
}

template <class Opt, int P>
void add_q8_fault(std::vector<Fault>& out) {
  // The self-test runs each param dtype's kernel first with f32 gradients and no output.
  out.push_back({std::string(Opt::kName) + " (", unit_dtypes(P, 0, 0) + " q8",
                 [](KernelTable& t) { t.units.of<Opt>().q8[P] = &bad_q8<Opt, P>; }});
}

/// One fault per kernel of unit Opt's table: every in-place entry (param, gradient and
/// output dtype), every streamed one, and (units that take 8-bit state) every q8 one.
template <class Opt>
std::vector<Fault> unit_faults() {
  constexpr int kSteps = cpu::detail::kDTypes * cpu::detail::kDTypes * cpu::detail::kOutputKinds;
  constexpr int kStreamed = cpu::detail::kDTypes * cpu::detail::kOutputKinds;
  std::vector<Fault> out;
  [&]<int... I>(std::integer_sequence<int, I...>) { (add_step_fault<Opt, I>(out), ...); }
  (std::make_integer_sequence<int, kSteps>{});
  [&]<int... I>(std::integer_sequence<int, I...>) { (add_streamed_fault<Opt, I>(out), ...); }
  (std::make_integer_sequence<int, kStreamed>{});
  if constexpr (stepcore::detail::unit_takes_q8<Opt>()) {
    [&]<int... I>(std::integer_sequence<int, I...>) { (add_q8_fault<Opt, I>(out), ...); }
    (std::make_integer_sequence<int, cpu::detail::kDTypes>{});
  }
  return out;
}

/// The faults of the kernels that are not optimizer units'.
const Fault kOtherFaults[] = {
    {"accumulate", "", [](KernelTable& t) { t.accumulate[0] = &bad_accumulate; }},
    {"scale_", "", [](KernelTable& t) { t.scale[1] = &bad_scale; }},
    {"norm_partial fast", "", [](KernelTable& t) { t.norm[0][2] = &bad_norm; }},
    {"norm_partial exact", "", [](KernelTable& t) { t.norm_exact[1][0] = &bad_norm_exact; }},
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

// Runs the self-test of `isa` with `f` installed: it must fail, naming the kernel.
void expect_caught(cpu::Isa isa, const Fault& f) {
  const ScopedFault scope(isa, f);
  const cpu::SelfTestResult r = cpu::self_test(isa);
  EXPECT_FALSE(r.passed) << cpu::isa_name(isa) << " " << f.name << f.dtypes;
  EXPECT_EQ(r.kernel.rfind(f.name, 0), 0u)
      << cpu::isa_name(isa) << ": expected '" << f.name << "...', got '" << r.kernel << "'";
  EXPECT_NE(r.kernel.find(f.dtypes), std::string::npos)
      << cpu::isa_name(isa) << ": expected '" << f.dtypes << "' in '" << r.kernel << "'";
  EXPECT_FALSE(r.detail.empty());
}

TEST(SelfTestFaults, ABrokenKernelOfEveryUnitIsCaughtAndNamed) {
  // Generated over AllUnits: a unit added there is covered here with no edit.
  for (const cpu::Isa isa : testing_support::isas_under_test()) {
    std::size_t faults = 0;
    ::stepcore::detail::AllUnits::for_each([&](auto unit) {
      for (const Fault& f : unit_faults<decltype(unit)>()) {
        SCOPED_TRACE(f.name + f.dtypes);
        expect_caught(isa, f);
        ++faults;
      }
    });
    EXPECT_GE(faults, 30u);
    EXPECT_TRUE(cpu::self_test(isa).passed) << "the built-in table is back";
  }
}

TEST(SelfTestFaults, EveryOtherKernelKindIsCaughtAndNamed) {
  for (const cpu::Isa isa : testing_support::isas_under_test()) {
    for (const Fault& f : kOtherFaults) expect_caught(isa, f);
    EXPECT_TRUE(cpu::self_test(isa).passed) << "the built-in table is back";
  }
}

TEST(SelfTestFaults, AChosenIsaFallsBackWithOneWarning) {
  ::unsetenv("STEPCORE_ISA");
  const auto isas = cpu::supported_isas();
  const cpu::Isa best = isas.back();
  const Fault adamw = unit_faults<::stepcore::detail::AdamW>().front();
  const ScopedFault scope(best, adamw);
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
    const ScopedFault scope(isa, kOtherFaults[2]);
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
