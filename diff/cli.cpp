// run(): the command line of stepcore-diff and its exit statuses.
#include <charconv>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include "diff/diff.hpp"
#include "diff/inputs.hpp"
#include "diff/report.hpp"
#include "stepcore/diff.hpp"

namespace stepcore::diff {

namespace {

constexpr const char* kUsage = R"(usage: stepcore-diff [options] A B

Compares two recordings (directories with a manifest.json) or two safetensors files
bit for bit and says where they first diverge (docs/diff.md).

options:
  --json          one JSON object on stdout instead of the table
  --all           list identical tensors too (the table; JSON always lists all)
  --max-ulps N    accept an f32/bf16/f16 tensor whose every difference is within N ulps
                  and has no class difference (NaN, signed zero, Inf)
  --threads N     threads to compare with (default: the CPUs of the affinity mask)
  --help          this text

exit status: 0 identical (or all within --max-ulps), 1 different, 2 error
)";

struct Options {
  bool json = false;
  bool all = false;
  std::optional<std::uint64_t> max_ulps;
  int threads = 0;
  std::vector<std::string> paths;
};

std::uint64_t parse_count(std::string_view option, std::string_view text, std::uint64_t lo,
                          std::uint64_t hi) {
  std::uint64_t v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || r.ec != std::errc() || r.ptr != text.data() + text.size() || v < lo || v > hi)
    throw UsageError(std::string(option) + " needs an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "], not '" + std::string(text) + "'");
  return v;
}

// Returns nullopt for --help.
std::optional<Options> parse(int argc, const char* const* argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    std::string_view value;
    bool has_value = false;
    if (a.starts_with("--") && a.find('=') != std::string_view::npos) {
      value = a.substr(a.find('=') + 1);
      a = a.substr(0, a.find('='));
      has_value = true;
    }
    const auto take = [&]() -> std::string_view {
      if (has_value) return value;
      if (i + 1 >= argc) throw UsageError(std::string(a) + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") return std::nullopt;
    if (a == "--json" || a == "--all") {
      if (has_value) throw UsageError(std::string(a) + " takes no value");
      (a == "--json" ? o.json : o.all) = true;
    } else if (a == "--max-ulps") {
      o.max_ulps = parse_count("--max-ulps", take(), 0, UINT64_MAX);
    } else if (a == "--threads") {
      o.threads = static_cast<int>(parse_count("--threads", take(), 1, 4096));
    } else if (a.starts_with("-") && a != "-") {
      throw UsageError("unknown option '" + std::string(a) + "'");
    } else {
      o.paths.emplace_back(a);
    }
  }
  if (o.paths.size() != 2)
    throw UsageError("needs two inputs A and B, got " + std::to_string(o.paths.size()));
  return o;
}

void check_same_kind(const Input& a, const Input& b) {
  if (a.kind != b.kind)
    throw UsageError(
        "A and B must both be recordings or both safetensors files: '" + a.path + "' is a " +
        (a.kind == InputKind::recording ? "recording" : "safetensors file") + ", '" + b.path +
        "' a " + (b.kind == InputKind::recording ? "recording" : "safetensors file"));
}

}  // namespace

std::string compare_json(const std::string& a_path, const std::string& b_path,
                         std::optional<std::uint64_t> max_ulps, int threads, bool all) {
  const Input a = load_input(a_path);
  const Input b = load_input(b_path);
  check_same_kind(a, b);
  DiffOptions d;
  d.max_ulps = max_ulps;
  d.threads = threads > 0 ? threads : default_threads();
  const DiffResult r = diff_inputs(a, b, d);
  std::ostringstream out;
  const bool recording = a.kind == InputKind::recording;
  out << "{\"kind\": \"" << (recording ? "recording" : "file") << "\", \"runs\": ["
      << (recording ? a.run_json : "null") << ", " << (recording ? b.run_json : "null")
      << "], \"result\": ";
  write_json(out, r);
  out << ", \"details\": ";
  write_details_json(out, r);
  std::ostringstream human;
  write_human(human, r, all, max_ulps);
  out << ", \"human\": "
      << nlohmann::json(human.str()).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
      << "}";
  return out.str();
}

int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  try {
    const std::optional<Options> o = parse(argc, argv);
    if (!o) {
      out << kUsage;
      return 0;
    }
    const Input a = load_input(o->paths[0]);
    const Input b = load_input(o->paths[1]);
    check_same_kind(a, b);
    DiffOptions d;
    d.max_ulps = o->max_ulps;
    d.threads = o->threads > 0 ? o->threads : default_threads();
    const DiffResult r = diff_inputs(a, b, d);
    if (o->json)
      write_json(out, r);
    else
      write_human(out, r, o->all, o->max_ulps);
    out.flush();
    return r.exit_status();
  } catch (const UsageError& e) {
    err << "stepcore-diff: " << e.what() << "\n"
        << "usage: stepcore-diff [--json] [--all] [--max-ulps N] [--threads N] A B (--help)\n";
    return 2;
  } catch (const InputError& e) {
    err << "stepcore-diff: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    err << "stepcore-diff: error: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace stepcore::diff
