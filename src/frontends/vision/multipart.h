// Form bodies: multipart/form-data (RFC 7578), whose parts are viewed in
// place (no copies; the views point into the body), and
// application/x-www-form-urlencoded, whose fields are decoded once into the
// form's own buffer. A form has at most kMaxFormParts parts.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "quern/status.h"

namespace quern {

struct FormPart {
  std::string name;          // Content-Disposition name="..."
  std::string filename;      // filename="...", "" when absent
  std::string content_type;  // the part's Content-Type, "" when absent
  std::string_view data;     // into the body
};

inline constexpr size_t kMaxFormParts = 256;
// A url-encoded field's name (encoded) is at most this long.
inline constexpr size_t kMaxFormNameBytes = 256;

// A parsed form: its parts, whose data views the body (multipart) or
// `decoded` (url-encoded). Moving a Form keeps the views valid (a vector's
// buffer moves with it); copying it does not, so it cannot be copied.
struct Form {
  Form() = default;
  Form(Form&&) = default;
  Form& operator=(Form&&) = default;
  Form(const Form&) = delete;
  Form& operator=(const Form&) = delete;

  std::vector<FormPart> parts;
  std::vector<char> decoded;

  // The first part named `name`, or null.
  const FormPart* Field(std::string_view name) const;
};

// True for the Content-Types ParseForm reads (multipart/form-data,
// application/x-www-form-urlencoded; any case, any parameters).
bool IsFormContentType(std::string_view content_type);

// The form in a POST body, by its Content-Type: multipart/form-data,
// application/x-www-form-urlencoded, or an empty body (no parts, whatever
// the type). Anything else, a malformed body or more than kMaxFormParts
// parts: InvalidArgument saying what was expected. `body` must outlive the
// Form (multipart parts view it).
Result<Form> ParseForm(std::string_view content_type, std::string_view body);

// The fields of an application/x-www-form-urlencoded body ('&'-separated
// name=value pairs, '+' and %XX decoded; an invalid % escape is kept as it
// is). More than kMaxFormParts fields, or a name over kMaxFormNameBytes:
// InvalidArgument. The decoded values are held in a buffer of at most the
// body's size (a caller charging memory counts `decoded.capacity()`).
Result<Form> ParseUrlEncodedForm(std::string_view body);

// The boundary of a "multipart/form-data; boundary=..." Content-Type, or an
// InvalidArgument saying what is wrong with the header.
Result<std::string> MultipartBoundary(std::string_view content_type);

// Splits `body` into its parts. Fails with InvalidArgument (saying where)
// when the body is not well-formed: no opening boundary, a part without the
// blank line after its headers, no closing boundary, or more than
// kMaxFormParts parts.
Result<std::vector<FormPart>> ParseMultipart(std::string_view body, std::string_view boundary);

}  // namespace quern
