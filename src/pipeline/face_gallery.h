// FaceGallery: the faces registered for recognition, by user id: each face
// one descriptor (a unit-length vector from a face descriptor model), a user
// any number of faces up to a bound. Recognition compares a face with every
// registered one by cosine similarity and names the closest user.
//
// Besides memory, a gallery may live in a store: a file (FileFaceStore) or
// Redis (store/redis_face_store.h, shared by instances). A store keeps one
// record per change: a user's faces after it (EncodeFaces' form), or the
// user's deletion. A change costs its own record, never the gallery's size.
// The store's version grows by one with each record. A change is written
// based on the version the gallery has read; a store that another instance
// changed meanwhile refuses the write, and the gallery reads the records
// written since (or everything, when the store no longer holds them) and
// applies the change again, so that no instance's registration is lost.
// Before comparing faces the gallery asks a shared store for its version and
// reads what changed. A stored gallery that does not read fails Open (or
// the change) with the reason: registered faces are never dropped silently.
// A shared store (Redis) is first read when faces are first used, so that a
// server starts while it is away.
//
// Recognition never waits for a change being written: while one is, it
// compares with the faces as they were (each change is published at once
// when its record is stored).
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/mutex.h"
#include "quern/clock.h"
#include "quern/status.h"

namespace quern {

// One change as stored: `userid`'s faces after it in EncodeFaces' form, or
// "" when the user was deleted.
struct FaceRecord {
  std::string userid;
  std::string faces;
};

// Where a gallery keeps its faces besides memory. Called with the gallery's
// store lock held: one call at a time.
class FaceGalleryStore {
 public:
  virtual ~FaceGalleryStore() = default;
  struct Records {
    std::vector<FaceRecord> records;  // oldest first
    int64_t version = 0;              // the version they bring the gallery to
  };
  // Every user's latest record (none deleted) and the version now.
  virtual Result<Records> Read() = 0;
  // The version stored now (cheaper than Read).
  virtual Result<int64_t> Version() = 0;
  // The records written after version `since`, or nullopt when the store
  // no longer holds them all (the gallery then Reads).
  virtual Result<std::optional<Records>> ChangesSince(int64_t since) = 0;
  // Stores `record` if the stored version is still `based_on`: the new
  // version, or nullopt when another writer came first.
  virtual Result<std::optional<int64_t>> Write(const FaceRecord& record, int64_t based_on) = 0;
  // For messages, e.g. "face gallery /var/lib/quern/faces.bin".
  virtual std::string Describe() const = 0;
  // True when other processes share it: unreachable at start is then not
  // fatal (the gallery reads it when it comes back).
  virtual bool Shared() const { return false; }
};

// A file written by this process alone, as a log: each change appended as
// one record (length, checksum, user, faces) and flushed to disk (fdatasync)
// before the change is answered (a new log, or one rewritten, is renamed
// into place and its folder flushed). Once the log holds more than twice the
// bytes its latest records need (and at least 1 MiB), it is compacted:
// written whole beside itself, flushed and renamed over it. A record the
// process was still appending when it died (cut short, zeros, or its
// checksum wrong, at the end of the file) was never answered: it is
// dropped, with a warning (a last record damaged after it was stored cannot
// be told from one cut short: it is dropped too). Any other damage fails
// Open. Mode 0600. A gallery file in the
// earlier whole-file form ("QUERNFACES1") is read, and rewritten as a log at
// the first change.
std::unique_ptr<FaceGalleryStore> FileFaceStore(std::filesystem::path file);

// At most 1000 x 16 faces of 1024 values (64 MiB).
struct FaceGalleryOptions {
  size_t max_users = 1000;
  size_t max_faces_per_user = 16;  // beyond it a user's oldest faces go
  const Clock* clock = nullptr;    // paces its warnings; null = the real clock
};

struct FaceMatch {
  std::string userid;
  float similarity = 0;  // cosine, -1..1
};

using Faces = std::vector<std::vector<float>>;

// The registered faces at one moment (immutable once published: matched
// without a lock; a change makes a new set sharing the users it left alone).
struct FaceSet {
  size_t dimension = 0;
  std::map<std::string, std::shared_ptr<const Faces>> users;

  // The registered face closest to `face`; none when there is none or its
  // dimension differs.
  std::optional<FaceMatch> Closest(std::span<const float> face) const;
};

// A user's faces as a record holds them: u32 dimension, u32 count, then
// count x dimension f32 (little-endian).
std::string EncodeFaces(const Faces& faces);

// The whole-file form of earlier releases ("QUERNFACES1\n", u32 dimension,
// u32 users, per user: u32 id length, id bytes, u32 faces, the faces) as
// records, one per user; INVALID_ARGUMENT naming `where` when it does not
// read.
Result<std::vector<FaceRecord>> ParseWholeGallery(std::string_view data, const std::string& where);

class FaceGallery {
 public:
  // Reads the store (null = memory only).
  static Result<std::unique_ptr<FaceGallery>> Open(FaceGalleryOptions options,
                                                   std::unique_ptr<FaceGalleryStore> store = nullptr);

  // A user id is 1-256 bytes of UTF-8 without control characters.
  static Status CheckUserId(std::string_view userid);
  // Cosine similarity of two vectors of one length (0 when either is zero).
  static float Similarity(std::span<const float> a, std::span<const float> b);

  // Adds faces to `userid` (creating it); all of one dimension, the
  // gallery's if it has faces. Nothing is added when anything is wrong.
  Status Register(const std::string& userid, const Faces& faces);
  // NOT_FOUND when no face is registered under `userid`.
  Status Delete(const std::string& userid);
  // The faces now: a shared store's changes are read first (one question
  // to the store), unless a change is being written (then the faces as they
  // were; before the store was first read, it waits for it) or the store
  // cannot be reached (the faces last read).
  std::shared_ptr<const FaceSet> Current();
  std::vector<std::string> Users();

 private:
  FaceGallery(FaceGalleryOptions options, std::unique_ptr<FaceGalleryStore> store)
      : options_(options), store_(std::move(store)), faces_(std::make_shared<const FaceSet>()) {}
  // Reads what the store changed since version_ and publishes it.
  Status Sync() QUERN_REQUIRES(store_mu_);
  // `userid`'s faces after the change `change` makes to them (null: none
  // yet) in `set`; an error leaves the gallery as it was. The record is
  // stored (again on what the store holds when another writer came first)
  // and published.
  using UserChange =
      std::function<Result<std::shared_ptr<const Faces>>(const FaceSet& set, const std::shared_ptr<const Faces>& mine)>;
  Status Change(const std::string& userid, const UserChange& change) QUERN_EXCLUDES(store_mu_);
  // `records` applied to a copy of `base` (errors name `where`).
  Result<std::shared_ptr<const FaceSet>> Apply(const FaceSet& base, const std::vector<FaceRecord>& records,
                                               const std::string& where) const;
  std::shared_ptr<const FaceSet> Published() QUERN_EXCLUDES(mu_);
  void Publish(std::shared_ptr<const FaceSet> faces) QUERN_EXCLUDES(mu_);
  // A warning on stderr, at most one every 10 s.
  void Warn(const Status& st);

  const FaceGalleryOptions options_;
  const std::unique_ptr<FaceGalleryStore> store_;
  Mutex store_mu_;                                    // one change or read of the store at a time
  int64_t version_ QUERN_GUARDED_BY(store_mu_) = -1;  // the store's version faces_ holds; -1 = not read yet
  Mutex mu_;                                          // held only to swap or copy faces_
  std::shared_ptr<const FaceSet> faces_ QUERN_GUARDED_BY(mu_);
  std::atomic<bool> read_once_{false};  // the store was read whole once (faces_ is what it holds)
  std::atomic<int64_t> last_warning_s_{0};
};

}  // namespace quern
