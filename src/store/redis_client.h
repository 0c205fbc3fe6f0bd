// A small synchronous Redis client: RESP2 over TCP or TLS, with timeouts.
//
// Commands are encoded into a RedisPipeline and sent in one write; the
// replies come back in order, so any number of commands costs one round
// trip. A RedisConnection is used by one thread at a time; a caller that
// gets UNAVAILABLE drops the connection and makes a new one (see
// RedisConnection::Connect).
//
//   redis://[[user]:password@]host[:port][/db]    plain TCP
//   rediss://...                                  TLS (certificate checked
//                                                 unless tls_skip_verify)
//   redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/master[/db]
//   rediss+sentinel://...                         the master that Redis
//                                                 Sentinels name, asked of
//                                                 them on every connect
//   ...?wait_replicas=N&wait_timeout_ms=T&sentinel_password=P
//                                                 (any form; see RedisOptions)
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "quern/status.h"

namespace quern {

struct RedisOptions {
  std::string host = "127.0.0.1";
  int port = 6379;
  int db = 0;
  std::string user, password;  // AUTH when password is set
  bool tls = false;
  std::string tls_ca_file;                  // trust anchors; empty = the system's
  std::string tls_cert_file, tls_key_file;  // client certificate, when the server asks for one
  bool tls_skip_verify = false;             // no certificate check (testing only)
  std::chrono::milliseconds connect_timeout{2000};
  std::chrono::milliseconds io_timeout{5000};  // one round trip, on top of a command's own blocking time
  // A bulk string (a stream entry's field, a value) longer than this is not
  // kept: its bytes are dropped as they arrive and the reply holds its
  // length instead (RedisReply::oversize). 0 = no bound.
  size_t max_bulk_bytes = 0;

  // Sentinel: when `sentinels` is not empty, host and port are not used; each
  // Connect asks the sentinels, in turn, for the address of the master named
  // `sentinel_master` and checks with ROLE that it is one. The sentinels get
  // AUTH with sentinel_user/sentinel_password when that is set; TLS settings
  // apply to them and to the master alike.
  struct Endpoint {
    std::string host;
    int port = 26379;
  };
  std::vector<Endpoint> sentinels;
  std::string sentinel_master;
  std::string sentinel_user, sentinel_password;
  // The sentinel that answered last (asked first next time); shared by the
  // copies of these options. May be null.
  std::shared_ptr<std::atomic<size_t>> sentinel_first;

  // Writes of job results wait until this many replicas have them (WAIT),
  // at most wait_timeout; 0 = do not wait (replication is asynchronous: a
  // failover can then lose the last results written).
  int wait_replicas = 0;
  std::chrono::milliseconds wait_timeout{100};

  // "host:port", or the master's name and its sentinels (for messages;
  // never a password).
  std::string Address() const;
};

// Parses a redis://, rediss://, redis+sentinel:// or rediss+sentinel:// URL
// into `options` (TLS file settings are kept). INVALID_ARGUMENT says what
// part is wrong.
Status ParseRedisUrl(std::string_view url, RedisOptions& options);

struct RedisReply {
  enum class Type { kString, kStatus, kError, kInteger, kNil, kArray };
  Type type = Type::kNil;
  std::string str;  // kString, kStatus, kError
  int64_t integer = 0;
  // kString over RedisOptions::max_bulk_bytes: its length (str is empty);
  // -1 otherwise.
  int64_t oversize = -1;
  std::vector<RedisReply> elements;  // kArray

  bool is_error() const { return type == Type::kError; }
  bool is_nil() const { return type == Type::kNil; }
  bool is_array() const { return type == Type::kArray; }
  bool is_string() const { return type == Type::kString || type == Type::kStatus; }
};

// Drops the bytes of bulk strings longer than `max_bulk` from `buf` as they
// arrive, leaving a marker with the length that ParseRedisReply reads as a
// string with RedisReply::oversize set. `scan` (where the next token starts)
// and `skip` (bytes of a dropped string still to come) carry over between
// calls, as more of the replies arrives; `buf` from `scan` on is what
// arrived since. Returns the bytes dropped.
size_t MarkOversizeBulks(std::string& buf, size_t& scan, size_t& skip, size_t max_bulk);

// Parses one reply from the front of `data`. Returns the reply and sets
// `consumed`; nullopt when `data` holds only part of a reply; INVALID_ARGUMENT
// for bytes that are not RESP.
Result<std::optional<RedisReply>> ParseRedisReply(std::string_view data, size_t& consumed);

// Commands encoded back to back, sent in one write.
class RedisPipeline {
 public:
  void Add(std::initializer_list<std::string_view> args);
  void Add(const std::vector<std::string_view>& args);
  void Add(const std::vector<std::string>& args);
  // A command whose last argument, `viewed`, is sent from where it is, not
  // copied: the pipeline keeps `owner` (which keeps `viewed` alive) until it
  // goes. For large values (a job's body).
  void AddViewing(std::initializer_list<std::string_view> args, std::string_view viewed,
                  std::shared_ptr<const void> owner);
  void AddViewing(const std::vector<std::string_view>& args, std::string_view viewed,
                  std::shared_ptr<const void> owner);

  // Appends `other`'s commands after these.
  void Append(const RedisPipeline& other);

  size_t size() const { return count_; }
  bool empty() const { return count_ == 0; }
  // The bytes to send, in order (the encoding and the viewed arguments).
  std::vector<std::string_view> Pieces() const;
  size_t bytes() const { return data_.size() + viewed_bytes_; }
  // The pieces joined (a copy: for tests).
  std::string Joined() const;
  void Clear() {
    data_.clear();
    views_.clear();
    viewed_bytes_ = 0;
    count_ = 0;
  }

 private:
  struct View {
    size_t at = 0;  // where in data_ it goes
    std::string_view bytes;
    std::shared_ptr<const void> owner;
  };
  void Begin(size_t n);
  void Arg(std::string_view a);

  std::string data_;
  std::vector<View> views_;  // in the order of `at`
  size_t viewed_bytes_ = 0;
  size_t count_ = 0;
};

class RedisConnection {
 public:
  // Connects, authenticates and selects the database (with sentinels: to the
  // master they name, see RedisOptions). UNAVAILABLE when the server cannot
  // be reached (or no sentinel names a master that says it is one);
  // PERMISSION_DENIED when AUTH is refused.
  static Result<std::unique_ptr<RedisConnection>> Connect(const RedisOptions& options);
  ~RedisConnection();

  // Sends the pipeline and reads one reply per command, in order. Error
  // replies are returned as replies; UNAVAILABLE when the connection failed
  // or timed out (the connection is then unusable). A READONLY reply (the
  // server is a replica now: a failover demoted it) also marks the
  // connection broken, so that its owner connects again to the master. `block` is extra time
  // the server may take (a blocking command's timeout).
  Result<std::vector<RedisReply>> Execute(const RedisPipeline& pipeline,
                                          std::chrono::milliseconds block = std::chrono::milliseconds(0));
  // One command; an error reply is returned as INTERNAL with its text.
  Result<RedisReply> Command(std::initializer_list<std::string_view> args,
                             std::chrono::milliseconds block = std::chrono::milliseconds(0));

  bool broken() const;
  // The options connected with: with sentinels, host and port are the
  // master's (and `sentinels` is empty).
  const RedisOptions& options() const;

  class Impl;

 private:
  explicit RedisConnection(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace quern
