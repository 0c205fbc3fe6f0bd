// FaceService over the real example face detector (CenterFace) and face
// descriptor, with the example portraits: its checks, and register,
// recognize and match end to end.
#include "pipeline/face_service.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>

#include "test_util.h"

namespace quern {
namespace {

std::string Photo(const std::string& name) {
  std::ifstream in(testing::Examples() / "data" / name, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class FaceServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto models = testing::Examples() / "models";
    if (!std::filesystem::exists(models / "faces") || !std::filesystem::exists(testing::Examples() / "data")) {
      GTEST_SKIP() << "the example face models and photos are set up by scripts/setup.sh";
    }
    for (const char* m : {"faces", "face_descriptor"}) {
      std::filesystem::copy(models / m, repo_.path() / m, std::filesystem::copy_options::recursive);
    }
    auto engine = Engine::Create({.model_repository = repo_.path().string()});
    ASSERT_TRUE(engine.has_value()) << engine.error().ToString();
    engine_ = std::move(*engine);
    VisionServiceOptions o;
    o.model_repository = repo_.path().string();
    service_ = std::make_unique<VisionService>(engine_.get(), o);
    auto gallery = FaceGallery::Open({}, nullptr);
    ASSERT_TRUE(gallery.has_value());
    gallery_ = std::move(*gallery);
    faces_ = std::make_unique<FaceService>(service_.get(), gallery_.get(), "");
  }

  // The result of `r` with `images` (field name, bytes), or the error
  // Submit returned.
  FaceResult Run(FaceRequest r, const std::vector<std::pair<std::string, std::string>>& images) {
    r.face_model = r.face_model.empty() ? "faces" : r.face_model;
    auto photos = std::make_shared<const std::vector<std::pair<std::string, std::string>>>(images);
    r.images.clear();
    for (const auto& [name, bytes] : *photos) r.images.push_back({name, bytes});
    r.owner = photos;
    std::promise<FaceResult> p;
    if (Status st = faces_->Submit(std::move(r), [&p](FaceResult&& f) { p.set_value(std::move(f)); }); !st.ok()) {
      FaceResult refused;
      refused.status = st;
      return refused;
    }
    return p.get_future().get();
  }

  testing::TempDir repo_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<VisionService> service_;
  std::unique_ptr<FaceGallery> gallery_;
  std::unique_ptr<FaceService> faces_;
};

TEST_F(FaceServiceTest, RequestsAreCheckedBeforeAnyImageIsSent) {
  FaceRequest r;
  r.kind = FaceRequest::Kind::kMatch;
  EXPECT_NE(Run(r, {{"image1", "x"}}).status.message().find("two images"), std::string::npos);
  r.kind = FaceRequest::Kind::kRegister;
  r.userid = "";
  EXPECT_NE(Run(r, {{"image", "x"}}).status.message().find("empty"), std::string::npos) << "the user id";
  r.userid = "ann";
  EXPECT_NE(Run(r, {{"image", ""}}).status.message().find("'image' field is empty"), std::string::npos);
  r.face_model = "face_descriptor";
  EXPECT_NE(Run(r, {{"image", "x"}}).status.message().find("not a detection model"), std::string::npos);
  FaceService off(service_.get(), nullptr, "");
  EXPECT_EQ(off.Available().code(), StatusCode::kUnavailable);
  EXPECT_EQ(off.Users().error().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(gallery_->Users().empty()) << "nothing was registered";
}

TEST_F(FaceServiceTest, RegistersRecognisesAndMatchesTheSamePerson) {
  FaceRequest reg;
  reg.kind = FaceRequest::Kind::kRegister;
  reg.userid = "obama";
  const FaceResult registered = Run(reg, {{"image", Photo("obama.jpg")}});
  ASSERT_TRUE(registered.status.ok()) << registered.status.ToString();
  EXPECT_EQ(*faces_->Users(), std::vector<std::string>{"obama"});

  FaceRequest rec;
  rec.kind = FaceRequest::Kind::kRecognize;
  const FaceResult known = Run(rec, {{"image", Photo("obama2.jpg")}});
  ASSERT_TRUE(known.status.ok()) << known.status.ToString();
  ASSERT_FALSE(known.faces.empty());
  EXPECT_EQ(known.faces[0].userid, "obama");
  EXPECT_GE(known.faces[0].confidence, kDefaultFaceMatchConfidence);
  const FaceResult other = Run(rec, {{"image", Photo("biden.jpg")}});
  ASSERT_TRUE(other.status.ok()) << other.status.ToString();
  ASSERT_FALSE(other.faces.empty());
  EXPECT_EQ(other.faces[0].userid, "unknown");
  EXPECT_EQ(other.faces[0].confidence, 0.0);

  FaceRequest match;
  match.kind = FaceRequest::Kind::kMatch;
  const FaceResult same = Run(match, {{"image1", Photo("obama.jpg")}, {"image2", Photo("obama3.jpg")}});
  const FaceResult different = Run(match, {{"image1", Photo("obama.jpg")}, {"image2", Photo("biden.jpg")}});
  ASSERT_TRUE(same.status.ok() && different.status.ok()) << same.status.ToString() << different.status.ToString();
  EXPECT_GT(same.similarity, different.similarity);

  const FaceResult no_face = Run(match, {{"image1", Photo("obama.jpg")}, {"image2", Photo("dog.jpg")}});
  EXPECT_NE(no_face.status.message().find("no face was found in 'image2'"), std::string::npos)
      << no_face.status.ToString();
  EXPECT_FALSE(no_face.counted) << "found here, not a failure of the service's";
  const FaceResult broken = Run(match, {{"image1", Photo("obama.jpg")}, {"image2", "not an image"}});
  EXPECT_TRUE(broken.status.message().starts_with("image2: ")) << broken.status.ToString();
  EXPECT_TRUE(broken.counted);
}

}  // namespace
}  // namespace quern
