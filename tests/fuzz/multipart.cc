// Fuzz target: form bodies (MultipartBoundary + ParseMultipart, and
// ParseUrlEncodedForm), as the CodeProject.AI vision routes read a form post.
//
// Input: the Content-Type header's value up to the first '\n', then the body.
// An input without '\n' is a body under "multipart/form-data; boundary=X".
#include "frontends/vision/multipart.h"

#include <cstdint>
#include <string>

#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in = quern::fuzz::AsView(data, size);
  std::string content_type = "multipart/form-data; boundary=X";
  if (const size_t nl = in.find('\n'); nl != std::string_view::npos) {
    content_type.assign(in.substr(0, nl));
    in.remove_prefix(nl + 1);
  }
  {
    const std::string body(in);
    auto form = quern::ParseUrlEncodedForm(body);
    if (form) {
      if (form->parts.size() > quern::kMaxFormParts) quern::fuzz::Fail("more form fields than the bound", "");
      for (const auto& p : form->parts) {
        const char* first = form->decoded.data();
        if (!p.data.empty() &&
            (p.data.data() < first || p.data.data() + p.data.size() > first + form->decoded.size())) {
          quern::fuzz::Fail("a url-encoded field's data lies outside the decoded buffer", p.name);
        }
      }
    }
  }
  auto boundary = quern::MultipartBoundary(content_type);
  if (!boundary) return 0;
  if (boundary->empty()) quern::fuzz::Fail("MultipartBoundary accepted an empty boundary", content_type);
  // A copy of exactly the body's bytes, so ASan catches a view that strays past it.
  const std::string body(in);
  auto parts = quern::ParseMultipart(body, *boundary);
  if (!parts) return 0;
  for (const auto& p : *parts) {
    if (!p.data.empty() && (p.data.data() < body.data() || p.data.data() + p.data.size() > body.data() + body.size())) {
      quern::fuzz::Fail("a form part's data lies outside the body", p.name);
    }
    uint8_t sum = 0;
    for (char c : p.data) sum ^= static_cast<uint8_t>(c);
    volatile uint8_t sink = sum;
    (void)sink;
  }
  return 0;
}
