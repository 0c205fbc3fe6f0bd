// Error model used on every request path in Quern.
//
// A Status is a code plus a human-readable message that says what was wrong
// (which model, which field, what was expected). Result<T> is either a value
// or a non-OK Status. No exceptions cross the data plane: backends catch their
// framework's exceptions and return a Status; each front end maps Status to
// its protocol in exactly one function.
#pragma once

#include <expected>
#include <string>
#include <string_view>
#include <utility>

namespace quern {

// Codes follow the gRPC canonical codes so that the mapping to gRPC is the
// identity and the mapping to HTTP is one table.
enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,  // the caller cancelled the request
  kUnknown = 2,
  kInvalidArgument = 3,   // bad input: permanent, do not retry
  kDeadlineExceeded = 4,  // the request's deadline passed before it ran
  kNotFound = 5,          // unknown model or version
  kAlreadyExists = 6,
  kPermissionDenied = 7,   // a required credential (API key) is missing or wrong
  kResourceExhausted = 8,  // a size limit was exceeded
  kFailedPrecondition = 9,
  kUnimplemented = 12,
  kInternal = 13,         // a bug or a backend failure
  kUnavailable = 14,      // retryable: queue full, model not ready, shutting down
  kUnauthenticated = 16,  // no valid credential (API key) was presented
};

// Returns the canonical upper-case name, e.g. "INVALID_ARGUMENT".
std::string_view StatusCodeName(StatusCode code);

// A cheap value type: OK carries no allocation.
class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "INVALID_ARGUMENT: message" or "OK".
  std::string ToString() const;

  bool operator==(const Status& other) const = default;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status NotFound(std::string m) {
  return {StatusCode::kNotFound, std::move(m)};
}
inline Status Unavailable(std::string m) {
  return {StatusCode::kUnavailable, std::move(m)};
}
inline Status DeadlineExceeded(std::string m) {
  return {StatusCode::kDeadlineExceeded, std::move(m)};
}
inline Status Cancelled(std::string m) {
  return {StatusCode::kCancelled, std::move(m)};
}
inline Status Internal(std::string m) {
  return {StatusCode::kInternal, std::move(m)};
}
inline Status Unimplemented(std::string m) {
  return {StatusCode::kUnimplemented, std::move(m)};
}
inline Status FailedPrecondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status Unauthenticated(std::string m) {
  return Status(StatusCode::kUnauthenticated, std::move(m));
}
inline Status PermissionDenied(std::string m) {
  return {StatusCode::kPermissionDenied, std::move(m)};
}
inline Status ResourceExhausted(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}

// Either a T or an error Status (never an OK Status).
template <typename T>
using Result = std::expected<T, Status>;

// Wraps a Status for returning from a function that returns Result<T>.
inline std::unexpected<Status> Err(Status s) {
  return std::unexpected<Status>(std::move(s));
}

namespace internal {
// Lets QUERN_RETURN_IF_ERROR return from functions returning Status or Result<T>.
struct ErrorReturn {
  Status status;
  operator Status() && { return std::move(status); }
  template <typename T>
  operator Result<T>() && {
    return std::unexpected<Status>(std::move(status));
  }
};
}  // namespace internal

}  // namespace quern

// Returns early from the enclosing function when `expr` (a Status) is not OK.
#define QUERN_RETURN_IF_ERROR(expr)                                                           \
  do {                                                                                        \
    ::quern::Status quern_status_ = (expr);                                                   \
    if (!quern_status_.ok()) return ::quern::internal::ErrorReturn{std::move(quern_status_)}; \
  } while (0)

// `lhs = value of expr` (a Result<T>), or returns its error early:
//   QUERN_ASSIGN_OR_RETURN(Tensor t, MakeTensor());
#define QUERN_ASSIGN_OR_RETURN(lhs, expr) \
  QUERN_ASSIGN_OR_RETURN_IMPL_(QUERN_STATUS_CONCAT_(quern_result_, __LINE__), lhs, expr)
#define QUERN_STATUS_CONCAT_INNER_(a, b) a##b
#define QUERN_STATUS_CONCAT_(a, b) QUERN_STATUS_CONCAT_INNER_(a, b)
#define QUERN_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr)                       \
  auto tmp = (expr);                                                       \
  if (!tmp) return ::quern::internal::ErrorReturn{std::move(tmp).error()}; \
  lhs = std::move(*tmp)
