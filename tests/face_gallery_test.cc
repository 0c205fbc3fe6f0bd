// The face gallery (registered faces, their file and a shared store) and
// the square crops a face descriptor reads. Expected values are worked out
// in the comments; the file's records are written here from the format its
// header states.
#include "pipeline/face_gallery.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <csignal>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <map>
#include <thread>
#include <utility>

#include "image/image.h"
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

// The file's size limit (RLIMIT_FSIZE) set to `bytes` for the scope: a
// write past it fails with EFBIG (SIGXFSZ ignored), for root too.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    old_signal_ = std::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &old_);
    rlimit l = old_;
    l.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &l);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_signal_);
  }

 private:
  rlimit old_{};
  void (*old_signal_)(int) = nullptr;
};

// One record of the log as face_gallery.cc writes it: u32 payload length,
// its complement, u32 FNV-1a of the payload, payload = u32 id length, id,
// u32 dimension, u32 count, the faces (no faces: deleted).
std::string Record(const std::string& id, const std::vector<std::vector<float>>& faces) {
  auto u32 = [](std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); };
  std::string payload;
  u32(payload, static_cast<uint32_t>(id.size()));
  payload += id;
  if (!faces.empty()) {
    u32(payload, static_cast<uint32_t>(faces[0].size()));
    u32(payload, static_cast<uint32_t>(faces.size()));
    for (const auto& f : faces) payload.append(reinterpret_cast<const char*>(f.data()), f.size() * 4);
  }
  uint32_t h = 2166136261u;
  for (char c : payload) h = (h ^ static_cast<unsigned char>(c)) * 16777619u;
  std::string out;
  u32(out, static_cast<uint32_t>(payload.size()));
  u32(out, ~static_cast<uint32_t>(payload.size()));
  u32(out, h);
  return out + payload;
}

TEST(FaceGallery, AFileThatCannotBeWrittenChangesNothing) {
  TempDir dir;
  const auto file = dir.path() / "faces.bin";
  auto g = std::move(*FaceGallery::Open({}, FileFaceStore(file)));
  ASSERT_TRUE(g->Register("ann", {{1, 0}}).ok());
  const std::string before = ReadAll(file);
  for (rlim_t room : {rlim_t{0}, rlim_t{10}}) {  // nothing written, or part of the record
    Status st;
    {
      FileSizeLimit limit(before.size() + room);
      st = g->Register("bob", {{0, 1}});
    }
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << room;
    EXPECT_NE(st.message().find("faces.bin"), std::string::npos) << st.message();
    EXPECT_EQ(ReadAll(file), before) << "a record cut short stays in the file";
  }
  {
    FileSizeLimit limit(before.size());
    EXPECT_EQ(g->Delete("ann").code(), StatusCode::kUnavailable);
  }
  EXPECT_EQ(g->Users(), (std::vector<std::string>{"ann"}));
  ASSERT_TRUE(g->Register("bob", {{0, 1}}).ok());  // and the log goes on where it was
  EXPECT_EQ((*FaceGallery::Open({}, FileFaceStore(file)))->Users(), (std::vector<std::string>{"ann", "bob"}));
  // Compaction writes beside the file: a folder in that place fails it, and
  // the file stays as it was.
  TempDir other;
  const auto fresh = other.path() / "faces.bin";
  std::filesystem::create_directory(other.path() / "faces.bin.tmp");
  auto h = std::move(*FaceGallery::Open({}, FileFaceStore(fresh)));
  EXPECT_EQ(h->Register("ann", {{1, 0}}).code(), StatusCode::kUnavailable);  // the first record writes the log whole
  EXPECT_TRUE(h->Users().empty());
  EXPECT_FALSE(std::filesystem::exists(fresh));
}

TEST(FaceGallery, ARegistrationAppendsItsOwnRecordAndTheLogIsCompacted) {
  TempDir dir;
  const auto file = dir.path() / "faces.bin";
  auto g = std::move(*FaceGallery::Open({}, FileFaceStore(file)));
  // 200 users of 4 faces of 256 values: 200 records of 12 + 4 + 2..4 + 8 + 4096 bytes.
  std::vector<std::vector<float>> four(4, std::vector<float>(256, 0.5f));
  for (int u = 0; u < 200; ++u) {
    std::string id = "u";  // (GCC 12 warns wrongly of "u" + std::to_string(u))
    id.append(std::to_string(u));
    ASSERT_TRUE(g->Register(id, four).ok());
  }
  const auto size = std::filesystem::file_size(file);
  // One more face for u7: the file grows by u7's record (its 5 faces), not by the gallery.
  std::vector<std::vector<float>> five = four;
  five.push_back(std::vector<float>(256, 0.25f));
  ASSERT_TRUE(g->Register("u7", {five.back()}).ok());
  EXPECT_EQ(std::filesystem::file_size(file), size + Record("u7", five).size());
  EXPECT_EQ(ReadAll(file).substr(size), Record("u7", five));
  // A deletion appends a record of its own.
  ASSERT_TRUE(g->Delete("u8").ok());
  EXPECT_EQ(ReadAll(file).substr(size + Record("u7", five).size()), Record("u8", {}));
  // 400 more registrations of one user (16 faces kept, 65 KB a record):
  // the log is compacted whenever it passes twice its live bytes + 1 MiB
  // (2.8 MB here: every 40 or so registrations).
  std::vector<float> face(256, 0.1f);
  uint64_t largest = 0;
  for (int i = 0; i < 400; ++i) {
    face[i % 256] += 1;
    ASSERT_TRUE(g->Register("busy", {face}).ok());
    largest = std::max<uint64_t>(largest, std::filesystem::file_size(file));
  }
  const uint64_t live =
      199 * Record("u0", four).size() + Record("busy", std::vector<std::vector<float>>(16, face)).size();
  EXPECT_LE(largest, 2 * live + (1u << 20) + Record("busy", std::vector<std::vector<float>>(16, face)).size());
  auto again = std::move(*FaceGallery::Open({}, FileFaceStore(file)));
  EXPECT_EQ(again->Users().size(), 200u);  // u0..u199 less u8, and busy
  EXPECT_NEAR(again->Current()->Closest(face)->similarity, 1.0f, 1e-6);
  EXPECT_EQ(again->Current()->Closest(face)->userid, "busy");
  // Opened again, the log is appended to, not rewritten.
  const auto reopened = std::filesystem::file_size(file);
  ASSERT_TRUE(again->Delete("u9").ok());
  EXPECT_EQ(std::filesystem::file_size(file), reopened + Record("u9", {}).size());
}

TEST(FaceGallery, ARecordCutShortAtTheEndIsDroppedAndDamageElsewhereRefused) {
  TempDir dir;
  const auto file = dir.path() / "faces.bin";
  {
    auto g = std::move(*FaceGallery::Open({}, FileFaceStore(file)));
    ASSERT_TRUE(g->Register("ann", {{1, 2, 3}, {4, 5, 6}}).ok());
    ASSERT_TRUE(g->Register("bob", {{0, 0, 1}}).ok());
  }
  const std::string whole = ReadAll(file);
  const std::string ann = Record("ann", {{1, 2, 3}, {4, 5, 6}}), bob = Record("bob", {{0, 0, 1}});
  ASSERT_EQ(whole, std::string("QUERNFACES2\n") + ann + bob);
  // Cut anywhere in bob's record (a stop while it was appended): bob is
  // dropped, ann kept, and the next record goes where bob's began.
  for (size_t n = whole.size() - bob.size() + 1; n < whole.size(); ++n) {
    std::ofstream(file, std::ios::binary | std::ios::trunc) << whole.substr(0, n);
    auto g = FaceGallery::Open({}, FileFaceStore(file));
    ASSERT_TRUE(g.has_value()) << "cut at " << n << ": " << g.error().ToString();
    EXPECT_EQ((*g)->Users(), (std::vector<std::string>{"ann"})) << n;
  }
  {
    auto g = std::move(*FaceGallery::Open({}, FileFaceStore(file)));
    ASSERT_TRUE(g->Register("cat", {{1, 1, 0}}).ok());
  }
  EXPECT_EQ(ReadAll(file), std::string("QUERNFACES2\n") + ann + Record("cat", {{1, 1, 0}}));
  // The last record's bytes overwritten (its checksum fails at the end): dropped too.
  std::string flipped = whole;
  flipped[flipped.size() - 1] ^= 0x40;
  std::ofstream(file, std::ios::binary | std::ios::trunc) << flipped;
  EXPECT_EQ((*FaceGallery::Open({}, FileFaceStore(file)))->Users(), (std::vector<std::string>{"ann"}));
  // Anywhere before the last record, a wrong byte is damage: refused, naming the file and the record.
  // (12: the first record's length, 16: its complement, 20: its checksum, 24 on: its payload.)
  for (size_t at : {size_t{12}, size_t{13}, size_t{16}, size_t{20}, size_t{24}, size_t{12 + ann.size() - 1}}) {
    std::string damaged = whole;
    damaged[at] ^= 0x40;
    std::ofstream(file, std::ios::binary | std::ios::trunc) << damaged;
    auto g = FaceGallery::Open({}, FileFaceStore(file));
    ASSERT_FALSE(g.has_value()) << at;
    EXPECT_NE(g.error().message().find("faces.bin"), std::string::npos) << g.error().message();
  }
  std::ofstream(file, std::ios::binary | std::ios::trunc) << "QUERNFACES9\n" << ann;
  EXPECT_FALSE(FaceGallery::Open({}, FileFaceStore(file)).has_value());
  // What a stop can leave after the last record: zeros (the file grew, its
  // bytes never came), or a header whose complement did not reach the disk.
  std::string header_only = bob.substr(0, 4) + std::string(8, '\0');
  for (const std::string& tail : {std::string(40, '\0'), header_only, header_only + bob.substr(12, 5)}) {
    std::ofstream(file, std::ios::binary | std::ios::trunc) << "QUERNFACES2\n" << ann << tail;
    auto g = FaceGallery::Open({}, FileFaceStore(file));
    ASSERT_TRUE(g.has_value()) << tail.size() << ": " << g.error().ToString();
    EXPECT_EQ((*g)->Users(), (std::vector<std::string>{"ann"}));
  }
}

TEST(FaceGallery, TheEarlierWholeFileIsReadAndRewrittenAsALogAtTheFirstChange) {
  TempDir dir;
  const auto file = dir.path() / "faces.bin";
  // The earlier form: magic, u32 dimension, u32 users, per user u32 id
  // length, id, u32 faces, the faces.
  auto u32 = [](std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); };
  std::string old = "QUERNFACES1\n";
  u32(old, 2);
  u32(old, 2);
  for (const auto& [id, f] : {std::pair<std::string, std::vector<float>>{"ann", {1, 0}}, {"bob", {0, 1}}}) {
    u32(old, static_cast<uint32_t>(id.size()));
    old += id;
    u32(old, 1);
    old.append(reinterpret_cast<const char*>(f.data()), 8);
  }
  std::ofstream(file, std::ios::binary) << old;
  {
    auto g = std::move(*FaceGallery::Open({}, FileFaceStore(file)));
    EXPECT_EQ(g->Users(), (std::vector<std::string>{"ann", "bob"}));
    EXPECT_EQ(g->Current()->Closest(std::vector<float>{0, 2})->userid, "bob");
    EXPECT_EQ(ReadAll(file), old);  // read only
    ASSERT_TRUE(g->Register("cat", {{0.6f, 0.8f}}).ok());
  }
  EXPECT_EQ(ReadAll(file), std::string("QUERNFACES2\n") + Record("ann", {{1, 0}}) + Record("bob", {{0, 1}}) +
                               Record("cat", {{0.6f, 0.8f}}));
  old.resize(old.size() - 3);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << old;  // the earlier form cut short: refused
  auto g = FaceGallery::Open({}, FileFaceStore(file));
  ASSERT_FALSE(g.has_value());
  EXPECT_NE(g.error().message().find("cut short"), std::string::npos) << g.error().message();
}

// One store that several galleries (instances) share, as they share Redis:
// a log of records, every version's.
struct SharedState {
  std::vector<FaceRecord> log;
};
class SharedStore : public FaceGalleryStore {
 public:
  explicit SharedStore(std::shared_ptr<SharedState> s) : s_(std::move(s)) {}
  Result<Records> Read() override {
    std::map<std::string, std::string> latest;
    for (const auto& r : s_->log) latest[r.userid] = r.faces;
    Records out;
    for (auto& [id, faces] : latest) {
      if (!faces.empty()) out.records.push_back({id, faces});
    }
    out.version = static_cast<int64_t>(s_->log.size());
    ++reads;
    return out;
  }
  Result<int64_t> Version() override { return static_cast<int64_t>(s_->log.size()); }
  Result<std::optional<Records>> ChangesSince(int64_t since) override {
    if (since > static_cast<int64_t>(s_->log.size())) return std::optional<Records>();
    return std::optional<Records>(
        Records{std::vector<FaceRecord>(s_->log.begin() + since, s_->log.end()), static_cast<int64_t>(s_->log.size())});
  }
  Result<std::optional<int64_t>> Write(const FaceRecord& record, int64_t based_on) override {
    if (before_write) std::exchange(before_write, nullptr)();  // another instance writes first
    if (based_on != static_cast<int64_t>(s_->log.size())) return std::optional<int64_t>();
    s_->log.push_back(record);
    return std::optional<int64_t>(static_cast<int64_t>(s_->log.size()));
  }
  std::string Describe() const override { return "shared store"; }
  bool Shared() const override { return true; }
  std::function<void()> before_write;
  int reads = 0;

 private:
  std::shared_ptr<SharedState> s_;
};

TEST(FaceGallery, InstancesSharingAStoreLoseNoChange) {
  auto state = std::make_shared<SharedState>();
  auto own = std::make_unique<SharedStore>(state);
  SharedStore* store = own.get();
  auto a = std::move(*FaceGallery::Open({}, std::move(own)));
  auto b_own = std::make_unique<SharedStore>(state);
  SharedStore* b_store = b_own.get();
  auto b = std::move(*FaceGallery::Open({}, std::move(b_own)));
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
  // After the first read, each instance reads only what changed.
  EXPECT_EQ(store->reads, 1);
  EXPECT_EQ(b_store->reads, 1);
  // A user's faces from both instances: each keeps the other's.
  store->before_write = [&] { ASSERT_TRUE(b->Register("ann", {{0.8f, 0.6f}}).ok()); };
  ASSERT_TRUE(a->Register("ann", {{0, 1}}).ok());
  EXPECT_NEAR(b->Current()->Closest(std::vector<float>{0.8f, 0.6f})->similarity, 1.0f, 1e-6);
  EXPECT_NEAR(b->Current()->Closest(std::vector<float>{0, 1})->similarity, 1.0f, 1e-6);
}

// A shared store whose writes wait until the test lets them go.
class SlowStore : public SharedStore {
 public:
  using SharedStore::SharedStore;
  Result<std::optional<int64_t>> Write(const FaceRecord& record, int64_t based_on) override {
    writing.set_value();
    release.get_future().wait();
    return SharedStore::Write(record, based_on);
  }
  std::promise<void> writing, release;
};

// A shared store whose reads wait until the test lets them go.
class SlowReadStore : public SharedStore {
 public:
  using SharedStore::SharedStore;
  Result<Records> Read() override {
    reading.set_value();
    release.get_future().wait();
    return SharedStore::Read();
  }
  std::promise<void> reading, release;
};

TEST(FaceGallery, BeforeASharedStoreIsFirstReadRecognitionWaitsForIt) {
  auto state = std::make_shared<SharedState>();
  state->log.push_back({"ann", EncodeFaces({{1, 0}})});  // registered by another instance
  auto own = std::make_unique<SlowReadStore>(state);
  SlowReadStore* store = own.get();
  auto g = std::move(*FaceGallery::Open({}, std::move(own)));
  auto first = std::async(std::launch::async, [&] { return g->Current(); });
  store->reading.get_future().wait();
  auto second = std::async(std::launch::async, [&] { return g->Current(); });
  EXPECT_EQ(second.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "answered from a gallery never read";
  store->release.set_value();
  EXPECT_EQ(first.get()->Closest(std::vector<float>{1, 0})->userid, "ann");
  EXPECT_EQ(second.get()->Closest(std::vector<float>{1, 0})->userid, "ann");
}

TEST(FaceGallery, RecognitionNeverWaitsForAChangeBeingWritten) {
  auto state = std::make_shared<SharedState>();
  auto own = std::make_unique<SlowStore>(state);
  SlowStore* store = own.get();
  auto g = std::move(*FaceGallery::Open({}, std::move(own)));
  std::thread registering([&] { EXPECT_TRUE(g->Register("ann", {{1, 0}}).ok()); });
  store->writing.get_future().wait();
  // The write is under way and holds the store: recognition answers from the faces as they are.
  auto now = std::async(std::launch::async, [&] { return g->Current(); });
  ASSERT_EQ(now.wait_for(std::chrono::seconds(10)), std::future_status::ready) << "recognition waited for the write";
  EXPECT_TRUE(now.get()->users.empty());
  store->release.set_value();
  registering.join();
  EXPECT_EQ(g->Current()->Closest(std::vector<float>{1, 0})->userid, "ann");
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
