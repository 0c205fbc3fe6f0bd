#include "frontends/vision/vision_json.h"

#include <cmath>
#include <cstdio>
#include <ctime>
#include <random>

namespace quern::vision {

HttpResponse Json(int status, std::string body) {
  HttpResponse r;
  r.status = status;
  r.body = std::move(body);
  return r;
}

HttpResponse JsonError(int status, const std::string& message) {
  rapidjson::StringBuffer sb;
  Writer w(sb);
  w.StartObject();
  w.Key("error");
  w.String(message.c_str(), static_cast<rapidjson::SizeType>(message.size()));
  w.EndObject();
  return Json(status, sb.GetString());
}

void String(Writer& w, std::string_view s) {
  w.String(s.data(), static_cast<rapidjson::SizeType>(s.size()));
}

void WriteBox(Writer& w, const Detection& box) {
  w.Key("x_min");
  w.Int(static_cast<int>(std::lround(box.x_min)));
  w.Key("y_min");
  w.Int(static_cast<int>(std::lround(box.y_min)));
  w.Key("x_max");
  w.Int(static_cast<int>(std::lround(box.x_max)));
  w.Key("y_max");
  w.Int(static_cast<int>(std::lround(box.y_max)));
}

std::string TimestampUtc(int64_t wall_ns) {
  const std::time_t now = static_cast<std::time_t>(wall_ns / 1'000'000'000);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%a, %d %b %Y %H:%M:%S GMT", &tm);
  return buf;
}

std::string RequestId() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const uint64_t a = rng(), b = rng();
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%08x-%04x-4%03x-%04x-%012llx", static_cast<unsigned>(a >> 32),
                static_cast<unsigned>((a >> 16) & 0xFFFF), static_cast<unsigned>(a & 0xFFF),
                static_cast<unsigned>(0x8000 | ((b >> 48) & 0x3FFF)),
                static_cast<unsigned long long>(b & 0xFFFFFFFFFFFFull));
  return buf;
}

}  // namespace quern::vision
