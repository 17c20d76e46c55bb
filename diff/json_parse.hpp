// Strict JSON parsing for stepcore-diff's inputs (a safetensors header, a manifest):
// nlohmann-json with duplicate keys and absurd nesting refused, every failure an
// InputError naming the file.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace stepcore::diff {

/// Parses `text`, the JSON text of `what` (e.g. "the header") in the file `path`.
/// Throws InputError(path, ...) when it is not valid JSON, an object has a key twice, or
/// it nests deeper than 64 levels.
nlohmann::json parse_json(std::string_view text, const std::string& path, std::string_view what);

/// Returns the JSON type of `v` in words ("a string", "an array", ...), for messages.
std::string json_kind(const nlohmann::json& v);

}  // namespace stepcore::diff
