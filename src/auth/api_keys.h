// API keys and per-key rate limits, shared by every front end.
//
// Keys come from files (one key per line; blank lines and lines starting
// with '#' are ignored; surrounding white space is trimmed) or from
// environment variables (comma-separated). Two kinds: user keys reach every
// route except model control; admin keys reach model control (load, unload)
// as well. Only SHA-256 digests of the keys are kept, and a presented key is
// found by its digest, so a comparison takes the same time whatever the
// presented key shares with a real one.
//
// Thread-safe: Authorize may be called from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/mutex.h"
#include "quern/status.h"

namespace quern {

struct ApiKeyOptions {
  std::string keys_file;        // user keys; empty = none from a file
  std::string admin_keys_file;  // admin keys; empty = none from a file
  std::string keys_env;         // value of QUERN_API_KEYS (comma-separated)
  std::string admin_keys_env;   // value of QUERN_ADMIN_KEYS (comma-separated)
  // --vision-api-key: one more user key, like any other (the routes it
  // opens are those every user key opens).
  std::string vision_key;
  // Requests per second each key may make (token bucket, burst of
  // max(1, rate) requests); 0 = no limit.
  double rate_limit_per_s = 0;
};

class ApiKeys {
 public:
  // Reads the files. INVALID_ARGUMENT when a file cannot be read or holds no
  // key, or when a key holds control characters or white space.
  static Result<std::unique_ptr<ApiKeys>> Load(const ApiKeyOptions& options);

  // True when any key is configured: every request must then carry one.
  bool enabled() const { return !digests_.empty(); }
  // How many distinct keys are configured, and how many of them are admin keys.
  size_t size() const { return digests_.size(); }
  size_t admin_count() const;
  // Requests per second each key may make; 0 = no limit.
  double rate_limit_per_s() const { return rate_; }

  // Checks a presented key for an ordinary request (`admin` false) or a
  // model-control request (`admin` true). OK; UNAUTHENTICATED when the key
  // is missing or unknown; PERMISSION_DENIED when a user key asks for model
  // control; RESOURCE_EXHAUSTED when the key is over its rate limit. Always
  // OK when no key is configured.
  Status Authorize(std::string_view presented, bool admin, int64_t now_ns);

 private:
  using Digest = std::array<unsigned char, 32>;
  struct Bucket {
    double tokens = 0;
    int64_t updated_ns = 0;
  };

  static Digest Hash(std::string_view key);
  Status AddKeys(const std::vector<std::string>& keys, bool admin, const std::string& source);

  std::map<Digest, bool> digests_;  // digest -> admin; fixed after Load
  double rate_ = 0;
  double burst_ = 0;
  Mutex mu_;
  std::map<Digest, Bucket> buckets_ QUERN_GUARDED_BY(mu_);
};

// The HTTP status for an Authorize error: 401 (with UNAUTHENTICATED), 403,
// 429 (RESOURCE_EXHAUSTED: over the rate limit).
int AuthHttpStatus(const Status& status);

// The key a request presents: "Authorization: Bearer <key>" (also
// "Authorization: <key>"), else "X-API-Key: <key>". Empty when none.
std::string_view PresentedKey(std::string_view authorization, std::string_view x_api_key);

}  // namespace quern
