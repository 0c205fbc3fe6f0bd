// Fuzz target: what a Python model's process sends the server about its own
// metrics (pb_utils.MetricFamily): CustomMetrics::Apply of the input as a frame
// "M"'s JSON list of operations, twice on a store of its own (what was refused
// the first time is refused again, what was taken is taken again), then
// Render, whose text must be Prometheus' exposition lines: every line a
// comment (# HELP, # TYPE) or a sample `name[{labels}] value`, no line empty,
// label values quoted and escaped, no label name twice in a sample, and at most
// the store's bounds of families and series.
#include "metrics/custom_metrics.h"

#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include "fuzz_util.h"

namespace {

// A sample line: a metric name, optionally {name="value",...} with \\, \" and \n escapes, a space,
// a value without spaces.
bool SampleLine(std::string_view line) {
  size_t i = 0;
  auto name_char = [](char c, bool first) {
    return c == '_' || c == ':' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (!first && c >= '0' && c <= '9');
  };
  if (i >= line.size() || !name_char(line[i], true)) return false;
  while (i < line.size() && name_char(line[i], false)) ++i;
  if (i < line.size() && line[i] == '{') {
    ++i;
    std::set<std::string_view> names;  // a label name twice: Prometheus refuses the scrape
    while (i < line.size() && line[i] != '}') {
      if (!name_char(line[i], true)) return false;
      const size_t start = i;
      while (i < line.size() && name_char(line[i], false)) ++i;
      if (!names.insert(line.substr(start, i - start)).second) return false;
      if (line.substr(i, 2) != "=\"") return false;
      i += 2;
      for (;; ++i) {
        if (i >= line.size() || line[i] == '\n') return false;
        if (line[i] == '\\') {
          if (i + 1 >= line.size() || (line[i + 1] != '\\' && line[i + 1] != '"' && line[i + 1] != 'n')) return false;
          ++i;
        } else if (line[i] == '"') {
          break;
        }
      }
      ++i;
      if (i < line.size() && line[i] == ',') ++i;
    }
    if (i >= line.size()) return false;
    ++i;
  }
  if (i >= line.size() || line[i] != ' ') return false;
  const std::string_view value = line.substr(i + 1);
  return !value.empty() && value.find(' ') == std::string_view::npos;
}

void CheckText(const std::string& text) {
  size_t samples = 0;
  for (size_t at = 0; at < text.size();) {
    const size_t end = text.find('\n', at);
    if (end == std::string::npos) quern::fuzz::Fail("the text does not end with a newline");
    const std::string_view line(text.data() + at, end - at);
    if (line.empty()) quern::fuzz::Fail("an empty line");
    if (line.starts_with("# HELP ") || line.starts_with("# TYPE ")) {
      // (a help text's newlines and backslashes are escaped: one line)
    } else if (!SampleLine(line)) {
      quern::fuzz::Fail("a line that is not a sample", std::string(line.substr(0, 300)));
    } else {
      ++samples;
    }
    at = end + 1;
  }
  // Each series writes at most its buckets, +Inf, _sum and _count.
  const size_t most = quern::CustomMetrics::kMaxFamilies * quern::CustomMetrics::kMaxSeriesPerFamily *
                      (quern::CustomMetrics::kMaxBuckets + 3);
  if (samples > most) quern::fuzz::Fail("more samples than the store's bounds allow");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in = quern::fuzz::AsView(data, size);
  quern::CustomMetrics store;
  const quern::Status first = store.Apply("fuzzed", in);
  std::string once;
  store.Render(once);
  CheckText(once);
  const quern::Status second = store.Apply("fuzzed", in);
  if (first.ok() != second.ok() && first.ok()) quern::fuzz::Fail("taken once, refused the second time");
  std::string twice;
  store.Render(twice);
  CheckText(twice);
  return 0;
}
