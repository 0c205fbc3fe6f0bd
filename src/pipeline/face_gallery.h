// FaceGallery: the faces registered for recognition, by user id: each face
// one descriptor (a unit-length vector from a face descriptor model), a user
// any number of faces up to a bound. Recognition compares a face with every
// registered one by cosine similarity and names the closest user.
//
// Besides memory, a gallery may live in a store: a file (FileFaceStore) or
// Redis (store/redis_face_store.h, shared by instances). The stored form is
// binary:
//   "QUERNFACES1\n", u32 dimension, u32 users,
//   per user: u32 id length, id bytes, u32 faces, faces x dimension f32
// (all little-endian). Every change is written whole, based on the version
// of the store it read; a store that another instance changed meanwhile
// refuses the write, and the change is applied again to what it holds now,
// so that no instance's registration is lost. Before comparing faces the
// gallery asks the store for its version and reads it again when it
// changed. A stored gallery that does not read fails Open (or the change)
// with the reason: registered faces are never dropped silently. A shared
// store (Redis) is first read when faces are first used, so that a server
// starts while it is away.
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
#include "quern/status.h"

namespace quern {

// Where a gallery keeps its faces besides memory. Called with the gallery's
// lock held: one call at a time.
class FaceGalleryStore {
 public:
  virtual ~FaceGalleryStore() = default;
  struct Stored {
    std::string bytes;  // the stored form; "" = nothing stored yet
    int64_t version = 0;
  };
  virtual Result<Stored> Read() = 0;
  // The version stored now (cheaper than Read).
  virtual Result<int64_t> Version() = 0;
  // Stores `bytes` if the stored version is still `based_on`: the new
  // version, or nullopt when another writer came first.
  virtual Result<std::optional<int64_t>> Write(const std::string& bytes, int64_t based_on) = 0;
  // For messages, e.g. "face gallery /var/lib/quern/faces.bin".
  virtual std::string Describe() const = 0;
  // True when other processes share it: unreachable at start is then not
  // fatal (the gallery reads it when it comes back).
  virtual bool Shared() const { return false; }
};

// A file written by this process alone: rewritten whole on every change
// (written beside it, flushed, renamed over it; mode 0600), so a crash
// leaves the previous or the new gallery, never a mix.
std::unique_ptr<FaceGalleryStore> FileFaceStore(std::filesystem::path file);

// The bounds keep the stored form (rewritten whole on every change) small:
// at most 1000 x 16 faces of 1024 values, 64 MiB.
struct FaceGalleryOptions {
  size_t max_users = 1000;
  size_t max_faces_per_user = 16;  // beyond it a user's oldest faces go
};

struct FaceMatch {
  std::string userid;
  float similarity = 0;  // cosine, -1..1
};

// The registered faces at one moment (immutable: matched without a lock).
struct FaceSet {
  size_t dimension = 0;
  std::map<std::string, std::vector<std::vector<float>>> users;

  // The registered face closest to `face`; none when there is none or its
  // dimension differs.
  std::optional<FaceMatch> Closest(std::span<const float> face) const;
};

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
  Status Register(const std::string& userid, const std::vector<std::vector<float>>& faces);
  // NOT_FOUND when no face is registered under `userid`.
  Status Delete(const std::string& userid);
  // The faces now, read again when the store's version moved (one question
  // to the store); when the store cannot be reached, the faces last read.
  std::shared_ptr<const FaceSet> Current();
  std::vector<std::string> Users();

 private:
  FaceGallery(FaceGalleryOptions options, std::unique_ptr<FaceGalleryStore> store)
      : options_(options), store_(std::move(store)), faces_(std::make_shared<const FaceSet>()) {}
  // Reads the store again when its version moved.
  Status Sync() QUERN_REQUIRES(mu_);
  // Applies `change` to a copy of the faces and stores it, again on what the
  // store holds when another writer came first.
  Status Change(const std::function<Status(FaceSet& faces)>& change) QUERN_REQUIRES(mu_);
  // The stored form, and back (errors name `where`).
  static std::string Serialize(const FaceSet& faces);
  Status Parse(std::string_view data, const std::string& where, FaceSet& faces) const;
  // A warning on stderr, at most one every 10 s.
  void Warn(const Status& st);

  const FaceGalleryOptions options_;
  const std::unique_ptr<FaceGalleryStore> store_;
  Mutex mu_;
  std::shared_ptr<const FaceSet> faces_ QUERN_GUARDED_BY(mu_);
  int64_t version_ QUERN_GUARDED_BY(mu_) = -1;  // the store's version faces_ holds; -1 = not read yet
  std::atomic<int64_t> last_warning_s_{0};
};

}  // namespace quern
