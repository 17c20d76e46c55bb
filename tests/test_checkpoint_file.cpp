// The checkpoint file of one rank (managers/checkpoint_file.hpp, docs/checkpoint.md):
// CRC-32C against published values and a bit-at-a-time reference; bit-exact round trips;
// every kind of corruption refused as corrupt_file (structural ones crafted with valid
// checksums by an encoder of the documented layout written here, independently of the
// library's); the compatibility rules; and what save leaves on disk when writes are
// short, the disk is full, fsync fails or the process dies before the rename.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "expect_error.hpp"
#include "host/crc32c.hpp"
#include "host/testing.hpp"
#include "managers/checkpoint_file.hpp"
#include "managers/testing.hpp"
#include "stepcore/error.hpp"

namespace {

namespace ckpt = stepcore::detail::checkpoint;
namespace fs = std::filesystem;
using ckpt::testing::SaveFaultKind;
using ckpt::testing::ScopedSaveFault;
using stepcore::Errc;
using stepcore::Error;
using test_support::expect_error;
using Bytes = std::vector<std::byte>;

// ---- helpers -----------------------------------------------------------------------------

/// A fresh directory for one test, removed with everything in it afterwards.
class TempDir {
 public:
  TempDir() {
    std::string pattern = ::testing::TempDir() + "stepcore-ckpt-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp: " << std::strerror(errno);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }
  /// The names in the directory, sorted.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(path_)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::string path_;
};

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Bytes out(chars.size());
  if (!chars.empty()) std::memcpy(out.data(), chars.data(), chars.size());
  return out;
}

void write_bytes(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::span<const std::byte> span_of(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

float from_bits(std::uint32_t bits) { return std::bit_cast<float>(bits); }

/// Arrays [param][array] and the source save reads them from.
using Arrays = std::vector<std::vector<std::vector<float>>>;

/// (An array of 8-bit codes is held in the first bytes of its floats: `h` gives its size.)
ckpt::ArraySource source_of(const Arrays& arrays, const ckpt::Header* h = nullptr) {
  return [&arrays, h](std::size_t i, std::size_t a) -> std::span<const std::byte> {
    const std::span<const std::byte> b = std::as_bytes(std::span<const float>(arrays.at(i).at(a)));
    return h ? b.first(ckpt::array_shape(*h, h->params[i], static_cast<std::uint32_t>(a)).bytes())
             : b;
  };
}

/// Deterministic arrays for `h`: parameter i, array a, element k from a seeded generator,
/// with special values (signed zero, subnormals, infinities, NaN payloads) at the front.
Arrays make_arrays(const ckpt::Header& h, std::uint32_t seed = 7) {
  static const std::uint32_t kSpecial[] = {
      0x80000000u,  // -0.0
      0x00000001u,  // the smallest subnormal
      0x807FFFFFu,  // the largest negative subnormal
      0x7FC12345u,  // a quiet NaN with a payload
      0xFFA00001u,  // a negative signalling NaN with a payload
      0x7F800000u,  // +inf
      0x00000000u,  // +0.0
  };
  std::mt19937 gen(seed);
  Arrays out(h.params.size());
  for (std::size_t i = 0; i < h.params.size(); ++i) {
    out[i].resize(h.arrays());
    for (std::uint32_t a = 0; a < h.arrays(); ++a) {
      std::vector<float>& v = out[i][a];
      const ckpt::ArrayShape shape = ckpt::array_shape(h, h.params[i], a);
      v.resize((shape.bytes() + 3) / 4);  // codes: random bytes in the first shape.bytes()
      for (std::size_t k = 0; k < v.size(); ++k)
        v[k] = k < std::size(kSpecial) && (i + a) % 2 == 0
                   ? from_bits(kSpecial[k])
                   : from_bits(static_cast<std::uint32_t>(gen()));
    }
  }
  return out;
}

ckpt::GroupRecord group(std::string name, double lr, double wd, double b1, double b2, double eps) {
  return {std::move(name), lr, wd, b1, b2, eps};
}

/// An AdamW header: two groups, `numels.size()` parameters (names w0, w1, ...).
ckpt::Header adamw_header(std::vector<std::uint64_t> numels) {
  ckpt::Header h;
  h.optimizer = "adamw";
  h.hyper = {{"formula", 1.0}, {"amsgrad", 0.0}, {"maximize", 0.0}};
  h.slots = {"exp_avg", "exp_avg_sq"};
  h.saved_mode = 2;
  h.rank = 2;
  h.world_size = 4;
  h.layout_fingerprint = 0xF00DFACECAFEBEEFull;
  h.library_version = "0.7.1-test";
  h.groups = {group("decay", 3e-4, 0.1, 0.9, 0.95, 1e-8),
              group("no_decay", 3e-4, 0.0, 0.9, 0.95, 1e-8)};
  for (std::size_t i = 0; i < numels.size(); ++i)
    h.params.push_back({"w" + std::to_string(i), numels[i], static_cast<std::uint32_t>(i % 2),
                        static_cast<float>(i + 10)});
  return h;
}

ckpt::Header sign_sgd_header(std::vector<std::uint64_t> numels) {
  ckpt::Header h = adamw_header(std::move(numels));
  h.optimizer = "sign_sgd";
  h.hyper.clear();
  h.slots.clear();
  for (auto& g : h.groups) g.beta1 = g.beta2 = g.eps = 0.0;
  for (auto& p : h.params) p.step = 0.0f;
  return h;
}

bool same_bits(double x, double y) {
  return std::bit_cast<std::uint64_t>(x) == std::bit_cast<std::uint64_t>(y);
}

/// Every header field of `got` is `want`'s (doubles and floats by bits).
void expect_same_header(const ckpt::Header& got, const ckpt::Header& want) {
  EXPECT_EQ(got.version, want.version);
  EXPECT_EQ(got.optimizer, want.optimizer);
  ASSERT_EQ(got.hyper.size(), want.hyper.size());
  for (std::size_t k = 0; k < want.hyper.size(); ++k) {
    EXPECT_EQ(got.hyper[k].name, want.hyper[k].name) << k;
    EXPECT_TRUE(same_bits(got.hyper[k].value, want.hyper[k].value)) << k;
  }
  EXPECT_EQ(got.slots, want.slots);
  EXPECT_EQ(got.saved_mode, want.saved_mode);
  EXPECT_EQ(got.rank, want.rank);
  EXPECT_EQ(got.world_size, want.world_size);
  EXPECT_EQ(got.layout_fingerprint, want.layout_fingerprint);
  EXPECT_EQ(got.library_version, want.library_version);
  ASSERT_EQ(got.groups.size(), want.groups.size());
  for (std::size_t g = 0; g < want.groups.size(); ++g) {
    EXPECT_EQ(got.groups[g].name, want.groups[g].name) << g;
    EXPECT_TRUE(same_bits(got.groups[g].lr, want.groups[g].lr)) << g;
    EXPECT_TRUE(same_bits(got.groups[g].weight_decay, want.groups[g].weight_decay)) << g;
    EXPECT_TRUE(same_bits(got.groups[g].beta1, want.groups[g].beta1)) << g;
    EXPECT_TRUE(same_bits(got.groups[g].beta2, want.groups[g].beta2)) << g;
    EXPECT_TRUE(same_bits(got.groups[g].eps, want.groups[g].eps)) << g;
  }
  ASSERT_EQ(got.params.size(), want.params.size());
  for (std::size_t i = 0; i < want.params.size(); ++i) {
    EXPECT_EQ(got.params[i].name, want.params[i].name) << i;
    EXPECT_EQ(got.params[i].numel, want.params[i].numel) << i;
    EXPECT_EQ(got.params[i].group, want.params[i].group) << i;
    EXPECT_EQ(std::bit_cast<std::uint32_t>(got.params[i].step),
              std::bit_cast<std::uint32_t>(want.params[i].step))
        << i;
    EXPECT_EQ(got.params[i].q8, want.params[i].q8) << i;
  }
}

std::uint64_t array_bytes(const ckpt::Header& h, const ckpt::ParamRecord& p, std::uint32_t a);

/// The file at `path` opens and holds `h` and `arrays`, bit for bit.
void expect_loads(const std::string& path, const ckpt::Header& h, const Arrays& arrays) {
  const ckpt::File f = ckpt::File::open(path);
  expect_same_header(f.header(), h);
  for (std::size_t i = 0; i < h.params.size(); ++i)
    for (std::uint32_t a = 0; a < h.arrays(); ++a) {
      // (An 8-bit parameter's codes: the first array_bytes of the floats that hold them.)
      const std::span<const std::byte> got = f.bytes(i, a);
      ASSERT_EQ(got.size(), array_bytes(h, h.params[i], a)) << i << "," << a;
      ASSERT_EQ((got.size() + 3) / 4, arrays[i][a].size()) << i << "," << a;
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(got.data()) % 64, 0u) << i << "," << a;
      EXPECT_EQ(got.empty() ? 0 : std::memcmp(got.data(), arrays[i][a].data(), got.size()), 0)
          << "param " << i << " array " << a;
      if (!h.params[i].q8 || a == 0 || a > h.slots.size())
        EXPECT_EQ(f.array(i, a).size_bytes(), got.size()) << i << "," << a;
    }
}

// ---- an encoder of the documented layout (docs/checkpoint.md), the tests' own ----------

struct Writer {
  Bytes bytes;
  Writer& u32(std::uint32_t v) {
    for (int b = 0; b < 4; ++b) bytes.push_back(std::byte(static_cast<std::uint8_t>(v >> (8 * b))));
    return *this;
  }
  Writer& u64(std::uint64_t v) {
    for (int b = 0; b < 8; ++b) bytes.push_back(std::byte(static_cast<std::uint8_t>(v >> (8 * b))));
    return *this;
  }
  Writer& f64(double v) { return u64(std::bit_cast<std::uint64_t>(v)); }
  Writer& str(const std::string& s) {
    u32(static_cast<std::uint32_t>(s.size()));
    for (char c : s) bytes.push_back(std::byte(static_cast<unsigned char>(c)));
    return *this;
  }
};

/// The header fields before the groups (version 2).
void encode_top(Writer& w, const ckpt::Header& h) {
  w.u32(h.saved_mode);
  w.u32(static_cast<std::uint32_t>(h.rank)).u32(static_cast<std::uint32_t>(h.world_size));
  w.u64(h.layout_fingerprint).str(h.library_version);
  w.str(h.optimizer).u32(static_cast<std::uint32_t>(h.hyper.size()));
  for (const auto& r : h.hyper) w.str(r.name).f64(r.value);
  w.u32(static_cast<std::uint32_t>(h.slots.size()));
  for (const auto& slot : h.slots) w.str(slot);
}

void encode_groups(Writer& w, const ckpt::Header& h) {
  w.u32(static_cast<std::uint32_t>(h.groups.size()));
  for (const auto& g : h.groups)
    w.str(g.name).f64(g.lr).f64(g.weight_decay).f64(g.beta1).f64(g.beta2).f64(g.eps);
}

/// The arrays per parameter of docs/checkpoint.md: the master and the Z slots, and in
/// version 3 the slots' block maxima too.
std::uint32_t arrays_of(const ckpt::Header& h) {
  const auto z = static_cast<std::uint32_t>(h.slots.size());
  return 1 + (h.version >= 3 ? 2 * z : z);
}

/// The bytes of array a of parameter p (docs/checkpoint.md): the master numel f32; a slot
/// numel f32, or numel code bytes for an 8-bit parameter; a slot's block maxima
/// ceil(numel / 256) f32 for an 8-bit parameter, else none.
std::uint64_t array_bytes(const ckpt::Header& h, const ckpt::ParamRecord& p, std::uint32_t a) {
  const std::uint64_t z = h.slots.size();
  if (a == 0) return p.numel * 4;
  if (a <= z) return p.q8 ? p.numel : p.numel * 4;
  return p.q8 ? (p.numel + 255) / 256 * 4 : 0;
}

/// The binary header of `h` with the array offsets `offsets` ([i * arrays + a]).
Bytes encode_header(const ckpt::Header& h, const std::vector<std::uint64_t>& offsets) {
  Writer w;
  encode_top(w, h);
  encode_groups(w, h);
  w.u32(static_cast<std::uint32_t>(h.params.size()));
  const std::uint32_t arrays = arrays_of(h);
  for (std::size_t i = 0; i < h.params.size(); ++i) {
    const auto& p = h.params[i];
    w.str(p.name).u64(p.numel).u32(p.group).u32(std::bit_cast<std::uint32_t>(p.step));
    if (h.version >= 3) w.u32(p.q8 ? 1 : 0);
    for (std::uint32_t a = 0; a < arrays; ++a) w.u64(offsets.at(i * arrays + a));
  }
  return w.bytes;
}

/// The offsets save uses: each array at the next multiple of 64, in order; and the end.
std::vector<std::uint64_t> packed_offsets(const ckpt::Header& h, std::uint64_t* payload_length) {
  std::vector<std::uint64_t> offsets;
  std::uint64_t cursor = 0;
  for (const auto& p : h.params)
    for (std::uint32_t a = 0; a < arrays_of(h); ++a) {
      cursor = (cursor + 63) / 64 * 64;
      offsets.push_back(cursor);
      cursor += array_bytes(h, p, a);
    }
  *payload_length = cursor;
  return offsets;
}

/// A whole file: preamble (with the checksums of `header` and `payload` unless given),
/// header, zero padding to a multiple of 64, payload.
struct FileParts {
  Bytes header, payload;
  std::uint32_t version = 3;
  std::uint32_t reserved = 0;
};

Bytes assemble(const FileParts& parts) {
  Writer w;
  for (char c : std::string("STEPCKPT"))
    w.bytes.push_back(std::byte(static_cast<unsigned char>(c)));
  w.u32(parts.version).u32(parts.reserved).u64(parts.header.size()).u64(parts.payload.size());
  w.u32(stepcore::detail::crc32c(parts.header)).u32(stepcore::detail::crc32c(parts.payload));
  w.bytes.insert(w.bytes.end(), parts.header.begin(), parts.header.end());
  while (w.bytes.size() % 64 != 0) w.bytes.push_back(std::byte{0});
  w.bytes.insert(w.bytes.end(), parts.payload.begin(), parts.payload.end());
  return w.bytes;
}

/// The file save writes for `h` and `arrays`, built by the tests' encoder.
Bytes encode_file(const ckpt::Header& h, const Arrays& arrays) {
  std::uint64_t length = 0;
  const std::vector<std::uint64_t> offsets = packed_offsets(h, &length);
  FileParts parts;
  parts.version = h.version;
  parts.header = encode_header(h, offsets);
  parts.payload.assign(length, std::byte{0});
  const std::uint32_t n = arrays_of(h);
  for (std::size_t i = 0; i < h.params.size(); ++i)
    for (std::uint32_t a = 0; a < n; ++a)
      if (!arrays[i][a].empty())  // (codes: the first bytes of the floats)
        std::memcpy(parts.payload.data() + offsets[i * n + a], arrays[i][a].data(),
                    array_bytes(h, h.params[i], a));
  return assemble(parts);
}

/// Rewrites the u64 at file offset `at`.
void poke_u64(Bytes& b, std::size_t at, std::uint64_t v) {
  for (int k = 0; k < 8; ++k) b.at(at + k) = std::byte(static_cast<std::uint8_t>(v >> (8 * k)));
}
void poke_u32(Bytes& b, std::size_t at, std::uint32_t v) {
  for (int k = 0; k < 4; ++k) b.at(at + k) = std::byte(static_cast<std::uint8_t>(v >> (8 * k)));
}

/// parse(bytes) and File::open of the same bytes on disk both refuse them as corrupt_file
/// naming "path", with a message that names the file and contains `what`.
void expect_corrupt(const TempDir& dir, const Bytes& bytes, const std::string& what) {
  const std::string path = dir.file("bad.stepcore");
  write_bytes(path, bytes);
  for (int via_open = 0; via_open < 2; ++via_open) {
    try {
      if (via_open)
        (void)ckpt::File::open(path);
      else
        (void)ckpt::parse(bytes, path);
      ADD_FAILURE() << "accepted; expected corrupt_file with '" << what << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::corrupt_file) << e.what();
      EXPECT_EQ(e.argument(), "path") << e.what();
      const std::string message = e.what();
      EXPECT_NE(message.find(path + ": "), std::string::npos) << message;
      EXPECT_NE(message.find(what), std::string::npos) << "'" << what << "' not in: " << message;
    }
  }
}

// ---- CRC-32C -------------------------------------------------------------------------------

/// The CRC-32C one bit at a time, straight from the definition.
std::uint32_t crc32c_bitwise(std::span<const std::byte> bytes, std::uint32_t prev = 0) {
  std::uint32_t crc = ~prev;
  for (std::byte b : bytes) {
    crc ^= std::to_integer<std::uint32_t>(b);
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

using CrcFunction = std::uint32_t (*)(std::span<const std::byte>, std::uint32_t) noexcept;

struct NamedCrc {
  const char* name;
  CrcFunction f;
};

std::vector<NamedCrc> crc_paths() {
  std::vector<NamedCrc> paths = {{"dispatch", stepcore::detail::crc32c},
                                 {"portable", stepcore::detail::crc32c_portable}};
  if (stepcore::detail::crc32c_sse42_supported())
    paths.push_back({"sse42", stepcore::detail::crc32c_sse42});
  return paths;
}

TEST(Crc32c, CheckValueAndPublishedVectors) {
  EXPECT_EQ(crc32c_bitwise(span_of("123456789")), 0xE3069283u);
  Bytes zeros(32, std::byte{0}), ones(32, std::byte{0xFF}), up(32), down(32);
  for (int k = 0; k < 32; ++k) {
    up[k] = std::byte(static_cast<std::uint8_t>(k));
    down[k] = std::byte(static_cast<std::uint8_t>(31 - k));
  }
  for (const NamedCrc& c : crc_paths()) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(c.f(span_of("123456789"), 0), 0xE3069283u);
    EXPECT_EQ(c.f({}, 0), 0u);
    EXPECT_EQ(c.f({}, 0x12345678u), 0x12345678u);
    // RFC 3720 (iSCSI), appendix B.4.
    EXPECT_EQ(c.f(zeros, 0), 0x8A9136AAu);
    EXPECT_EQ(c.f(ones, 0), 0x62A8AB43u);
    EXPECT_EQ(c.f(up, 0), 0x46DD794Eu);
    EXPECT_EQ(c.f(down, 0), 0x113FDB5Cu);
  }
}

TEST(Crc32c, PathsAgreeOnRandomBuffersAtEveryAlignment) {
  if (!stepcore::detail::crc32c_sse42_supported())
    std::printf("note: no SSE4.2 here; the portable path and the dispatch are compared\n");
  std::mt19937 gen(42);
  Bytes storage(1025 + 8);
  for (auto& b : storage) b = std::byte(static_cast<std::uint8_t>(gen()));
  for (std::size_t size = 0; size <= 1025; ++size)
    for (std::size_t start = 0; start < 8; ++start) {
      const std::span<const std::byte> buf(storage.data() + start, size);
      const std::uint32_t want = crc32c_bitwise(buf);
      for (const NamedCrc& c : crc_paths())
        ASSERT_EQ(c.f(buf, 0), want) << c.name << " size " << size << " start " << start;
    }
}

TEST(Crc32c, IncrementalEqualsWhole) {
  std::mt19937 gen(3);
  Bytes buf(300);
  for (auto& b : buf) b = std::byte(static_cast<std::uint8_t>(gen()));
  const std::uint32_t whole = crc32c_bitwise(buf);
  for (const NamedCrc& c : crc_paths())
    for (std::size_t cut = 0; cut <= buf.size(); ++cut) {
      const std::span<const std::byte> all(buf);
      ASSERT_EQ(c.f(all.subspan(cut), c.f(all.first(cut), 0)), whole) << c.name << " cut " << cut;
    }
}

TEST(Crc32c, LongBuffersThroughTheInterleavedLoopAgreeWithTheDefinition) {
  // The SSE4.2 path folds 3 x 8192-byte lanes side by side: sizes around one and two
  // blocks, at every 8-byte misalignment, and a long one with a continued register.
  std::mt19937 gen(7);
  Bytes storage((1u << 18) + 64);
  for (auto& b : storage) b = std::byte(static_cast<std::uint8_t>(gen()));
  const std::size_t block = 3 * 8192;
  for (std::size_t size : {block - 1, block, block + 1, block + 8, 2 * block - 3, 2 * block + 17,
                           std::size_t{100000}, std::size_t{1} << 18})
    for (std::size_t start = 0; start < 8; start += (size > block + 8 ? 3 : 1)) {
      const std::span<const std::byte> buf(storage.data() + start, size);
      const std::uint32_t prev = static_cast<std::uint32_t>(gen());
      const std::uint32_t want = crc32c_bitwise(buf, prev);
      for (const NamedCrc& c : crc_paths())
        ASSERT_EQ(c.f(buf, prev), want) << c.name << " size " << size << " start " << start;
    }
}

TEST(Crc32c, ShiftIsFoldingZeroBytes) {
  std::mt19937 gen(11);
  for (std::size_t n : {0, 1, 7, 8, 63, 1000, 8192, 16384, 70001}) {
    const std::uint32_t prev = static_cast<std::uint32_t>(gen());
    const Bytes zeros(n, std::byte{0});
    // The register is the inverted CRC; folding n zero bytes from it is the shift.
    EXPECT_EQ(~stepcore::detail::crc32c_shift(~prev, n), crc32c_bitwise(zeros, prev)) << n;
  }
}

TEST(Crc32c, CombinedPiecesEqualTheWhole) {
  std::mt19937 gen(5);
  Bytes buf(50000);
  for (auto& b : buf) b = std::byte(static_cast<std::uint8_t>(gen()));
  const std::span<const std::byte> all(buf);
  const std::uint32_t whole = crc32c_bitwise(all);
  for (std::size_t cut : {0, 1, 8, 4096, 24576, 30001, 50000}) {
    const std::uint32_t a = crc32c_bitwise(all.first(cut)), b = crc32c_bitwise(all.subspan(cut));
    EXPECT_EQ(stepcore::detail::crc32c_combine(a, b, buf.size() - cut), whole) << cut;
  }
}

// ---- round trips -----------------------------------------------------------------------------

TEST(CheckpointRoundTrip, AdamWAllFieldsBitExact) {
  TempDir dir;
  ckpt::Header h = adamw_header({1, 0, 17, 64, 1000});
  h.params[0].name = "encoder.layers.0.attn.q_proj.weight";
  h.params[2].name = "Gewicht_äöü_重量_🙂";  // UTF-8, bytes as given
  h.groups[0].name = "gruppe-ß";
  h.groups[1].lr = -0.0;
  h.params[3].step = from_bits(0x7FC00001u);
  h.params[4].step = 16777216.0f;
  const Arrays arrays = make_arrays(h);
  const std::string path = dir.file("rank-00002.stepcore");
  ckpt::save(path, h, source_of(arrays));
  expect_loads(path, h, arrays);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"rank-00002.stepcore"});
}

// A file of several 4 MiB pieces (arrays straddling the pieces' bounds) is read by several
// threads: the same bits, the CRC of the combined pieces, and the value scan's verdict per
// array — exactly the arrays spoiled, wherever in the file — and a flipped byte in a middle
// piece refused.
TEST(CheckpointRoundTrip, AFileOfManyPiecesReadOnSeveralThreads) {
  TempDir dir;
  const ckpt::Header h = adamw_header({1000003, 5, 1100001, 0, 333});  // ~25 MB
  const std::string path = dir.file("many.stepcore");
  const Arrays special = make_arrays(h);
  ckpt::save(path, h, source_of(special));
  expect_loads(path, h, special);

  // Finite values, exp_avg_sq >= 0 (including -0): every array clean.
  Arrays clean(h.params.size());
  std::mt19937 gen(9);
  for (std::size_t i = 0; i < h.params.size(); ++i)
    for (std::uint32_t a = 0; a < h.arrays(); ++a) {  // (arrays 3, 4: no block maxima)
      std::vector<float> v(a < 3 ? h.params[i].numel : 0);
      for (float& x : v) x = static_cast<float>(static_cast<std::int32_t>(gen())) * 1e-9f;
      if (a == 2)
        for (float& x : v) x = std::fabs(x);
      if (a == 2 && !v.empty()) v[0] = -0.0f;
      clean[i].push_back(std::move(v));
    }
  struct Spoil {
    std::size_t i, a, k;
    std::uint32_t bits;
  };
  const std::vector<std::vector<Spoil>> cases = {
      {},
      {{2, 2, 1100000, 0xBF800000u}},                              // the file's last value
      {{0, 1, 700000, 0x7F800000u}, {2, 0, 123456, 0x7FC00000u}},  // two, in later pieces
      {{0, 2, 0, 0x80000001u}, {4, 2, 332, 0xFF800000u}},          // -denormal, -inf
  };
  for (std::size_t c = 0; c < cases.size(); ++c) {
    SCOPED_TRACE("case " + std::to_string(c));
    Arrays arrays = clean;
    for (const Spoil& sp : cases[c]) arrays[sp.i][sp.a][sp.k] = from_bits(sp.bits);
    ckpt::save(path, h, source_of(arrays));
    expect_loads(path, h, arrays);
    const ckpt::File f = ckpt::File::open(path, /*scan_values=*/true);
    const ckpt::File unscanned = ckpt::File::open(path);
    for (std::size_t i = 0; i < h.params.size(); ++i)
      for (std::size_t a = 0; a < 3; ++a) {
        bool spoiled = false;
        for (const Spoil& sp : cases[c]) spoiled = spoiled || (sp.i == i && sp.a == a);
        EXPECT_EQ(f.values_clean(i, a), !spoiled) << "param " << i << " array " << a;
        EXPECT_FALSE(unscanned.values_clean(i, a)) << "no scan, no verdict";
      }
  }
  Bytes bytes = read_bytes(path);
  bytes[bytes.size() / 2] ^= std::byte{0x40};
  expect_corrupt(dir, bytes, "payload checksum mismatch");
}

// Another process truncating the file around a load, 1,000 times at random offsets and
// moments: before the open, between two reads of it (ScopedReadHook), after the open
// while every value is read, and from another thread at a random moment. The loader never
// maps the file (a mapped page cut away raises SIGBUS and kills the process: the third
// kind always did), so each load either gives the whole file's values or its typed error.
TEST(Checkpoint, ALoadRacingATruncationIsAnErrorNeverASignal) {
  TempDir dir;
  const ckpt::Header h = adamw_header({100000, 30000, 7, 64, 1000});  // ~1.6 MB
  const Arrays arrays = make_arrays(h);
  const std::string master = dir.file("master.stepcore");
  ckpt::save(master, h, source_of(arrays));
  const Bytes bytes = read_bytes(master);
  const std::string path = dir.file("racing.stepcore");
  auto write_copy = [&] {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
  };
  auto cut_to = [&](off_t cut) {
    ASSERT_EQ(::truncate(path.c_str(), cut), 0) << std::strerror(errno);
  };
  // A load that succeeded holds the saved values, whatever happens to the file after.
  auto expect_whole = [&](const ckpt::File& f, int run) {
    for (std::size_t i = 0; i < f.header().params.size(); ++i)
      for (std::size_t a = 0; a < f.header().arrays(); ++a) {
        const std::span<const float> got = f.array(i, a);
        ASSERT_EQ(got.size(), arrays[i][a].size());
        ASSERT_EQ(got.empty() ? 0 : std::memcmp(got.data(), arrays[i][a].data(), 4 * got.size()), 0)
            << "run " << run << ", parameter " << i << ", array " << a;
      }
  };
  write_copy();
  const auto t0 = std::chrono::steady_clock::now();
  expect_whole(ckpt::File::open(path), -1);
  const std::int64_t load_ns = std::max<std::int64_t>(
      1000,
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count());
  std::mt19937_64 rng(27);
  int loaded = 0, io_errors = 0, corrupt = 0;
  for (int run = 0; run < 1000; ++run) {
    write_copy();
    const auto cut = static_cast<off_t>(rng() % bytes.size());
    const int kind = run % 4;
    std::atomic<bool> go{false};
    std::thread racer;
    try {
      if (kind == 0) {  // before the open
        cut_to(cut);
        (void)ckpt::File::open(path);
        ADD_FAILURE() << "run " << run << ": a file cut to " << cut << " bytes loaded";
      } else if (kind == 1) {  // between two reads
        const std::size_t chunk = 4096 + rng() % 65536;
        const std::size_t at = rng() % bytes.size();
        bool done = false;
        const stepcore::detail::testing::ScopedReadHook hook(chunk, [&](std::uint64_t offset) {
          if (!done && offset + chunk > at) {
            cut_to(cut);
            done = true;
          }
        });
        (void)ckpt::File::open(path);
        ADD_FAILURE() << "run " << run << ": a file cut while read loaded";
      } else if (kind == 2) {  // after the open, while every value is read
        const ckpt::File f = ckpt::File::open(path);
        cut_to(cut);
        expect_whole(f, run);
        ++loaded;
      } else {  // from another thread, at a random moment of the load
        const auto delay =
            std::chrono::nanoseconds(static_cast<std::int64_t>(rng() % (2 * load_ns)));
        racer = std::thread([&, delay] {  // delay by value: it leaves scope before the join
          while (!go.load(std::memory_order_acquire)) {
          }
          const auto until = std::chrono::steady_clock::now() + delay;
          while (std::chrono::steady_clock::now() < until) {
          }
          cut_to(cut);
        });
        go.store(true, std::memory_order_release);
        expect_whole(ckpt::File::open(path), run);
        ++loaded;
      }
    } catch (const Error& e) {
      EXPECT_NE(kind, 2) << e.what();
      EXPECT_TRUE(e.code() == Errc::io_error || e.code() == Errc::corrupt_file) << e.what();
      if (kind == 1) EXPECT_EQ(e.code(), Errc::io_error) << e.what();
      EXPECT_EQ(e.argument(), "path") << e.what();
      ++(e.code() == Errc::io_error ? io_errors : corrupt);
    }
    if (racer.joinable()) racer.join();
    if (HasFailure()) return;
  }
  std::printf(
      "[ checkpoint ] 1,000 loads around a truncation: %d loaded whole, %d io_error, %d "
      "corrupt_file\n",
      loaded, io_errors, corrupt);
  EXPECT_GE(io_errors, 250) << "every truncation between two reads is an io_error";
}

TEST(CheckpointRoundTrip, SignSgdOneArray) {
  TempDir dir;
  const ckpt::Header h = sign_sgd_header({5, 130, 0});
  const Arrays arrays = make_arrays(h, 11);
  const std::string path = dir.file("s.stepcore");
  ckpt::save(path, h, source_of(arrays));
  expect_loads(path, h, arrays);
  const ckpt::File f = ckpt::File::open(path);
  expect_error([&] { (void)f.array(0, 1); }, Errc::out_of_range, "a");
  expect_error([&] { (void)f.array(3, 0); }, Errc::out_of_range, "i");
}

TEST(CheckpointRoundTrip, ZeroAndOneParameters) {
  TempDir dir;
  for (std::uint32_t arrays : {1u, 3u}) {
    ckpt::Header none = arrays == 3 ? adamw_header({}) : sign_sgd_header({});
    ckpt::save(dir.file("none"), none, source_of({}));
    expect_loads(dir.file("none"), none, {});
    none.groups.clear();
    ckpt::save(dir.file("bare"), none, source_of({}));
    expect_loads(dir.file("bare"), none, {});

    const ckpt::Header one = arrays == 3 ? adamw_header({3}) : sign_sgd_header({3});
    const Arrays a = make_arrays(one);
    ckpt::save(dir.file("one"), one, source_of(a));
    expect_loads(dir.file("one"), one, a);

    const ckpt::Header empty = arrays == 3 ? adamw_header({0}) : sign_sgd_header({0});
    ckpt::save(dir.file("empty"), empty, source_of(make_arrays(empty)));
    expect_loads(dir.file("empty"), empty, make_arrays(empty));
  }
}

TEST(CheckpointRoundTrip, SaveReplacesTheFileAtPath) {
  TempDir dir;
  const std::string path = dir.file("c");
  const ckpt::Header first = adamw_header({10, 20});
  ckpt::save(path, first, source_of(make_arrays(first, 1)));
  const ckpt::Header second = sign_sgd_header({7});
  const Arrays arrays = make_arrays(second, 2);
  ckpt::save(path, second, source_of(arrays));
  expect_loads(path, second, arrays);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"c"});
}

TEST(CheckpointRoundTrip, BytesAreTheDocumentedLayout) {
  // The tests' own encoder of docs/checkpoint.md gives save's bytes exactly, and parse
  // of those bytes agrees with File::open.
  TempDir dir;
  for (const ckpt::Header& h :
       {adamw_header({3, 0, 33}), sign_sgd_header({1, 16, 17}), adamw_header({})}) {
    const Arrays arrays = make_arrays(h);
    ckpt::save(dir.file("f"), h, source_of(arrays));
    const Bytes saved = read_bytes(dir.file("f"));
    EXPECT_EQ(saved, encode_file(h, arrays));
    const ckpt::ParsedFile parsed = ckpt::parse(saved, "f");
    expect_same_header(parsed.header, h);
    EXPECT_EQ(parsed.payload_start % 64, 0u);
    std::uint64_t length = 0;
    EXPECT_EQ(parsed.array_offsets, packed_offsets(h, &length));
  }
}

// ---- format version 3: 8-bit state ----------------------------------------------------------

/// An AdamW header whose parameters `q8` (by index) keep 8-bit slots.
ckpt::Header q8_header(std::vector<std::uint64_t> numels, std::vector<bool> q8) {
  ckpt::Header h = adamw_header(std::move(numels));
  for (std::size_t i = 0; i < h.params.size(); ++i) h.params[i].q8 = q8[i];
  return h;
}

TEST(CheckpointV3, EightBitArraysRoundTripInTheDocumentedLayout) {
  // Codes (one byte per element, any byte) and block maxima (one f32 per block of 256, the
  // last block shorter) beside f32 parameters, empty ones and an 8-bit parameter of 0.
  TempDir dir;
  for (const ckpt::Header& h :
       {q8_header({600, 5, 0, 257, 256, 1}, {true, false, true, true, true, true}),
        q8_header({3}, {false})}) {
    ASSERT_EQ(h.arrays(), 5u);
    const Arrays arrays = make_arrays(h, 3);
    ckpt::save(dir.file("f"), h, source_of(arrays, &h));
    const Bytes saved = read_bytes(dir.file("f"));
    EXPECT_EQ(saved, encode_file(h, arrays));  // the tests' encoder of docs/checkpoint.md
    expect_loads(dir.file("f"), h, arrays);
    const ckpt::ParsedFile parsed = ckpt::parse(saved, "f");
    expect_same_header(parsed.header, h);
    std::uint64_t length = 0;
    EXPECT_EQ(parsed.array_offsets, packed_offsets(h, &length));
  }
  // The codes are bytes: File::array refuses them by name; the maxima are f32.
  const ckpt::Header h = q8_header({601}, {true});
  const Arrays arrays = make_arrays(h);
  ckpt::save(dir.file("g"), h, source_of(arrays, &h));
  const ckpt::File f = ckpt::File::open(dir.file("g"));
  expect_error([&] { (void)f.array(0, 1); }, Errc::invalid_argument, "a");
  EXPECT_EQ(f.bytes(0, 1).size(), 601u);
  EXPECT_EQ(f.array(0, 3).size(), 3u);
  EXPECT_EQ(f.array(0, 4).size(), 3u);
  // A source that gives a code array 604 bytes (its floats) for 601 is refused naming it.
  expect_error([&] { ckpt::save(dir.file("h"), h, source_of(arrays)); }, Errc::invalid_argument,
               "source");
}

TEST(CheckpointV3, MaximaAreScannedAndCodesAreNot) {
  TempDir dir;
  const ckpt::Header h = q8_header({700, 9}, {true, false});
  Arrays arrays(2);
  for (std::size_t i = 0; i < 2; ++i)
    for (std::uint32_t a = 0; a < h.arrays(); ++a)
      arrays[i].emplace_back((array_bytes(h, h.params[i], a) + 3) / 4, 0.5f);
  // Codes of every byte value, among them the patterns of NaN and of negative floats.
  std::memset(arrays[0][1].data(), 0xFF, 700);
  arrays[0][4][2] = -1.0f;  // exp_avg_sq's maxima: block 2 negative
  ckpt::save(dir.file("f"), h, source_of(arrays, &h));
  const ckpt::File f = ckpt::File::open(dir.file("f"), /*scan_values=*/true);
  for (std::uint32_t a = 0; a < h.arrays(); ++a) EXPECT_EQ(f.values_clean(0, a), a != 4) << a;
  arrays[0][4][2] = 0.5f;
  arrays[0][3][0] = -0.0f;  // -0 is not below -0
  ckpt::save(dir.file("f"), h, source_of(arrays, &h));
  EXPECT_TRUE(ckpt::File::open(dir.file("f"), true).values_clean(0, 3));
}

TEST(CheckpointV3, ABadStateFieldIsCorrupt) {
  TempDir dir;
  ckpt::Header h = q8_header({300, 4}, {true, false});
  const Arrays arrays = make_arrays(h);
  std::uint64_t length = 0;
  const std::vector<std::uint64_t> offsets = packed_offsets(h, &length);
  const Bytes good = encode_file(h, arrays);
  // The state field of params[1] is the u32 before its offsets, after its step.
  const Bytes header = encode_header(h, offsets);
  const std::size_t state_at = header.size() - 5 * 8 - 4;
  auto with_state = [&](std::uint32_t v) {
    Bytes hb = header;
    for (int k = 0; k < 4; ++k)
      hb[state_at + k] = std::byte(static_cast<std::uint8_t>(v >> (8 * k)));
    FileParts parts;
    parts.header = hb;
    parts.payload.assign(
        good.begin() + static_cast<std::ptrdiff_t>((40 + header.size() + 63) / 64 * 64),
        good.end());
    return assemble(parts);
  };
  expect_corrupt(dir, with_state(2), "params[1].state is 2: 0 (f32 slots) or 1 (8-bit slots)");
  // As 8-bit, params[1]'s maxima arrays (16 bytes each) would need bytes the payload
  // does not place: refused as overlapping or running past it, never read.
  expect_corrupt(dir, with_state(1), "");
  // An optimizer without slots cannot have 8-bit ones.
  ckpt::Header none = sign_sgd_header({4});
  none.params[0].q8 = true;
  expect_error([&] { ckpt::save(dir.file("n"), none, source_of(make_arrays(none))); },
               Errc::invalid_argument, "header.params[0].q8");
}

// ---- corrupt files ---------------------------------------------------------------------------

/// A small valid file (AdamW, three parameters) and its parts.
/// A version 2 file (the parser's checks of the layout are version 3's too; version 3's own
/// fields have tests of their own below).
struct Sample {
  ckpt::Header h = [] {
    ckpt::Header v2 = adamw_header({5, 40, 3});
    v2.version = ckpt::kFormatVersion2;
    return v2;
  }();
  Arrays arrays = make_arrays(h);
  std::uint64_t payload_length = 0;
  std::vector<std::uint64_t> offsets = packed_offsets(h, &payload_length);
  Bytes bytes = encode_file(h, arrays);
  std::size_t header_length() const { return encode_header(h, offsets).size(); }
  std::size_t payload_start() const { return (40 + header_length() + 63) / 64 * 64; }
  /// A file of `header` (valid checksums) with this sample's payload.
  Bytes with_header(const Bytes& header) const {
    FileParts parts;
    parts.version = h.version;
    parts.header = header;
    parts.payload.assign(bytes.begin() + payload_start(), bytes.end());
    return assemble(parts);
  }
};

TEST(CheckpointCorrupt, SampleIsValid) {
  TempDir dir;
  const Sample s;
  write_bytes(dir.file("ok"), s.bytes);
  expect_loads(dir.file("ok"), s.h, s.arrays);
}

TEST(CheckpointCorrupt, EmptyAndTruncated) {
  TempDir dir;
  const Sample s;
  expect_corrupt(dir, {}, "the file is empty");
  for (std::size_t n : {std::size_t{1}, std::size_t{8}, std::size_t{39}})
    expect_corrupt(dir, Bytes(s.bytes.begin(), s.bytes.begin() + n),
                   "shorter than the 40-byte preamble");
  // Inside the header: the header length runs past the end.
  for (std::size_t n : {std::size_t{40}, std::size_t{41}, 40 + s.header_length() - 1})
    expect_corrupt(dir, Bytes(s.bytes.begin(), s.bytes.begin() + n), "runs past the end");
  // After the header, inside the padding, inside the payload, the last byte missing.
  for (std::size_t n :
       {40 + s.header_length(), s.payload_start(), s.payload_start() + 7, s.bytes.size() - 1})
    expect_corrupt(dir, Bytes(s.bytes.begin(), s.bytes.begin() + n), "(truncated?)");
}

TEST(CheckpointCorrupt, LengthsInThePreamble) {
  TempDir dir;
  const Sample s;
  Bytes b = s.bytes;
  b.push_back(std::byte{0});
  expect_corrupt(dir, b, "do not add up to the file's");
  b = s.bytes;
  poke_u64(b, 16, s.bytes.size());  // header length past the end
  expect_corrupt(dir, b, "header length " + std::to_string(s.bytes.size()) + " runs past the end");
  b = s.bytes;
  poke_u64(b, 16, std::numeric_limits<std::uint64_t>::max());
  expect_corrupt(dir, b, "runs past the end");
  b = s.bytes;
  poke_u64(b, 24, s.payload_length + 64);
  expect_corrupt(dir, b, "payload length");
  b = s.bytes;
  poke_u64(b, 24, s.payload_length - 1);
  expect_corrupt(dir, b, "do not add up");
  b = s.bytes;
  poke_u64(b, 24, std::numeric_limits<std::uint64_t>::max() - 10);  // overflows the sum
  expect_corrupt(dir, b, "do not add up");
  b = s.bytes;
  poke_u64(b, 16, s.header_length() + 1);  // header length moved into the padding
  expect_corrupt(dir, b, "header checksum mismatch");
}

TEST(CheckpointCorrupt, MagicVersionReserved) {
  TempDir dir;
  const Sample s;
  Bytes b = s.bytes;
  b[0] = std::byte{'X'};
  expect_corrupt(dir, b, "not a stepcore checkpoint");
  b = s.bytes;
  b[7] = std::byte{'t'};
  expect_corrupt(dir, b, "magic");
  b = s.bytes;
  poke_u32(b, 8, 4);
  expect_corrupt(dir, b, "format version 4, this build reads 1, 2 and 3");
  b = s.bytes;
  poke_u32(b, 8, 0);
  expect_corrupt(dir, b, "format version 0, this build reads 1, 2 and 3");
  b = s.bytes;
  poke_u32(b, 8, 1);  // a version 2 header read as version 1's fields
  expect_corrupt(dir, b, "");
  b = s.bytes;
  poke_u32(b, 8, 3);  // read as version 3's: its parameter records lack the state field
  expect_corrupt(dir, b, "");
  b = s.bytes;
  poke_u32(b, 12, 1);
  expect_corrupt(dir, b, "reserved preamble field");
}

TEST(CheckpointCorrupt, FlippedBytesFailTheChecksums) {
  TempDir dir;
  const Sample s;
  // Every byte of the header, one at a time.
  for (std::size_t at = 40; at < 40 + s.header_length(); ++at) {
    Bytes b = s.bytes;
    b[at] ^= std::byte{0x10};
    expect_corrupt(dir, b, "header checksum mismatch");
  }
  for (std::size_t at : {s.payload_start(), s.payload_start() + 21, s.bytes.size() - 1}) {
    Bytes b = s.bytes;
    b[at] ^= std::byte{0x01};
    expect_corrupt(dir, b, "payload checksum mismatch");
  }
  Bytes b = s.bytes;
  b[32] ^= std::byte{0x80};  // the stored header CRC
  expect_corrupt(dir, b, "header checksum mismatch");
  b = s.bytes;
  b[39] ^= std::byte{0x80};  // the stored payload CRC
  expect_corrupt(dir, b, "payload checksum mismatch");
  ASSERT_LT(40 + s.header_length(), s.payload_start());
  b = s.bytes;
  b[s.payload_start() - 1] = std::byte{1};
  expect_corrupt(dir, b, "padding between the header and the payload is not zero");
}

TEST(CheckpointCorrupt, ArrayOffsets) {
  TempDir dir;
  const Sample s;
  auto with_offset = [&](std::size_t k, std::uint64_t offset) {
    std::vector<std::uint64_t> offsets = s.offsets;
    offsets.at(k) = offset;
    return s.with_header(encode_header(s.h, offsets));
  };
  // Misaligned.
  expect_corrupt(dir, with_offset(4, s.offsets[4] + 4), "params[1] array 1 is at payload offset");
  expect_corrupt(dir, with_offset(0, 1), "not a multiple of 64");
  // Out of range: past the payload, and so far that offset + size overflows.
  expect_corrupt(dir, with_offset(8, s.payload_length / 64 * 64 + 64), "runs past the end of the");
  expect_corrupt(dir, with_offset(4, std::numeric_limits<std::uint64_t>::max() / 64 * 64),
                 "params[1] array 1 (160 bytes at payload offset");
  // An array that starts inside another (params[1] array 1: payload bytes [384, 544)).
  ASSERT_EQ(s.offsets[4], 384u);
  expect_corrupt(dir, with_offset(6, 448),
                 "params[2] array 0 (payload bytes [448, 460)) overlaps params[1] array 1 (payload "
                 "bytes [384, 544))");
  // Two arrays at the same place.
  expect_corrupt(dir, with_offset(5, s.offsets[3]),
                 "params[1] array 2 (payload bytes [192, 352)) overlaps params[1] array 0");
  // Empty arrays overlap nothing: a numel-0 parameter's offsets may be anywhere inside.
  ckpt::Header h = adamw_header({4, 0});
  Arrays arrays = make_arrays(h);
  std::uint64_t length = 0;
  std::vector<std::uint64_t> offsets = packed_offsets(h, &length);
  offsets[3] = offsets[4] = offsets[5] = 0;
  FileParts parts;
  parts.header = encode_header(h, offsets);
  const Bytes packed = encode_file(h, arrays);
  parts.payload.assign(packed.end() - static_cast<std::ptrdiff_t>(length), packed.end());
  write_bytes(dir.file("empty-at-0"), assemble(parts));
  expect_loads(dir.file("empty-at-0"), h, arrays);
}

TEST(CheckpointCorrupt, RecordsInTheHeader) {
  TempDir dir;
  const Sample s;
  ckpt::Header h = s.h;
  h.params[2].group = 2;
  expect_corrupt(dir, s.with_header(encode_header(h, s.offsets)),
                 "params[2].group is 2, but the file has 2 groups");
  h = s.h;
  h.params[2].name = h.params[0].name;
  expect_corrupt(dir, s.with_header(encode_header(h, s.offsets)),
                 "params[2].name 'w0' is also the name of params[0]");
  h = s.h;
  h.rank = 4;
  expect_corrupt(dir, s.with_header(encode_header(h, s.offsets)), "rank 4 of world size 4");
  h = s.h;
  h.world_size = 0;
  h.rank = 0;
  expect_corrupt(dir, s.with_header(encode_header(h, s.offsets)), "rank 0 of world size 0");
  h = s.h;
  h.rank = -1;
  expect_corrupt(dir, s.with_header(encode_header(h, s.offsets)), "rank -1 of world size 4");
  // Slots: more than the limit, an empty name, a name twice.
  h = s.h;
  h.slots.assign(17, "s");
  expect_corrupt(dir, s.with_header(encode_header(h, std::vector<std::uint64_t>(3 * 18))),
                 "17 state slots");
  h.slots = {"exp_avg", ""};
  expect_corrupt(dir, s.with_header(encode_header(h, s.offsets)), "slots[1] is an empty name");
  h.slots = {"exp_avg", "exp_avg"};
  expect_corrupt(dir, s.with_header(encode_header(h, s.offsets)),
                 "slots[1] 'exp_avg' is also slots[0]");
  // Hyper-parameters past the limit; an empty optimizer name.
  h = s.h;
  h.hyper.assign(65, {"x", 1.0});
  expect_corrupt(dir, s.with_header(encode_header(h, s.offsets)), "65 hyper-parameters");
  h = s.h;
  h.optimizer = "";
  expect_corrupt(dir, s.with_header(encode_header(h, s.offsets)), "optimizer name is empty");
  // One slot fewer: two arrays per parameter, at offsets that overlap for these sizes.
  h = s.h;
  h.slots = {"exp_avg"};
  expect_corrupt(dir, s.with_header(encode_header(h, {0, 64, 128, 192, 256, 320})),
                 "params[1] array 1 (payload bytes [192, 352)) overlaps params[1] array 0");
  // Bytes after the last parameter.
  Bytes header = encode_header(s.h, s.offsets);
  header.push_back(std::byte{0});
  expect_corrupt(dir, s.with_header(header), "1 unread bytes follow the last parameter");
  // The header cut short at every length (valid checksums): the reader never reads past it.
  const Bytes full = encode_header(s.h, s.offsets);
  for (std::size_t n = 0; n < full.size(); ++n)
    expect_corrupt(dir, s.with_header(Bytes(full.begin(), full.begin() + n)), "the header");
}

TEST(CheckpointCorrupt, HugeLengthsAndCounts) {
  TempDir dir;
  const Sample s;
  const std::uint64_t kMax64 = std::numeric_limits<std::uint64_t>::max();
  {  // numel * 4 overflows
    ckpt::Header h = s.h;
    h.params[1].numel = kMax64 / 4 + 1;
    expect_corrupt(dir, s.with_header(encode_header(h, s.offsets)), "params[1].numel is");
    h.params[1].numel = kMax64 / 8;  // no overflow, far past the payload
    expect_corrupt(dir, s.with_header(encode_header(h, s.offsets)), "runs past the end of the");
  }
  {  // a name longer than the limit, and one longer than the header
    ckpt::Header h = s.h;
    h.params[0].name = std::string(4097, 'n');
    expect_corrupt(dir, s.with_header(encode_header(h, s.offsets)),
                   "params[0].name is 4097 bytes long");
    h.params[0].name = std::string(4096, 'n');  // the limit itself is fine
    write_bytes(dir.file("long-name"), s.with_header(encode_header(h, s.offsets)));
    EXPECT_EQ(ckpt::File::open(dir.file("long-name")).header().params[0].name, h.params[0].name);
    h = s.h;
    h.library_version = std::string(100, 'v');
    Bytes header = encode_header(h, s.offsets);
    poke_u32(header, 20, 0xFFFFFFFFu);  // library_version's length (after 3 u32s and a u64)
    expect_corrupt(dir, s.with_header(header), "library_version is 4294967295 bytes long");
    poke_u32(header, 20, 4000);  // within the limit, past the header's end
    expect_corrupt(dir, s.with_header(header), "the header ends inside library_version");
  }
  {  // counts: past the limit, and more than the bytes left can hold
    for (std::uint32_t count : {0xFFFFFFFFu, (1u << 24) + 1, 3u}) {
      Writer w;
      encode_top(w, s.h);
      w.u32(count);
      expect_corrupt(dir, s.with_header(w.bytes), "groups, more than its remaining");
    }
    for (std::uint32_t count : {0xFFFFFFFFu, (1u << 24) + 1, 1u}) {
      Writer w;
      encode_top(w, s.h);
      encode_groups(w, s.h);
      w.u32(count);
      expect_corrupt(dir, s.with_header(w.bytes), "parameters, more than its remaining");
    }
  }
}

/// Rewrites both CRCs of a file whose preamble lengths are intact, so that the parser (not
/// the checksum) judges the rest.
void refresh_crcs(Bytes& b) {
  if (b.size() < 40) return;
  std::uint64_t h = 0, p = 0;
  for (int k = 7; k >= 0; --k) {
    h = h << 8 | std::to_integer<std::uint64_t>(b[16 + k]);
    p = p << 8 | std::to_integer<std::uint64_t>(b[24 + k]);
  }
  const std::uint64_t start = (40 + h + 63) / 64 * 64;
  if (h > b.size() - 40 || start > b.size() || p != b.size() - start) return;
  const std::span<const std::byte> all(b);
  poke_u32(b, 32, stepcore::detail::crc32c(all.subspan(40, h)));
  poke_u32(b, 36, stepcore::detail::crc32c(all.subspan(start)));
}

TEST(CheckpointCorrupt, RandomMutationsAreRefusedOrConsistent) {
  // A small deterministic fuzz: random byte changes (checksums refreshed, so the header
  // parser is what decides), truncations and random headers. Each input either parses
  // into arrays that lie inside the bytes, or is refused as corrupt_file; nothing else.
  const Sample s;
  std::mt19937_64 gen(2024);
  std::size_t accepted = 0, refused = 0;
  auto judge = [&](const Bytes& b) {
    try {
      const ckpt::ParsedFile f = ckpt::parse(b, "fuzz");
      ++accepted;
      const ckpt::Header& h = f.header;
      ASSERT_EQ(f.array_offsets.size(), h.params.size() * h.arrays());
      for (std::size_t k = 0; k < f.array_offsets.size(); ++k) {
        const std::uint64_t end =
            f.payload_start + f.array_offsets[k] + h.params[k / h.arrays()].numel * 4;
        ASSERT_LE(end, b.size());
        ASSERT_EQ((f.payload_start + f.array_offsets[k]) % 64, 0u);
      }
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), Errc::corrupt_file) << e.what();
      ++refused;
    }
  };
  for (int round = 0; round < 4000; ++round) {
    Bytes b = s.bytes;
    const int edits = 1 + static_cast<int>(gen() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = 40 + gen() % (b.size() - 40);
      switch (gen() % 3) {
        case 0:
          b[at] = std::byte(static_cast<std::uint8_t>(gen()));
          break;
        case 1:
          b[at] = std::byte{0xFF};
          break;
        default:
          b[at] ^= std::byte(static_cast<std::uint8_t>(1u << (gen() % 8)));
      }
    }
    refresh_crcs(b);
    judge(b);
    ASSERT_FALSE(HasFatalFailure());
    judge(Bytes(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(gen() % b.size())));
    ASSERT_FALSE(HasFatalFailure());
    Bytes noise(gen() % 300);
    for (auto& x : noise) x = std::byte(static_cast<std::uint8_t>(gen() % 4 == 0 ? gen() : 0));
    try {
      (void)ckpt::parse_header(noise, gen() % 4096, "noise");
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), Errc::corrupt_file) << e.what();
    }
  }
  EXPECT_GT(refused, 0u);
  std::printf("note: %zu mutated files accepted, %zu refused\n", accepted, refused);
}

TEST(CheckpointOpen, IoErrors) {
  TempDir dir;
  expect_error([&] { (void)ckpt::File::open(dir.file("missing")); }, Errc::io_error, "path");
  try {
    (void)ckpt::File::open(dir.file("missing"));
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("missing") + ": cannot open: No such file"),
              std::string::npos)
        << e.what();
  }
  expect_error([&] { (void)ckpt::File::open(dir.path()); }, Errc::io_error, "path");
  try {
    (void)ckpt::File::open(dir.path());
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Is a directory"), std::string::npos) << e.what();
  }
}

TEST(CheckpointOpen, FileOutlivesItsMoves) {
  TempDir dir;
  const ckpt::Header h = adamw_header({9});
  const Arrays arrays = make_arrays(h);
  ckpt::save(dir.file("m"), h, source_of(arrays));
  ckpt::File f = ckpt::File::open(dir.file("m"));
  ckpt::File g = std::move(f);
  fs::remove(dir.file("m"));  // the mapping stays valid
  EXPECT_EQ(std::memcmp(g.array(0, 2).data(), arrays[0][2].data(), 36), 0);
}

// ---- compatibility -----------------------------------------------------------------------------

TEST(CheckpointCompatible, EachDifferenceIsNamed) {
  const ckpt::Header base = adamw_header({4, 8, 2});
  ckpt::check_compatible(base, base, "f");

  // What may differ: the schedule's state and the informational fields.
  ckpt::Header ok = base;
  ok.groups[0].lr = 1.0;
  ok.groups[1].weight_decay = 0.5;
  ok.saved_mode = 0;
  ok.library_version = "other";
  ok.params[1].step = 99.0f;
  ckpt::check_compatible(base, ok, "f");

  struct Case {
    std::function<void(ckpt::Header&)> change;
    Errc code;
    std::string argument;
  };
  const std::vector<Case> cases = {
      {[](auto& h) { h.optimizer = "adam"; }, Errc::invalid_argument, "checkpoint.optimizer"},
      {[](auto& h) { h.hyper[0].value = 0.0; }, Errc::invalid_argument, "checkpoint.hyper.formula"},
      {[](auto& h) { h.hyper.pop_back(); }, Errc::invalid_argument, "checkpoint.hyper.maximize"},
      {[](auto& h) {
         h.hyper.push_back({"momentum", 0.9});
       },
       Errc::invalid_argument, "checkpoint.hyper.momentum"},
      {[](auto& h) { h.slots.pop_back(); }, Errc::invalid_argument, "checkpoint.slots"},
      {[](auto& h) { h.slots[1] = "max_exp_avg_sq"; }, Errc::invalid_argument, "checkpoint.slots"},
      {[](auto& h) { h.groups.pop_back(); }, Errc::size_mismatch, "checkpoint.groups"},
      {[](auto& h) { h.groups[1].name = "x"; }, Errc::invalid_argument,
       "checkpoint.groups[1].name"},
      {[](auto& h) { h.groups[0].beta1 = 0.8; }, Errc::invalid_argument,
       "checkpoint.groups[0].beta1"},
      {[](auto& h) { h.groups[1].beta2 = 0.999; }, Errc::invalid_argument,
       "checkpoint.groups[1].beta2"},
      {[](auto& h) { h.groups[0].eps = 1e-6; }, Errc::invalid_argument, "checkpoint.groups[0].eps"},
      {[](auto& h) { h.rank = 1; }, Errc::invalid_argument, "checkpoint.rank"},
      {[](auto& h) { h.world_size = 8; }, Errc::invalid_argument, "checkpoint.world_size"},
      {[](auto& h) { h.layout_fingerprint ^= 1; }, Errc::invalid_argument,
       "checkpoint.layout_fingerprint"},
      {[](auto& h) { h.params.pop_back(); }, Errc::size_mismatch, "checkpoint.params"},
      {[](auto& h) { h.params[2].name = "w9"; }, Errc::invalid_argument,
       "checkpoint.params[2].name"},
      {[](auto& h) { h.params[1].numel = 9; }, Errc::size_mismatch, "checkpoint.params[1].numel"},
      {[](auto& h) { h.params[0].group = 1; }, Errc::invalid_argument,
       "checkpoint.params[0].group"},
  };
  for (std::size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE(cases[k].argument);
    ckpt::Header mine = base;
    cases[k].change(mine);
    expect_error([&] { ckpt::check_compatible(base, mine, "ckpt/rank-00002.stepcore"); },
                 cases[k].code, cases[k].argument);
  }
  // The message names both values and the file.
  ckpt::Header mine = base;
  mine.params[1].name = "w3";
  try {
    ckpt::check_compatible(base, mine, "ckpt/rank-00002.stepcore");
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'w1' in ckpt/rank-00002.stepcore, 'w3' in this manager"),
              std::string::npos)
        << e.what();
  }
}

// ---- save: refusals and faults -----------------------------------------------------------------

TEST(CheckpointSave, InvalidHeaderCreatesNothing) {
  TempDir dir;
  const std::string path = dir.file("c");
  struct Case {
    std::function<void(ckpt::Header&)> change;
    std::string argument;
  };
  const std::vector<Case> cases = {
      {[](auto& h) { h.version = 1; }, "header.version"},
      {[](auto& h) { h.optimizer = ""; }, "header.optimizer"},
      {[](auto& h) { h.slots.assign(17, "s"); }, "header.slots"},
      {[](auto& h) {
         h.slots = {"a", "a"};
       },
       "header.slots[1]"},
      {[](auto& h) { h.slots = {""}; }, "header.slots[0]"},
      {[](auto& h) {
         h.hyper.assign(65, {"x", 0.0});
       },
       "header.hyper"},
      {[](auto& h) { h.hyper[1].name = ""; }, "header.hyper[1].name"},
      {[](auto& h) { h.params[1].group = 2; }, "header.params[1].group"},
      {[](auto& h) { h.params[2].name = "w0"; }, "header.params[2].name"},
      {[](auto& h) { h.params[0].name = std::string(4097, 'x'); }, "header.params[0].name"},
      {[](auto& h) { h.groups[1].name = std::string(4097, 'x'); }, "header.groups[1].name"},
      {[](auto& h) { h.library_version = std::string(4097, 'x'); }, "header.library_version"},
      {[](auto& h) { h.rank = 4; }, "header.rank"},
      {[](auto& h) { h.rank = -1; }, "header.rank"},
      {[](auto& h) { h.world_size = 0; }, "header.world_size"},
      {[](auto& h) { h.params[0].numel = std::uint64_t{1} << 62; }, "header.params[0].numel"},
      {[](auto& h) {
         h.params[0].numel = (std::uint64_t{1} << 61);
         h.params[1].numel = (std::uint64_t{1} << 61);
       },
       "header.params"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.argument);
    ckpt::Header h = adamw_header({1, 2, 3});
    const Arrays arrays = make_arrays(h);
    c.change(h);
    expect_error([&] { ckpt::save(path, h, source_of(arrays)); }, Errc::invalid_argument,
                 c.argument);
    EXPECT_TRUE(dir.entries().empty());
  }
  const ckpt::Header h = adamw_header({1});
  expect_error([&] { ckpt::save(path, h, ckpt::ArraySource{}); }, Errc::invalid_argument, "source");
  expect_error([&] { ckpt::save("", h, source_of(make_arrays(h))); }, Errc::invalid_argument,
               "path");
  EXPECT_TRUE(dir.entries().empty());
}

/// A valid file at dir/"c" and what it holds; every fault below must leave it so.
struct Previous {
  explicit Previous(const TempDir& dir) : path(dir.file("c")) {
    ckpt::save(path, h, source_of(arrays));
    bytes = read_bytes(path);
  }
  void expect_intact() const {
    EXPECT_EQ(read_bytes(path), bytes);
    expect_loads(path, h, arrays);
  }
  std::string path;
  ckpt::Header h = adamw_header({300, 0, 70});
  Arrays arrays = make_arrays(h, 5);
  Bytes bytes;
};

/// save must throw io_error naming "path" with `what` in its message.
void expect_io_error(const std::function<void()>& f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected io_error with '" << what << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::io_error) << e.what();
    EXPECT_EQ(e.argument(), "path") << e.what();
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos)
        << "'" << what << "' not in: " << e.what();
  }
}

TEST(CheckpointSave, SourceOfTheWrongSizeRemovesTheTemporaryFile) {
  TempDir dir;
  const Previous prev(dir);
  const ckpt::Header h = adamw_header({4, 5});
  Arrays arrays = make_arrays(h);
  arrays[1][2].pop_back();
  expect_error([&] { ckpt::save(prev.path, h, source_of(arrays)); }, Errc::invalid_argument,
               "source");
  const ckpt::ArraySource throwing = [](std::size_t, std::size_t) -> std::span<const std::byte> {
    throw std::runtime_error("device copy failed");
  };
  EXPECT_THROW(ckpt::save(prev.path, h, throwing), std::runtime_error);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"c"});
  prev.expect_intact();
}

TEST(CheckpointSave, ShortWritesAndEintrStillWriteTheSameFile) {
  TempDir dir;
  const ckpt::Header h = adamw_header({300, 0, 70, 1});
  const Arrays arrays = make_arrays(h, 9);
  ckpt::save(dir.file("plain"), h, source_of(arrays));
  {
    ScopedSaveFault fault(SaveFaultKind::short_writes);
    ckpt::save(dir.file("short"), h, source_of(arrays));
  }
  EXPECT_EQ(read_bytes(dir.file("short")), read_bytes(dir.file("plain")));
  expect_loads(dir.file("short"), h, arrays);
}

TEST(CheckpointSave, DiskFullLeavesThePreviousFile) {
  TempDir dir;
  const Previous prev(dir);
  const ckpt::Header h = sign_sgd_header({500, 3});
  const Arrays arrays = make_arrays(h);
  ckpt::save(dir.file("probe"), h, source_of(arrays));
  const std::uint64_t size = read_bytes(dir.file("probe")).size();
  fs::remove(dir.file("probe"));
  for (std::uint64_t budget : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{40},
                               std::uint64_t{200}, std::uint64_t{1000}, std::uint64_t{2000}}) {
    SCOPED_TRACE(budget);
    ScopedSaveFault fault(SaveFaultKind::disk_full_after, budget);
    expect_io_error([&] { ckpt::save(prev.path, h, source_of(arrays)); },
                    "No space left on device");
    EXPECT_EQ(dir.entries(), std::vector<std::string>{"c"});
    prev.expect_intact();
  }
  // A budget of the file's size: the final preamble (rewritten last) is what runs out.
  for (std::uint64_t budget : {size - 1, size, size + 39}) {
    SCOPED_TRACE(budget);
    ScopedSaveFault fault(SaveFaultKind::disk_full_after, budget);
    expect_io_error([&] { ckpt::save(prev.path, h, source_of(arrays)); },
                    "write of the temporary file");
    EXPECT_EQ(dir.entries(), std::vector<std::string>{"c"});
    prev.expect_intact();
  }
  {  // Placeholder and final preamble together: the save goes through.
    ScopedSaveFault fault(SaveFaultKind::disk_full_after, size + 40);
    ckpt::save(dir.file("exact"), h, source_of(arrays));
    expect_loads(dir.file("exact"), h, arrays);
    fs::remove(dir.file("exact"));
  }
  // No fault: the save goes through.
  ckpt::save(prev.path, h, source_of(arrays));
  expect_loads(prev.path, h, arrays);
}

TEST(CheckpointSave, CrashBeforeRenameLeavesThePreviousFile) {
  TempDir dir;
  const Previous prev(dir);
  const ckpt::Header h = adamw_header({8});
  const Arrays arrays = make_arrays(h);
  {
    ScopedSaveFault fault(SaveFaultKind::crash_before_rename);
    expect_io_error([&] { ckpt::save(prev.path, h, source_of(arrays)); }, "simulated crash");
  }
  prev.expect_intact();
  // The temporary file is left as a killed process would leave it: complete and valid.
  const std::vector<std::string> names = dir.entries();
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[1].rfind("c.tmp-" + std::to_string(::getpid()) + "-", 0), 0u) << names[1];
  expect_loads(dir.file(names[1]), h, arrays);
  // A later save succeeds (a new temporary name) and replaces the file.
  ckpt::save(prev.path, h, source_of(arrays));
  expect_loads(prev.path, h, arrays);
}

TEST(CheckpointSave, FsyncFailureLeavesThePreviousFile) {
  TempDir dir;
  const Previous prev(dir);
  const ckpt::Header h = adamw_header({8, 9});
  {
    ScopedSaveFault fault(SaveFaultKind::fsync_fails);
    expect_io_error([&] { ckpt::save(prev.path, h, source_of(make_arrays(h))); },
                    "fsync of the temporary file");
    expect_io_error([&] { ckpt::save(prev.path, h, source_of(make_arrays(h))); },
                    "Input/output error");
  }
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"c"});
  prev.expect_intact();
}

TEST(CheckpointSave, FaultScopesNestAndEnd) {
  TempDir dir;
  const Previous prev(dir);
  const ckpt::Header h = adamw_header({8});
  const Arrays arrays = make_arrays(h);
  {
    ScopedSaveFault outer(SaveFaultKind::fsync_fails);
    {
      ScopedSaveFault inner(SaveFaultKind::short_writes);
      ckpt::save(prev.path, h, source_of(arrays));  // short writes only
    }
    expect_io_error([&] { ckpt::save(prev.path, prev.h, source_of(prev.arrays)); }, "fsync");
  }
  expect_loads(prev.path, h, arrays);
  ckpt::save(prev.path, prev.h, source_of(prev.arrays));
  prev.expect_intact();
}

TEST(CheckpointSave, MissingDirectory) {
  TempDir dir;
  const ckpt::Header h = adamw_header({2});
  expect_io_error([&] { ckpt::save(dir.file("no/such/dir/c"), h, source_of(make_arrays(h))); },
                  "cannot create the temporary file");
  EXPECT_TRUE(dir.entries().empty());
}

TEST(CheckpointSave, PathWithoutDirectory) {
  // A bare file name: the temporary file and the directory fsync are in the working directory.
  TempDir dir;
  const std::string cwd = fs::current_path();
  fs::current_path(dir.path());
  const ckpt::Header h = adamw_header({2});
  const Arrays arrays = make_arrays(h);
  ckpt::save("bare.stepcore", h, source_of(arrays));
  fs::current_path(cwd);
  expect_loads(dir.file("bare.stepcore"), h, arrays);
}

}  // namespace
