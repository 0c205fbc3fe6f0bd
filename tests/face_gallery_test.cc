// The face gallery (registered faces and their file) and the square crops a
// face descriptor reads. Expected values are worked out in the comments.
#include "pipeline/face_gallery.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <functional>
#include <iterator>
#include <utility>

#include "pipeline/image.h"
#include "test_util.h"

namespace quern {
namespace {

using quern::testing::TempDir;

std::string ReadAll(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(FaceGallery, ClosestFaceByCosineAndRoundTripThroughTheFile) {
  TempDir dir;
  const auto file = dir.path() / "faces.bin";
  {
    auto g = FaceGallery::Open({}, FileFaceStore(file));
    ASSERT_TRUE(g.has_value()) << g.error().ToString();
    ASSERT_TRUE((*g)->Register("ann", {{1, 0, 0}, {0.8f, 0.6f, 0}}).ok());
    ASSERT_TRUE((*g)->Register("bob", {{0, 0, 2}}).ok());  // not unit length: cosine ignores length
    // (0.6, 0.8, 0): cosine with ann's second face 0.48 + 0.48 = 0.96, with her first 0.6, with bob 0.
    auto m = (*g)->Current()->Closest(std::vector<float>{0.6f, 0.8f, 0});
    ASSERT_TRUE(m.has_value());
    EXPECT_EQ(m->userid, "ann");
    EXPECT_NEAR(m->similarity, 0.96f, 1e-6);
    EXPECT_FALSE((*g)->Current()->Closest(std::vector<float>{1, 0}).has_value());  // another dimension
  }
  auto g = FaceGallery::Open({}, FileFaceStore(file));  // read back
  ASSERT_TRUE(g.has_value()) << g.error().ToString();
  EXPECT_EQ((*g)->Users(), (std::vector<std::string>{"ann", "bob"}));
  EXPECT_NEAR((*g)->Current()->Closest(std::vector<float>{0, 0.1f, 1})->similarity, 1 / std::sqrt(1.01f), 1e-6);
  EXPECT_EQ((*g)->Current()->Closest(std::vector<float>{0, 0.1f, 1})->userid, "bob");
  EXPECT_TRUE((*g)->Delete("bob").ok());
  EXPECT_EQ((*g)->Delete("bob").code(), StatusCode::kNotFound);
  EXPECT_EQ((*FaceGallery::Open({}, FileFaceStore(file)))->Users(), (std::vector<std::string>{"ann"}));
  struct stat st {};
  ASSERT_EQ(::stat(file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);  // faces are personal data
}

TEST(FaceGallery, RefusesWhatDoesNotFitAndKeepsWhatItHad) {
  FaceGalleryOptions o;
  o.max_users = 2;
  o.max_faces_per_user = 2;
  auto g = std::move(*FaceGallery::Open(o, nullptr));
  EXPECT_EQ(g->Register("", {{1}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g->Register("a\nb", {{1}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g->Register(std::string(257, 'x'), {{1}}).code(), StatusCode::kInvalidArgument);
  for (const char* bad : {"\xff", "a\xc3", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xc2\x85"}) {
    EXPECT_EQ(g->Register(bad, {{1}}).code(), StatusCode::kInvalidArgument) << bad;  // not UTF-8, or C1 control
  }
  EXPECT_TRUE(FaceGallery::CheckUserId("Zoë Saldaña 张伟 🙂").ok());
  EXPECT_EQ(g->Register("ann", {}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g->Register("ann", {{1, 0}, {1}}).code(), StatusCode::kInvalidArgument);  // lengths differ
  EXPECT_EQ(g->Register("ann", {{std::nanf(""), 0}}).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(g->Register("ann", {{1, 0}}).ok());
  EXPECT_EQ(g->Register("bob", {{1, 0, 0}}).code(), StatusCode::kFailedPrecondition);  // another descriptor
  ASSERT_TRUE(g->Register("bob", {{0, 1}}).ok());
  EXPECT_EQ(g->Register("cat", {{0, 1}}).code(), StatusCode::kResourceExhausted);  // a third user
  // A user keeps her newest faces: (1, 0) goes when two more come.
  ASSERT_TRUE(g->Register("ann", {{0.6f, 0.8f}, {0.8f, 0.6f}}).ok());
  EXPECT_NEAR(g->Current()->Closest(std::vector<float>{1, 0})->similarity, 0.8f, 1e-6);
  EXPECT_EQ(g->Users(), (std::vector<std::string>{"ann", "bob"}));
}

TEST(FaceGallery, AFileThatCannotBeWrittenChangesNothing) {
  TempDir dir;
  const auto file = dir.path() / "faces.bin";
  auto g = std::move(*FaceGallery::Open({}, FileFaceStore(file)));
  ASSERT_TRUE(g->Register("ann", {{1, 0}}).ok());
  // The file is written beside itself first; a directory in that place
  // makes every write fail (for root too).
  std::filesystem::create_directory(dir.path() / "faces.bin.tmp");
  Status st = g->Register("bob", {{0, 1}});
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("faces.bin"), std::string::npos) << st.message();
  EXPECT_EQ(g->Delete("ann").code(), StatusCode::kUnavailable);
  EXPECT_EQ(g->Users(), (std::vector<std::string>{"ann"}));
  std::filesystem::remove(dir.path() / "faces.bin.tmp");
  EXPECT_EQ((*FaceGallery::Open({}, FileFaceStore(file)))->Users(), (std::vector<std::string>{"ann"}));
}

TEST(FaceGallery, ADamagedFileIsRefusedAtEveryCut) {
  TempDir dir;
  const auto file = dir.path() / "faces.bin";
  ASSERT_TRUE((*FaceGallery::Open({}, FileFaceStore(file)))->Register("ann", {{1, 2, 3}, {4, 5, 6}}).ok());
  const std::string whole = ReadAll(file);
  // 12-byte magic + dimension + users + id length + "ann" + faces + 2 x 3 floats.
  ASSERT_EQ(whole.size(), 12u + 4 + 4 + 4 + 3 + 4 + 24);
  for (size_t n = 1; n < whole.size(); ++n) {  // (an empty file stores nothing)
    std::ofstream(file, std::ios::binary | std::ios::trunc) << whole.substr(0, n);
    auto g = FaceGallery::Open({}, FileFaceStore(file));
    EXPECT_FALSE(g.has_value()) << "cut at " << n;
    if (!g) {
      EXPECT_NE(g.error().message().find("faces.bin"), std::string::npos) << g.error().message();
    }
  }
  std::ofstream(file, std::ios::binary | std::ios::trunc) << whole << "x";
  EXPECT_FALSE(FaceGallery::Open({}, FileFaceStore(file)).has_value());
  std::string huge = whole;
  huge[12] = '\xff';  // a dimension of 255 + ...: the faces no longer fit the file
  huge[13] = '\xff';
  std::ofstream(file, std::ios::binary | std::ios::trunc) << huge;
  EXPECT_FALSE(FaceGallery::Open({}, FileFaceStore(file)).has_value());
}

// One store that several galleries (instances) share, as they share Redis.
struct SharedState {
  std::string bytes;
  int64_t version = 0;
};
class SharedStore : public FaceGalleryStore {
 public:
  explicit SharedStore(std::shared_ptr<SharedState> s) : s_(std::move(s)) {}
  Result<Stored> Read() override { return Stored{s_->bytes, s_->version}; }
  Result<int64_t> Version() override { return s_->version; }
  Result<std::optional<int64_t>> Write(const std::string& bytes, int64_t based_on) override {
    if (before_write) std::exchange(before_write, nullptr)();  // another instance writes first
    if (based_on != s_->version) return std::optional<int64_t>();
    s_->bytes = bytes;
    return std::optional<int64_t>(++s_->version);
  }
  std::string Describe() const override { return "shared store"; }
  std::function<void()> before_write;

 private:
  std::shared_ptr<SharedState> s_;
};

TEST(FaceGallery, InstancesSharingAStoreLoseNoChange) {
  auto state = std::make_shared<SharedState>();
  auto own = std::make_unique<SharedStore>(state);
  SharedStore* store = own.get();
  auto a = std::move(*FaceGallery::Open({}, std::move(own)));
  auto b = std::move(*FaceGallery::Open({}, std::make_unique<SharedStore>(state)));
  // b registers bob between a's read and a's write: a's write is refused,
  // and a applies its change again to what b wrote.
  store->before_write = [&] { ASSERT_TRUE(b->Register("bob", {{0, 1}}).ok()); };
  ASSERT_TRUE(a->Register("ann", {{1, 0}}).ok());
  EXPECT_EQ(a->Users(), (std::vector<std::string>{"ann", "bob"}));
  EXPECT_EQ(b->Users(), (std::vector<std::string>{"ann", "bob"}));  // b reads the new version
  store->before_write = [&] { ASSERT_TRUE(b->Delete("bob").ok()); };
  ASSERT_TRUE(a->Register("cat", {{0.6f, 0.8f}}).ok());
  EXPECT_EQ(b->Users(), (std::vector<std::string>{"ann", "cat"}));
  EXPECT_EQ(b->Current()->Closest(std::vector<float>{0.6f, 0.8f})->userid, "cat");
}

TEST(CropSquare, TheLongerSideCentredAndMovedInsideTheImage) {
  // A 10x6 image whose pixel (x, y) has red = 10 * y + x.
  DecodedImage d;
  d.image.width = 10;
  d.image.height = 6;
  for (int y = 0; y < 6; ++y) {
    for (int x = 0; x < 10; ++x) d.image.pixels.insert(d.image.pixels.end(), {static_cast<uint8_t>(10 * y + x), 0, 0});
  }
  d.source_width = 10;
  d.source_height = 6;
  // Box x 2-4, y 1-5: 2 wide, 4 high -> a 4x4 square centred on (3, 3): x 1-5, y 1-5.
  DecodedImage c = CropSquare(d, 2, 1, 4, 5);
  ASSERT_EQ(c.image.width, 4);
  ASSERT_EQ(c.source_height, 4);
  EXPECT_EQ(c.image.pixels[0], 11);                // (1, 1)
  EXPECT_EQ(c.image.pixels[(3 * 4 + 3) * 3], 44);  // (4, 4)
  // At the right edge: box x 9-10, y 0-2 -> a 2x2 square around (9.5, 1) moved inside: x 8-10, y 0-2.
  c = CropSquare(d, 9, 0, 10, 2);
  EXPECT_EQ(c.image.width, 2);
  EXPECT_EQ(c.image.pixels[0], 8);
  // Box x 8-10, y -1-3 -> a 4x4 square around (9, 1) moved inside: x 6-10, y 0-4.
  c = CropSquare(d, 8, -1, 10, 3);
  ASSERT_EQ(c.image.width, 4);
  EXPECT_EQ(c.image.pixels[0], 6);  // (6, 0)
  // Larger than the image: the shorter side (6), around (0, 0) moved inside: x 0-6, y 0-6.
  c = CropSquare(d, -50, -50, 50, 50);
  ASSERT_EQ(c.image.width, 6);
  EXPECT_EQ(c.image.pixels[0], 0);
  EXPECT_EQ(c.image.pixels[(5 * 6 + 5) * 3], 55);
  // A source twice the decoded size (DCT scaling): the box is mapped first.
  d.source_width = 20;
  d.source_height = 12;
  c = CropSquare(d, 4, 2, 8, 10);  // decoded x 2-4, y 1-5, as the first case
  ASSERT_EQ(c.image.width, 4);
  EXPECT_EQ(c.image.pixels[0], 11);
}

}  // namespace
}  // namespace quern
