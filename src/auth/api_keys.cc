#include "auth/api_keys.h"

#include <openssl/sha.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace quern {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

Result<std::vector<std::string>> ReadKeyFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Err(InvalidArgument("cannot read the API key file '" + path + "'"));
  std::vector<std::string> keys;
  for (std::string line; std::getline(in, line);) {
    std::string_view k = Trim(line);
    if (k.empty() || k.front() == '#') continue;
    keys.emplace_back(k);
  }
  if (keys.empty()) return Err(InvalidArgument("the API key file '" + path + "' holds no key"));
  return keys;
}

std::vector<std::string> SplitList(std::string_view s) {
  std::vector<std::string> out;
  while (!s.empty()) {
    const size_t comma = s.find(',');
    std::string_view k = Trim(s.substr(0, comma));
    if (!k.empty()) out.emplace_back(k);
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return out;
}

}  // namespace

ApiKeys::Digest ApiKeys::Hash(std::string_view key) {
  Digest d;
  SHA256(reinterpret_cast<const unsigned char*>(key.data()), key.size(), d.data());
  return d;
}

Status ApiKeys::AddKeys(const std::vector<std::string>& keys, bool admin, const std::string& source) {
  for (const auto& k : keys) {
    for (unsigned char c : k) {
      if (c <= 0x20 || c == 0x7f) {
        return InvalidArgument(source + ": an API key holds white space or a control character");
      }
    }
    bool& is_admin = digests_[Hash(k)];
    is_admin = is_admin || admin;
  }
  return Status::Ok();
}

Result<std::unique_ptr<ApiKeys>> ApiKeys::Load(const ApiKeyOptions& o) {
  std::unique_ptr<ApiKeys> keys(new ApiKeys());
  if (!o.keys_file.empty()) {
    QUERN_ASSIGN_OR_RETURN(auto list, ReadKeyFile(o.keys_file));
    QUERN_RETURN_IF_ERROR(keys->AddKeys(list, false, o.keys_file));
  }
  if (!o.admin_keys_file.empty()) {
    QUERN_ASSIGN_OR_RETURN(auto list, ReadKeyFile(o.admin_keys_file));
    QUERN_RETURN_IF_ERROR(keys->AddKeys(list, true, o.admin_keys_file));
  }
  QUERN_RETURN_IF_ERROR(keys->AddKeys(SplitList(o.keys_env), false, "QUERN_API_KEYS"));
  QUERN_RETURN_IF_ERROR(keys->AddKeys(SplitList(o.admin_keys_env), true, "QUERN_ADMIN_KEYS"));
  if (!o.vision_key.empty()) QUERN_RETURN_IF_ERROR(keys->AddKeys({o.vision_key}, false, "--vision-api-key"));
  if (!(o.rate_limit_per_s >= 0) || o.rate_limit_per_s > 1e9) {
    return Err(InvalidArgument("the API key rate limit must be a number of requests per second >= 0"));
  }
  keys->rate_ = o.rate_limit_per_s;
  keys->burst_ = std::max(1.0, o.rate_limit_per_s);
  return keys;
}

size_t ApiKeys::admin_count() const {
  size_t n = 0;
  for (const auto& [digest, admin] : digests_) n += admin ? 1 : 0;
  return n;
}

Status ApiKeys::Authorize(std::string_view presented, bool admin, int64_t now_ns) {
  if (digests_.empty()) return Status::Ok();
  if (presented.empty()) {
    return Unauthenticated("an API key is required (Authorization: Bearer <key>)");
  }
  const Digest d = Hash(presented);
  auto it = digests_.find(d);
  if (it == digests_.end()) return Unauthenticated("the API key is not valid");
  if (admin && !it->second) return PermissionDenied("model control needs an admin key");
  if (rate_ > 0) {
    MutexLock lock(mu_);
    auto [b, fresh] = buckets_.try_emplace(d);
    if (fresh) {
      b->second.tokens = burst_;
    } else {
      const double elapsed_s = static_cast<double>(now_ns - b->second.updated_ns) / 1e9;
      b->second.tokens = std::min(burst_, b->second.tokens + std::max(0.0, elapsed_s) * rate_);
    }
    b->second.updated_ns = now_ns;
    if (b->second.tokens < 1.0) {
      std::ostringstream m;
      m << "this API key is over its rate limit of " << rate_ << " requests per second";
      return ResourceExhausted(m.str());
    }
    b->second.tokens -= 1.0;
  }
  return Status::Ok();
}

int AuthHttpStatus(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk: return 200;
    case StatusCode::kUnauthenticated: return 401;
    case StatusCode::kPermissionDenied: return 403;
    case StatusCode::kResourceExhausted: return 429;
    default: return 500;
  }
}

std::string_view PresentedKey(std::string_view authorization, std::string_view x_api_key) {
  std::string_view a = Trim(authorization);
  if (!a.empty()) {
    if (a.size() > 7 && (a[0] == 'B' || a[0] == 'b') && (a.substr(1, 6) == "earer " || a.substr(1, 6) == "EARER ")) {
      a = Trim(a.substr(7));
    }
    return a;
  }
  return Trim(x_api_key);
}

}  // namespace quern
