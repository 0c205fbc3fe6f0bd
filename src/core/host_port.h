// "host", "host:port", "[v6]" and "[v6]:port", as URLs and flags write an
// address (the Redis URL, `quern perf --url`).
#pragma once

#include <string>
#include <string_view>

namespace quern {

// Splits `text` into host and port; `port` is `default_port` when none is
// written. Returns "" or what is wrong ("no host", "port 'x' is not
// 1-65535", ...), for the caller to put in its own message.
std::string ParseHostPort(std::string_view text, int default_port, std::string& host, int& port);

}  // namespace quern
