// multipart/form-data (RFC 7578) bodies: the parts of a form post, viewed in
// place (no copies; the views point into the body).
#pragma once

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

// The boundary of a "multipart/form-data; boundary=..." Content-Type, or an
// InvalidArgument saying what is wrong with the header.
Result<std::string> MultipartBoundary(std::string_view content_type);

// Splits `body` into its parts. Fails with InvalidArgument (saying where)
// when the body is not well-formed: no opening boundary, a part without the
// blank line after its headers, or no closing boundary.
Result<std::vector<FormPart>> ParseMultipart(std::string_view body, std::string_view boundary);

}  // namespace quern
