#include "frontends/vision/multipart.h"

#include <algorithm>
#include <cctype>

namespace quern {
namespace {

std::string Lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// The value of `key` in a header with parameters (`form-data; name="x"`);
// quoted or bare; "" when absent.
std::string Param(std::string_view header, std::string_view key) {
  size_t pos = 0;
  while ((pos = header.find(';', pos)) != std::string_view::npos) {
    ++pos;
    std::string_view rest = Trim(header.substr(pos));
    const size_t eq = rest.find('=');
    if (eq == std::string_view::npos) continue;
    if (Lower(Trim(rest.substr(0, eq))) != key) continue;
    std::string_view v = Trim(rest.substr(eq + 1));
    if (!v.empty() && v.front() == '"') {
      std::string out;
      for (size_t i = 1; i < v.size() && v[i] != '"'; ++i) {
        if (v[i] == '\\' && i + 1 < v.size()) ++i;
        out.push_back(v[i]);
      }
      return out;
    }
    return std::string(v.substr(0, v.find(';')));
  }
  return "";
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Appends `s` with '+' and %XX decoded to `out`.
template <typename Out>
void AppendFormDecoded(std::string_view s, Out& out) {
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '+') {
      out.push_back(' ');
    } else if (s[i] == '%' && i + 2 < s.size() && HexValue(s[i + 1]) >= 0 && HexValue(s[i + 2]) >= 0) {
      out.push_back(static_cast<char>(HexValue(s[i + 1]) * 16 + HexValue(s[i + 2])));
      i += 2;
    } else {
      out.push_back(s[i]);
    }
  }
}

}  // namespace

const FormPart* Form::Field(std::string_view name) const {
  for (const auto& p : parts) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

bool IsFormContentType(std::string_view content_type) {
  const std::string lower = Lower(content_type.substr(0, 40));
  return lower.starts_with("multipart/form-data") || lower.starts_with("application/x-www-form-urlencoded");
}

Result<Form> ParseUrlEncodedForm(std::string_view body) {
  Form form;
  // The values' encoded length bounds their decoded length: reserved once,
  // the buffer is never reallocated, so the views taken into it stay valid
  // (and a body of names holds no buffer of its size).
  size_t values = 0;
  for (std::string_view rest = body; !rest.empty();) {
    const size_t amp = rest.find('&');
    const std::string_view pair = rest.substr(0, amp);
    rest = amp == std::string_view::npos ? std::string_view{} : rest.substr(amp + 1);
    if (const size_t eq = pair.find('='); eq != std::string_view::npos) values += pair.size() - eq - 1;
  }
  form.decoded.reserve(values);
  while (!body.empty()) {
    const size_t amp = body.find('&');
    const std::string_view pair = body.substr(0, amp);
    body = amp == std::string_view::npos ? std::string_view{} : body.substr(amp + 1);
    if (pair.empty()) continue;
    if (form.parts.size() == kMaxFormParts) {
      return std::unexpected(InvalidArgument("the form has more than " + std::to_string(kMaxFormParts) + " fields"));
    }
    const size_t eq = pair.find('=');
    if (std::min(eq, pair.size()) > kMaxFormNameBytes) {
      return std::unexpected(
          InvalidArgument("a form field's name is over " + std::to_string(kMaxFormNameBytes) + " bytes"));
    }
    FormPart part;
    AppendFormDecoded(pair.substr(0, eq), part.name);
    const size_t start = form.decoded.size();
    if (eq != std::string_view::npos) AppendFormDecoded(pair.substr(eq + 1), form.decoded);
    part.data = std::string_view(form.decoded.data() + start, form.decoded.size() - start);
    form.parts.push_back(std::move(part));
  }
  return form;
}

Result<Form> ParseForm(std::string_view content_type, std::string_view body) {
  const std::string lower = Lower(content_type.substr(0, 40));
  if (lower.starts_with("application/x-www-form-urlencoded")) return ParseUrlEncodedForm(body);
  if (body.empty()) return Form{};  // no fields, whatever the type
  if (!lower.starts_with("multipart/form-data")) {
    return std::unexpected(InvalidArgument(
        "expected a form: Content-Type multipart/form-data or application/x-www-form-urlencoded, got '" +
        std::string(content_type.empty() ? "(none)" : content_type.substr(0, 100)) + "'"));
  }
  QUERN_ASSIGN_OR_RETURN(const std::string boundary, MultipartBoundary(content_type));
  Form form;
  QUERN_ASSIGN_OR_RETURN(form.parts, ParseMultipart(body, boundary));
  return form;
}

Result<std::string> MultipartBoundary(std::string_view content_type) {
  const std::string lower = Lower(content_type);
  if (!lower.starts_with("multipart/form-data")) {
    return std::unexpected(InvalidArgument("expected Content-Type multipart/form-data, got '" +
                                           std::string(content_type.empty() ? "(none)" : content_type) + "'"));
  }
  std::string b = Param(content_type, "boundary");
  if (b.empty() || b.size() > 200) {
    return std::unexpected(
        InvalidArgument("the multipart/form-data Content-Type has no boundary (or one over 200 "
                        "characters)"));
  }
  return b;
}

Result<std::vector<FormPart>> ParseMultipart(std::string_view body, std::string_view boundary) {
  const std::string delim = "--" + std::string(boundary);
  size_t pos = body.find(delim);
  if (pos == std::string_view::npos) {
    return std::unexpected(
        InvalidArgument("the multipart body does not contain its boundary '" + std::string(boundary) + "'"));
  }
  std::vector<FormPart> parts;
  const std::string next = "\r\n" + delim;
  while (true) {
    pos += delim.size();
    if (body.substr(pos, 2) == "--") return parts;  // closing boundary
    // Rest of the boundary line (transport padding) and its CRLF.
    const size_t eol = body.find("\r\n", pos);
    if (eol == std::string_view::npos) {
      return std::unexpected(InvalidArgument("the multipart body ends inside a boundary line (truncated upload?)"));
    }
    pos = eol + 2;
    const size_t headers_end = body.find("\r\n\r\n", pos);
    const size_t end = body.find(next, pos);
    if (end == std::string_view::npos) {
      return std::unexpected(InvalidArgument("the multipart body has no closing boundary after part " +
                                             std::to_string(parts.size() + 1) + " (truncated upload?)"));
    }
    FormPart part;
    size_t data_start;
    if (body.substr(pos, 2) == "\r\n") {  // no headers
      data_start = pos + 2;
    } else if (headers_end != std::string_view::npos && headers_end < end) {
      std::string_view headers = body.substr(pos, headers_end - pos);
      while (!headers.empty()) {
        const size_t nl = headers.find("\r\n");
        std::string_view line = headers.substr(0, nl);
        headers = nl == std::string_view::npos ? std::string_view{} : headers.substr(nl + 2);
        const size_t colon = line.find(':');
        if (colon == std::string_view::npos) continue;
        const std::string key = Lower(Trim(line.substr(0, colon)));
        std::string_view value = Trim(line.substr(colon + 1));
        if (key == "content-disposition") {
          part.name = Param(value, "name");
          part.filename = Param(value, "filename");
        } else if (key == "content-type") {
          part.content_type = std::string(value);
        }
      }
      data_start = headers_end + 4;
    } else {
      return std::unexpected(InvalidArgument("multipart part " + std::to_string(parts.size() + 1) +
                                             " has no blank line after its headers"));
    }
    if (data_start > end) {
      return std::unexpected(InvalidArgument("multipart part " + std::to_string(parts.size() + 1) +
                                             " has no blank line after its headers"));
    }
    part.data = body.substr(data_start, end - data_start);
    if (parts.size() == kMaxFormParts) {
      return std::unexpected(InvalidArgument("the form has more than " + std::to_string(kMaxFormParts) + " parts"));
    }
    parts.push_back(std::move(part));
    pos = end + 2;  // at the next delimiter
  }
}

}  // namespace quern
