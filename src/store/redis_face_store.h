// The face gallery in Redis, shared by every instance that names the same
// server, one record per user: `quern:faces:users` (a hash: user id -> the
// user's faces in EncodeFaces' form, and the field "" marking the gallery
// as written), `quern:faces:version` (a counter, one more per change) and
// `quern:faces:changes` (a sorted set: the last 1024 changes, member
// "<version>:<user id>" scored by version). A write is optimistic: WATCH
// the version, check it is the one the change was based on, then MULTI /
// HSET or HDEL / INCR / ZADD / EXEC; another instance's write in between
// makes EXEC fail, and the gallery reads what changed and re-applies its
// change. A reader asks only for the version (one GET) before it compares
// faces, and reads the users that changed since (or every user, when the
// changes it missed are no longer kept). A registration writes one user's
// faces, never the gallery's. The gallery of earlier releases (one string,
// `quern:faces`) is moved into the hash when first read.
//
// Thread safety: one caller at a time (FaceGallery holds its store lock
// around every call).
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
  // `clock` paces reconnection attempts (null = the real clock).
  explicit RedisFaceStore(RedisOptions options, std::string key = "quern:faces", const Clock* clock = nullptr);
  ~RedisFaceStore() override;

  Result<Records> Read() override;
  Result<int64_t> Version() override;
  Result<std::optional<Records>> ChangesSince(int64_t since) override;
  Result<std::optional<int64_t>> Write(const FaceRecord& record, int64_t based_on) override;
  std::string Describe() const override;
  bool Shared() const override { return true; }

 private:
  // The connection, made when missing or broken.
  Result<RedisConnection*> Connection();
  // A failed round trip: the connection goes, and the error names the store.
  Status Failed(const Status& st);
  // Moves the gallery of earlier releases (one string at key_) into the
  // hash; done when another instance moved it first.
  Status MoveWholeGallery(RedisConnection* c);
  // The error for a gallery whose hash is gone while its version is not.
  Status Missing(int64_t version) const;

  const RedisOptions options_;
  const std::string key_, users_key_, version_key_, changes_key_;
  const Clock& clock_;
  std::unique_ptr<RedisConnection> conn_;
  // After a failed connection: its error, until retry_at_ns_ (clock_ time).
  Status last_error_;
  int64_t retry_at_ns_ = 0;
};

}  // namespace quern
