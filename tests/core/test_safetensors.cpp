#include "refit/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>

#include "core/error_of.h"
#include "core/safetensors_header.h"
#include "core/wire.h"
#include "refit/error.h"

namespace refit {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("refit_st_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
            std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  // A hand-made file: 8-byte length (`header_len` if given, else the header's size), header, data.
  std::string raw(const std::string& name, const std::string& header, size_t data_bytes,
                  std::optional<uint64_t> header_len = std::nullopt) const {
    std::ofstream out(file(name), std::ios::binary);
    ByteWriter w;
    w.put<uint64_t>(header_len.value_or(header.size()));
    const auto length = w.take();
    out.write(reinterpret_cast<const char*>(length.data()), static_cast<std::streamsize>(length.size()));
    out << header << std::string(data_bytes, '\x7f');
    return file(name);
  }

  // Expects opening `path` to fail with kModel and a message holding `parts` and the path.
  void expect_bad(const std::string& path, std::initializer_list<std::string> parts) const {
    try {
      SafetensorsFile f(path);
      ADD_FAILURE() << "opened " << path;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kModel) << e.what();
      EXPECT_THAT(e.what(), HasSubstr(path));
      for (const auto& p : parts) EXPECT_THAT(e.what(), HasSubstr(p));
    }
  }

  fs::path dir_;
};

TEST_F(Safetensors, RoundTripAllDtypesAndZeroSize) {
  std::vector<TensorInfo> infos;
  for (int i = 0; i < kDTypeCount; ++i) {
    auto dtype = static_cast<DType>(i);
    infos.push_back({"t." + std::string(dtype_name(dtype)), dtype, {3, i + 1}});
  }
  infos.push_back({"empty", DType::kBFloat16, {0}});
  infos.push_back({"empty2d", DType::kFloat32, {4, 0}});
  infos.push_back({"scalar", DType::kFloat64, {}});
  infos.push_back({"odd", DType::kUInt8, {5}});  // leaves the next tensor unaligned; allowed

  std::vector<std::vector<std::byte>> bufs;
  std::vector<SafetensorsEntry> entries;
  uint8_t seed = 1;
  for (const auto& info : infos) {
    auto& b = bufs.emplace_back(info.nbytes());
    for (auto& x : b) x = std::byte{seed++};
  }
  for (size_t i = 0; i < infos.size(); ++i) entries.push_back({infos[i], bufs[i]});
  write_safetensors(file("all.safetensors"), entries);

  // Header padded with spaces to a multiple of 8, like the reference writer.
  std::ifstream in(file("all.safetensors"), std::ios::binary);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  EXPECT_EQ(header_len % 8, 0u);
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  EXPECT_EQ(header.front(), '{');
  EXPECT_THAT(header, HasSubstr("\"BF16\""));
  EXPECT_THAT(header, HasSubstr("\"F8_E4M3\""));

  SafetensorsFile f(file("all.safetensors"));
  EXPECT_EQ(f.path(), file("all.safetensors"));
  ASSERT_EQ(f.tensors().size(), infos.size());
  // Written in entry order, so file order (by offset) is entry order, except that zero-size
  // tensors sort by their (shared) offset; compare by name.
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const auto& t = f.tensors()[i];
    auto it = std::find_if(infos.begin(), infos.end(), [&](const TensorInfo& x) { return x.name == t.name; });
    ASSERT_NE(it, infos.end()) << t.name;
    EXPECT_EQ(t, *it);
    const auto& expect = bufs[it - infos.begin()];
    auto got = f.data(i);
    ASSERT_EQ(got.size(), expect.size()) << t.name;
    EXPECT_TRUE(std::equal(got.begin(), got.end(), expect.begin())) << t.name;
  }
  EXPECT_EQ(f.tensors()[0].name, "t.bool");

  // Moves keep the mapping alive.
  SafetensorsFile moved(std::move(f));
  EXPECT_EQ(moved.tensors().size(), infos.size());
  EXPECT_EQ(moved.data(0)[0], bufs[0][0]);
  SafetensorsFile other(file("all.safetensors"));
  other = std::move(moved);
  EXPECT_EQ(other.data(1)[0], bufs[1][0]);

  try {
    other.data(infos.size());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  }
}

TEST_F(Safetensors, EmptyFileOfTensors) {
  write_safetensors(file("none.safetensors"), {});
  SafetensorsFile f(file("none.safetensors"));
  EXPECT_TRUE(f.tensors().empty());
}

TEST_F(Safetensors, TensorsInOffsetOrder) {
  // JSON key order (a, b) differs from data order (b, a); "__metadata__" is skipped.
  auto path = raw("order.safetensors",
                  R"({"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
                      "b": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})",
                  12);
  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensors()[0].name, "b");
  EXPECT_EQ(f.tensors()[1].name, "a");
  EXPECT_EQ(f.tensors()[1].dtype, DType::kFloat32);
  EXPECT_EQ(f.data(1).size(), 4u);
}

TEST_F(Safetensors, ZeroSizeInsideAnotherIsNotOverlap) {
  auto path = raw("zero.safetensors",
                  R"({"a": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
                      "z": {"dtype": "BF16", "shape": [0, 7], "data_offsets": [8, 8]}})",
                  16);
  SafetensorsFile f(path);
  EXPECT_EQ(f.tensors().size(), 2u);
}

TEST_F(Safetensors, MissingFile) { expect_bad(file("absent.safetensors"), {"cannot open"}); }

TEST_F(Safetensors, TruncatedFile) {
  std::ofstream(file("empty.safetensors")).close();
  expect_bad(file("empty.safetensors"), {"0 bytes"});
  std::ofstream(file("five.safetensors")) << "12345";
  expect_bad(file("five.safetensors"), {"5 bytes"});
}

TEST_F(Safetensors, HeaderLengthBeyondFile) {
  expect_bad(raw("long.safetensors", "{}", 0, 1000), {"header length 1000"});
  expect_bad(raw("huge.safetensors", "{}", 0, ~0ull), {"header length"});
}

TEST_F(Safetensors, BadHeaderJson) {
  expect_bad(raw("json.safetensors", R"({"a": {"dtype": )", 0), {"not valid JSON"});
  expect_bad(raw("array.safetensors", "[1, 2]", 0), {"not a JSON object"});
  expect_bad(raw("entry.safetensors", R"({"w": 3})", 0), {"'w'"});
}

TEST_F(Safetensors, BadDtype) {
  expect_bad(raw("dtype.safetensors", R"({"w": {"dtype": "U16", "shape": [2], "data_offsets": [0, 4]}})", 4),
             {"'w'", "unknown dtype 'U16'"});
  // Torch spellings are not safetensors dtypes.
  expect_bad(raw("torch.safetensors", R"({"w": {"dtype": "bfloat16", "shape": [2], "data_offsets": [0, 4]}})", 4),
             {"'w'", "'bfloat16'"});
  expect_bad(raw("nodtype.safetensors", R"({"w": {"shape": [2], "data_offsets": [0, 4]}})", 4), {"'w'", "dtype"});
}

TEST_F(Safetensors, BadShapeOrOffsets) {
  expect_bad(raw("shape.safetensors", R"({"w": {"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}})", 2),
             {"'w'", "shape"});
  expect_bad(raw("offs.safetensors", R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0]}})", 2),
             {"'w'", "data_offsets"});
  expect_bad(raw("back.safetensors", R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 2]}})", 4),
             {"'w'", "end before begin"});
}

TEST_F(Safetensors, OffsetsNotMatchingSize) {
  expect_bad(raw("size.safetensors", R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}})", 24),
             {"'w'", "20 bytes", "24"});
}

TEST_F(Safetensors, OffsetsPastEnd) {
  expect_bad(raw("past.safetensors", R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 15),
             {"'w'", "past the end"});
}

TEST_F(Safetensors, Overlap) {
  expect_bad(raw("overlap.safetensors",
                 R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
                     "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}})",
                 12),
             {"'a'", "'b'", "overlaps"});
}

TEST_F(Safetensors, HeaderLengthIsLittleEndian) {
  std::vector<std::byte> data(3);
  write_safetensors(file("w.safetensors"), std::vector<SafetensorsEntry>{{{"w", DType::kUInt8, {3}}, data}});
  std::ifstream in(file("w.safetensors"), std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 11u);
  const uint64_t header_len = bytes.size() - 8 - 3;
  ASSERT_LT(header_len, 256u);
  EXPECT_THAT(std::vector<uint8_t>(bytes.begin(), bytes.begin() + 8),
              ::testing::ElementsAre(header_len, 0, 0, 0, 0, 0, 0, 0));

  const std::vector<uint8_t> little = {2, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
  EXPECT_TRUE(decode_safetensors_header(little, "little.safetensors").tensors.empty());
  // The same length big-endian is 2^57: past the end of the file.
  const std::vector<uint8_t> big = {0, 0, 0, 0, 0, 0, 0, 2, '{', '}'};
  EXPECT_THAT(testing::error_of(ErrorKind::kModel, [&] { decode_safetensors_header(big, "big.safetensors"); }),
              AllOf(HasSubstr("big.safetensors"), HasSubstr("header length 144115188075855872")));
}

TEST_F(Safetensors, ShapesMustFitSixtyFourBits) {
  expect_bad(raw("huge.safetensors",
                 R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", 0),
             {"'w'", "more than 2^64 bytes"});
  expect_bad(
      raw("dim.safetensors", R"({"w": {"dtype": "U8", "shape": [9223372036854775808], "data_offsets": [0, 0]}})", 0),
      {"'w'", "bad shape"});
  expect_bad(raw("nested.safetensors", R"({"w": {"dtype": "U8", "shape": [[[1]]], "data_offsets": [0, 1]}})", 1),
             {"'w'", "bad shape"});
}

// A shape nested a million deep parses (nlohmann's parser is iterative) and is refused without
// being printed: the message once dumped it, recursively.
TEST_F(Safetensors, DeeplyNestedShapeIsRefusedWithoutRecursion) {
  const size_t depth = 1'000'000;
  const std::string header = R"({"w": {"dtype": "U8", "shape": )" + std::string(depth, '[') + std::string(depth, ']') +
                             R"(, "data_offsets": [0, 0]}})";
  ByteWriter w;
  w.put_string<uint64_t>(header);
  const auto file = w.take();
  EXPECT_THAT(testing::error_of(ErrorKind::kModel, [&] { decode_safetensors_header(file, "deep.safetensors"); }),
              AllOf(HasSubstr("deep.safetensors"), HasSubstr("'w'"), HasSubstr("bad shape")));
}

TEST_F(Safetensors, WriterErrors) {
  std::vector<std::byte> buf(8);
  std::vector<SafetensorsEntry> dup = {{{"w", DType::kFloat32, {2}}, buf}, {{"w", DType::kFloat32, {2}}, buf}};
  try {
    write_safetensors(file("dup.safetensors"), dup);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("'w'"));
  }
  std::vector<SafetensorsEntry> size = {{{"w", DType::kFloat32, {3}}, buf}};
  try {
    write_safetensors(file("size.safetensors"), size);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("'w'"));
    EXPECT_THAT(e.what(), HasSubstr("12"));
  }
  std::vector<SafetensorsEntry> ok = {{{"w", DType::kFloat32, {2}}, buf}};
  try {
    write_safetensors(file("no/such/dir/x.safetensors"), ok);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIo);
    EXPECT_THAT(e.what(), HasSubstr("no/such/dir"));
  }
}

}  // namespace
}  // namespace refit
