#include "store/redis_face_store.h"

#include <charconv>
#include <chrono>

#include "core/log.h"

namespace quern {
namespace {

// How long a store that could not connect answers at once with that error
// instead of trying again (recognition asks on every request).
constexpr auto kReconnectAfter = std::chrono::seconds(1);

// A version counter's value: nil (never written) is 0. An error reply (a
// Redis still loading its data, say) is UNAVAILABLE.
Result<int64_t> VersionOf(const RedisReply& r) {
  if (r.is_nil()) return int64_t{0};
  if (r.is_error()) return std::unexpected(Unavailable(r.str));
  if (r.type == RedisReply::Type::kInteger) return r.integer;
  int64_t v = 0;
  const char* end = r.str.data() + r.str.size();
  if (!r.is_string() || r.str.empty() || std::from_chars(r.str.data(), end, v).ptr != end) {
    return std::unexpected(InvalidArgument("its version key does not hold a number"));
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
  const auto now = std::chrono::steady_clock::now();
  if (now < retry_at_) return std::unexpected(last_error_);
  auto c = RedisConnection::Connect(options_);
  if (!c) {
    last_error_ =
        Status(c.error().code() == StatusCode::kPermissionDenied ? c.error().code() : StatusCode::kUnavailable,
               Describe() + ": " + c.error().message());
    retry_at_ = now + kReconnectAfter;
    return std::unexpected(last_error_);
  }
  conn_ = std::move(*c);
  return conn_.get();
}

Status RedisFaceStore::Failed(const Status& st) {
  conn_.reset();  // a WATCH or a transaction left open goes with it
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
  if (!replies) return std::unexpected(Failed(replies.error()));
  const RedisReply& exec = replies->back();
  if (!exec.is_array() || exec.elements.size() != 2) {
    return std::unexpected(Failed(
        Internal("an unexpected answer to reading the gallery" + (exec.is_error() ? ": " + exec.str : std::string()))));
  }
  Stored s;
  auto version = VersionOf(exec.elements[0]);
  if (!version) return std::unexpected(Failed(version.error()));
  s.version = *version;
  const RedisReply& gallery = exec.elements[1];
  if (gallery.is_error()) return std::unexpected(Failed(Unavailable(gallery.str)));
  if (gallery.is_string()) {
    s.bytes = gallery.str;
  } else if (s.version > 0) {
    // Written once, gone now (evicted by maxmemory, deleted): an empty
    // gallery written over it would lose every instance's faces.
    return std::unexpected(InvalidArgument(
        Describe() + ": the gallery is missing while its version is " + std::to_string(s.version) +
        " (evicted or deleted?); restore it, or delete " + version_key_ + " to start an empty gallery"));
  }
  return s;
}

Result<int64_t> RedisFaceStore::Version() {
  QUERN_ASSIGN_OR_RETURN(RedisConnection * c, Connection());
  RedisPipeline p;
  p.Add({"GET", version_key_});
  auto replies = c->Execute(p);
  if (!replies) return std::unexpected(Failed(replies.error()));
  auto version = VersionOf(replies->front());
  if (!version) return std::unexpected(Failed(version.error()));
  return *version;
}

Result<std::optional<int64_t>> RedisFaceStore::Write(const std::string& bytes, int64_t based_on) {
  QUERN_ASSIGN_OR_RETURN(RedisConnection * c, Connection());
  RedisPipeline watch;
  watch.Add({"WATCH", version_key_});
  watch.Add({"GET", version_key_});
  auto seen = c->Execute(watch);
  if (!seen) return std::unexpected(Failed(seen.error()));
  auto version = VersionOf(seen->back());
  if (!version) return std::unexpected(Failed(version.error()));  // the WATCH goes with the connection
  if (*version != based_on) {
    RedisPipeline unwatch;
    unwatch.Add({"UNWATCH"});
    if (auto r = c->Execute(unwatch); !r) return std::unexpected(Failed(r.error()));
    return std::optional<int64_t>();  // another instance wrote first
  }
  RedisPipeline tx;
  tx.Add({"MULTI"});
  tx.Add({"SET", key_, bytes});
  tx.Add({"INCR", version_key_});
  tx.Add({"EXEC"});
  // As job results: the registration is answered once the replicas asked
  // for have it (or the wait timed out, which is logged).
  const int wait = options_.wait_replicas;
  const std::string wait_n = std::to_string(wait), wait_ms = std::to_string(options_.wait_timeout.count());
  if (wait > 0) tx.Add({"WAIT", wait_n, wait_ms});
  auto replies = c->Execute(tx, wait > 0 ? options_.wait_timeout : std::chrono::milliseconds(0));
  if (!replies) return std::unexpected(Failed(replies.error()));
  if (wait > 0) {
    const RedisReply& acked = replies->back();
    if (acked.is_error() || acked.integer < wait) {
      Log(LogLevel::kWarning, Describe() + ": gallery written but " +
                                  (acked.is_error() ? "WAIT failed: " + acked.str
                                                    : std::to_string(acked.integer) + " of " + wait_n +
                                                          " replicas confirmed it within " + wait_ms + " ms"));
    }
    replies->pop_back();
  }
  const RedisReply& exec = replies->back();
  if (exec.is_nil()) return std::optional<int64_t>();  // the version changed after the check
  if (!exec.is_array() || exec.elements.size() != 2 || exec.elements[1].type != RedisReply::Type::kInteger) {
    for (const auto& r : *replies) {
      if (r.is_error()) return std::unexpected(Failed(Unavailable(r.str)));
    }
    for (const auto& r : exec.elements) {
      if (r.is_error()) return std::unexpected(Failed(Unavailable(r.str)));
    }
    return std::unexpected(Failed(Internal("an unexpected answer to writing the gallery")));
  }
  return std::optional<int64_t>(exec.elements[1].integer);
}

}  // namespace quern
