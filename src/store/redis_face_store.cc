#include "store/redis_face_store.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <set>

#include "core/log.h"

namespace quern {
namespace {

// How long a store that could not connect answers at once with that error
// instead of trying again (recognition asks on every request).
constexpr int64_t kReconnectAfterNs = 1'000'000'000;
// Changes kept for readers that missed them (older ones read every user).
constexpr int kKeptChanges = 1024;
// The users hash's field that marks the gallery as written (no user id is
// empty): a version above 0 without it means the hash was lost.
constexpr std::string_view kWrittenField = "";
constexpr std::string_view kWrittenValue = "QUERNFACES2";
// Reads of the changes that a concurrent write invalidated before the
// reader falls back to reading every user.
constexpr int kChangeReadAttempts = 3;

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

RedisFaceStore::RedisFaceStore(RedisOptions options, std::string key, const Clock* clock)
    : options_(std::move(options)),
      key_(std::move(key)),
      users_key_(key_ + ":users"),
      version_key_(key_ + ":version"),
      changes_key_(key_ + ":changes"),
      clock_(clock ? *clock : RealClockInstance()) {}

RedisFaceStore::~RedisFaceStore() = default;

std::string RedisFaceStore::Describe() const {
  return "face gallery in Redis at " + options_.Address() + " (key " + key_ + ")";
}

Result<RedisConnection*> RedisFaceStore::Connection() {
  if (conn_ && !conn_->broken()) return conn_.get();
  conn_.reset();
  const int64_t now = clock_.NowNs();
  if (now < retry_at_ns_) return std::unexpected(last_error_);
  auto c = RedisConnection::Connect(options_);
  if (!c) {
    last_error_ =
        Status(c.error().code() == StatusCode::kPermissionDenied ? c.error().code() : StatusCode::kUnavailable,
               Describe() + ": " + c.error().message());
    retry_at_ns_ = now + kReconnectAfterNs;
    return std::unexpected(last_error_);
  }
  conn_ = std::move(*c);
  return conn_.get();
}

Status RedisFaceStore::Failed(const Status& st) {
  conn_.reset();  // a WATCH or a transaction left open goes with it
  return Status(st.code(), Describe() + ": " + st.message());
}

Status RedisFaceStore::Missing(int64_t version) const {
  // Written once, gone now (evicted by maxmemory, deleted): an empty
  // gallery written over it would lose every instance's faces.
  return InvalidArgument(Describe() + ": the gallery is missing while its version is " + std::to_string(version) +
                         " (evicted or deleted?); restore " + users_key_ + ", or delete " + version_key_ + " and " +
                         changes_key_ + " to start an empty gallery");
}

Result<FaceGalleryStore::Records> RedisFaceStore::Read() {
  QUERN_ASSIGN_OR_RETURN(RedisConnection * c, Connection());
  for (int attempt = 0; attempt < 2; ++attempt) {
    RedisPipeline p;  // in one transaction: a version and the users it belongs to
    p.Add({"MULTI"});
    p.Add({"GET", version_key_});
    p.Add({"HGETALL", users_key_});
    p.Add({"EXISTS", key_});
    p.Add({"EXEC"});
    auto replies = c->Execute(p);
    if (!replies) return std::unexpected(Failed(replies.error()));
    const RedisReply& exec = replies->back();
    if (!exec.is_array() || exec.elements.size() != 3) {
      return std::unexpected(Failed(Internal("an unexpected answer to reading the gallery" +
                                             (exec.is_error() ? ": " + exec.str : std::string()))));
    }
    if (exec.elements[2].integer == 1 && attempt == 0) {
      QUERN_RETURN_IF_ERROR(MoveWholeGallery(c));
      continue;  // read again what was moved
    }
    Records out;
    auto version = VersionOf(exec.elements[0]);
    if (!version) return std::unexpected(Failed(version.error()));
    out.version = *version;
    const RedisReply& users = exec.elements[1];
    if (users.is_error()) return std::unexpected(Failed(Unavailable(users.str)));
    bool written = false;
    for (size_t i = 0; i + 1 < users.elements.size(); i += 2) {
      const RedisReply& field = users.elements[i];
      const RedisReply& value = users.elements[i + 1];
      if (field.oversize >= 0 || value.oversize >= 0) {
        return std::unexpected(Failed(InvalidArgument("a user's faces are larger than the largest value read")));
      }
      if (field.str == kWrittenField) {
        written = true;
        continue;
      }
      out.records.push_back({field.str, value.str});
    }
    if (!written && out.version > 0) return std::unexpected(Missing(out.version));
    return out;
  }
  return std::unexpected(
      Failed(Internal("the gallery of an earlier release is still at " + key_ + " after it was moved")));
}

Status RedisFaceStore::MoveWholeGallery(RedisConnection* c) {
  RedisPipeline watch;
  watch.Add({"WATCH", version_key_, key_});
  watch.Add({"GET", key_});
  auto seen = c->Execute(watch);
  if (!seen) return Failed(seen.error());
  const RedisReply& whole = seen->back();
  if (whole.is_nil()) {  // another instance moved it
    RedisPipeline unwatch;
    unwatch.Add({"UNWATCH"});
    if (auto r = c->Execute(unwatch); !r) return Failed(r.error());
    return Status::Ok();
  }
  if (!whole.is_string() || whole.oversize >= 0) {
    return Failed(InvalidArgument(
        "the gallery at " + key_ + " cannot be read whole (" +
        (whole.oversize >= 0 ? std::to_string(whole.oversize) + " bytes" : std::string("not a string")) + ")"));
  }
  auto records = ParseWholeGallery(whole.str, Describe() + " (key " + key_ + ")");
  if (!records) {
    conn_.reset();
    return records.error();
  }
  std::vector<std::string> hset = {"HSET", users_key_, std::string(kWrittenField), std::string(kWrittenValue)};
  for (auto& r : *records) {
    hset.push_back(std::move(r.userid));
    hset.push_back(std::move(r.faces));
  }
  RedisPipeline tx;
  tx.Add({"MULTI"});
  tx.Add({"DEL", users_key_, changes_key_});
  tx.Add(hset);
  tx.Add({"INCR", version_key_});
  tx.Add({"DEL", key_});
  tx.Add({"EXEC"});
  auto replies = c->Execute(tx);
  if (!replies) return Failed(replies.error());
  const RedisReply& exec = replies->back();
  if (exec.is_nil()) return Status::Ok();  // another instance wrote first: read what is there
  for (const auto& r : exec.elements) {
    if (r.is_error()) return Failed(Unavailable(r.str));
  }
  Log(LogLevel::kInfo, Describe() + ": the gallery of an earlier release (" + std::to_string(records->size()) +
                           " users) moved from " + key_ + " to " + users_key_);
  return Status::Ok();
}

Result<std::optional<FaceGalleryStore::Records>> RedisFaceStore::ChangesSince(int64_t since) {
  QUERN_ASSIGN_OR_RETURN(RedisConnection * c, Connection());
  for (int attempt = 0; attempt < kChangeReadAttempts; ++attempt) {
    RedisPipeline p;
    p.Add({"MULTI"});
    p.Add({"GET", version_key_});
    std::string after = "(";  // exclusive
    after.append(std::to_string(since));
    p.Add({"ZRANGEBYSCORE", changes_key_, after, "+inf"});
    p.Add({"EXEC"});
    auto replies = c->Execute(p);
    if (!replies) return std::unexpected(Failed(replies.error()));
    const RedisReply& exec = replies->back();
    if (!exec.is_array() || exec.elements.size() != 2 || !exec.elements[1].is_array()) {
      return std::unexpected(Failed(Internal("an unexpected answer to reading the gallery's changes" +
                                             (exec.is_error() ? ": " + exec.str : std::string()))));
    }
    auto version = VersionOf(exec.elements[0]);
    if (!version) return std::unexpected(Failed(version.error()));
    Records out;
    out.version = *version;
    if (*version == since) return std::optional<Records>(std::move(out));
    // Every change since, or the reader reads every user: the set holds
    // consecutive versions, so the count tells.
    const auto& changes = exec.elements[1].elements;
    if (*version < since || static_cast<int64_t>(changes.size()) != *version - since) {
      return std::optional<Records>();
    }
    std::vector<std::string> order;  // each changed user once, at its last change
    std::set<std::string_view> seen;
    for (auto it = changes.rbegin(); it != changes.rend(); ++it) {
      const size_t colon = it->str.find(':');
      if (colon == std::string::npos) return std::optional<Records>();
      const std::string_view id = std::string_view(it->str).substr(colon + 1);
      if (seen.insert(id).second) order.emplace_back(id);
    }
    std::reverse(order.begin(), order.end());
    std::vector<std::string> hmget = {"HMGET", users_key_, std::string(kWrittenField)};
    hmget.insert(hmget.end(), order.begin(), order.end());
    RedisPipeline read;
    read.Add(hmget);
    read.Add({"GET", version_key_});
    auto values = c->Execute(read);
    if (!values) return std::unexpected(Failed(values.error()));
    auto again = VersionOf(values->back());
    if (!again) return std::unexpected(Failed(again.error()));
    if (*again != *version) continue;  // a change came between the two reads: read them again
    const RedisReply& got = values->front();
    if (!got.is_array() || got.elements.size() != order.size() + 1) {
      return std::unexpected(Failed(Internal("an unexpected answer to reading the changed users" +
                                             (got.is_error() ? ": " + got.str : std::string()))));
    }
    if (got.elements[0].is_nil()) return std::unexpected(Missing(*version));
    for (size_t i = 0; i < order.size(); ++i) {
      const RedisReply& v = got.elements[i + 1];
      if (v.oversize >= 0) {
        return std::unexpected(Failed(InvalidArgument("a user's faces are larger than the largest value read")));
      }
      out.records.push_back({std::move(order[i]), v.is_nil() ? std::string() : v.str});
    }
    return std::optional<Records>(std::move(out));
  }
  return std::optional<Records>();  // changing under every read: read every user
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

Result<std::optional<int64_t>> RedisFaceStore::Write(const FaceRecord& record, int64_t based_on) {
  QUERN_ASSIGN_OR_RETURN(RedisConnection * c, Connection());
  // The hash is watched too: a version that stayed while the hash went
  // (evicted, deleted) must not let one user's record start a new one.
  RedisPipeline watch;
  watch.Add({"WATCH", version_key_, users_key_});
  watch.Add({"GET", version_key_});
  watch.Add({"HEXISTS", users_key_, kWrittenField});
  auto seen = c->Execute(watch);
  if (!seen) return std::unexpected(Failed(seen.error()));
  auto version = VersionOf((*seen)[1]);
  if (!version) return std::unexpected(Failed(version.error()));  // the WATCH goes with the connection
  if (*version > 0 && (*seen)[2].integer != 1) {
    conn_.reset();  // and the WATCH with it
    return std::unexpected(Missing(*version));
  }
  if (*version != based_on) {
    RedisPipeline unwatch;
    unwatch.Add({"UNWATCH"});
    if (auto r = c->Execute(unwatch); !r) return std::unexpected(Failed(r.error()));
    return std::optional<int64_t>();  // another instance wrote first
  }
  const std::string next = std::to_string(based_on + 1);
  std::string member = next;  // "<version>:<user id>"
  member.push_back(':');
  member.append(record.userid);
  RedisPipeline tx;
  tx.Add({"MULTI"});
  if (record.faces.empty()) {
    tx.Add({"HDEL", users_key_, record.userid});
    tx.Add({"HSET", users_key_, kWrittenField, kWrittenValue});
  } else {
    tx.Add({"HSET", users_key_, kWrittenField, kWrittenValue, record.userid, record.faces});
  }
  tx.Add({"INCR", version_key_});
  tx.Add({"ZADD", changes_key_, next, member});
  tx.Add({"ZREMRANGEBYRANK", changes_key_, "0", std::to_string(-kKeptChanges - 1)});
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
  const size_t incr = record.faces.empty() ? 2 : 1;    // INCR's answer among the transaction's
  if (!exec.is_array() || exec.elements.size() != incr + 3 || exec.elements[incr].type != RedisReply::Type::kInteger) {
    for (const auto& r : *replies) {
      if (r.is_error()) return std::unexpected(Failed(Unavailable(r.str)));
    }
    for (const auto& r : exec.elements) {
      if (r.is_error()) return std::unexpected(Failed(Unavailable(r.str)));
    }
    return std::unexpected(Failed(Internal("an unexpected answer to writing the gallery")));
  }
  return std::optional<int64_t>(exec.elements[incr].integer);
}

}  // namespace quern
