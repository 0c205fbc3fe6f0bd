#include "core/log.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>

#include "core/json.h"

namespace quern {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_format{static_cast<int>(LogFormat::kText)};

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "info";
}

// A JSON string of `s`: control characters escaped, well-formed UTF-8 as it
// is, and each byte of anything else (a client's raw bytes in a path) as
// \u00XX, so every line is valid JSON whatever a client sent.
void JsonString(std::string& out, std::string_view s) {
  out += '"';
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      if (const size_t n = Utf8SequenceLength(s.substr(i)); n > 0) {
        out.append(s.data() + i, n);
        i += n - 1;
      } else {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        out += buf;
      }
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

// A text field's value: quoted when it holds spaces, quotes, control
// characters or bytes that are not well-formed UTF-8.
void TextValue(std::string& out, std::string_view v) {
  bool plain = !v.empty();
  for (size_t i = 0; plain && i < v.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(v[i]);
    if (c >= 0x80) {
      const size_t n = Utf8SequenceLength(v.substr(i));
      plain = n > 0;
      i += n > 0 ? n - 1 : 0;
    } else {
      plain = c > 0x20 && c != '"' && c != 0x7f;
    }
  }
  if (plain) {
    out += v;
  } else {
    JsonString(out, v);
  }
}

}  // namespace

std::string LogTimestamp() {
  const auto now = std::chrono::system_clock::now();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms % 1000));
  return buf;
}

void SetLogOptions(LogOptions options) {
  g_level.store(static_cast<int>(options.level), std::memory_order_relaxed);
  g_format.store(static_cast<int>(options.format), std::memory_order_relaxed);
}

LogOptions CurrentLogOptions() {
  return {static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)),
          static_cast<LogFormat>(g_format.load(std::memory_order_relaxed))};
}

Result<LogLevel> ParseLogLevel(std::string_view name) {
  if (name == "debug") return LogLevel::kDebug;
  if (name == "info") return LogLevel::kInfo;
  if (name == "warning" || name == "warn") return LogLevel::kWarning;
  if (name == "error") return LogLevel::kError;
  return Err(InvalidArgument("log level '" + std::string(name) + "': expected debug, info, warning or error"));
}

Result<LogFormat> ParseLogFormat(std::string_view name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  return Err(InvalidArgument("log format '" + std::string(name) + "': expected text or json"));
}

bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed);
}

std::string FormatLogLine(LogFormat format, LogLevel level, std::string_view message,
                          std::span<const LogField> fields) {
  std::string line;
  line.reserve(64 + message.size());
  if (format == LogFormat::kJson) {
    line += "{\"time\":\"";
    line += LogTimestamp();
    line += "\",\"level\":\"";
    line += LevelName(level);
    line += "\",\"msg\":";
    JsonString(line, message);
    for (const auto& [k, v] : fields) {
      line += ',';
      JsonString(line, k);
      line += ':';
      JsonString(line, v);
    }
    line += '}';
    return line;
  }
  line += "quern: ";
  if (level == LogLevel::kWarning || level == LogLevel::kError || level == LogLevel::kDebug) {
    line += LevelName(level);
    line += ": ";
  }
  line += message;
  for (const auto& [k, v] : fields) {
    line += ' ';
    line += k;
    line += '=';
    TextValue(line, v);
  }
  return line;
}

void LogTo(std::FILE* out, LogLevel level, std::string_view message, LogFields fields) {
  if (!LogEnabled(level)) return;
  std::string line =
      FormatLogLine(static_cast<LogFormat>(g_format.load(std::memory_order_relaxed)), level, message, fields);
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), out);  // one call: lines of threads do not interleave
  std::fflush(out);
}

void Log(LogLevel level, std::string_view message, LogFields fields) {
  LogTo(stderr, level, message, fields);
}

bool UsableRequestId(std::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    if (c <= ' ' || c >= 127 || c == '"' || c == '\\') return false;
  }
  return true;
}

}  // namespace quern
