// parse_json: nlohmann's parser with a callback that tracks each open object's keys.
#include "diff/json_parse.hpp"

#include <set>
#include <vector>

#include "stepcore/diff.hpp"

namespace stepcore::diff {

namespace {
constexpr int kMaxDepth = 64;
}

nlohmann::json parse_json(std::string_view text, const std::string& path, std::string_view what) {
  std::vector<std::set<std::string>> open_keys;  // one set per object being parsed
  std::string problem;
  const auto watch = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (depth > kMaxDepth && problem.empty())
      problem = std::string(what) + " nests deeper than " + std::to_string(kMaxDepth) + " levels";
    if (event == E::object_start) {
      open_keys.emplace_back();
    } else if (event == E::object_end) {
      if (!open_keys.empty()) open_keys.pop_back();
    } else if (event == E::key && !open_keys.empty()) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!open_keys.back().insert(k).second && problem.empty())
        problem = std::string(what) + " has the key \"" + k + "\" twice in one object";
    }
    return true;
  };
  nlohmann::json out;
  try {
    out = nlohmann::json::parse(text.begin(), text.end(), watch);
  } catch (const nlohmann::json::exception& e) {
    // e.what() is "[json.exception.parse_error.101] parse error at line 1, column 3: ...".
    std::string m = e.what();
    const auto at = m.find("] ");
    if (at != std::string::npos) m = m.substr(at + 2);
    throw InputError(path, std::string(what) + " is not valid JSON (" + m + ")");
  }
  if (!problem.empty()) throw InputError(path, problem);
  return out;
}

std::string json_kind(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::object:
      return "an object";
    case nlohmann::json::value_t::array:
      return "an array";
    case nlohmann::json::value_t::string:
      return "a string";
    case nlohmann::json::value_t::boolean:
      return "a boolean";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
      return "an integer";
    case nlohmann::json::value_t::number_float:
      return "a non-integer number";
    default:
      return "an unexpected JSON value";
  }
}

}  // namespace stepcore::diff
