#include "core/host_port.h"

#include <charconv>
#include <cstdint>

namespace quern {

std::string ParseHostPort(std::string_view text, int default_port, std::string& host, int& port) {
  std::string_view h = text, p;
  if (text.starts_with('[')) {  // [::1]:6379
    const auto close = text.find(']');
    if (close == std::string_view::npos) return "unterminated IPv6 address";
    h = text.substr(1, close - 1);
    std::string_view after = text.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return "unexpected text after the address";
      p = after.substr(1);
    }
  } else if (auto colon = text.rfind(':'); colon != std::string_view::npos) {
    h = text.substr(0, colon);
    p = text.substr(colon + 1);
  }
  if (h.empty()) return "no host";
  int v = default_port;
  if (!p.empty()) {
    auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), v);
    if (ec != std::errc() || end != p.data() + p.size() || v <= 0 || v > 65535) {
      return "port '" + std::string(p) + "' is not 1-65535";
    }
  }
  host = std::string(h);
  port = v;
  return "";
}

}  // namespace quern
