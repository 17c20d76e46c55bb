// write_human and write_json: every field formatted from the DiffResult, nothing computed.
#include "diff/report.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "stepcore/convert.hpp"

namespace stepcore::diff {

namespace {

using Json = nlohmann::ordered_json;

// The value of float bits (f32/bf16/f16 widened exactly to f32; f64 as is).
double float_value(DType t, std::uint64_t bits) {
  switch (t) {
    case DType::f32:
      return stepcore::f32_from_bits(static_cast<std::uint32_t>(bits));
    case DType::bf16:
      return stepcore::bf16_bits_to_f32(static_cast<std::uint16_t>(bits));
    case DType::f16:
      return stepcore::f16_bits_to_f32(static_cast<std::uint16_t>(bits));
    default: {
      double d;
      std::memcpy(&d, &bits, sizeof d);
      return d;
    }
  }
}

// Integer dtypes: the value, sign-extended for I8..I64.
std::int64_t signed_value(DType t, std::uint64_t bits) {
  switch (t) {
    case DType::i8:
      return static_cast<std::int8_t>(bits);
    case DType::i16:
      return static_cast<std::int16_t>(bits);
    case DType::i32:
      return static_cast<std::int32_t>(bits);
    default:
      return static_cast<std::int64_t>(bits);
  }
}

bool is_signed_int(DType t) {
  return t == DType::i8 || t == DType::i16 || t == DType::i32 || t == DType::i64;
}

Json value_json(DType t, std::uint64_t bits) {
  if (dtype_is_float(t)) {
    const double v = float_value(t, bits);
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    return v;
  }
  if (is_signed_int(t)) return signed_value(t, bits);
  if (t == DType::boolean) return bits != 0;
  return bits;
}

std::string compact_shape(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

// "17" for a 1-D tensor, "17 (1,5)" with the coordinates otherwise.
std::string index_string(std::uint64_t flat, const std::vector<std::int64_t>& shape) {
  std::string s = std::to_string(flat);
  if (shape.size() < 2) return s;
  std::vector<std::uint64_t> at(shape.size());
  std::uint64_t rest = flat;
  for (std::size_t d = shape.size(); d-- > 0;) {
    const auto n = static_cast<std::uint64_t>(shape[d]);
    at[d] = rest % n;
    rest /= n;
  }
  s += " (";
  for (std::size_t d = 0; d < at.size(); ++d) s += (d ? "," : "") + std::to_string(at[d]);
  return s + ")";
}

std::string number(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

std::string percent(std::uint64_t part, std::uint64_t whole) {
  if (whole == 0) return "0%";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g%%",
                100.0 * static_cast<double>(part) / static_cast<double>(whole));
  return buf;
}

std::string classes_string(const ElementStats& s) {
  std::string c;
  const auto add = [&](const char* name, std::uint64_t n) {
    if (n) c += (c.empty() ? "" : " ") + std::string(name) + "=" + std::to_string(n);
  };
  add("nan_vs_number", s.nan_vs_number);
  add("nan_payload", s.nan_payload);
  add("signed_zero", s.signed_zero);
  add("inf", s.inf);
  return c.empty() ? "-" : c;
}

// The table's cells of one tensor, in the header's order.
std::vector<std::string> row(const TensorResult& t, bool recording) {
  std::vector<std::string> cells;
  if (recording) {
    cells.push_back(std::to_string(*t.step));
    cells.push_back(*t.point);
    cells.push_back(std::to_string(*t.rank));
  }
  cells.push_back(t.name);
  cells.push_back(std::string(status_name(t.status)));
  const TensorInfo& info = t.info();
  std::string dtype(dtype_name(info.dtype)), shape = compact_shape(info.shape);
  if (t.status == Status::dtype_mismatch) dtype += "/" + std::string(dtype_name(t.b->dtype));
  if (t.status == Status::dtype_mismatch || t.status == Status::shape_mismatch)
    shape += "/" + compact_shape(t.b->shape);
  cells.push_back(dtype);
  cells.push_back(shape);
  if (!t.stats) {
    for (int i = 0; i < 8; ++i) cells.push_back("-");
    return cells;
  }
  const ElementStats& s = *t.stats;
  const bool ulps = dtype_has_ulps(info.dtype);
  cells.push_back(std::to_string(s.differing));
  cells.push_back(percent(s.differing, s.elements));
  cells.push_back(ulps ? std::to_string(s.max_ulps) : "-");
  cells.push_back(ulps ? number(s.median_ulps) : "-");
  if (s.first_index) {
    cells.push_back(index_string(*s.first_index, info.shape));
    cells.push_back(hex_string(info.dtype, t.a_bits) + " " + value_string(info.dtype, t.a_bits));
    cells.push_back(hex_string(info.dtype, t.b_bits) + " " + value_string(info.dtype, t.b_bits));
  } else {
    for (int i = 0; i < 3; ++i) cells.push_back("-");
  }
  cells.push_back(ulps ? classes_string(s) : "-");
  return cells;
}

void write_table(std::ostream& out, const std::vector<std::vector<std::string>>& rows,
                 std::size_t first_right, std::size_t last_right) {
  std::vector<std::size_t> width(rows[0].size(), 0);
  for (const auto& r : rows)
    for (std::size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], r[c].size());
  for (const auto& r : rows) {
    std::string line;
    for (std::size_t c = 0; c < r.size(); ++c) {
      const std::string pad(width[c] - r[c].size(), ' ');
      const bool right = c >= first_right && c <= last_right;
      if (c > 0) line += "  ";
      line += right ? pad + r[c] : (c + 1 == r.size() ? r[c] : r[c] + pad);
    }
    out << line << '\n';
  }
}

Json opt(const std::optional<std::int64_t>& v) { return v ? Json(*v) : Json(nullptr); }
Json opt(const std::optional<std::string>& v) { return v ? Json(*v) : Json(nullptr); }

}  // namespace

std::string value_string(DType t, std::uint64_t bits) {
  if (dtype_is_float(t)) {
    const double v = float_value(t, bits);
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    char buf[64];
    const auto r = t == DType::f64 ? std::to_chars(buf, buf + sizeof buf, v)
                                   : std::to_chars(buf, buf + sizeof buf, static_cast<float>(v));
    return std::string(buf, r.ptr);
  }
  if (is_signed_int(t)) return std::to_string(signed_value(t, bits));
  return std::to_string(bits);
}

std::string hex_string(DType t, std::uint64_t bits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%0*llx", static_cast<int>(2 * dtype_size(t)),
                static_cast<unsigned long long>(bits));
  return buf;
}

void write_human(std::ostream& out, const DiffResult& r, bool all,
                 std::optional<std::uint64_t> max_ulps) {
  const bool recording = r.kind == InputKind::recording;
  std::vector<std::vector<std::string>> rows;
  rows.push_back({});
  if (recording) rows[0] = {"step", "point", "rank"};
  for (const char* h : {"name", "status", "dtype", "shape", "differing", "fraction", "max_ulps",
                        "median", "first", "a", "b", "classes"})
    rows[0].push_back(h);
  for (const TensorResult& t : r.tensors)
    if (all || t.status != Status::identical) rows.push_back(row(t, recording));
  if (rows.size() > 1) {
    // Right-aligned: the counts (differing, fraction, max_ulps, median).
    const std::size_t base = recording ? 3 : 0;
    write_table(out, rows, base + 4, base + 7);
  }
  const std::uint64_t n = r.tensors.size();
  const auto count = [&](Status s) { return r.counts[static_cast<std::size_t>(s)]; };
  if (!r.first_divergence) {
    // "identical" only when every tensor is bitwise identical.
    if (count(Status::within_tolerance) == 0) {
      out << "identical: " << n << " tensor" << (n == 1 ? "" : "s") << '\n';
    } else {
      out << "within tolerance: " << n << " tensor" << (n == 1 ? "" : "s") << " ("
          << count(Status::identical) << " identical, " << count(Status::within_tolerance)
          << " within " << max_ulps.value_or(0) << " ulps)\n";
    }
    return;
  }
  const TensorResult& f = r.tensors[*r.first_divergence];
  out << "first divergence: ";
  if (recording)
    out << "step " << *f.step << ", point " << *f.point << ", name " << f.name << ", rank "
        << *f.rank << '\n';
  else
    out << "name " << f.name << '\n';
  out << n << " tensor" << (n == 1 ? "" : "s") << ":";
  const char* sep = " ";
  for (std::size_t s = 0; s < kStatusCount; ++s) {
    if (r.counts[s] == 0) continue;
    std::string name(status_name(static_cast<Status>(s)));
    std::replace(name.begin(), name.end(), '_', ' ');
    out << sep << r.counts[s] << ' ' << name;
    sep = ", ";
  }
  out << '\n';
}

void write_json(std::ostream& out, const DiffResult& r) {
  Json j;
  // Bitwise identical: every tensor (a run accepted with --max-ulps has exit status 0 but
  // is not identical).
  j["identical"] = r.counts[static_cast<std::size_t>(Status::identical)] == r.tensors.size();
  j["exit_status"] = r.exit_status();
  if (r.first_divergence) {
    const TensorResult& f = r.tensors[*r.first_divergence];
    j["first_divergence"] = {
        {"step", opt(f.step)}, {"point", opt(f.point)}, {"name", f.name}, {"rank", opt(f.rank)}};
  } else {
    j["first_divergence"] = nullptr;
  }
  Json tensors = Json::array();
  for (const TensorResult& t : r.tensors) {
    const TensorInfo& info = t.info();
    Json e;
    e["step"] = opt(t.step);
    e["rank"] = opt(t.rank);
    e["point"] = opt(t.point);
    e["name"] = t.name;
    e["key"] = t.key;
    e["status"] = status_name(t.status);
    e["dtype"] = dtype_name(info.dtype);
    e["shape"] = info.shape;
    e["elements"] = info.elements;
    const ElementStats* s = t.stats ? &*t.stats : nullptr;
    const bool ulps = s && dtype_has_ulps(info.dtype);
    const bool first = s && s->first_index;
    e["differing"] = s ? Json(s->differing) : Json(nullptr);
    e["fraction"] =
        s ? Json(s->elements ? static_cast<double>(s->differing) / static_cast<double>(s->elements)
                             : 0.0)
          : Json(nullptr);
    e["max_ulps"] = ulps ? Json(s->max_ulps) : Json(nullptr);
    e["median_ulps"] = ulps ? Json(s->median_ulps) : Json(nullptr);
    e["first_index"] = first ? Json(*s->first_index) : Json(nullptr);
    e["a_hex"] = first ? Json(hex_string(info.dtype, t.a_bits)) : Json(nullptr);
    e["b_hex"] = first ? Json(hex_string(info.dtype, t.b_bits)) : Json(nullptr);
    e["a_value"] = first ? value_json(info.dtype, t.a_bits) : Json(nullptr);
    e["b_value"] = first ? value_json(info.dtype, t.b_bits) : Json(nullptr);
    e["nan_vs_number"] = ulps ? Json(s->nan_vs_number) : Json(nullptr);
    e["nan_payload"] = ulps ? Json(s->nan_payload) : Json(nullptr);
    e["signed_zero"] = ulps ? Json(s->signed_zero) : Json(nullptr);
    e["inf"] = ulps ? Json(s->inf) : Json(nullptr);
    tensors.push_back(std::move(e));
  }
  j["tensors"] = std::move(tensors);
  Json summary;
  summary["tensors"] = r.tensors.size();
  for (std::size_t s = 0; s < kStatusCount; ++s)
    summary[std::string(status_name(static_cast<Status>(s)))] = r.counts[s];
  j["summary"] = std::move(summary);
  out << j.dump(-1, ' ', false, Json::error_handler_t::replace) << '\n';
}

void write_details_json(std::ostream& out, const DiffResult& r) {
  Json all = Json::array();
  for (const TensorResult& t : r.tensors) {
    Json e;
    const ElementStats* s = t.stats ? &*t.stats : nullptr;
    if (s && s->differing > 0 && dtype_has_ulps(t.info().dtype)) {
      e["hist"] = s->ulp_log2;
    } else {
      e["hist"] = nullptr;
    }
    const auto side = [](const std::optional<TensorInfo>& i) {
      return i ? Json::array({dtype_name(i->dtype), i->shape}) : Json(nullptr);
    };
    e["a"] = side(t.a);
    e["b"] = side(t.b);
    e["shards"] = t.shards;
    all.push_back(std::move(e));
  }
  out << all.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace stepcore::diff
