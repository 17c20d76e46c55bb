// libFuzzer harness: the planner's text inputs on arbitrary text: the Hugging Face config
// reader (stepcore/plan.hpp) and, on the input's first line, the optimizer names
// (parse_optimizer_choice, stepcore/managers.hpp). Oracle: every input either parses or
// throws stepcore::Error naming the file (never a crash, a hang or another exception); a
// parsed config's parameters have the sizes its fields say (no wrapped products) and plan
// without error on 8 ranks; a name is taken exactly when it is a table name, or a name of
// an entry with q8 followed by "8bit" (then with q8_state), else refused naming "optimizer".
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/plan.hpp"

namespace {

[[noreturn]] void fail(const char* what) {
  __builtin_trap();
  (void)what;
}

// The optimizer-name oracle on `text` (see the file comment).
void check_optimizer_name(std::string_view text) {
  using namespace stepcore;
  const OptimizerInfo* base = nullptr;
  bool q8 = false;
  for (const OptimizerInfo& info : optimizer_table()) {
    const std::string_view n = info.name;
    if (text == n) base = &info;
    if (info.q8 && text.size() == n.size() + 4 && text.substr(0, n.size()) == n &&
        text.substr(n.size()) == "8bit") {
      base = &info;
      q8 = true;
    }
  }
  OptimizerChoice choice;
  try {
    choice = parse_optimizer_choice(text);
  } catch (const Error& e) {
    if (base != nullptr) fail("a name refused");
    if (e.code() != Errc::invalid_argument || e.argument() != "optimizer")
      fail("a name's error names something else than the optimizer");
    return;
  }
  if (base == nullptr) fail("a name taken that is not one");
  if (choice.q8_state != q8 || optimizer_name(choice.optimizer) != base->name)
    fail("a name taken as another optimizer");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace stepcore;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  check_optimizer_name(text.substr(0, text.find('\n')));
  const std::string name = "fuzz.json";
  DecoderConfig c;
  try {
    c = parse_decoder_config(text, name);
  } catch (const Error& e) {
    if (e.argument() != name) fail("an error naming something else than the file");
    return 0;
  }
  // The embedding is vocab x hidden; every parameter's count fits 64 bits.
  if (c.vocab_size == 0 || c.hidden_size == 0 || c.head_dim == 0) fail("a zero size parsed");
  // Planning needs every tensor (a layer count of billions is too many to list).
  if (c.num_hidden_layers > 4096) return 0;
  const std::vector<ModelParam> model = decoder_params(c);
  if (model.empty() || model[0].shape.size() != 2 || model[0].shape[0] != c.vocab_size ||
      model[0].shape[1] != c.hidden_size)
    fail("the embedding's shape");
  for (std::size_t i = 0; i < model.size(); ++i) try {
      (void)model_param_numel(model[i], "model");
    } catch (const Error&) {
      fail("a derived shape overflows");
    }
  return 0;
}
