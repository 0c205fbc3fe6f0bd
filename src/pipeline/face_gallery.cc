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
#include <optional>
#include <set>

#include "core/log.h"

namespace quern {
namespace {

static_assert(std::endian::native == std::endian::little, "the stored gallery is little-endian");

constexpr std::string_view kWholeMagic = "QUERNFACES1\n";  // earlier releases: the gallery whole
constexpr std::string_view kLogMagic = "QUERNFACES2\n";    // a log of records
constexpr size_t kMaxUserIdBytes = 256;
constexpr size_t kMaxDimension = 65536;
constexpr size_t kRecordHeaderBytes = 12;  // u32 payload length, its complement, u32 checksum
// Writes that lose the race to another instance before one is given up.
constexpr int kMaxAttempts = 16;
// A log is compacted once it holds more than twice what its latest
// records need, and at least this much more.
constexpr uint64_t kCompactFloorBytes = uint64_t{1} << 20;

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
  std::string_view rest() const { return data_; }
  bool done() const { return data_.empty(); }

 private:
  std::string_view data_;
};

bool AllZero(std::string_view bytes) {
  return std::all_of(bytes.begin(), bytes.end(), [](char c) { return c == 0; });
}

// FNV-1a: tells a record written whole from one cut short or overwritten.
uint32_t Checksum(std::string_view data) {
  uint32_t h = 2166136261u;
  for (const char c : data) h = (h ^ static_cast<unsigned char>(c)) * 16777619u;
  return h;
}

// A record on disk: u32 payload length, its complement (a length that was
// damaged is told from a record cut short), u32 checksum of the payload,
// then the payload: u32 id length, id bytes, the faces (EncodeFaces; none:
// the user deleted).
std::string Frame(const FaceRecord& r) {
  std::string payload;
  PutU32(payload, r.userid.size());
  payload += r.userid;
  payload += r.faces;
  std::string out;
  out.reserve(kRecordHeaderBytes + payload.size());
  PutU32(out, payload.size());
  PutU32(out, ~static_cast<uint32_t>(payload.size()));
  PutU32(out, Checksum(payload));
  return out + payload;
}

// `faces` (EncodeFaces' form) as faces; an error says what is wrong.
Result<Faces> DecodeFaces(std::string_view bytes, size_t max_faces) {
  Reader r(bytes);
  size_t dim = 0, count = 0;
  if (!r.U32(dim) || !r.U32(count)) return std::unexpected(InvalidArgument("is cut short"));
  if (dim == 0 || dim > kMaxDimension || count == 0 || count > max_faces) {
    return std::unexpected(InvalidArgument("declares " + std::to_string(count) + " faces of " + std::to_string(dim) +
                                           " values, outside the limits"));
  }
  if (r.rest().size() != count * dim * sizeof(float)) {
    return std::unexpected(InvalidArgument("holds " + std::to_string(r.rest().size()) + " bytes of faces for " +
                                           std::to_string(count) + " faces of " + std::to_string(dim) + " values"));
  }
  Faces out(count, std::vector<float>(dim));
  for (size_t f = 0; f < count; ++f) std::memcpy(out[f].data(), r.rest().data() + f * dim * sizeof(float), dim * 4);
  return out;
}

// Writes all of `bytes` to `fd`; 0, or the errno that stopped it.
int WriteAll(int fd, std::string_view bytes) {
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : EIO;
    done += static_cast<size_t>(n);
  }
  return 0;
}

// Writes `bytes` to a new file `path` (mode 0600, never through a link) and
// flushes it; errno on failure (the file removed).
int WriteNewFile(const std::filesystem::path& path, std::string_view bytes) {
  ::unlink(path.c_str());  // one left by a crash; never followed if it is a link
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return errno;
  int failed = WriteAll(fd, bytes);
  if (failed == 0 && ::fsync(fd) != 0) failed = errno;
  if (::close(fd) != 0 && failed == 0) failed = errno;
  if (failed != 0) ::unlink(path.c_str());
  return failed;
}

class FileStore : public FaceGalleryStore {
 public:
  explicit FileStore(std::filesystem::path file) : file_(std::move(file)) {}
  ~FileStore() override {
    if (fd_ >= 0) ::close(fd_);
  }

  Result<Records> Read() override {
    QUERN_ASSIGN_OR_RETURN(Loaded loaded, Load());
    if (loaded.torn_bytes > 0) {
      Log(LogLevel::kWarning, Describe() + ": its last record (" + std::to_string(loaded.torn_bytes) +
                                  " bytes) was cut short while it was written (the server stopped before "
                                  "answering that change); it is dropped");
    }
    whole_form_ = loaded.whole_form;
    log_bytes_ = loaded.good_bytes;
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (!whole_form_ && log_bytes_ > 0) {
      // Appended to from the next change on (a record cut short is cut off
      // first); -1: the next change writes the log whole.
      fd_ = ::open(file_.c_str(), O_WRONLY | O_APPEND | O_NOFOLLOW | O_CLOEXEC);
    }
    live_.clear();
    live_bytes_ = 0;
    Records out;
    for (auto& [id, r] : loaded.latest) {
      Track(r, Frame(r).size());
      out.records.push_back(std::move(r));
    }
    out.version = version_;
    return out;
  }

  Result<int64_t> Version() override { return version_; }  // this process is its only writer

  Result<std::optional<Records>> ChangesSince(int64_t since) override {
    if (since != version_) return std::optional<Records>();
    return std::optional<Records>(Records{{}, version_});
  }

  Result<std::optional<int64_t>> Write(const FaceRecord& record, int64_t based_on) override {
    if (based_on != version_) return std::optional<int64_t>();
    const std::string frame = Frame(record);
    const uint64_t live_after = live_bytes_ - Size(record.userid) + (record.faces.empty() ? 0 : frame.size());
    if (fd_ < 0 || whole_form_ || log_bytes_ + frame.size() > 2 * live_after + kCompactFloorBytes) {
      QUERN_RETURN_IF_ERROR(Compact(record));
    } else {
      QUERN_RETURN_IF_ERROR(Append(frame));
      Track(record, frame.size());
    }
    return std::optional<int64_t>(++version_);
  }

  std::string Describe() const override { return "face gallery " + file_.string(); }

 private:
  struct Loaded {
    std::map<std::string, FaceRecord> latest;  // by user; none deleted
    uint64_t good_bytes = 0;                   // the log up to its last whole record
    uint64_t torn_bytes = 0;                   // after it: a record cut short
    bool whole_form = false;                   // the earlier whole-file form
  };

  // The file as it is on disk (nothing: no file, or an empty one), its
  // first `limit` bytes when given (a log's: what this store wrote and
  // flushed; past it only what a failed append left).
  Result<Loaded> Load(std::optional<uint64_t> limit = std::nullopt) const {
    Loaded out;
    std::error_code ec;
    if (!std::filesystem::exists(file_, ec)) return out;
    std::ifstream in(file_, std::ios::binary);
    if (!in) return std::unexpected(Unavailable(Describe() + " cannot be read"));
    std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (limit && data.starts_with(kLogMagic) && *limit >= kLogMagic.size() && *limit < data.size()) {
      data.resize(*limit);
    }
    if (data.empty()) return out;
    if (std::string_view(data).starts_with(kWholeMagic)) {
      QUERN_ASSIGN_OR_RETURN(std::vector<FaceRecord> records, ParseWholeGallery(data, Describe()));
      for (auto& r : records) out.latest[r.userid] = std::move(r);
      out.whole_form = true;
      return out;
    }
    if (!std::string_view(data).starts_with(kLogMagic)) {
      return std::unexpected(InvalidArgument(Describe() + " is not a face gallery (its header does not read)"));
    }
    size_t at = kLogMagic.size();
    for (size_t n = 1; at < data.size(); ++n) {
      const auto damaged = [&] {
        return std::unexpected(InvalidArgument(Describe() + " is damaged at record " + std::to_string(n) + " (byte " +
                                               std::to_string(at) + ")"));
      };
      Reader r(std::string_view(data).substr(at));
      size_t length = 0, complement = 0, sum = 0;
      std::string_view payload;
      // Cut short: a header not whole, or a whole one (its length checked
      // by its complement) whose payload did not all reach the disk.
      if (!r.U32(length) || !r.U32(complement) || !r.U32(sum)) {
        out.torn_bytes = data.size() - at;
        break;
      }
      if (static_cast<uint32_t>(length) != ~static_cast<uint32_t>(complement)) {
        // A header written in part (zeros where the rest did not reach the
        // disk) leaves a length no reading of which fits the file; a length
        // damaged in place still has its complement to fit.
        const size_t room = data.size() - at - kRecordHeaderBytes;
        if (!AllZero(std::string_view(data).substr(at)) &&
            (length <= room || static_cast<size_t>(~static_cast<uint32_t>(complement)) <= room)) {
          return damaged();
        }
        out.torn_bytes = data.size() - at;
        break;
      }
      if (!r.Bytes(length, payload) || (Checksum(payload) != sum && r.done())) {
        out.torn_bytes = data.size() - at;
        break;
      }
      Reader p(payload);
      size_t id_bytes = 0;
      std::string_view id;
      if (Checksum(payload) != sum || !p.U32(id_bytes) || !p.Bytes(id_bytes, id)) return damaged();
      if (p.done()) {
        out.latest.erase(std::string(id));
      } else {
        out.latest[std::string(id)] = FaceRecord{std::string(id), std::string(p.rest())};
      }
      at += kRecordHeaderBytes + length;
    }
    out.good_bytes = at;  // where the next record goes
    return out;
  }

  // The bytes `userid`'s latest record takes in the log (0: none).
  uint64_t Size(const std::string& userid) const {
    auto it = live_.find(userid);
    return it == live_.end() ? 0 : it->second;
  }

  // `record` (`bytes` in the log) is `userid`'s latest.
  void Track(const FaceRecord& record, uint64_t bytes) {
    live_bytes_ -= Size(record.userid);
    if (record.faces.empty()) {
      live_.erase(record.userid);
    } else {
      live_[record.userid] = bytes;
      live_bytes_ += bytes;
    }
  }

  // Appends `frame` and flushes it; on failure the log is cut back to where
  // it was (else rewritten whole at the next change).
  Status Append(const std::string& frame) {
    int failed = 0;
    if (::ftruncate(fd_, static_cast<off_t>(log_bytes_)) != 0) failed = errno;  // a record cut short goes
    if (failed == 0) failed = WriteAll(fd_, frame);
    if (failed == 0 && ::fdatasync(fd_) != 0) failed = errno;
    if (failed != 0) {
      if (::ftruncate(fd_, static_cast<off_t>(log_bytes_)) != 0) {
        ::close(fd_);  // the next change rewrites the log whole
        fd_ = -1;
      }
      return Unavailable(Describe() + " cannot be written: " + std::strerror(failed));
    }
    log_bytes_ += frame.size();
    return Status::Ok();
  }

  // Writes the log whole, its latest records with `record` applied, beside
  // the file, flushes it and renames it over the file.
  Status Compact(const FaceRecord& record) {
    QUERN_ASSIGN_OR_RETURN(Loaded loaded, Load(whole_form_ ? std::nullopt : std::optional<uint64_t>(log_bytes_)));
    if (record.faces.empty()) {
      loaded.latest.erase(record.userid);
    } else {
      loaded.latest[record.userid] = record;
    }
    std::string out(kLogMagic);
    std::map<std::string, uint64_t> live;
    uint64_t live_bytes = 0;
    for (const auto& [id, r] : loaded.latest) {
      std::string frame = Frame(r);
      live[id] = frame.size();
      live_bytes += frame.size();
      out += frame;
    }
    const std::filesystem::path tmp = file_.string() + ".tmp";
    int failed = WriteNewFile(tmp, out);
    if (failed == 0 && ::rename(tmp.c_str(), file_.c_str()) != 0) {
      failed = errno;
      ::unlink(tmp.c_str());
    }
    if (failed != 0) return Unavailable(Describe() + " cannot be written: " + std::strerror(failed));
    if (fd_ >= 0) ::close(fd_);
    fd_ = ::open(file_.c_str(), O_WRONLY | O_APPEND | O_NOFOLLOW | O_CLOEXEC);  // -1: the next change compacts
    whole_form_ = false;
    log_bytes_ = out.size();
    live_ = std::move(live);
    live_bytes_ = live_bytes;
    // The rename itself reaches the disk with the folder's entry: until it
    // has, a stop could bring the file before it back, so the change is not
    // answered as stored.
    const int dir =
        ::open(file_.parent_path().empty() ? "." : file_.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0 || ::fsync(dir) != 0) failed = errno;
    if (dir >= 0) ::close(dir);
    if (failed != 0) return Unavailable(Describe() + "'s folder cannot be flushed: " + std::strerror(failed));
    return Status::Ok();
  }

  const std::filesystem::path file_;
  int64_t version_ = 0;
  int fd_ = -1;                           // the log, open for appending; -1: none yet (the next change writes it whole)
  bool whole_form_ = false;               // the file is in the earlier form: rewritten at the next change
  uint64_t log_bytes_ = 0;                // the log's bytes up to its last whole record
  std::map<std::string, uint64_t> live_;  // each user's latest record's bytes in the log
  uint64_t live_bytes_ = 0;               // their sum
};

}  // namespace

std::unique_ptr<FaceGalleryStore> FileFaceStore(std::filesystem::path file) {
  return std::make_unique<FileStore>(std::move(file));
}

std::string EncodeFaces(const Faces& faces) {
  std::string out;
  const size_t dim = faces.empty() ? 0 : faces.front().size();
  out.reserve(8 + faces.size() * dim * sizeof(float));
  PutU32(out, dim);
  PutU32(out, faces.size());
  for (const auto& f : faces) out.append(reinterpret_cast<const char*>(f.data()), f.size() * sizeof(float));
  return out;
}

Result<std::vector<FaceRecord>> ParseWholeGallery(std::string_view data, const std::string& where) {
  Reader r(data);
  std::string_view magic;
  size_t dim = 0, count = 0;
  if (!r.Bytes(kWholeMagic.size(), magic) || magic != kWholeMagic || !r.U32(dim) || !r.U32(count)) {
    return std::unexpected(InvalidArgument(where + " is not a face gallery (its header does not read)"));
  }
  if (dim > kMaxDimension || (dim == 0 && count > 0) || count > (1u << 20)) {
    return std::unexpected(InvalidArgument(where + " declares " + std::to_string(count) + " users of " +
                                           std::to_string(dim) + "-value faces, outside the limits"));
  }
  std::vector<FaceRecord> out;
  std::set<std::string_view> seen;
  for (size_t u = 0; u < count; ++u) {
    size_t id_bytes = 0, faces = 0;
    std::string_view id, bytes;
    if (!r.U32(id_bytes) || !r.Bytes(id_bytes, id) || !FaceGallery::CheckUserId(id).ok() || !r.U32(faces) ||
        faces == 0 || faces > (1u << 16) || !seen.insert(id).second) {
      return std::unexpected(
          InvalidArgument(where + " is damaged at user " + std::to_string(u + 1) + " of " + std::to_string(count)));
    }
    if (!r.Bytes(faces * dim * sizeof(float), bytes)) {
      return std::unexpected(InvalidArgument(where + " is cut short at user " + std::to_string(u + 1)));
    }
    std::string record;
    PutU32(record, dim);
    PutU32(record, faces);
    record += bytes;
    out.push_back({std::string(id), std::move(record)});
  }
  if (!r.done()) return std::unexpected(InvalidArgument(where + " has data after its last user"));
  return out;
}

Result<std::unique_ptr<FaceGallery>> FaceGallery::Open(FaceGalleryOptions options,
                                                       std::unique_ptr<FaceGalleryStore> store) {
  std::unique_ptr<FaceGallery> g(new FaceGallery(options, std::move(store)));
  if (g->store_ && !g->store_->Shared()) {
    MutexLock lock(g->store_mu_);
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

Status FaceGallery::Register(const std::string& userid, const Faces& faces) {
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
  return Change(
      userid,
      [&](const FaceSet& set, const std::shared_ptr<const Faces>& mine) -> Result<std::shared_ptr<const Faces>> {
        if (!set.users.empty() && dim != set.dimension) {
          return std::unexpected(
              FailedPrecondition("the registered faces were described with " + std::to_string(set.dimension) +
                                 " values and this descriptor gives " + std::to_string(dim) +
                                 " (another face descriptor model?); delete them to register with this one"));
        }
        if (!mine && set.users.size() >= options_.max_users) {
          return std::unexpected(ResourceExhausted("the face gallery holds its limit of " +
                                                   std::to_string(options_.max_users) + " users"));
        }
        auto after = std::make_shared<Faces>(mine ? *mine : Faces());
        after->insert(after->end(), faces.begin(), faces.end());
        if (after->size() > options_.max_faces_per_user) {
          after->erase(after->begin(),
                       after->begin() + static_cast<std::ptrdiff_t>(after->size() - options_.max_faces_per_user));
        }
        return std::shared_ptr<const Faces>(std::move(after));
      });
}

Status FaceGallery::Delete(const std::string& userid) {
  return Change(userid,
                [&](const FaceSet&, const std::shared_ptr<const Faces>& mine) -> Result<std::shared_ptr<const Faces>> {
                  if (!mine) return std::unexpected(NotFound("no face is registered as '" + userid + "'"));
                  return std::shared_ptr<const Faces>();
                });
}

std::shared_ptr<const FaceSet> FaceGallery::Current() {
  if (store_ && store_->Shared()) {
    if (!read_once_.load(std::memory_order_acquire)) {
      // Nothing read yet: the empty gallery is no answer.
      MutexLock lock(store_mu_);
      if (const Status st = Sync(); !st.ok()) Warn(st);
    } else if (store_mu_.TryLock()) {
      // Else a change being written (or a read under way) holds the store:
      // the faces as they are now are answered without waiting for it.
      const Status st = Sync();
      store_mu_.Unlock();
      if (!st.ok()) Warn(st);
    }
  }
  return Published();
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
    for (const auto& f : *faces) {
      const float s = FaceGallery::Similarity(face, f);
      if (!best || s > best->similarity) best = FaceMatch{id, s};
    }
  }
  return best;
}

void FaceGallery::Warn(const Status& st) {
  const int64_t now = (options_.clock ? *options_.clock : RealClockInstance()).NowNs() / 1'000'000'000;
  int64_t last = last_warning_s_.load();
  if (now - last >= 10 && last_warning_s_.compare_exchange_strong(last, now)) {
    Log(LogLevel::kWarning, st.message() + " (answering from the faces last read)");
  }
}

std::shared_ptr<const FaceSet> FaceGallery::Published() {
  MutexLock lock(mu_);
  return faces_;
}

void FaceGallery::Publish(std::shared_ptr<const FaceSet> faces) {
  MutexLock lock(mu_);
  faces_.swap(faces);
  // The set replaced is freed here, after the lock (by its last reader if
  // one still compares with it).
  lock.Unlock();
}

Status FaceGallery::Sync() {
  if (!store_) return Status::Ok();
  QUERN_ASSIGN_OR_RETURN(const int64_t version, store_->Version());
  if (version == version_) return Status::Ok();
  if (version_ >= 0) {
    QUERN_ASSIGN_OR_RETURN(std::optional<FaceGalleryStore::Records> changes, store_->ChangesSince(version_));
    if (changes) {
      QUERN_ASSIGN_OR_RETURN(std::shared_ptr<const FaceSet> next,
                             Apply(*Published(), changes->records, store_->Describe()));
      Publish(std::move(next));
      version_ = changes->version;
      return Status::Ok();
    }
  }
  QUERN_ASSIGN_OR_RETURN(FaceGalleryStore::Records all, store_->Read());
  QUERN_ASSIGN_OR_RETURN(std::shared_ptr<const FaceSet> next, Apply(FaceSet(), all.records, store_->Describe()));
  Publish(std::move(next));
  version_ = all.version;
  read_once_.store(true, std::memory_order_release);
  return Status::Ok();
}

Result<std::shared_ptr<const FaceSet>> FaceGallery::Apply(const FaceSet& base, const std::vector<FaceRecord>& records,
                                                          const std::string& where) const {
  auto set = std::make_shared<FaceSet>(base);
  for (const FaceRecord& r : records) {
    if (!CheckUserId(r.userid).ok()) {
      return std::unexpected(InvalidArgument(where + " holds a record whose user id is not valid"));
    }
    if (r.faces.empty()) {
      set->users.erase(r.userid);
      continue;
    }
    auto faces = DecodeFaces(r.faces, options_.max_faces_per_user);
    if (!faces) {
      return std::unexpected(
          InvalidArgument(where + ": the faces of '" + r.userid + "' " + std::string(faces.error().message())));
    }
    const size_t dim = faces->front().size();
    const auto mine = set->users.find(r.userid);
    const size_t others = set->users.size() - (mine == set->users.end() ? 0 : 1);
    if (others > 0 && dim != set->dimension) {
      return std::unexpected(InvalidArgument(where + " holds faces of " + std::to_string(set->dimension) + " and " +
                                             std::to_string(dim) + " values"));
    }
    if (mine == set->users.end() && others >= options_.max_users) {
      return std::unexpected(
          InvalidArgument(where + " holds more than " + std::to_string(options_.max_users) + " users (the limit)"));
    }
    set->users[r.userid] = std::make_shared<const Faces>(std::move(*faces));
    set->dimension = dim;
  }
  if (set->users.empty()) set->dimension = 0;
  return std::shared_ptr<const FaceSet>(std::move(set));
}

Status FaceGallery::Change(const std::string& userid, const UserChange& change) {
  MutexLock lock(store_mu_);
  for (int attempt = 0; attempt < kMaxAttempts; ++attempt) {
    QUERN_RETURN_IF_ERROR(Sync());
    const std::shared_ptr<const FaceSet> base = Published();
    const auto it = base->users.find(userid);
    QUERN_ASSIGN_OR_RETURN(std::shared_ptr<const Faces> after,
                           change(*base, it == base->users.end() ? nullptr : it->second));
    if (store_) {
      const FaceRecord record{userid, after ? EncodeFaces(*after) : std::string()};
      QUERN_ASSIGN_OR_RETURN(const std::optional<int64_t> version, store_->Write(record, version_));
      if (!version) continue;  // another writer came first: Sync reads what it wrote, and the change is made again
      version_ = *version;
    }
    auto next = std::make_shared<FaceSet>(*base);
    if (after) {
      next->dimension = after->front().size();
      next->users[userid] = std::move(after);
    } else {
      next->users.erase(userid);
      if (next->users.empty()) next->dimension = 0;
    }
    Publish(std::move(next));
    return Status::Ok();
  }
  return Unavailable(store_->Describe() + " kept changing under " + std::to_string(kMaxAttempts) +
                     " attempts to write it; try again");
}

}  // namespace quern
