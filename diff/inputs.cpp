// load_input: recognises a recording or a safetensors file; load_recording checks the
// manifest and every entry against its file.
#include "diff/inputs.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <tuple>

#include "diff/json_parse.hpp"
#include "stepcore/diff.hpp"

namespace stepcore::diff {

namespace {

using nlohmann::json;

constexpr const char* kFormat = "stepcore-recording";
constexpr std::int64_t kVersion = 2;  // version 1 (entries inline) is read too

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
  std::vector<std::int64_t> shape(const char* key) const {
    const json& v = field(key);
    std::vector<std::int64_t> out;
    bool ok = v.is_array();
    for (std::size_t i = 0; ok && i < v.size(); ++i) {
      ok = v[i].is_number_unsigned() &&
           v[i].get<std::uint64_t>() <= static_cast<std::uint64_t>(INT64_MAX);
      if (ok) out.push_back(v[i].get<std::int64_t>());
    }
    if (!ok)
      fail(std::string("\"") + key + "\" is " + v.dump() +
           ", not an array of non-negative integers");
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
    item.tensor = &t;
    item.data = f.data(t);
    in.items.push_back(std::move(item));
  }
  return in;
}

std::vector<json> parse_journal(std::string_view text, const std::string& path) {
  std::vector<json> out;
  std::size_t line = 0;
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t nl = text.find('\n', at);
    if (nl == std::string_view::npos) break;  // a torn last line: not yet written
    ++line;
    const std::string what = "line " + std::to_string(line) + " of the journal";
    if (nl == at) throw InputError(path, what + " is empty");
    json e = parse_json(text.substr(at, nl - at), path, what);
    if (!e.is_object())
      throw InputError(path, what + " is " + json_kind(e) + ", not a JSON object");
    out.push_back(std::move(e));
    at = nl + 1;
  }
  return out;
}

namespace {

// The shards of one (step, point, name): where each lies in the whole tensor.
struct ShardGroup {
  std::size_t item;  // the index in Input::items of the first shard (replaced by the whole)
  std::string who;   // the first shard's entry, for messages
  DType dtype;
  std::vector<std::int64_t> global_shape;
  struct Shard {
    std::size_t index;  // in Input::items
    const Item* item;   // set once every entry is read
    std::string who;
    std::vector<std::int64_t> offset;
  };
  std::vector<Shard> shards;
};

std::uint64_t product(const std::vector<std::int64_t>& shape) {
  std::uint64_t n = 1;
  for (std::int64_t d : shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

// Copies every shard of `g` into one buffer; throws InputError(manifest, ...) when an
// element is in no shard, or two shards disagree on an element both cover.
std::unique_ptr<GatheredTensor> gather(const std::string& manifest, const ShardGroup& g) {
  auto out = std::make_unique<GatheredTensor>();
  const std::size_t size = dtype_size(g.dtype);
  const std::uint64_t elements = product(g.global_shape);
  out->info.name = g.shards[0].item->name;
  out->info.dtype = g.dtype;
  out->info.shape = g.global_shape;
  out->info.elements = elements;
  out->info.end = elements * size;
  out->bytes = std::make_unique<std::byte[]>(elements * size);
  std::vector<bool> covered(elements, false);
  const std::size_t dims = g.global_shape.size();
  for (const ShardGroup::Shard& s : g.shards) {
    const std::vector<std::int64_t>& local = s.item->tensor->shape;
    const std::uint64_t n = s.item->tensor->elements;
    if (n == 0) continue;
    // Rows along the last dimension are contiguous in both the shard and the whole.
    const std::uint64_t row = dims == 0 ? 1 : static_cast<std::uint64_t>(local[dims - 1]);
    std::vector<std::int64_t> at(dims, 0);  // the row's coordinates in the shard
    for (std::uint64_t first = 0; first < n; first += row) {
      std::uint64_t g0 = 0;  // the row's first global index
      for (std::size_t d = 0; d < dims; ++d)
        g0 = g0 * static_cast<std::uint64_t>(g.global_shape[d]) +
             static_cast<std::uint64_t>(at[d] + s.offset[d]);
      const std::byte* src = s.item->data + first * size;
      std::byte* dst = out->bytes.get() + g0 * size;
      for (std::uint64_t k = 0; k < row; ++k) {
        if (covered[g0 + k]) {
          if (std::memcmp(dst + k * size, src + k * size, size) != 0)
            throw InputError(manifest, s.who +
                                           ": its shard and an earlier rank's differ at "
                                           "global index " +
                                           std::to_string(g0 + k) + ", which both hold");
        } else {
          std::memcpy(dst + k * size, src + k * size, size);
          covered[g0 + k] = true;
        }
      }
      for (std::size_t d = dims >= 1 ? dims - 1 : 0; d-- > 0;) {  // the next row
        if (++at[d] < local[d]) break;
        at[d] = 0;
      }
    }
  }
  for (std::uint64_t i = 0; i < elements; ++i)
    if (!covered[i])
      throw InputError(manifest, g.who + ": global index " + std::to_string(i) + " of " +
                                     shape_string(g.global_shape) +
                                     " is in none of its ranks' shards");
  return out;
}

}  // namespace

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
    const FileBytes text(manifest);
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
  if (!version->is_number_integer() || version->get<std::int64_t>() < 1 ||
      version->get<std::int64_t>() > kVersion)
    throw InputError(manifest, "\"version\" is " + version->dump() +
                                   "; this stepcore-diff reads versions 1 to " +
                                   std::to_string(kVersion));
  const auto run = m.find("run");
  if (run != m.end() && !run->is_object())
    throw InputError(manifest, "\"run\" is " + json_kind(*run) + ", not an object");
  if (run != m.end()) in.run_json = run->dump(-1, ' ', false, json::error_handler_t::replace);

  // Version 1 lists the entries; version 2 names the journal that does, a line each.
  std::string where = manifest;  // the file that holds the entries
  json listed;
  const json* entries = nullptr;
  if (version->get<std::int64_t>() == 1) {
    const auto e = m.find("entries");
    if (e == m.end()) throw InputError(manifest, "no \"entries\"");
    if (!e->is_array())
      throw InputError(manifest, "\"entries\" is " + json_kind(*e) + ", not an array");
    entries = &*e;
  } else {
    const auto j = m.find("journal");
    if (j == m.end()) throw InputError(manifest, "no \"journal\"");
    if (!j->is_string() || !inside(j->get<std::string>()))
      throw InputError(
          manifest, "\"journal\" is " + j->dump() + ", not a relative path inside the recording");
    where = join_path(dir, j->get<std::string>());
    if (::stat(where.c_str(), &st) != 0)
      throw InputError(manifest,
                       "its journal " + where + " does not exist (" + std::strerror(errno) + ")");
    const FileBytes text(where);
    listed = json(parse_journal(
        std::string_view(reinterpret_cast<const char*>(text.data()), text.size()), where));
    entries = &listed;
  }

  std::map<std::string, const SafetensorsFile*> opened;  // by relative path
  std::map<std::tuple<std::int64_t, std::int64_t, std::string, std::string>, std::size_t> seen;
  std::map<std::tuple<std::int64_t, std::string, std::string>, ShardGroup> groups;
  const bool journal = where != manifest;
  for (std::size_t i = 0; i < entries->size(); ++i) {
    const json& e = (*entries)[i];
    EntryReader r{where, e,
                  journal ? "line " + std::to_string(i + 1) : "entries[" + std::to_string(i) + "]"};
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
    const std::vector<std::int64_t> shape = r.shape("shape");
    const bool placed = e.contains("global_shape") || e.contains("global_offset");
    std::vector<std::int64_t> global_shape, offset;
    if (placed) {
      global_shape = r.shape("global_shape");
      offset = r.shape("global_offset");
      if (global_shape.size() != shape.size() || offset.size() != shape.size())
        r.fail("\"shape\", \"global_shape\" and \"global_offset\" have different lengths");
      std::uint64_t n = 1;
      for (std::size_t d = 0; d < shape.size(); ++d) {
        const auto g = static_cast<std::uint64_t>(global_shape[d]);
        if (static_cast<std::uint64_t>(offset[d]) > g ||
            static_cast<std::uint64_t>(shape[d]) > g - static_cast<std::uint64_t>(offset[d]))
          r.fail("its shard (offset " + shape_string(offset) + ", shape " + shape_string(shape) +
                 ") does not lie inside the global shape " + shape_string(global_shape));
        if (g != 0 && n > (std::uint64_t{1} << 56) / g)
          r.fail("\"global_shape\" " + shape_string(global_shape) + " is too large");
        n *= g;
      }
    }
    const auto [dup, fresh] =
        seen.emplace(std::tuple(*item.step, *item.rank, *item.point, item.name), i);
    if (!fresh)
      r.fail("repeats the (step, rank, point, name) of " +
             (journal ? "line " + std::to_string(dup->second + 1)
                      : "entries[" + std::to_string(dup->second) + "]"));
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
    item.tensor = it->second->find(item.key);
    if (item.tensor == nullptr) r.fail("key '" + item.key + "' is not in " + full);
    if (item.tensor->dtype != *type || item.tensor->shape != shape)
      r.fail("the manifest says " + describe(dtype, shape) + ", but " + full + " has key '" +
             item.key + "' with " + describe(dtype_name(item.tensor->dtype), item.tensor->shape));
    item.data = it->second->data(*item.tensor);
    if (placed) {
      const auto gk = std::tuple(*item.step, *item.point, item.name);
      auto g = groups.find(gk);
      if (g == groups.end()) {
        g = groups.emplace(gk, ShardGroup{in.items.size(), r.who, *type, global_shape, {}}).first;
      } else if (g->second.dtype != *type || g->second.global_shape != global_shape) {
        r.fail("its shard is of " + describe(dtype, global_shape) + ", but " + g->second.who +
               "'s is of " + describe(dtype_name(g->second.dtype), g->second.global_shape));
      }
      g->second.shards.push_back({in.items.size(), nullptr, r.who, offset});
    }
    in.items.push_back(std::move(item));
  }
  if (groups.empty()) return in;

  // Each sharded tensor becomes one item, rank 0, where its first shard was.
  std::vector<bool> drop(in.items.size(), false);
  for (auto& [gk, g] : groups) {
    const auto [step, point, name] = gk;
    const auto rank0 = seen.find(std::tuple(step, std::int64_t{0}, point, name));
    if (rank0 != seen.end() &&
        !(*in.items[rank0->second].rank == 0 &&
          std::any_of(g.shards.begin(), g.shards.end(),
                      [&](const ShardGroup::Shard& s) { return s.index == rank0->second; })))
      throw InputError(where, g.who + ": a sharded tensor, gathered as rank 0, but rank 0 " +
                                  "also recorded it unsharded");
    for (ShardGroup::Shard& s : g.shards) {
      s.item = &in.items[s.index];
      drop[s.index] = true;
    }
    in.gathered.push_back(gather(where, g));
    Item merged = in.items[g.item];
    merged.rank = 0;
    merged.tensor = &in.gathered.back()->info;
    merged.data = in.gathered.back()->bytes.get();
    merged.shards = static_cast<std::uint32_t>(g.shards.size());
    in.items[g.item] = std::move(merged);
    drop[g.item] = false;
  }
  std::vector<Item> kept;
  for (std::size_t i = 0; i < in.items.size(); ++i)
    if (!drop[i]) kept.push_back(std::move(in.items[i]));
  in.items = std::move(kept);
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

}  // namespace stepcore::diff
