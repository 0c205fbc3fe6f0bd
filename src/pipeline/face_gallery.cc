#include "pipeline/face_gallery.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>

#include "core/log.h"

namespace quern {
namespace {

static_assert(std::endian::native == std::endian::little, "the stored gallery is little-endian");

constexpr std::string_view kMagic = "QUERNFACES1\n";
constexpr size_t kMaxUserIdBytes = 256;
constexpr size_t kMaxDimension = 65536;
// Writes that lose the race to another instance before one is given up.
constexpr int kMaxAttempts = 16;

void PutU32(std::string& out, size_t v) {
  const auto u = static_cast<uint32_t>(v);
  out.append(reinterpret_cast<const char*>(&u), 4);
}

// Reads the stored form's fields in order; every read is bounds-checked.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  bool U32(size_t& v) {
    uint32_t u = 0;
    if (data_.size() < 4) return false;
    std::memcpy(&u, data_.data(), 4);
    data_.remove_prefix(4);
    v = u;
    return true;
  }
  bool Bytes(size_t n, std::string_view& out) {
    if (data_.size() < n) return false;
    out = data_.substr(0, n);
    data_.remove_prefix(n);
    return true;
  }
  bool done() const { return data_.empty(); }

 private:
  std::string_view data_;
};

class FileStore : public FaceGalleryStore {
 public:
  explicit FileStore(std::filesystem::path file) : file_(std::move(file)) {}

  Result<Stored> Read() override {
    Stored s;
    std::error_code ec;
    if (!std::filesystem::exists(file_, ec)) return s;  // none registered yet
    std::ifstream in(file_, std::ios::binary);
    if (!in) return std::unexpected(Unavailable(Describe() + " cannot be read"));
    s.bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    s.version = version_;
    return s;
  }

  Result<int64_t> Version() override { return version_; }  // this process is its only writer

  Result<std::optional<int64_t>> Write(const std::string& bytes, int64_t based_on) override {
    if (based_on != version_) return std::optional<int64_t>();
    const std::filesystem::path tmp = file_.string() + ".tmp";
    ::unlink(tmp.c_str());  // one left by a crash; never followed if it is a link
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return std::unexpected(Unavailable(Describe() + " cannot be written: " + std::strerror(errno)));
    int failed = 0;
    for (size_t done = 0; done < bytes.size() && failed == 0;) {
      const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) failed = n < 0 ? errno : EIO;
      if (n > 0) done += static_cast<size_t>(n);
    }
    if (failed == 0 && ::fsync(fd) != 0) failed = errno;
    if (::close(fd) != 0 && failed == 0) failed = errno;
    if (failed == 0 && ::rename(tmp.c_str(), file_.c_str()) != 0) failed = errno;
    if (failed != 0) {
      ::unlink(tmp.c_str());
      return std::unexpected(Unavailable(Describe() + " cannot be written: " + std::strerror(failed)));
    }
    return std::optional<int64_t>(++version_);
  }

  std::string Describe() const override { return "face gallery " + file_.string(); }

 private:
  const std::filesystem::path file_;
  int64_t version_ = 0;
};

}  // namespace

std::unique_ptr<FaceGalleryStore> FileFaceStore(std::filesystem::path file) {
  return std::make_unique<FileStore>(std::move(file));
}

Result<std::unique_ptr<FaceGallery>> FaceGallery::Open(FaceGalleryOptions options,
                                                       std::unique_ptr<FaceGalleryStore> store) {
  std::unique_ptr<FaceGallery> g(new FaceGallery(options, std::move(store)));
  if (g->store_ && !g->store_->Shared()) {
    MutexLock lock(g->mu_);
    QUERN_RETURN_IF_ERROR(g->Sync());
  }
  return g;
}

Status FaceGallery::CheckUserId(std::string_view userid) {
  if (userid.empty()) return InvalidArgument("the userid is empty");
  if (userid.size() > kMaxUserIdBytes) {
    return InvalidArgument("the userid is " + std::to_string(userid.size()) + " bytes; at most " +
                           std::to_string(kMaxUserIdBytes));
  }
  for (size_t i = 0; i < userid.size();) {
    const auto c = static_cast<unsigned char>(userid[i]);
    if (c < 0x20 || c == 0x7F) return InvalidArgument("the userid holds a control character");
    // UTF-8: the length from the lead byte, continuation bytes 10xxxxxx, no
    // overlong forms, surrogates or code points above U+10FFFF.
    const size_t n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (n == 0 || i + n > userid.size()) return InvalidArgument("the userid is not UTF-8");
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(userid[i + k]);
      if ((b & 0xC0) != 0x80) return InvalidArgument("the userid is not UTF-8");
      cp = (cp << 6) | (b & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return InvalidArgument("the userid is not UTF-8");
    }
    if (cp >= 0x80 && cp < 0xA0) return InvalidArgument("the userid holds a control character");
    i += n;
  }
  return Status::Ok();
}

float FaceGallery::Similarity(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) return 0;
  double dot = 0, na = 0, nb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    dot += static_cast<double>(a[i]) * b[i];
    na += static_cast<double>(a[i]) * a[i];
    nb += static_cast<double>(b[i]) * b[i];
  }
  return na > 0 && nb > 0 ? static_cast<float>(dot / std::sqrt(na * nb)) : 0.0f;
}

Status FaceGallery::Register(const std::string& userid, const std::vector<std::vector<float>>& faces) {
  QUERN_RETURN_IF_ERROR(CheckUserId(userid));
  if (faces.empty()) return InvalidArgument("no face to register for '" + userid + "'");
  const size_t dim = faces.front().size();
  if (dim == 0 || dim > kMaxDimension)
    return InvalidArgument("a face descriptor of " + std::to_string(dim) + " values");
  for (const auto& f : faces) {
    if (f.size() != dim) return InvalidArgument("face descriptors of different lengths");
    for (float v : f) {
      if (!std::isfinite(v)) return InvalidArgument("a face descriptor that is not finite");
    }
  }
  MutexLock lock(mu_);
  return Change([&](FaceSet& set) {
    if (!set.users.empty() && dim != set.dimension) {
      return FailedPrecondition("the registered faces were described with " + std::to_string(set.dimension) +
                                " values and this descriptor gives " + std::to_string(dim) +
                                " (another face descriptor model?); delete them to register with this one");
    }
    if (!set.users.contains(userid) && set.users.size() >= options_.max_users) {
      return ResourceExhausted("the face gallery holds its limit of " + std::to_string(options_.max_users) + " users");
    }
    auto& mine = set.users[userid];
    mine.insert(mine.end(), faces.begin(), faces.end());
    if (mine.size() > options_.max_faces_per_user) {
      mine.erase(mine.begin(), mine.begin() + static_cast<std::ptrdiff_t>(mine.size() - options_.max_faces_per_user));
    }
    set.dimension = dim;
    return Status::Ok();
  });
}

Status FaceGallery::Delete(const std::string& userid) {
  MutexLock lock(mu_);
  return Change([&](FaceSet& set) {
    return set.users.erase(userid) ? Status::Ok() : NotFound("no face is registered as '" + userid + "'");
  });
}

std::shared_ptr<const FaceSet> FaceGallery::Current() {
  MutexLock lock(mu_);
  if (Status st = Sync(); !st.ok()) Warn(st);
  return faces_;
}

std::vector<std::string> FaceGallery::Users() {
  const std::shared_ptr<const FaceSet> faces = Current();
  std::vector<std::string> out;
  out.reserve(faces->users.size());
  for (const auto& [id, mine] : faces->users) out.push_back(id);
  return out;
}

std::optional<FaceMatch> FaceSet::Closest(std::span<const float> face) const {
  if (users.empty() || face.size() != dimension) return std::nullopt;
  std::optional<FaceMatch> best;
  for (const auto& [id, faces] : users) {
    for (const auto& f : faces) {
      const float s = FaceGallery::Similarity(face, f);
      if (!best || s > best->similarity) best = FaceMatch{id, s};
    }
  }
  return best;
}

void FaceGallery::Warn(const Status& st) {
  const int64_t now =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  int64_t last = last_warning_s_.load();
  if (now - last >= 10 && last_warning_s_.compare_exchange_strong(last, now)) {
    Log(LogLevel::kWarning, st.message() + " (answering from the faces last read)");
  }
}

Status FaceGallery::Sync() {
  if (!store_) return Status::Ok();
  QUERN_ASSIGN_OR_RETURN(const int64_t version, store_->Version());
  if (version == version_) return Status::Ok();
  QUERN_ASSIGN_OR_RETURN(FaceGalleryStore::Stored stored, store_->Read());
  auto faces = std::make_shared<FaceSet>();
  QUERN_RETURN_IF_ERROR(Parse(stored.bytes, store_->Describe(), *faces));
  faces_ = std::move(faces);
  version_ = stored.version;
  return Status::Ok();
}

Status FaceGallery::Change(const std::function<Status(FaceSet& faces)>& change) {
  for (int attempt = 0; attempt < kMaxAttempts; ++attempt) {
    QUERN_RETURN_IF_ERROR(Sync());
    auto faces = std::make_shared<FaceSet>(*faces_);
    QUERN_RETURN_IF_ERROR(change(*faces));
    if (faces->users.empty()) faces->dimension = 0;
    if (store_) {
      QUERN_ASSIGN_OR_RETURN(const std::optional<int64_t> version, store_->Write(Serialize(*faces), version_));
      if (!version) {
        version_ = -1;  // another writer came first: read what it wrote, apply the change again
        continue;
      }
      version_ = *version;
    }
    faces_ = std::move(faces);
    return Status::Ok();
  }
  return Unavailable(store_->Describe() + " kept changing under " + std::to_string(kMaxAttempts) +
                     " attempts to write it; try again");
}

std::string FaceGallery::Serialize(const FaceSet& set) {
  std::string out(kMagic);
  PutU32(out, set.dimension);
  PutU32(out, set.users.size());
  for (const auto& [id, faces] : set.users) {
    PutU32(out, id.size());
    out += id;
    PutU32(out, faces.size());
    for (const auto& f : faces) out.append(reinterpret_cast<const char*>(f.data()), f.size() * sizeof(float));
  }
  return out;
}

Status FaceGallery::Parse(std::string_view data, const std::string& where, FaceSet& set) const {
  auto& users = set.users;
  if (data.empty()) return Status::Ok();  // nothing stored yet
  Reader r(data);
  std::string_view magic;
  size_t dim = 0, count = 0;
  if (!r.Bytes(kMagic.size(), magic) || magic != kMagic || !r.U32(dim) || !r.U32(count)) {
    return InvalidArgument(where + " is not a face gallery (its header does not read)");
  }
  if (dim > kMaxDimension || (dim == 0 && count > 0) || count > options_.max_users) {
    return InvalidArgument(where + " declares " + std::to_string(count) + " users of " + std::to_string(dim) +
                           "-value faces, outside the limits");
  }
  for (size_t u = 0; u < count; ++u) {
    size_t id_bytes = 0, faces = 0;
    std::string_view id;
    if (!r.U32(id_bytes) || !r.Bytes(id_bytes, id) || !CheckUserId(id).ok() || !r.U32(faces) || faces == 0 ||
        faces > options_.max_faces_per_user || users.contains(std::string(id))) {
      return InvalidArgument(where + " is damaged at user " + std::to_string(u + 1) + " of " + std::to_string(count));
    }
    auto& mine = users[std::string(id)];
    for (size_t f = 0; f < faces; ++f) {
      std::string_view bytes;
      if (!r.Bytes(dim * sizeof(float), bytes)) {
        return InvalidArgument(where + " is cut short at user " + std::to_string(u + 1));
      }
      std::vector<float> v(dim);
      std::memcpy(v.data(), bytes.data(), bytes.size());
      mine.push_back(std::move(v));
    }
  }
  if (!r.done()) return InvalidArgument(where + " has data after its last user");
  set.dimension = dim;
  return Status::Ok();
}

}  // namespace quern
