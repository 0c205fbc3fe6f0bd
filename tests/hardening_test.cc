// Unit tests for the defences against hostile input: JSON nesting, element
// count overflow, model names and file confinement, configured bounds and
// request body decoding.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/json.h"
#include "core/model_config_parser.h"
#include "core/repository.h"
#include "frontends/http/content_encoding.h"
#include "frontends/http/http_util.h"
#include "frontends/http/kserve_handler.h"
#include "quern/tensor.h"

namespace quern {
namespace {

namespace fs = std::filesystem;

TEST(ParseJson, DeepNestingIsAnErrorNotACrash) {
  // Far deeper than any stack allows a recursive parser to go.
  const std::string deep(1'000'000, '[');
  rapidjson::Document doc;
  JsonParseError e;
  EXPECT_FALSE(ParseJson(doc, deep.data(), deep.size(), e));
  EXPECT_EQ(e.message, "nested deeper than 64 levels");
  EXPECT_EQ(e.offset, 64u);  // the 65th '[' (offset 64) is refused
  EXPECT_TRUE(doc.IsNull());

  std::string nested_objects;
  for (int i = 0; i < 100'000; ++i) nested_objects += "{\"a\":";
  EXPECT_FALSE(ParseJson(doc, nested_objects.data(), nested_objects.size(), e));
  EXPECT_EQ(e.message, "nested deeper than 64 levels");
}

// An error message that quotes a client's bytes cut in the middle of a character is still valid
// UTF-8 (JSON text): a model version of mathematical letters, cut at 64 bytes.
TEST(ValidUtf8, ReplacesWhatStartsNoCharacter) {
  EXPECT_EQ(ValidUtf8("plain"), "plain");
  EXPECT_EQ(ValidUtf8("\xF0\x9D\x90\x93x"), "\xF0\x9D\x90\x93x") << "a whole four-byte character stays";
  EXPECT_EQ(ValidUtf8("a\xF0\x9D\x90"), "a\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD") << "a cut one does not";
  EXPECT_EQ(ValidUtf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD") << "an overlong form";
  std::string version;
  for (int i = 0; i < 20; ++i) version += "\xF0\x9D\x90\x93";  // 80 bytes: cut at 64 lands inside none
  HttpResponse r = ErrorResponse(InvalidArgument("model version '" + version.substr(0, 63) + "' is not a number"));
  EXPECT_TRUE(IsUtf8(r.body)) << r.body;
}

TEST(ParseJson, NestingUpToTheLimitParses) {
  std::string ok = std::string(64, '[') + "1" + std::string(64, ']');
  rapidjson::Document doc;
  JsonParseError e;
  ASSERT_TRUE(ParseJson(doc, ok.data(), ok.size(), e)) << e.message;
  const rapidjson::Value* v = &doc;
  for (int i = 0; i < 64; ++i) {
    ASSERT_TRUE(v->IsArray());
    v = &(*v)[0];
  }
  EXPECT_EQ(v->GetInt(), 1);
  std::string too_deep = "[" + ok + "]";
  EXPECT_FALSE(ParseJson(doc, too_deep.data(), too_deep.size(), e));
}

TEST(ParseJson, ReadsOnlyTheGivenBytesAndReportsSyntaxErrors) {
  const std::string text = R"({"a": [1, 2]}garbage)";
  rapidjson::Document doc;
  JsonParseError e;
  ASSERT_TRUE(ParseJson(doc, text.data(), 13, e)) << e.message;
  EXPECT_EQ(doc["a"].Size(), 2u);
  EXPECT_FALSE(ParseJson(doc, text.data(), text.size(), e));
  EXPECT_EQ(e.offset, 13u);
  EXPECT_FALSE(e.message.empty());
}

// RapidJSON's streams read a NUL byte as the end of the text: a document
// followed by one (as a KServe JSON header is by binary data whose first
// byte is 0 when the split is not given) would parse with the rest
// ignored. What follows a document is refused, a NUL as any other byte.
TEST(ParseJson, ANulByteAfterTheDocumentIsNotItsEnd) {
  for (const std::string& text :
       {std::string("{\"a\": [1, 2]}\0garbage", 21), std::string("{\"a\": [1, 2]}  \0", 16), std::string("7\0", 2)}) {
    rapidjson::Document doc;
    JsonParseError e;
    EXPECT_FALSE(ParseJson(doc, text.data(), text.size(), e)) << text.size();
    EXPECT_EQ(e.offset, text.find('\0')) << text.size();
    EXPECT_NE(e.message.find("followed"), std::string::npos) << e.message;
    EXPECT_TRUE(doc.IsNull());
  }
  const std::string spaced = "{\"a\": 1} \r\n\t";
  rapidjson::Document doc;
  JsonParseError e;
  EXPECT_TRUE(ParseJson(doc, spaced.data(), spaced.size(), e)) << e.message;
}

TEST(ElementCount, OverflowIsNeverAWrappedCount) {
  EXPECT_EQ(ElementCount({2, 3, 4}), 24);
  EXPECT_EQ(ElementCount({}), 1);
  EXPECT_EQ(ElementCount({4, -1}), -1);
  // 2^62 * 4 = 2^64 wraps to 0 in 64 bits; 16 * 2^60 likewise.
  EXPECT_EQ(ElementCount({int64_t{1} << 62, 4}), -1);
  EXPECT_EQ(ElementCount({16, int64_t{1} << 60}), -1);
  EXPECT_EQ(ElementCount({int64_t{1} << 62, int64_t{1} << 62, 3}), -1);
  // A zero anywhere makes the count 0, even after an overflow.
  EXPECT_EQ(ElementCount({int64_t{1} << 62, int64_t{1} << 62, 0}), 0);
  EXPECT_EQ(ByteCount({int64_t{1} << 61, 2}, 4), -1);
  EXPECT_EQ(ByteCount({int64_t{1} << 60}, 4), int64_t{1} << 62);
}

TEST(ElementCount, TensorsWithHugeShapesFailValidation) {
  Tensor f = Tensor::Borrow(DataType::kFp32, {int64_t{1} << 62, 4}, nullptr, 0);
  EXPECT_FALSE(f.Validate().ok());
  Tensor g = Tensor::Borrow(DataType::kFp32, {int64_t{1} << 61, 1}, nullptr, 0);  // 2^63 bytes
  EXPECT_FALSE(g.Validate().ok());
  // BYTES with a shape of 2^40 elements and a 4-byte buffer: refused without
  // reserving room for 2^40 strings.
  const uint32_t zero = 0;
  Tensor b = Tensor::Borrow(DataType::kBytes, {int64_t{1} << 40}, &zero, 4);
  Status st = b.Validate();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("holds 1 elements"), std::string::npos) << st.message();
}

TEST(KServeParse, HugeShapesAndDeepDataAreInvalidArgument) {
  auto r = ParseKServeInferBody(
      "m", -1, R"({"inputs": [{"name": "x", "shape": [4611686018427387904, 4], "datatype": "FP32", "data": []}]})", "");
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message().find("64 bits"), std::string::npos) << r.error().message();

  r = ParseKServeInferBody("m", -1, std::string(200'000, '['), "");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);

  std::string dims = "1";
  for (int i = 1; i < 100; ++i) dims += ",1";
  r = ParseKServeInferBody(
      "m", -1, R"({"inputs": [{"name": "x", "datatype": "FP32", "data": [1], "shape": [)" + dims + "]}]}", "");
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message().find("at most 64"), std::string::npos) << r.error().message();
}

TEST(TargetPath, SegmentsArePercentDecoded) {
  auto p = SplitTargetPath("/v2/models/my%20model/versions/1/infer?x=%20");
  ASSERT_EQ(p.size(), 6u);
  EXPECT_EQ(p[2], "my model");
  EXPECT_EQ(SplitTargetPath("/v2/models/mod%C3%A8le")[2], "mod\xc3\xa8le");
  EXPECT_EQ(SplitTargetPath("/v2/models/a%2Fb/ready")[2], "a/b");  // an encoded '/' stays in its segment
  EXPECT_EQ(SplitTargetPath("/v2/models/100%/ready")[2], "100%");  // not an escape: kept
  EXPECT_EQ(SplitTargetPath("/v2/models/%zz%4")[2], "%zz%4");
}

TEST(TargetPath, DecodedSegmentsSurviveAMove) {
  // The segments are views; a decoded one views the object's own copy,
  // which a move (a short path included) must not leave behind.
  for (const char* target : {"/%41", "/v2/models/a%20b/versions/%31/infer"}) {
    TargetPath a = SplitTargetPath(target);
    TargetPath b = std::move(a);
    TargetPath c;
    c = std::move(b);
    ASSERT_FALSE(c.empty()) << target;
    EXPECT_EQ(c.back(), std::string_view(target).size() == 4 ? "A" : "infer");
    if (c.size() > 4) {
      EXPECT_EQ(c[2], "a b");
      EXPECT_EQ(c[4], "1");
    }
  }
}

TEST(ModelName, NamesAreNotPaths) {
  for (const char* ok : {"add_sub", "my model", "mod\xc3\xa8le", "a.b", "...", "v1-2"}) {
    EXPECT_TRUE(CheckModelName(ok).ok()) << ok;
  }
  for (std::string bad : {std::string(""), std::string("."), std::string(".."), std::string("../x"),
                          std::string("/etc"), std::string("a/b"), std::string("a\\b"), std::string("a\0b", 3),
                          std::string("a\nb"), std::string("\x7f"), std::string(256, 'a')}) {
    Status st = CheckModelName(bad);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(st.message().find('\n'), std::string::npos) << "control characters are escaped: " << st.message();
  }
}

class RepositoryConfinement : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("quern_confine_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_ / "repo" / "m" / "1");
    fs::create_directories(root_ / "outside" / "1");
    Write(root_ / "repo" / "m" / "1" / "model.onnx", "x");
    Write(root_ / "outside" / "1" / "model.onnx", "x");
  }
  void TearDown() override { fs::remove_all(root_); }
  static void Write(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }
  fs::path repo() const { return root_ / "repo"; }

  fs::path root_;
};

TEST_F(RepositoryConfinement, ResolvesOnlyInside) {
  EXPECT_TRUE(ResolveInRepository(repo(), repo() / "m", "1/model.onnx", "file").has_value());
  EXPECT_FALSE(ResolveInRepository(repo(), repo() / "m", "../../outside/1/model.onnx", "file").has_value());
  EXPECT_FALSE(ResolveInRepository(repo(), repo() / "m", root_ / "outside", "file").has_value());
  EXPECT_FALSE(ResolveInRepository(repo(), repo() / "m", "/etc/passwd", "file").has_value());
  // Past a missing component ".." is resolved by text while opening follows
  // links: "missing/../out/x" with `out` a link outside would pass.
  fs::create_directory_symlink(root_ / "outside", repo() / "m" / "out");
  EXPECT_FALSE(ResolveInRepository(repo(), repo() / "m", "missing/../out/1/model.onnx", "file").has_value());
  EXPECT_FALSE(ResolveInRepository(repo(), repo() / "m", "out/1/model.onnx", "file").has_value());
  // A sibling whose name starts with the repository's is outside too.
  fs::create_directories(root_ / "repo2");
  EXPECT_FALSE(ResolveInRepository(repo(), repo(), "../repo2", "file").has_value());
}

TEST_F(RepositoryConfinement, LinkedModelFoldersNeedPermission) {
  fs::create_directory_symlink(root_ / "outside", repo() / "linked");
  auto refused = ReadRepositoryModel(repo(), "linked");
  ASSERT_FALSE(refused.has_value());
  EXPECT_NE(refused.error().message().find("outside"), std::string::npos) << refused.error().message();
  auto allowed = ReadRepositoryModel(repo(), "linked", /*allow_links_outside=*/true);
  ASSERT_TRUE(allowed.has_value()) << allowed.error().message();
  // Inside a linked folder, files still may not escape it.
  Write(root_ / "outside" / "config.pbtxt", "default_model_filename: \"x.onnx\"\n");
  fs::create_symlink(root_ / "repo" / "m" / "1" / "model.onnx", root_ / "outside" / "1" / "x.onnx");
  EXPECT_FALSE(ReadRepositoryModel(repo(), "linked", true).has_value());
}

TEST_F(RepositoryConfinement, SymlinkLoopsAreErrorsNotExceptions) {
  fs::create_directory_symlink(repo() / "b", repo() / "a");
  fs::create_directory_symlink(repo() / "a", repo() / "b");
  fs::create_directory_symlink(repo() / "m" / "loop", repo() / "m" / "loop");
  auto names = ListRepositoryModels(repo());
  ASSERT_TRUE(names.has_value());
  auto a = ReadRepositoryModel(repo(), "a");
  EXPECT_FALSE(a.has_value());
  EXPECT_TRUE(ReadRepositoryModel(repo(), "m").has_value());
  EXPECT_FALSE(FingerprintModelDir(repo() / "m").empty());
  EXPECT_FALSE(ReadRepositoryModel(repo(), "../outside").has_value());
  EXPECT_EQ(ReadRepositoryModel(repo(), "nope").error().code(), StatusCode::kNotFound);
}

TEST_F(RepositoryConfinement, ModelFileNamesStayInTheirVersionFolder) {
  Write(repo() / "m" / "config.pbtxt", "default_model_filename: \"../../../outside/1/model.onnx\"\n");
  auto m = ReadRepositoryModel(repo(), "m");
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().message().find("default_model_filename"), std::string::npos) << m.error().message();
}

Result<ModelConfig> Convert(const std::string& text) {
  auto proto = ParseModelConfigText(text, "config.pbtxt");
  if (!proto) return Err(proto.error());
  return ConvertModelConfig(*proto, "config.pbtxt");
}

TEST(ModelConfigBounds, EveryConfiguredNumberHasABound) {
  const std::pair<const char*, const char*> cases[] = {
      {"instance_group [ { count: 100000 } ]", "instance_group"},
      {"instance_group [ { count: 200 }, { count: 200 } ]", "instance_group"},
      {"max_batch_size: 2000000000", "max_batch_size"},
      {"input [ { name: \"x\" data_type: TYPE_FP32 dims: [ 4611686018427387904 ] } ]", "dimension"},
      {"input [ { name: \"x\" data_type: TYPE_FP32 dims: [ 2000000000, 2000000000, 2000000000 ] } ]", "64 bits"},
      {"dynamic_batching { max_queue_delay_microseconds: 18446744073709551615 }", "max_queue_delay_microseconds"},
      {"dynamic_batching { priority_levels: 4000000000 }", "priority_levels"},
      {"dynamic_batching { default_queue_policy { default_timeout_microseconds: 18446744073709551615 } }",
       "default_timeout_microseconds"},
      {"dynamic_batching { priority_levels: 2 priority_queue_policy { key: 1 value { "
       "default_timeout_microseconds: 18446744073709551615 } } }",
       "priority_queue_policy"},
      {"model_warmup [ { name: \"w\" count: 100000000 } ]", "count"},
      {"optimization { graph { level: 99 } }", "level"},
      {"parameters { key: \"quern.batch_size_tunning\" value { string_value: \"on\" } }", "quern.batch_size_tunning"},
  };
  for (const auto& [text, field] : cases) {
    auto c = Convert(text);
    ASSERT_FALSE(c.has_value()) << text;
    EXPECT_NE(c.error().message().find("config.pbtxt"), std::string::npos) << c.error().message();
    EXPECT_NE(c.error().message().find(field), std::string::npos) << c.error().message();
  }
  // Triton's own examples stay within the bounds.
  EXPECT_TRUE(Convert("max_batch_size: 1024\ninstance_group [ { count: 8 } ]\n"
                      "dynamic_batching { max_queue_delay_microseconds: 100000 }\n"
                      "parameters { key: \"quern.image.size\" value { string_value: \"64x64\" } }")
                  .has_value());
}

TEST(ModelConfigBounds, UnknownDataTypeNumbersAreInvalid) {
  // Text format takes any integer for an enum: data_type 32 indexed past the
  // type table (found by fuzzing).
  auto c = Convert(
      "input [ { name: \"x\" data_type: 32 dims: [ 3 ] } ]\n"
      "output [ { name: \"y\" data_type: -5 dims: [ 3 ] } ]");
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  EXPECT_EQ(c->inputs[0].dtype, DataType::kInvalid);
  EXPECT_EQ(c->outputs[0].dtype, DataType::kInvalid);
  c->name = "m";
  Status st = ValidateModelConfig(*c);
  EXPECT_NE(st.message().find("data_type"), std::string::npos) << st.message();
  EXPECT_EQ(DataTypeName(static_cast<DataType>(32)), "INVALID");
  EXPECT_EQ(DataTypeByteSize(static_cast<DataType>(-1)), 0u);
}

TEST(ModelConfigBounds, ValidationBoundsConfigsMadeInCode) {
  ModelConfig c;
  c.name = "m";
  c.inputs.push_back({"x", DataType::kFp32, {4}});
  c.outputs.push_back({"y", DataType::kFp32, {4}});
  EXPECT_TRUE(ValidateModelConfig(c).ok());
  c.instance_count = 100000;
  EXPECT_FALSE(ValidateModelConfig(c).ok());
  c.instance_count = 1;
  c.max_batch_size = 1 << 30;
  EXPECT_FALSE(ValidateModelConfig(c).ok());
  c.max_batch_size = 0;
  c.inputs[0].dims = {int64_t{1} << 40};
  EXPECT_FALSE(ValidateModelConfig(c).ok());
}

std::string Compress(const std::string& s, int window_bits) {
  z_stream zs{};
  deflateInit2(&zs, 6, Z_DEFLATED, window_bits, 8, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&zs, s.size()) + 32, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(s.data()));
  zs.avail_in = static_cast<uInt>(s.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  deflate(&zs, Z_FINISH);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

TEST(ContentEncoding, GzipZlibAndRawDeflateAreDecoded) {
  const std::string body = "{\"inputs\": []}" + std::string(10000, ' ');
  EXPECT_EQ(*DecodeContentEncoding("gzip", Compress(body, 15 + 16), 1 << 20), body);
  EXPECT_EQ(*DecodeContentEncoding("Deflate", Compress(body, 15), 1 << 20), body);
  EXPECT_EQ(*DecodeContentEncoding("deflate", Compress(body, -15), 1 << 20), body);
  EXPECT_EQ(*DecodeContentEncoding("identity", body, 1 << 20), body);
}

TEST(ContentEncoding, BombsGarbageAndUnknownEncodingsAreRefused) {
  const std::string bomb = Compress(std::string(64 << 20, '['), 15 + 16);  // 64 MiB in ~64 KiB
  auto r = DecodeContentEncoding("gzip", bomb, 1 << 20);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kResourceExhausted);
  r = DecodeContentEncoding("gzip", "not gzip", 1 << 20);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);
  const std::string cut = Compress("hello hello hello", 15 + 16);
  r = DecodeContentEncoding("gzip", cut.substr(0, cut.size() - 6), 1 << 20);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);
  r = DecodeContentEncoding("gzip", cut + "trailing", 1 << 20);
  ASSERT_FALSE(r.has_value());
  r = DecodeContentEncoding("br", "x", 1 << 20);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kUnimplemented);
}

TEST(ContentEncoding, ABodyMayInflateAHundredfoldBeyondAMebibyteWithinTheLimit) {
  // Under the body limit (64 MiB) but a thousandfold: refused as soon as it
  // passes 100 times its size.
  const std::string bomb = Compress(std::string(60 << 20, ' '), 15 + 16);
  ASSERT_LT(bomb.size() * 100, size_t{60} << 20);
  auto r = DecodeContentEncoding("gzip", bomb, size_t{64} << 20);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.error().message().find("100 times its"), std::string::npos) << r.error().message();
  // Up to a mebibyte is let through whatever the ratio; a tenfold body of
  // any size too.
  const std::string small(1 << 20, ' ');
  EXPECT_EQ(*DecodeContentEncoding("gzip", Compress(small, 15 + 16), size_t{64} << 20), small);
  std::string varied(8 << 20, ' ');
  uint32_t x = 1;
  for (auto& c : varied) c = static_cast<char>('a' + ((x = x * 1103515245 + 12345) >> 16) % 8);
  EXPECT_EQ(*DecodeContentEncoding("gzip", Compress(varied, 15 + 16), size_t{64} << 20), varied);
}

}  // namespace
}  // namespace quern
