// FaceGallery: the faces registered for recognition, by user id: each face
// one descriptor (a unit-length vector from a face descriptor model), a user
// any number of faces up to a bound. Recognition compares a face with every
// registered one by cosine similarity and names the closest user.
//
// With a file, the gallery is kept there and rewritten whole on every change
// (written beside it, flushed, then renamed over it), so a crash leaves the
// previous or the new gallery, never a mix. The file is binary:
//   "QUERNFACES1\n", u32 dimension, u32 users,
//   per user: u32 id length, id bytes, u32 faces, faces x dimension f32
// (all little-endian). A file that does not read fails Open with the reason:
// registered faces are never dropped silently.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstddef>
#include <filesystem>
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

struct FaceGalleryOptions {
  std::filesystem::path file;  // "" = memory only
  size_t max_users = 10000;
  size_t max_faces_per_user = 32;  // beyond it a user's oldest faces go
};

struct FaceMatch {
  std::string userid;
  float similarity = 0;  // cosine, -1..1
};

class FaceGallery {
 public:
  // Reads `options.file` when it exists.
  static Result<std::unique_ptr<FaceGallery>> Open(FaceGalleryOptions options);

  // A user id is 1-256 bytes of UTF-8 without control characters.
  static Status CheckUserId(std::string_view userid);
  // Cosine similarity of two vectors of one length (0 when either is zero).
  static float Similarity(std::span<const float> a, std::span<const float> b);

  // Adds faces to `userid` (creating it); all of one dimension, the
  // gallery's if it has faces. Nothing is added when anything is wrong.
  Status Register(const std::string& userid, const std::vector<std::vector<float>>& faces);
  // NOT_FOUND when no face is registered under `userid`.
  Status Delete(const std::string& userid);
  std::vector<std::string> Users() const;
  // The registered face closest to `face`; none when the gallery is empty
  // or its faces have another dimension.
  std::optional<FaceMatch> Closest(std::span<const float> face) const;

 private:
  explicit FaceGallery(FaceGalleryOptions options) : options_(std::move(options)) {}
  Status Load();
  // Writes the gallery to the file (when there is one).
  Status Save() const QUERN_REQUIRES(mu_);

  const FaceGalleryOptions options_;
  mutable Mutex mu_;
  size_t dimension_ QUERN_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::vector<std::vector<float>>> users_ QUERN_GUARDED_BY(mu_);
};

}  // namespace quern
