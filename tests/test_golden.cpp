// Golden files from PyTorch (tests/data/, made by tools/golden/make_golden.py) replayed
// bit for bit:
//  * every optimizer file (*_torch.txt, one format: tests/data/README.md) through one
//    loader and one replay: each case names its optimizer, its hyper-parameters by
//    OptimizerTraits' field names and its state by the unit's slot names, so the loader
//    builds the OptimizerTensor records from the unit's slot list (core/optimizers) and the
//    replay runs each unit's cases (a test per unit of AllUnits; a unit the set has no
//    data for, as Lion, is skipped) through the reference and through the CPU engine on
//    every ISA; a torch-backed optimizer added later needs nothing here;
//  * per optimizer, the tests that show the data tells the chosen formula from its
//    candidates (the candidates are the optimizer's own);
//  * clip_grad_norm.txt (not an optimizer, its own loader): the exact norm against an exact
//    Fraction/integer computation in Python, torch's norm within a bound, the clipped bits.
// Two sets, both run on every target (tests/CMakeLists.txt registers the binary twice):
// torch's x86 AVX2 build (tests/data) and, with STEPCORE_GOLDEN_SET=aarch64, its aarch64
// NEON build (tests/data/aarch64; docs/numerics.md 7.2, "Per platform").
#include <gtest/gtest.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "core/optimizers/all.hpp"
#include "isa_list.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/reference.hpp"

namespace {

using stepcore::ConstTensorView;
using stepcore::DType;
using stepcore::OptimizerConfig;
using stepcore::OptimizerTensor;
using stepcore::TensorView;

// The torch build of this run's set: its vector width W and v's form (docs/numerics.md
// 7.2): x86's AVX2 kernel, 8 wide, v = fma(c*g, g, v*b2) in the body; aarch64's NEON
// kernel, 4 wide, v = fma(v, b2, c*g*g) everywhere. STEPCORE_GOLDEN_SET=aarch64 (ctest's
// aarch64-set/ tests) picks the second.
const bool kAarch64Set = [] {
  const char* s = std::getenv("STEPCORE_GOLDEN_SET");
  return s != nullptr && std::string(s) == "aarch64";
}();
const int kTorchWidth = kAarch64Set ? 4 : 8;

/// The folder of this run's set.
std::string set_dir() {
  return std::string(STEPCORE_TEST_DATA_DIR) + (kAarch64Set ? "/aarch64" : "");
}

// ---------------------------------------------------------------- parsing

struct Record {
  std::string key;
  std::vector<std::string> tok;
  int line = 0;
};

// A golden file's records (comments dropped), read in order.
class GoldenFile {
 public:
  explicit GoldenFile(std::string path) : path_(std::move(path)) {
    std::ifstream in(path_);
    if (!in) throw std::runtime_error("cannot open " + path_);
    std::string text;
    int n = 0;
    while (std::getline(in, text)) {
      ++n;
      if (text.empty() || text[0] == '#') continue;
      std::istringstream ss(text);
      Record r;
      r.line = n;
      ss >> r.key;
      for (std::string t; ss >> t;) r.tok.push_back(std::move(t));
      records_.push_back(std::move(r));
    }
  }

  bool done() const { return pos_ >= records_.size(); }
  /// Whether the next record has keyword `key`.
  bool next_is(const std::string& key) const { return !done() && records_[pos_].key == key; }

  // Returns the next record, which must have keyword `key`.
  const Record& expect(const std::string& key) {
    if (done()) fail("unexpected end of file, wanted '" + key + "'");
    const Record& r = records_[pos_++];
    if (r.key != key)
      fail("line " + std::to_string(r.line) + ": wanted '" + key + "', got '" + r.key + "'");
    return r;
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(path_ + ": " + what);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<Record> records_;
  std::size_t pos_ = 0;
};

template <class T>
T parse_hex(const std::string& s, std::size_t digits) {
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 16);
  if (ec != std::errc() || end != s.data() + s.size() || s.size() != digits)
    throw std::runtime_error("bad hex word '" + s + "'");
  return static_cast<T>(v);
}

std::size_t parse_size(const std::string& s) {
  std::size_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 10);
  if (ec != std::errc() || end != s.data() + s.size())
    throw std::runtime_error("bad count '" + s + "'");
  return v;
}

// Reads a double written by Python's float.hex() (strtod reads hex floats exactly).
double parse_double(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) throw std::runtime_error("bad double '" + s + "'");
  return v;
}

bool parse_flag(const std::string& s) {
  if (s != "0" && s != "1") throw std::runtime_error("bad flag '" + s + "'");
  return s == "1";
}

float parse_f32(const std::string& s) {
  return stepcore::f32_from_bits(parse_hex<std::uint32_t>(s, 8));
}

DType parse_dtype(const GoldenFile& f, const std::string& s) {
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    if (s == stepcore::dtype_name(d)) return d;
  f.fail("unknown dtype '" + s + "'");
}

std::vector<std::size_t> parse_sizes(const Record& r, std::size_t k) {
  if (r.tok.size() != k)
    throw std::runtime_error("sizes: wrong count at line " + std::to_string(r.line));
  std::vector<std::size_t> v;
  for (const auto& t : r.tok) v.push_back(parse_size(t));
  return v;
}

// ---------------------------------------------------------------- arrays

/// One tensor of a golden file in its dtype: f32 values, or bf16/f16 bit patterns.
struct Array {
  DType dtype = DType::f32;
  std::vector<float> f32;
  std::vector<std::uint16_t> h;

  static Array filled(DType dt, std::size_t n, float value) {
    Array a;
    a.dtype = dt;
    if (dt == DType::f32)
      a.f32.assign(n, value);
    else
      a.h.assign(n, dt == DType::bf16 ? stepcore::f32_to_bf16_bits(value)
                                      : stepcore::f32_to_f16_bits(value));
    return a;
  }
  std::size_t size() const { return dtype == DType::f32 ? f32.size() : h.size(); }
  void* data() { return dtype == DType::f32 ? static_cast<void*>(f32.data()) : h.data(); }
  const void* data() const {
    return dtype == DType::f32 ? static_cast<const void*>(f32.data()) : h.data();
  }
  TensorView view() { return {data(), size(), dtype}; }
  ConstTensorView cview() const { return {data(), size(), dtype}; }
  /// Element i's bit pattern (16-bit types in the low half).
  std::uint32_t bits(std::size_t i) const {
    return dtype == DType::f32 ? stepcore::f32_bits(f32[i]) : h[i];
  }
  /// Element i widened to f32 (exact).
  float value(std::size_t i) const {
    if (dtype == DType::f32) return f32[i];
    return dtype == DType::bf16 ? stepcore::bf16_bits_to_f32(h[i])
                                : stepcore::f16_bits_to_f32(h[i]);
  }
};

// A tensor record "<key> <index> <words...>": n words of 8 (f32) or 4 (bf16, f16) digits.
Array read_array(GoldenFile& f, const std::string& key, std::size_t index, std::size_t n,
                 DType dt) {
  const Record& r = f.expect(key);
  if (r.tok.empty() || parse_size(r.tok[0]) != index || r.tok.size() != n + 1)
    f.fail("line " + std::to_string(r.line) + ": '" + key + "' record for tensor " +
           std::to_string(index) + " with " + std::to_string(n) + " elements expected");
  Array a;
  a.dtype = dt;
  for (std::size_t i = 0; i < n; ++i) {
    if (dt == DType::f32)
      a.f32.push_back(parse_f32(r.tok[i + 1]));
    else
      a.h.push_back(parse_hex<std::uint16_t>(r.tok[i + 1], 4));
  }
  return a;
}

std::vector<Array> read_arrays(GoldenFile& f, const std::string& key,
                               const std::vector<std::size_t>& sizes, DType dt) {
  std::vector<Array> out;
  for (std::size_t t = 0; t < sizes.size(); ++t) out.push_back(read_array(f, key, t, sizes[t], dt));
  return out;
}

// ---------------------------------------------------------------- the optimizer files

/// One case of an optimizer file: torch's optimizer `optimizer` (OptimizerTraits' name) run
/// from init_param for steps.size() steps.
struct GoldenCase {
  std::string file, name, optimizer;
  DType param_dtype = DType::f32, grad_dtype = DType::f32;
  OptimizerConfig config;          ///< torch build fields set to this set's
  std::vector<std::string> slots;  ///< the state slots the config uses: the unit's names
  std::vector<float> initial;      ///< per slot, the unit's initial value (+0 by default)
  bool counts_steps = false;       ///< the unit keeps a per-tensor step counter
  std::vector<std::size_t> sizes;
  std::vector<Array> init_param;
  /// [slot][tensor]: torch's state after construction; empty for a slot torch creates
  /// at the first step (the unit's initial value then).
  std::vector<std::vector<Array>> init_state;
  struct Step {
    std::vector<Array> grad, param;
    std::vector<std::vector<Array>> state;  ///< [slot][tensor], after torch's step
    std::vector<float> count;               ///< torch's state['step']; empty: torch keeps none
  };
  std::vector<Step> steps;

  /// Returns the index of slot `name`, or -1 when the config does not use it.
  int slot(std::string_view name) const {
    for (std::size_t j = 0; j < slots.size(); ++j)
      if (slots[j] == name) return static_cast<int>(j);
    return -1;
  }
  /// Returns lanes * torch's f32 width: where torch's scalar tail begins (bf16/f16 vectors
  /// hold twice the f32 lanes, docs/numerics.md 7.3); only for messages.
  std::size_t tail_width() const { return (param_dtype == DType::f32 ? 1 : 2) * kTorchWidth; }
};

/// Calls fn(Unit{}) for the unit of AllUnits named `name`; returns whether there is one.
template <class Fn>
bool with_unit(std::string_view name, Fn&& fn) {
  bool found = false;
  stepcore::detail::AllUnits::for_each([&](auto unit) {
    if (!found && name == decltype(unit)::kName) {
      found = true;
      fn(unit);
    }
  });
  return found;
}

/// The value of a machine-role field (which torch build to follow): this set's build.
template <class C, class M>
void set_machine_field(const GoldenFile& f, C& c, const char* name, M C::*member) {
  if constexpr (std::is_same_v<M, int>) {
    if (std::string_view(name) == "torch_tail_width") {
      c.*member = kTorchWidth;
      return;
    }
  } else if constexpr (std::is_same_v<M, bool>) {
    if (std::string_view(name) == "torch_v_first") {
      c.*member = kAarch64Set;
      return;
    }
  }
  f.fail(std::string("no golden set value for the machine field '") + name + "'");
}

/// Reads an `hparams` record into configuration C: every field of OptimizerTraits<C>
/// whose role is not `machine`, once, as `name=value` (doubles as float.hex(), flags 0|1,
/// the AdamW formula by name); the machine fields are this set's torch build.
template <class C>
C parse_config(const GoldenFile& f, const Record& h) {
  constexpr auto& fields = stepcore::OptimizerTraits<C>::kFields;
  C c{};
  std::vector<bool> seen(std::size(fields), false);
  for (const std::string& tok : h.tok) {
    const auto eq = tok.find('=');
    if (eq == std::string::npos) f.fail("bad hyper-parameter '" + tok + "'");
    const std::string key = tok.substr(0, eq), value = tok.substr(eq + 1);
    std::size_t i = 0;
    while (i < std::size(fields) && key != fields[i].name) ++i;
    if (i == std::size(fields) || fields[i].role == stepcore::HyperRole::machine || seen[i])
      f.fail("line " + std::to_string(h.line) + ": unexpected hyper-parameter '" + key + "'");
    seen[i] = true;
    std::visit(
        [&](auto member) {
          using M = std::remove_reference_t<decltype(c.*member)>;
          if constexpr (std::is_same_v<M, double>) {
            c.*member = parse_double(value);
          } else if constexpr (std::is_same_v<M, bool>) {
            c.*member = parse_flag(value);
          } else if constexpr (std::is_same_v<M, int>) {
            c.*member = static_cast<int>(parse_size(value));
          } else if constexpr (std::is_same_v<M, stepcore::AdamWFormula>) {
            std::size_t k = 0;
            const auto& names = stepcore::kAdamWFormulaNames;
            while (k < std::size(names) && names[k] != value) ++k;
            if (k == std::size(names)) f.fail("bad formula '" + value + "'");
            c.*member = static_cast<stepcore::AdamWFormula>(k);
          } else {
            static_assert(sizeof(M) == 0, "a field type the golden format cannot write");
          }
        },
        fields[i].member);
  }
  for (std::size_t i = 0; i < std::size(fields); ++i) {
    if (fields[i].role == stepcore::HyperRole::machine)
      std::visit([&](auto member) { set_machine_field(f, c, fields[i].name, member); },
                 fields[i].member);
    else if (!seen[i])
      f.fail("line " + std::to_string(h.line) + ": hyper-parameter '" + fields[i].name +
             "' missing");
  }
  return c;
}

/// Sets the field `name` of the optimizer `c` holds to `value` (an int or bool field);
/// returns false when its configuration has no such field.
template <class V>
bool set_field(OptimizerConfig& c, std::string_view name, V value) {
  return std::visit(
      [&](auto& cfg) {
        bool done = false;
        for (const auto& field : stepcore::OptimizerTraits<std::decay_t<decltype(cfg)>>::kFields)
          if (name == field.name)
            std::visit(
                [&](auto member) {
                  using M = std::remove_reference_t<decltype(cfg.*member)>;
                  if constexpr (std::is_same_v<M, V>) {
                    cfg.*member = value;
                    done = true;
                  }
                },
                field.member);
        return done;
      },
      c);
}

// Reads every case of one optimizer file (the format: tests/data/README.md).
std::vector<GoldenCase> load_optimizer_file(const std::filesystem::path& path) {
  GoldenFile f(path.string());
  std::vector<GoldenCase> cases;
  while (!f.done()) {
    const Record& c = f.expect("case");
    if (c.tok.size() != 6) f.fail("bad case line " + std::to_string(c.line));
    GoldenCase k;
    k.file = path.filename().string();
    k.name = c.tok[0];
    k.optimizer = c.tok[1];
    k.param_dtype = parse_dtype(f, c.tok[2]);
    k.grad_dtype = parse_dtype(f, c.tok[3]);
    const std::size_t K = parse_size(c.tok[4]), S = parse_size(c.tok[5]);
    const Record& h = f.expect("hparams");
    const bool known = with_unit(k.optimizer, [&](auto unit) {
      using Unit = decltype(unit);
      const auto config = parse_config<typename Unit::Config>(f, h);
      k.config = config;
      const int used = Unit::slots(Unit::variant(config));
      for (int j = 0; j < used; ++j) {
        k.slots.emplace_back(Unit::kSlotNames[j]);
        k.initial.push_back(stepcore::detail::unit_initial_slot<Unit>(config, j));
      }
      k.counts_steps = Unit::kCountsSteps;
    });
    if (!known) f.fail("line " + std::to_string(c.line) + ": no optimizer '" + k.optimizer + "'");
    k.sizes = parse_sizes(f.expect("sizes"), K);
    k.init_param = read_arrays(f, "init_param", k.sizes, k.param_dtype);
    for (const std::string& slot : k.slots)
      k.init_state.push_back(f.next_is("init_" + slot)
                                 ? read_arrays(f, "init_" + slot, k.sizes, k.param_dtype)
                                 : std::vector<Array>{});
    for (std::size_t s = 1; s <= S; ++s) {
      const Record& st = f.expect("step");
      if (st.tok.size() != 1 || parse_size(st.tok[0]) != s)
        f.fail("bad step line " + std::to_string(st.line));
      GoldenCase::Step step;
      step.grad = read_arrays(f, "grad", k.sizes, k.grad_dtype);
      step.param = read_arrays(f, "param", k.sizes, k.param_dtype);
      for (const std::string& slot : k.slots)
        step.state.push_back(read_arrays(f, slot, k.sizes, k.param_dtype));
      if (f.next_is("step_count")) {
        if (!k.counts_steps)
          f.fail(k.name + ": torch counts steps, the unit " + k.optimizer + " not");
        for (std::size_t t = 0; t < K; ++t)
          step.count.push_back(read_array(f, "step_count", t, 1, DType::f32).f32[0]);
      }
      if (s > 1 && step.count.empty() != k.steps[0].count.empty())
        f.fail(k.name + ": step_count records in some steps only");
      k.steps.push_back(std::move(step));
    }
    f.expect("end");
    cases.push_back(std::move(k));
  }
  return cases;
}

// Every case of every optimizer file of this run's set (*_torch.txt and *_torchao.txt, in
// name order).
const std::vector<GoldenCase>& golden_cases() {
  static const std::vector<GoldenCase> cases = [] {
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(set_dir())) {
      const std::string name = e.path().filename().string();
      if (e.is_regular_file() && (name.ends_with("_torch.txt") || name.ends_with("_torchao.txt")))
        files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    std::vector<GoldenCase> all;
    for (const auto& p : files)
      for (auto& k : load_optimizer_file(p)) all.push_back(std::move(k));
    return all;
  }();
  return cases;
}

/// The cases of one file (the tests of what a file holds, and the candidate tests that
/// were shown on that file's data).
std::vector<const GoldenCase*> cases_in(std::string_view file) {
  std::vector<const GoldenCase*> out;
  for (const auto& k : golden_cases())
    if (k.file == file) out.push_back(&k);
  return out;
}

// SignSGD with a NaN gradient is a deliberate difference (docs/numerics.md 8): torch's sign
// gives +0, stepcore's the NaN. GoldenSignSgd.NanGradientsPropagateElsewhereTorchBits
// checks those cases; the replay leaves them out.
bool has_nan_gradient(const GoldenCase& k) {
  for (const auto& st : k.steps)
    for (const Array& g : st.grad)
      for (std::size_t i = 0; i < g.size(); ++i)
        if (std::isnan(g.value(i))) return true;
  return false;
}
bool deliberate_difference(const GoldenCase& k) {
  return k.optimizer == "sign_sgd" && has_nan_gradient(k);
}

// ---------------------------------------------------------------- the replay

std::string hex32(std::uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", u);
  return buf;
}

// Element mismatches of one quantity (param, a slot) over a whole case: the bits differ
// and are not both NaN (docs/numerics.md 1: a NaN result's payload is unspecified).
struct Tally {
  std::size_t elements = 0, body = 0, tail = 0;
  std::string first;  // where the first one was seen
  void add(const Array& want, const Array& got, std::size_t tail_w, const std::string& where) {
    const std::size_t n = want.size();
    const std::size_t tail_begin = tail_w > 1 ? n - n % tail_w : n;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t a = want.bits(i), b = got.bits(i);
      if (a == b || (std::isnan(want.value(i)) && std::isnan(got.value(i)))) continue;
      ++elements;
      ++(i < tail_begin ? body : tail);
      if (first.empty()) {
        std::ostringstream os;
        os.precision(9);
        os << where << " [" << i << "] (" << (i < tail_begin ? "body" : "tail") << "): torch "
           << hex32(a) << " (" << want.value(i) << "), stepcore " << hex32(b) << " ("
           << got.value(i) << ")";
        first = os.str();
      }
    }
  }
  ::testing::AssertionResult result() const {
    if (elements == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << elements << " element-steps differ (" << body << " in torch's vector body, " << tail
           << " in its scalar tail); first: " << first;
  }
};

using StepFn = std::function<void(std::span<const OptimizerTensor>, const OptimizerConfig&)>;

void reference_step(std::span<const OptimizerTensor> ts, const OptimizerConfig& c) {
  stepcore::reference::optimizer_step(ts, c);
}

/// How to replay a case (the defaults: the reference, the case's configuration, from
/// torch's state before each step, failures reported).
struct Replay {
  /// Each step from the replay's own previous state (the whole trajectory from torch's
  /// initial state); else from torch's state after the previous step, so a disagreement is
  /// reported at the step and element where it arises.
  bool chained = false;
  bool report = true;  ///< EXPECT every quantity to match (else only count)
  StepFn step = reference_step;
  const OptimizerConfig* config = nullptr;  ///< a variation of the case's configuration
  /// The gradient fed at step s (0-based) to tensor t, from the param the step starts
  /// from; default: the file's.
  std::function<Array(std::size_t s, std::size_t t, const Array& param)> grad_of;
  /// The value every slot without torch's initial state starts from (default: the unit's).
  const float* initial = nullptr;
};

// Replays a case; compares param, every slot and the step counters after every step.
// Returns the differing element-steps (and counters).
std::size_t replay(const GoldenCase& k, const Replay& how = {}) {
  const OptimizerConfig& config = how.config ? *how.config : k.config;
  const std::size_t K = k.sizes.size(), J = k.slots.size();
  const std::size_t w = k.tail_width();
  std::vector<Array> p = k.init_param;
  std::vector<std::vector<Array>> st(J);
  for (std::size_t j = 0; j < J; ++j)
    for (std::size_t t = 0; t < K; ++t)
      st[j].push_back(!k.init_state[j].empty()
                          ? k.init_state[j][t]
                          : Array::filled(k.param_dtype, k.sizes[t],
                                          how.initial ? *how.initial : k.initial[j]));
  std::vector<float> count(K, 0.0f);
  Tally tp;
  std::vector<Tally> ts(J);
  std::size_t counters = 0;
  for (std::size_t s = 0; s < k.steps.size(); ++s) {
    const GoldenCase::Step& rec = k.steps[s];
    if (!how.chained && s > 0) {
      const GoldenCase::Step& prev = k.steps[s - 1];
      p = prev.param;
      for (std::size_t j = 0; j < J; ++j) st[j] = prev.state[j];
      count = prev.count.empty() ? std::vector<float>(K, static_cast<float>(s)) : prev.count;
    }
    std::vector<Array> g(K);
    std::vector<OptimizerTensor> tensors(K);
    for (std::size_t t = 0; t < K; ++t) {
      g[t] = how.grad_of ? how.grad_of(s, t, p[t]) : rec.grad[t];
      tensors[t].param = p[t].view();
      for (std::size_t j = 0; j < J; ++j) tensors[t].state[j] = st[j][t].view();
      tensors[t].step = k.counts_steps ? &count[t] : nullptr;
      tensors[t].grad = g[t].cview();
    }
    how.step(tensors, config);
    for (std::size_t t = 0; t < K; ++t) {
      const std::string where = "step " + std::to_string(s + 1) + " tensor " + std::to_string(t) +
                                " (numel " + std::to_string(k.sizes[t]) + ")";
      tp.add(rec.param[t], p[t], w, where);
      for (std::size_t j = 0; j < J; ++j) ts[j].add(rec.state[j][t], st[j][t], w, where);
      if (k.counts_steps) {
        const float want = rec.count.empty() ? static_cast<float>(s + 1) : rec.count[t];
        const bool same = stepcore::f32_bits(want) == stepcore::f32_bits(count[t]);
        counters += !same;
        if (how.report)
          EXPECT_TRUE(same) << where << ": step counter " << count[t] << ", torch " << want;
      }
    }
  }
  std::size_t total = tp.elements + counters;
  for (std::size_t j = 0; j < J; ++j) {
    total += ts[j].elements;
    if (how.report) EXPECT_TRUE(ts[j].result()) << k.slots[j];
  }
  if (how.report) EXPECT_TRUE(tp.result()) << "param";
  return total;
}

/// Replays `cases` with `how`; returns the differing element-steps of them all.
std::size_t mismatches(const std::vector<const GoldenCase*>& cases, Replay how) {
  how.report = false;
  std::size_t n = 0;
  for (const GoldenCase* k : cases) n += replay(*k, how);
  return n;
}

/// Replays `cases`, each with its configuration changed by `edit`.
std::size_t mismatches_with(const std::vector<const GoldenCase*>& cases,
                            const std::function<void(OptimizerConfig&)>& edit) {
  std::size_t n = 0;
  for (const GoldenCase* k : cases) {
    OptimizerConfig c = k->config;
    edit(c);
    n += replay(*k, {.report = false, .config = &c});
  }
  return n;
}

// The engines of every ISA this processor runs, threads 1 and 3.
std::vector<stepcore::cpu::Engine> golden_engines() {
  std::vector<stepcore::cpu::Engine> out;
  for (stepcore::cpu::Isa isa : stepcore::testing_support::isas_under_test())
    for (int threads : {1, 3}) out.emplace_back(stepcore::cpu::EngineConfig{isa, threads});
  return out;
}

std::string engine_name(const stepcore::cpu::Engine& e) {
  return std::string(stepcore::cpu::isa_name(e.isa())) + " threads " + std::to_string(e.threads());
}

// ---------------------------------------------------------------- every unit in the data

// The names of the library's units (core/optimizers/all.hpp).
std::vector<std::string> unit_names() {
  std::vector<std::string> names;
  stepcore::detail::AllUnits::for_each(
      [&](auto unit) { names.emplace_back(decltype(unit)::kName); });
  return names;
}

// The replayed cases of a unit; skips the test when the set has none (an optimizer torch
// does not have, as Lion).
class GoldenUnit : public ::testing::TestWithParam<std::string> {
 protected:
  std::vector<const GoldenCase*> unit_cases() const {
    std::vector<const GoldenCase*> out;
    for (const auto& k : golden_cases())
      if (k.optimizer == GetParam() && !deliberate_difference(k)) out.push_back(&k);
    return out;
  }
};

TEST_P(GoldenUnit, ReferenceMatchesTorchBitForBit) {
  const auto cases = unit_cases();
  if (cases.empty()) GTEST_SKIP() << GetParam() << ": no torch golden data in this set";
  for (const GoldenCase* k : cases) {
    SCOPED_TRACE(k->file + " case " + k->name);
    replay(*k);
  }
}

// The whole trajectory from torch's initial state, each step from the reference's own
// previous result.
TEST_P(GoldenUnit, ReferenceChainedOverAllStepsMatchesTorch) {
  const auto cases = unit_cases();
  if (cases.empty()) GTEST_SKIP() << GetParam() << ": no torch golden data in this set";
  for (const GoldenCase* k : cases) {
    SCOPED_TRACE(k->file + " case " + k->name);
    replay(*k, {.chained = true});
  }
}

// The CPU engine on every ISA, threads 1 and 3, from torch's state and chained.
TEST_P(GoldenUnit, CpuEngineOnEveryIsaMatchesTorch) {
  const auto cases = unit_cases();
  if (cases.empty()) GTEST_SKIP() << GetParam() << ": no torch golden data in this set";
  for (const stepcore::cpu::Engine& e : golden_engines()) {
    SCOPED_TRACE(engine_name(e));
    const StepFn step = [&e](std::span<const OptimizerTensor> ts, const OptimizerConfig& config) {
      std::visit([&](const auto& c) { e.step(ts, c); }, config);
    };
    for (const GoldenCase* k : cases) {
      SCOPED_TRACE(k->file + " case " + k->name);
      replay(*k, {.step = step});
      replay(*k, {.chained = true, .step = step});
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Torch, GoldenUnit, ::testing::ValuesIn(unit_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// torch's state after construction (Adagrad's sum: initial_accumulator_value) is the unit's
// initial slot value (what a caller fills a new slot with), rounded to the param's dtype.
TEST(GoldenData, InitialStateIsTheUnitsInitialSlotValue) {
  std::size_t checked = 0;
  for (const auto& k : golden_cases())
    for (std::size_t j = 0; j < k.slots.size(); ++j)
      for (std::size_t t = 0; t < k.init_state[j].size(); ++t) {
        const Array& got = k.init_state[j][t];
        const Array want = Array::filled(k.param_dtype, got.size(), k.initial[j]);
        for (std::size_t i = 0; i < got.size(); ++i)
          ASSERT_EQ(hex32(want.bits(i)), hex32(got.bits(i)))
              << k.file << " case " << k.name << " init_" << k.slots[j] << " tensor " << t;
        ++checked;
      }
  EXPECT_GT(checked, 0u);
}

// ---------------------------------------------------------------- AdamW

TEST(GoldenAdamW, FileHasTheExpectedCases) {
  const auto cases = cases_in("adamw_torch.txt");
  ASSERT_GE(cases.size(), 5u);
  bool f32 = false, bf16 = false, wd0 = false, wd = false, big_lerp = false, all_tail = false;
  for (const GoldenCase* k : cases) {
    const auto& c = std::get<stepcore::AdamWConfig>(k->config);
    EXPECT_EQ(k->param_dtype, DType::f32);
    (k->grad_dtype == DType::f32 ? f32 : bf16) = true;
    (c.weight_decay == 0.0 ? wd0 : wd) = true;
    if (1.0 - c.beta1 >= 0.5) big_lerp = true;
    for (std::size_t n : k->sizes)
      if (n < 8) all_tail = true;
    EXPECT_GE(k->steps.size(), 5u) << k->name;
  }
  EXPECT_TRUE(f32 && bf16 && wd0 && wd && big_lerp && all_tail);
}

/// Returns the differing element-steps of the AdamW file replayed with tail width `w`.
std::size_t adamw_mismatches_with_tail_width(int w) {
  return mismatches_with(cases_in("adamw_torch.txt"),
                         [w](OptimizerConfig& c) { set_field(c, "torch_tail_width", w); });
}

// The data must be able to tell torch's scalar tail from its vector body: with the
// body's rounding used everywhere (tail width 1) the replay has to disagree somewhere.
// torch's aarch64 build computes plain AdamW alike in body and tail: nothing to tell.
TEST(GoldenAdamW, DataDistinguishesTheScalarTail) {
  if (kAarch64Set) GTEST_SKIP() << "aarch64 set: v has one form, body and tail alike";
  EXPECT_GT(adamw_mismatches_with_tail_width(1), 0u);
}

// torch's fused AdamW on an AVX-512 processor runs its AVX2 kernel (REGISTER_DISPATCH
// leaves the AVX-512 slot empty; docs/numerics.md 7.2), so its tail is 8 wide there too:
// a 16-wide tail must disagree with the data, which has tensors of 8 < numel mod 16.
TEST(GoldenAdamW, DataRejectsASixteenWideTail) {
  if (kAarch64Set) GTEST_SKIP() << "aarch64 set: v has one form, body and tail alike";
  EXPECT_GT(adamw_mismatches_with_tail_width(16), 0u);
}

// The other build's v (x86's body form on the aarch64 set, aarch64's everywhere form on the
// x86 set) must disagree with the data: the two builds are different functions.
TEST(GoldenAdamW, DataRejectsTheOtherBuildsFormOfV) {
  EXPECT_GT(
      mismatches_with(cases_in("adamw_torch.txt"),
                      [](OptimizerConfig& c) { set_field(c, "torch_v_first", !kAarch64Set); }),
      0u);
}

// ---------------------------------------------------------------- Adagrad

TEST(GoldenAdagrad, FileHasTheExpectedCases) {
  const auto cases = cases_in("adagrad_torch.txt");
  ASSERT_GE(cases.size(), 6u);
  bool decay0 = false, decay = false, wd0 = false, wd = false, iav0 = false, iav = false;
  bool maximize = false, minimize = false, empty = false, all_tail = false, body_and_tail = false;
  std::vector<double> eps;
  for (const GoldenCase* k : cases) {
    const auto& c = std::get<stepcore::AdagradConfig>(k->config);
    (c.lr_decay == 0.0 ? decay0 : decay) = true;
    (c.weight_decay == 0.0 ? wd0 : wd) = true;
    (c.initial_accumulator_value == 0.0 ? iav0 : iav) = true;
    (c.maximize ? maximize : minimize) = true;
    if (std::find(eps.begin(), eps.end(), c.eps) == eps.end()) eps.push_back(c.eps);
    for (std::size_t n : k->sizes) {
      empty = empty || n == 0;
      all_tail = all_tail || (n > 0 && n < 8);
      body_and_tail = body_and_tail || (n > 8 && n % 8 != 0);
    }
    EXPECT_EQ(k->init_state.at(0).size(), k->sizes.size()) << k->name << ": torch's initial sum";
    EXPECT_GE(k->steps.size(), 3u) << k->name;
  }
  EXPECT_TRUE(decay0 && decay && wd0 && wd && iav0 && iav && maximize && minimize);
  EXPECT_TRUE(empty && all_tail && body_and_tail);
  EXPECT_GE(eps.size(), 4u);
}

// The candidate roundings the spec chose between (docs/numerics.md 8c), as one scalar
// emulation with a switch per choice; torch's choice is the first of each pair.
struct AdagradCandidate {
  bool decay_fma = true;      // g = fma(p, wd, g)           vs  g + RN(p * wd)
  bool sum_fma = true;        // sum = fma(g, g, sum)        vs  sum + RN(g * g)
  bool clr_fma = true;        // 1 + (step - 1) * lr_decay   as one binary64 FMA vs two roundings
  bool product_first = true;  // (clr * g) / std            vs  clr * (g / std)
};

void candidate_adagrad(std::span<const OptimizerTensor> ts, const stepcore::AdagradConfig& c,
                       const AdagradCandidate& how) {
  const float wd = static_cast<float>(c.weight_decay), eps = static_cast<float>(c.eps);
  for (const auto& t : ts) {
    *t.step = *t.step + 1.0f;
    const double s1 = static_cast<double>(*t.step) - 1.0;
    const double prod = s1 * c.lr_decay;  // rounded on its own (-ffp-contract=off)
    const double den = how.clr_fma ? std::fma(s1, c.lr_decay, 1.0) : 1.0 + prod;
    const float clr = static_cast<float>(c.lr / den);
    auto* P = static_cast<float*>(t.param.data);
    auto* S = static_cast<float*>(t.state[0].data);
    const auto* G = static_cast<const float*>(t.grad.data);
    for (std::size_t i = 0; i < t.param.numel; ++i) {
      float g = c.maximize ? -G[i] : G[i];
      if (c.weight_decay != 0.0) {
        const float pw = P[i] * wd;
        g = how.decay_fma ? std::fma(P[i], wd, g) : g + pw;
      }
      const float gg = g * g;
      S[i] = how.sum_fma ? std::fma(g, g, S[i]) : S[i] + gg;
      const float std_ = std::sqrt(S[i]) + eps;
      const float upd = how.product_first ? (clr * g) / std_ : clr * (g / std_);
      P[i] = P[i] - upd;
    }
  }
}

std::size_t candidate_mismatches(const AdagradCandidate& how) {
  return mismatches(cases_in("adagrad_torch.txt"),
                    {.step = [&](std::span<const OptimizerTensor> ts, const OptimizerConfig& c) {
                      candidate_adagrad(ts, std::get<stepcore::AdagradConfig>(c), how);
                    }});
}

// The data tells every rejected rounding apart from torch's: each alternative, alone,
// disagrees with torch somewhere, while the emulation with torch's choices agrees
// everywhere (so the disagreements come from the alternative, not from the emulation).
TEST(GoldenAdagrad, DataDistinguishesTheRejectedContractions) {
  EXPECT_EQ(candidate_mismatches({}), 0u);
  EXPECT_GT(candidate_mismatches({.decay_fma = false}), 0u) << "g + RN(p * wd)";
  EXPECT_GT(candidate_mismatches({.sum_fma = false}), 0u) << "sum + RN(g * g)";
  EXPECT_GT(candidate_mismatches({.clr_fma = false}), 0u) << "1 + RN((step - 1) * lr_decay)";
  EXPECT_GT(candidate_mismatches({.product_first = false}), 0u) << "clr * (g / std)";
}

// ---------------------------------------------------------------- Adam, amsgrad, maximize

/// The Adam-family flags of a case (Adam or AdamW).
struct AdamFlags {
  bool adamw = false, amsgrad = false, maximize = false;
  double beta1 = 0, weight_decay = 0;
};
AdamFlags adam_flags(const GoldenCase& k) {
  return std::visit(
      [](const auto& c) -> AdamFlags {
        using C = std::decay_t<decltype(c)>;
        if constexpr (std::is_same_v<C, stepcore::AdamConfig> ||
                      std::is_same_v<C, stepcore::AdamWConfig>)
          return {std::is_same_v<C, stepcore::AdamWConfig>, c.amsgrad, c.maximize, c.beta1,
                  c.weight_decay};
        else
          throw std::runtime_error("not an Adam-family case");
      },
      k.config);
}

TEST(GoldenAdam, FileHasTheExpectedCases) {
  const auto cases = cases_in("adam_torch.txt");
  ASSERT_GE(cases.size(), 8u);
  bool adam = false, adamw = false, ams = false, maxi = false, wd0 = false, wd = false,
       big_lerp = false, nan = false, adam_wd_ams_max = false, adamw_ams_max = false;
  std::vector<std::size_t> seen;
  for (const GoldenCase* k : cases) {
    const AdamFlags a = adam_flags(*k);
    (a.adamw ? adamw : adam) = true;
    ams |= a.amsgrad;
    maxi |= a.maximize;
    (a.weight_decay == 0.0 ? wd0 : wd) = true;
    big_lerp |= 1.0 - a.beta1 >= 0.5;
    adam_wd_ams_max |= !a.adamw && a.weight_decay != 0.0 && a.amsgrad && a.maximize;
    adamw_ams_max |= a.adamw && a.amsgrad && a.maximize;
    nan |= has_nan_gradient(*k);
    seen.insert(seen.end(), k->sizes.begin(), k->sizes.end());
    EXPECT_GE(k->steps.size(), 2u) << k->name;
  }
  EXPECT_TRUE(adam && adamw && ams && maxi && wd0 && wd && big_lerp && nan);
  EXPECT_TRUE(adam_wd_ams_max && adamw_ams_max);
  for (std::size_t n : {0, 1, 7, 8, 9, 31, 32, 33, 1023, 1024, 1025})
    EXPECT_NE(std::find(seen.begin(), seen.end(), n), seen.end()) << "no tensor of size " << n;
}

// The data tells torch's scalar tail from its vector body for Adam too: the body's
// rounding of v everywhere (tail width 1) disagrees somewhere.
TEST(GoldenAdam, DataDistinguishesTheScalarTail) {
  EXPECT_GT(mismatches_with(cases_in("adam_torch.txt"),
                            [](OptimizerConfig& c) { set_field(c, "torch_tail_width", 1); }),
            0u);
}

// Adam's L2 decay is one FMA, g = fma(p, f32(wd), g), in torch's body and tail; the
// separately rounded g + RN(p * f32(wd)) is ruled out by the data. Both are fed to the
// reference as a pre-decayed gradient with weight_decay = 0 (the same formula then); the
// fused one reproduces torch, which shows the emulation itself is faithful.
std::size_t mismatches_with_predecayed_gradient(bool fused, std::size_t& body_tail_cases) {
  std::size_t n = 0;
  for (const GoldenCase* k : cases_in("adam_torch.txt")) {
    const AdamFlags a = adam_flags(*k);
    if (a.adamw || a.weight_decay == 0.0 || k->name.ends_with("_nan")) continue;
    ++body_tail_cases;
    const float wd = static_cast<float>(a.weight_decay);
    OptimizerConfig no_decay = k->config;
    std::get<stepcore::AdamConfig>(no_decay).weight_decay = 0.0;
    n += replay(*k, {.report = false,
                     .config = &no_decay,
                     .grad_of = [&](std::size_t s, std::size_t t, const Array& p) {
                       Array g = k->steps[s].grad[t];
                       for (std::size_t i = 0; i < g.size(); ++i) {
                         const float e = a.maximize ? -g.f32[i] : g.f32[i];  // negated back
                         const float d = fused ? std::fma(p.f32[i], wd, e) : e + p.f32[i] * wd;
                         g.f32[i] = a.maximize ? -d : d;
                       }
                       return g;
                     }});
  }
  return n;
}

TEST(GoldenAdam, DataRulesOutASeparatelyRoundedL2Decay) {
  std::size_t cases = 0;
  EXPECT_EQ(mismatches_with_predecayed_gradient(/*fused=*/true, cases), 0u);
  EXPECT_GT(mismatches_with_predecayed_gradient(/*fused=*/false, cases), 0u);
  EXPECT_GE(cases, 6u);  // the Adam cases with weight decay, twice
}

// amsgrad divides by the new maximum, not by the new v: with the denominator from v the
// replay disagrees (emulated by handing the reference a fresh max slot of zeros, so the
// maximum it takes is v itself; torch's stored maximum is then compared to v and differs
// too, so only param mismatches are counted).
TEST(GoldenAdam, DataRulesOutTheDenominatorFromV) {
  std::size_t param_mismatches = 0, cases = 0;
  for (const GoldenCase* k : cases_in("adam_torch.txt")) {
    if (!adam_flags(*k).amsgrad || k->name.ends_with("_nan")) continue;
    ++cases;
    for (std::size_t s = 1; s < k->steps.size(); ++s) {
      const auto& prev = k->steps[s - 1];
      for (std::size_t t = 0; t < k->sizes.size(); ++t) {
        Array p = prev.param[t], m = prev.state[k->slot("exp_avg")][t],
              v = prev.state[k->slot("exp_avg_sq")][t],
              x = Array::filled(DType::f32, k->sizes[t], 0.0f);
        float count = prev.count[t];
        OptimizerTensor ot;
        ot.param = p.view();
        ot.state[0] = m.view();
        ot.state[1] = v.view();
        ot.state[2] = x.view();
        ot.step = &count;
        ot.grad = k->steps[s].grad[t].cview();
        reference_step(std::span<const OptimizerTensor>(&ot, 1), k->config);
        for (std::size_t i = 0; i < p.size(); ++i)
          param_mismatches += p.bits(i) != k->steps[s].param[t].bits(i);
      }
    }
  }
  EXPECT_GE(cases, 3u);
  EXPECT_GT(param_mismatches, 0u);
}

// amsgrad's maximum and NaN (case *_nan, NaN gradients in step 2): torch's vector body
// stores NaN, its scalar tail keeps the old maximum (std::max(old, NaN) is old). The
// replay checks the reference does the same; this checks the data shows both.
TEST(GoldenAdam, NanDataShowsBothMaximumRules) {
  std::size_t body_nan = 0, tail_kept = 0;
  for (const GoldenCase* k : cases_in("adam_torch.txt")) {
    if (!adam_flags(*k).amsgrad || !k->name.ends_with("_nan")) continue;
    const auto& st = k->steps[1];
    const int v = k->slot("exp_avg_sq"), x = k->slot("max_exp_avg_sq");
    for (std::size_t t = 0; t < k->sizes.size(); ++t) {
      const std::size_t n = k->sizes[t];
      for (std::size_t i = 0; i < n; ++i) {
        if (!std::isnan(st.grad[t].value(i))) continue;
        const bool tail = i >= n - n % kTorchWidth;
        const float xi = st.state[x][t].value(i);
        if (!tail && std::isnan(xi)) ++body_nan;
        if (tail && !std::isnan(xi) && std::isnan(st.state[v][t].value(i))) ++tail_kept;
      }
    }
  }
  EXPECT_GT(body_nan, 0u);
  EXPECT_GT(tail_kept, 0u);
}

// ---------------------------------------------------------------- SignSGD

TEST(GoldenSignSgd, FileHasTheExpectedCases) {
  const auto cases = cases_in("sign_sgd_torch.txt");
  ASSERT_GE(cases.size(), 5u);
  bool f32 = false, bf16 = false, wd0 = false, wd = false, neg_zero_grad = false,
       neg_zero_param = false;
  for (const GoldenCase* k : cases) {
    (k->grad_dtype == DType::f32 ? f32 : bf16) = true;
    (std::get<stepcore::SignSgdConfig>(k->config).weight_decay > 0.0 ? wd : wd0) = true;
    for (const Array& g : k->steps[0].grad)
      for (std::size_t i = 0; i < g.size(); ++i)
        neg_zero_grad |= g.bits(i) == (g.dtype == DType::f32 ? 0x80000000u : 0x8000u);
    for (const Array& p : k->init_param)
      for (std::size_t i = 0; i < p.size(); ++i) neg_zero_param |= p.bits(i) == 0x80000000u;
  }
  EXPECT_TRUE(f32 && bf16 && wd0 && wd && neg_zero_grad && neg_zero_param);
}

// torch.sign(NaN) is +0 on CPU, so plain PyTorch SignSGD silently leaves a parameter
// with a NaN gradient at its decayed value. stepcore deliberately differs
// (docs/numerics.md section 8): sign(NaN) = NaN, so the parameter becomes NaN and the
// non-finite gradient cannot pass unnoticed. Everywhere else the bits are torch's.
TEST(GoldenSignSgd, NanGradientsPropagateElsewhereTorchBits) {
  int replayed = 0;
  for (const GoldenCase* k : cases_in("sign_sgd_torch.txt")) {
    if (!deliberate_difference(*k)) continue;
    SCOPED_TRACE("case " + k->name);
    const std::size_t K = k->sizes.size();
    std::vector<Array> p = k->init_param;
    std::vector<std::vector<bool>> poisoned(K);
    for (std::size_t t = 0; t < K; ++t) poisoned[t].assign(k->sizes[t], false);
    for (std::size_t s = 0; s < k->steps.size(); ++s) {
      std::vector<OptimizerTensor> ts(K);
      for (std::size_t t = 0; t < K; ++t) {
        ts[t].param = p[t].view();
        ts[t].grad = k->steps[s].grad[t].cview();
      }
      stepcore::reference::sign_sgd_step(ts, std::get<stepcore::SignSgdConfig>(k->config));
      for (std::size_t t = 0; t < K; ++t) {
        for (std::size_t i = 0; i < k->sizes[t]; ++i) {
          if (std::isnan(k->steps[s].grad[t].value(i))) poisoned[t][i] = true;
          if (poisoned[t][i]) {
            ASSERT_TRUE(std::isnan(p[t].value(i)))
                << "step " << s + 1 << " tensor " << t << " element " << i;
          } else {
            ASSERT_EQ(hex32(p[t].bits(i)), hex32(k->steps[s].param[t].bits(i)))
                << "step " << s + 1 << " tensor " << t << " element " << i;
          }
        }
      }
      ++replayed;
    }
  }
  EXPECT_GE(replayed, 1);
}

// ---------------------------------------------------------------- SGD

TEST(GoldenSgd, FileHasTheExpectedCases) {
  const auto cases = cases_in("sgd_torch.txt");
  ASSERT_GE(cases.size(), 8u);
  bool mom0 = false, mom = false, damp = false, nesterov = false, wd0 = false, wd = false,
       maximize = false, neg_zero_grad = false;
  std::vector<bool> size_seen(1026, false);
  for (const GoldenCase* k : cases) {
    const auto& c = std::get<stepcore::SgdConfig>(k->config);
    (c.momentum == 0.0 ? mom0 : mom) = true;
    damp |= c.dampening != 0.0;
    nesterov |= c.nesterov;
    (c.weight_decay == 0.0 ? wd0 : wd) = true;
    maximize |= c.maximize;
    for (std::size_t n : k->sizes)
      if (n < size_seen.size()) size_seen[n] = true;
    for (const Array& g : k->steps[0].grad)
      for (std::size_t i = 0; i < g.size(); ++i) neg_zero_grad |= g.bits(i) == 0x80000000u;
    EXPECT_GE(k->steps.size(), 3u) << k->name;
  }
  EXPECT_TRUE(mom0 && mom && damp && nesterov && wd0 && wd && maximize && neg_zero_grad);
  for (std::size_t n : {0, 1, 7, 8, 9, 31, 32, 33, 1023, 1024, 1025})
    EXPECT_TRUE(size_seen[n]) << "size " << n;
}

// torch has no momentum buffer before its first step, so the first step must read none:
// every SGD case (f32, bf16 and f16 params) replayed with the buffer NaN-filled before it,
// from torch's state and chained, still gives torch's bits.
TEST(GoldenSgd, FirstStepReadsNoBuffer) {
  const float nan = std::nanf("");
  std::size_t with_buffer = 0;
  for (const auto& k : golden_cases()) {
    if (k.optimizer != "sgd" || k.slots.empty()) continue;
    ++with_buffer;
    SCOPED_TRACE(k.file + " case " + k.name);
    replay(k, {.initial = &nan});
    replay(k, {.chained = true, .initial = &nan});
  }
  EXPECT_GE(with_buffer, 5u);
}

std::size_t sgd_mismatches_with_tail_width(int w) {
  return mismatches_with(cases_in("sgd_torch.txt"),
                         [w](OptimizerConfig& c) { set_field(c, "torch_tail_width", w); });
}

// The body's momentum rounding everywhere (tail width 1) must disagree with torch.
TEST(GoldenSgd, DataDistinguishesTheScalarTail) {
  EXPECT_GT(sgd_mismatches_with_tail_width(1), 0u);
}

// torch 2.15 runs its AVX2 fused SGD on AVX-512 too (docs/numerics.md 8b): W = 16 is wrong.
// x86: W = 16 (an AVX-512 build) disagrees; aarch64: W = 8 (x86's width) disagrees.
TEST(GoldenSgd, DataRejectsADoubleWidthTail) {
  EXPECT_GT(sgd_mismatches_with_tail_width(2 * kTorchWidth), 0u);
}

// torch's source as written, every product and sum rounded separately (no FMA; this test
// is compiled with -ffp-contract=off): the compiled kernel's contractions must be visible.
void uncontracted_sgd(std::span<const OptimizerTensor> ts, const OptimizerConfig& config) {
  const auto& c = std::get<stepcore::SgdConfig>(config);
  const float wd = static_cast<float>(c.weight_decay), mom = static_cast<float>(c.momentum);
  const float damp = static_cast<float>(1.0 - c.dampening), neg_lr = static_cast<float>(-c.lr);
  for (const auto& t : ts) {
    *t.step = *t.step + 1.0f;
    auto* P = static_cast<float*>(t.param.data);
    auto* B = static_cast<float*>(t.state[0].data);
    const auto* G = static_cast<const float*>(t.grad.data);
    for (std::size_t i = 0; i < t.param.numel; ++i) {
      float g = c.maximize ? -G[i] : G[i];
      if (c.weight_decay != 0.0) g = g + P[i] * wd;
      if (c.momentum != 0.0) {
        B[i] = *t.step == 1.0f ? g : B[i] * mom + g * damp;
        g = c.nesterov ? g + B[i] * mom : B[i];
      }
      P[i] = P[i] + g * neg_lr;
    }
  }
}

TEST(GoldenSgd, DataRejectsTheUncontractedSourceFormula) {
  EXPECT_GT(mismatches(cases_in("sgd_torch.txt"), {.step = uncontracted_sgd}), 0u);
}

// ---------------------------------------------------------------- bf16 / f16 params

TEST(GoldenLowPrecision, FileHasTheExpectedCases) {
  const auto cases = cases_in("lowp_torch.txt");
  ASSERT_GE(cases.size(), 20u);
  std::vector<std::string> seen;
  bool amsgrad = false, maximize = false, nesterov = false, momentum = false, l2 = false;
  std::vector<bool> size_seen(1026, false);
  for (const GoldenCase* k : cases) {
    EXPECT_NE(k->param_dtype, DType::f32) << k->name;
    EXPECT_EQ(k->grad_dtype, k->param_dtype) << k->name;
    seen.push_back(k->optimizer + "/" + std::string(stepcore::dtype_name(k->param_dtype)));
    std::visit(
        [&](const auto& c) {
          using C = std::decay_t<decltype(c)>;
          if constexpr (std::is_same_v<C, stepcore::AdamConfig> ||
                        std::is_same_v<C, stepcore::AdamWConfig>) {
            amsgrad |= c.amsgrad;
            maximize |= c.maximize;
            l2 |= std::is_same_v<C, stepcore::AdamConfig> && c.weight_decay != 0.0;
          } else if constexpr (std::is_same_v<C, stepcore::SgdConfig>) {
            nesterov |= c.nesterov;
            momentum |= c.momentum != 0.0;
          }
        },
        k->config);
    for (std::size_t n : k->sizes)
      if (n < size_seen.size()) size_seen[n] = true;
  }
  for (const char* opt : {"adam", "adamw", "sgd", "adagrad"})
    for (const char* dt : {"bf16", "f16"})
      EXPECT_NE(std::find(seen.begin(), seen.end(), std::string(opt) + "/" + dt), seen.end())
          << opt << " " << dt;
  EXPECT_TRUE(amsgrad && maximize && nesterov && momentum && l2);
  for (std::size_t n : {0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 1023, 1024, 1025})
    EXPECT_TRUE(size_seen[n]) << "size " << n;
}

// torch's reduced-precision tail is the last numel mod 2W elements (Vectorized<T> of a
// 16-bit T holds twice the f32 lanes, 7.3): the f32 width (W elements: tail width W/2 here,
// doubled) and no tail at all must both disagree with the data.
TEST(GoldenLowPrecision, DataRejectsTheF32TailWidthAndNoTail) {
  for (int w : {kTorchWidth / 2, 1}) {
    std::size_t n = 0;
    for (const GoldenCase* k : cases_in("lowp_torch.txt")) {
      OptimizerConfig c = k->config;
      if (set_field(c, "torch_tail_width", w)) n += replay(*k, {.report = false, .config = &c});
    }
    EXPECT_GT(n, 0u) << "tail width " << 2 * w << " elements";
  }
}

// ---------------------------------------------------------------- norm and clip

struct ClipCase {
  std::string name;
  double max_norm = 0.0;
  float max_norm_f32 = 0.0f;
  std::vector<std::size_t> sizes;
  std::vector<std::vector<float>> grad, clipped;
  float norm_torch = 0.0f, norm_exact = 0.0f, coef_torch = 0.0f;
  bool bounded = true;  // "bound": torch's f32 norm is within the summation bound
};

std::vector<std::vector<float>> read_f32s(GoldenFile& f, const std::string& key,
                                          const std::vector<std::size_t>& sizes) {
  std::vector<std::vector<float>> out;
  for (const Array& a : read_arrays(f, key, sizes, DType::f32)) out.push_back(a.f32);
  return out;
}

std::vector<ClipCase> load_clip() {
  GoldenFile f(set_dir() + "/clip_grad_norm.txt");
  std::vector<ClipCase> cases;
  while (!f.done()) {
    const Record& c = f.expect("case");
    if (c.tok.size() != 3 || (c.tok[2] != "bound" && c.tok[2] != "none"))
      f.fail("bad case line " + std::to_string(c.line));
    ClipCase k;
    k.name = c.tok[0];
    const std::size_t K = parse_size(c.tok[1]);
    k.bounded = c.tok[2] == "bound";
    const Record& mn = f.expect("max_norm");
    if (mn.tok.size() != 2) f.fail("bad max_norm line " + std::to_string(mn.line));
    k.max_norm = parse_double(mn.tok[0]);
    k.max_norm_f32 = parse_f32(mn.tok[1]);
    k.sizes = parse_sizes(f.expect("sizes"), K);
    k.grad = read_f32s(f, "grad", k.sizes);
    k.norm_torch = parse_f32(f.expect("norm_torch").tok.at(0));
    k.norm_exact = parse_f32(f.expect("norm_exact").tok.at(0));
    k.coef_torch = parse_f32(f.expect("coef_torch").tok.at(0));
    k.clipped = read_f32s(f, "clipped", k.sizes);
    f.expect("end");
    cases.push_back(std::move(k));
  }
  return cases;
}

const std::vector<ClipCase>& clip_cases() {
  static const std::vector<ClipCase> cases = load_clip();
  return cases;
}

std::vector<ConstTensorView> const_views(const std::vector<std::vector<float>>& ts) {
  std::vector<ConstTensorView> v;
  for (const auto& t : ts) v.emplace_back(t.data(), t.size(), DType::f32);
  return v;
}

// Compares bit patterns; on a difference returns a message naming the first element.
::testing::AssertionResult same_bits(const std::vector<float>& want,
                                     const std::vector<float>& got) {
  if (want.size() != got.size()) return ::testing::AssertionFailure() << "size differs";
  for (std::size_t i = 0; i < want.size(); ++i)
    if (stepcore::f32_bits(want[i]) != stepcore::f32_bits(got[i]))
      return ::testing::AssertionFailure()
             << "first difference at [" << i << "]: torch " << hex32(stepcore::f32_bits(want[i]))
             << " (" << want[i] << "), stepcore " << hex32(stepcore::f32_bits(got[i])) << " ("
             << got[i] << ")";
  return ::testing::AssertionSuccess();
}

TEST(GoldenClip, FileHasTheExpectedCases) {
  const auto& cases = clip_cases();
  ASSERT_GE(cases.size(), 20u);
  bool empty_tensor = false, clipped = false, unclipped = false;
  for (const auto& k : cases) {
    for (std::size_t n : k.sizes) empty_tensor |= n == 0;
    (k.coef_torch < 1.0f ? clipped : unclipped) = true;
    EXPECT_EQ(stepcore::f32_bits(static_cast<float>(k.max_norm)),
              stepcore::f32_bits(k.max_norm_f32))
        << k.name;
  }
  EXPECT_TRUE(empty_tensor && clipped && unclipped);
}

// (a) The reference's exact norm equals the exactly rounded value computed in Python.
TEST(GoldenClip, ExactNormMatchesPythonFractions) {
  for (const auto& k : clip_cases()) {
    const auto r = stepcore::finalize(stepcore::reference::norm_partial(const_views(k.grad)));
    EXPECT_TRUE(r.finite) << k.name;
    EXPECT_EQ(hex32(stepcore::f32_bits(r.norm)), hex32(stepcore::f32_bits(k.norm_exact))) << k.name;
  }
}

TEST(GoldenClip, CpuEngineNormOnEveryIsaMatchesPythonFractions) {
  for (const stepcore::cpu::Isa isa : stepcore::testing_support::isas_under_test()) {
    const stepcore::cpu::Engine engine(stepcore::cpu::EngineConfig{isa, 2});
    for (const auto& k : clip_cases()) {
      const auto r = engine.norm(const_views(k.grad));
      EXPECT_EQ(hex32(stepcore::f32_bits(r.norm)), hex32(stepcore::f32_bits(k.norm_exact)))
          << k.name << " " << engine.isa_name();
    }
  }
}

// (b) torch's f32 norm is within the a-priori bound of f32 summation in any order:
// |torch - exact| <= (N + K + 4) * 2^-24 * exact, N elements in K tensors (README).
// Cases marked "none" are those where torch's f32 squares underflow or overflow.
TEST(GoldenClip, TorchNormWithinSummationBound) {
  int checked = 0;
  for (const auto& k : clip_cases()) {
    if (!k.bounded) continue;
    ++checked;
    std::size_t N = 0;
    for (std::size_t n : k.sizes) N += n;
    const double exact = k.norm_exact, torch = k.norm_torch;
    const double bound = static_cast<double>(N + k.sizes.size() + 4) * std::ldexp(1.0, -24) * exact;
    EXPECT_LE(std::fabs(torch - exact), bound)
        << k.name << ": torch " << torch << ", exact " << exact;
  }
  EXPECT_GE(checked, 20);
}

// (c1) Scaling by torch's coefficient with the reference's scale_ gives torch's bits.
TEST(GoldenClip, ScaleByTorchCoefficientMatchesTorch) {
  for (const auto& k : clip_cases()) {
    auto g = k.grad;
    std::vector<TensorView> views;
    for (auto& t : g) views.push_back({t.data(), t.size(), DType::f32});
    stepcore::reference::scale_(views, k.coef_torch);
    for (std::size_t t = 0; t < g.size(); ++t)
      EXPECT_TRUE(same_bits(k.clipped[t], g[t])) << k.name << " tensor " << t;
  }
}

// (c2) stepcore's clip coefficient from torch's norm equals torch's coefficient.
TEST(GoldenClip, ClipCoefficientMatchesTorch) {
  for (const auto& k : clip_cases()) {
    const float coef = stepcore::clip_coefficient(k.norm_torch, k.max_norm_f32);
    EXPECT_EQ(hex32(stepcore::f32_bits(coef)), hex32(stepcore::f32_bits(k.coef_torch)))
        << k.name << ": norm " << k.norm_torch << ", max_norm " << k.max_norm_f32;
  }
}

// (c) End to end: clip_coefficient(torch's norm) then scale_ reproduces torch's clipped
// gradients (for coef == 1 torch multiplies by 1.0, which leaves every bit unchanged).
TEST(GoldenClip, ClipThenScaleReproducesTorchGradients) {
  for (const auto& k : clip_cases()) {
    const float coef = stepcore::clip_coefficient(k.norm_torch, k.max_norm_f32);
    auto g = k.grad;
    std::vector<TensorView> views;
    for (auto& t : g) views.push_back({t.data(), t.size(), DType::f32});
    stepcore::reference::scale_(views, coef);
    for (std::size_t t = 0; t < g.size(); ++t)
      EXPECT_TRUE(same_bits(k.clipped[t], g[t]))
          << k.name << " tensor " << t << " (coef " << coef << ")";
  }
}

}  // namespace
