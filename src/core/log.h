// The server's log: one line per event on stderr, with a level and, where
// they apply, fields such as the model and the request id.
//
//   text (the default):  quern: warning: <message> model=m request_id=42
//   json:                {"time":"2026-11-24T22:17:34.123Z","level":"warning",
//                         "msg":"<message>","model":"m","request_id":"42"}
//
// Lines below the configured level are dropped before anything is
// formatted. Thread-safe: each line is written whole, in one call.
#pragma once

#include <cstdio>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "quern/status.h"

namespace quern {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };
enum class LogFormat { kText, kJson };

struct LogOptions {
  LogLevel level = LogLevel::kInfo;
  LogFormat format = LogFormat::kText;
};

// Applies to every later line; call before the server starts its threads.
void SetLogOptions(LogOptions options);
LogOptions CurrentLogOptions();

// "debug", "info", "warning" (or "warn"), "error".
Result<LogLevel> ParseLogLevel(std::string_view name);
// "text" or "json".
Result<LogFormat> ParseLogFormat(std::string_view name);

using LogField = std::pair<std::string_view, std::string_view>;
using LogFields = std::initializer_list<LogField>;

bool LogEnabled(LogLevel level);
// One event on stderr.
void Log(LogLevel level, std::string_view message, LogFields fields = {});
// The same on `out` (the start-up lines that name the ports go to stdout).
void LogTo(std::FILE* out, LogLevel level, std::string_view message, LogFields fields = {});

// The time as the JSON lines give it: "2026-11-24T22:17:34.123Z" (UTC).
std::string LogTimestamp();

// True when a client's request id may name its request as it is: 1 to 128
// printable ASCII characters without spaces, quotes or backslashes (nothing
// that could break a log line or a header).
bool UsableRequestId(std::string_view id);

// The line Log would write, without the newline (for tests and the access log).
std::string FormatLogLine(LogFormat format, LogLevel level, std::string_view message, std::span<const LogField> fields);
inline std::string FormatLogLine(LogFormat format, LogLevel level, std::string_view message, LogFields fields) {
  return FormatLogLine(format, level, message, std::span<const LogField>(fields.begin(), fields.size()));
}

}  // namespace quern
