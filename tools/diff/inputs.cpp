// load_input: recognises a recording or a safetensors file; load_recording checks the
// manifest and every entry against its file.
#include "inputs.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <tuple>

#include "error.hpp"
#include "json_parse.hpp"

namespace stepcore_diff {

namespace {

using nlohmann::json;

constexpr const char* kFormat = "stepcore-recording";
constexpr std::int64_t kVersion = 1;

std::string join_path(const std::string& dir, const std::string& rel) {
  if (dir.empty() || dir.back() == '/') return dir + rel;
  return dir + "/" + rel;
}

// A relative path that stays inside the recording: not empty, not absolute, no ".."
// component.
bool inside(const std::string& rel) {
  if (rel.empty() || rel.front() == '/') return false;
  for (std::size_t at = 0; at <= rel.size();) {  // each '/'-separated component
    const std::size_t slash = std::min(rel.find('/', at), rel.size());
    if (rel.compare(at, slash - at, "..") == 0) return false;
    at = slash + 1;
  }
  return true;
}

// One manifest entry's fields, read with a message naming the entry on any problem.
struct EntryReader {
  const std::string& manifest;
  const json& entry;
  std::string who;

  [[noreturn]] void fail(const std::string& what) const {
    throw InputError(manifest, who + ": " + what);
  }
  const json& field(const char* key) const {
    const auto it = entry.find(key);
    if (it == entry.end()) fail(std::string("no \"") + key + "\"");
    return *it;
  }
  std::string string(const char* key) const {
    const json& v = field(key);
    if (!v.is_string()) fail(std::string("\"") + key + "\" is " + json_kind(v) + ", not a string");
    return v.get<std::string>();
  }
  std::int64_t count(const char* key) const {
    const json& v = field(key);
    if (!v.is_number_unsigned() || v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
      fail(std::string("\"") + key + "\" is " + v.dump() + ", not a non-negative integer");
    return v.get<std::int64_t>();
  }
  std::vector<std::int64_t> shape() const {
    const json& v = field("shape");
    std::vector<std::int64_t> out;
    bool ok = v.is_array();
    for (std::size_t i = 0; ok && i < v.size(); ++i) {
      ok = v[i].is_number_unsigned() &&
           v[i].get<std::uint64_t>() <= static_cast<std::uint64_t>(INT64_MAX);
      if (ok) out.push_back(v[i].get<std::int64_t>());
    }
    if (!ok) fail("\"shape\" is " + v.dump() + ", not an array of non-negative integers");
    return out;
  }
};

std::string describe(std::string_view dtype, const std::vector<std::int64_t>& shape) {
  return "dtype " + std::string(dtype) + ", shape " + shape_string(shape);
}

}  // namespace

std::string item_label(const Item& item) {
  if (!item.step) return "name " + item.name;
  return "step " + std::to_string(*item.step) + ", rank " + std::to_string(*item.rank) +
         ", point " + *item.point + ", name " + item.name;
}

Input load_safetensors(const std::string& path) {
  Input in;
  in.kind = InputKind::safetensors;
  in.path = path;
  in.files.push_back(std::make_unique<SafetensorsFile>(path));
  const SafetensorsFile& f = *in.files.back();
  for (const TensorInfo& t : f.tensors()) {
    Item item;
    item.name = t.name;
    item.key = t.name;
    item.file = &f;
    item.tensor = &t;
    in.items.push_back(std::move(item));
  }
  return in;
}

Input load_recording(const std::string& dir) {
  Input in;
  in.kind = InputKind::recording;
  in.path = dir;
  const std::string manifest = join_path(dir, "manifest.json");
  struct stat st {};
  if (::stat(manifest.c_str(), &st) != 0)
    throw InputError(
        dir, "not a recording: no manifest.json (" + std::string(std::strerror(errno)) + ")");
  json m;
  {
    const MappedFile text(manifest);
    m = parse_json(std::string_view(reinterpret_cast<const char*>(text.data()), text.size()),
                   manifest, "the manifest");
  }
  if (!m.is_object())
    throw InputError(manifest, "the manifest is " + json_kind(m) + ", not a JSON object");
  const auto format = m.find("format");
  if (format == m.end()) throw InputError(manifest, "no \"format\"");
  if (!format->is_string() || format->get<std::string>() != kFormat)
    throw InputError(manifest,
                     "\"format\" is " + format->dump() + ", not \"" + std::string(kFormat) + "\"");
  const auto version = m.find("version");
  if (version == m.end()) throw InputError(manifest, "no \"version\"");
  if (!version->is_number_integer() || version->get<std::int64_t>() != kVersion)
    throw InputError(manifest, "\"version\" is " + version->dump() +
                                   "; this stepcore-diff reads version " +
                                   std::to_string(kVersion));
  const auto run = m.find("run");
  if (run != m.end() && !run->is_object())
    throw InputError(manifest, "\"run\" is " + json_kind(*run) + ", not an object");
  const auto entries = m.find("entries");
  if (entries == m.end()) throw InputError(manifest, "no \"entries\"");
  if (!entries->is_array())
    throw InputError(manifest, "\"entries\" is " + json_kind(*entries) + ", not an array");

  std::map<std::string, const SafetensorsFile*> opened;  // by relative path
  std::map<std::tuple<std::int64_t, std::int64_t, std::string, std::string>, std::size_t> seen;
  for (std::size_t i = 0; i < entries->size(); ++i) {
    const json& e = (*entries)[i];
    EntryReader r{manifest, e, "entries[" + std::to_string(i) + "]"};
    if (!e.is_object()) r.fail("is " + json_kind(e) + ", not an object");
    Item item;
    item.step = r.count("step");
    item.rank = r.count("rank");
    item.point = r.string("point");
    item.name = r.string("name");
    r.who += " (" + item_label(item) + ")";
    const std::string file = r.string("file");
    item.key = r.string("key");
    const std::string dtype = r.string("dtype");
    const auto type = dtype_from_name(dtype);
    if (!type) r.fail("unknown dtype \"" + dtype + "\"");
    const std::vector<std::int64_t> shape = r.shape();
    const auto [dup, fresh] =
        seen.emplace(std::tuple(*item.step, *item.rank, *item.point, item.name), i);
    if (!fresh)
      r.fail("repeats the (step, rank, point, name) of entries[" + std::to_string(dup->second) +
             "]");
    if (!inside(file))
      r.fail("\"file\" \"" + file + "\" is not a relative path inside the recording");
    const std::string full = join_path(dir, file);
    auto it = opened.find(file);
    if (it == opened.end()) {
      if (::stat(full.c_str(), &st) != 0)
        r.fail("its file " + full + " does not exist (" + std::strerror(errno) + ")");
      in.files.push_back(std::make_unique<SafetensorsFile>(full));
      it = opened.emplace(file, in.files.back().get()).first;
    }
    item.file = it->second;
    item.tensor = item.file->find(item.key);
    if (item.tensor == nullptr) r.fail("key '" + item.key + "' is not in " + full);
    if (item.tensor->dtype != *type || item.tensor->shape != shape)
      r.fail("the manifest says " + describe(dtype, shape) + ", but " + full + " has key '" +
             item.key + "' with " + describe(dtype_name(item.tensor->dtype), item.tensor->shape));
    in.items.push_back(std::move(item));
  }
  return in;
}

Input load_input(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw InputError(path, std::string("cannot read: ") + std::strerror(errno));
  if (S_ISDIR(st.st_mode)) return load_recording(path);
  if (S_ISREG(st.st_mode)) return load_safetensors(path);
  throw InputError(path, "neither a recording (a directory) nor a safetensors file");
}

}  // namespace stepcore_diff
