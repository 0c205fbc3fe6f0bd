#include "store/redis_face_store.h"

#include <charconv>

namespace quern {
namespace {

// A version counter's value: nil (never written) is 0.
Result<int64_t> VersionOf(const RedisReply& r) {
  if (r.is_nil()) return int64_t{0};
  if (r.type == RedisReply::Type::kInteger) return r.integer;
  int64_t v = 0;
  if (!r.is_string() || std::from_chars(r.str.data(), r.str.data() + r.str.size(), v).ec != std::errc()) {
    return std::unexpected(InvalidArgument("the face gallery's version in Redis is not a number"));
  }
  return v;
}

}  // namespace

RedisFaceStore::RedisFaceStore(RedisOptions options, std::string key)
    : options_(std::move(options)), key_(std::move(key)), version_key_(key_ + ":version") {}

RedisFaceStore::~RedisFaceStore() = default;

std::string RedisFaceStore::Describe() const {
  return "face gallery in Redis at " + options_.Address() + " (key " + key_ + ")";
}

Result<RedisConnection*> RedisFaceStore::Connection() {
  if (conn_ && !conn_->broken()) return conn_.get();
  conn_.reset();
  auto c = RedisConnection::Connect(options_);
  if (!c) return std::unexpected(Status(c.error().code(), Describe() + ": " + c.error().message()));
  conn_ = std::move(*c);
  return conn_.get();
}

Status RedisFaceStore::Lost(const Status& st) {
  conn_.reset();
  return Status(st.code(), Describe() + ": " + st.message());
}

Result<FaceGalleryStore::Stored> RedisFaceStore::Read() {
  QUERN_ASSIGN_OR_RETURN(RedisConnection * c, Connection());
  RedisPipeline p;  // both in one transaction: a version and the gallery it belongs to
  p.Add({"MULTI"});
  p.Add({"GET", version_key_});
  p.Add({"GET", key_});
  p.Add({"EXEC"});
  auto replies = c->Execute(p);
  if (!replies) return std::unexpected(Lost(replies.error()));
  const RedisReply& exec = replies->back();
  if (!exec.is_array() || exec.elements.size() != 2) {
    return std::unexpected(Lost(
        Internal("an unexpected answer to reading the gallery" + (exec.is_error() ? ": " + exec.str : std::string()))));
  }
  Stored s;
  QUERN_ASSIGN_OR_RETURN(s.version, VersionOf(exec.elements[0]));
  if (exec.elements[1].is_string()) s.bytes = exec.elements[1].str;
  return s;
}

Result<int64_t> RedisFaceStore::Version() {
  QUERN_ASSIGN_OR_RETURN(RedisConnection * c, Connection());
  RedisPipeline p;
  p.Add({"GET", version_key_});
  auto replies = c->Execute(p);
  if (!replies) return std::unexpected(Lost(replies.error()));
  return VersionOf(replies->front());
}

Result<std::optional<int64_t>> RedisFaceStore::Write(const std::string& bytes, int64_t based_on) {
  QUERN_ASSIGN_OR_RETURN(RedisConnection * c, Connection());
  RedisPipeline watch;
  watch.Add({"WATCH", version_key_});
  watch.Add({"GET", version_key_});
  auto seen = c->Execute(watch);
  if (!seen) return std::unexpected(Lost(seen.error()));
  QUERN_ASSIGN_OR_RETURN(const int64_t now, VersionOf(seen->back()));
  if (now != based_on) {
    RedisPipeline unwatch;
    unwatch.Add({"UNWATCH"});
    if (auto r = c->Execute(unwatch); !r) return std::unexpected(Lost(r.error()));
    return std::optional<int64_t>();  // another instance wrote first
  }
  RedisPipeline tx;
  tx.Add({"MULTI"});
  tx.Add({"SET", key_, bytes});
  tx.Add({"INCR", version_key_});
  tx.Add({"EXEC"});
  auto replies = c->Execute(tx);
  if (!replies) return std::unexpected(Lost(replies.error()));
  const RedisReply& exec = replies->back();
  if (exec.is_nil()) return std::optional<int64_t>();  // the version changed after the check
  if (!exec.is_array() || exec.elements.size() != 2 || exec.elements[1].type != RedisReply::Type::kInteger) {
    for (const auto& r : *replies) {
      if (r.is_error()) return std::unexpected(Unavailable(Describe() + ": " + r.str));
    }
    return std::unexpected(Lost(Internal("an unexpected answer to writing the gallery")));
  }
  return std::optional<int64_t>(exec.elements[1].integer);
}

}  // namespace quern
