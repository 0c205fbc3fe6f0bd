// The face gallery in Redis, shared by every instance that names the same
// server: the gallery (FaceGallery's file format) in one string key and a
// version counter beside it, `quern:faces` and `quern:faces:version`. A
// write is optimistic: WATCH the version, check it is the one the change was
// based on, then MULTI / SET / INCR / EXEC; another instance's write in
// between makes EXEC fail, and the gallery reads the store again and
// re-applies its change. A reader asks only for the version (one GET) before
// it compares faces, and reads the gallery when it changed.
//
// Thread safety: one caller at a time (FaceGallery holds its lock around
// every call).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "pipeline/face_gallery.h"
#include "store/redis_client.h"

namespace quern {

class RedisFaceStore : public FaceGalleryStore {
 public:
  explicit RedisFaceStore(RedisOptions options, std::string key = "quern:faces");
  ~RedisFaceStore() override;

  Result<Stored> Read() override;
  Result<int64_t> Version() override;
  Result<std::optional<int64_t>> Write(const std::string& bytes, int64_t based_on) override;
  std::string Describe() const override;
  bool Shared() const override { return true; }

 private:
  // The connection, made when missing or broken.
  Result<RedisConnection*> Connection();
  // A failed round trip: the connection goes, and the error names the store.
  Status Failed(const Status& st);

  const RedisOptions options_;
  const std::string key_, version_key_;
  std::unique_ptr<RedisConnection> conn_;
  // After a failed connection: its error, until retry_at_.
  Status last_error_;
  std::chrono::steady_clock::time_point retry_at_;
};

}  // namespace quern
