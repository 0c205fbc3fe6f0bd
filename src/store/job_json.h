// A job record's JSON, written and read in this one place, in its two forms:
//
//   kStored  what a result store keeps (the Redis record; docs/jobs.md):
//            times as Unix milliseconds, the error as {code, grpc_code,
//            message}, the submitter's binary-output choices, and the keys
//            of the result's binary parts.
//   kPoll    what GET /v2/jobs/{id} answers: times as RFC 3339 UTC (null
//            until reached), the error as its message, model_version once
//            known.
//
// Both carry job_id, status, model_name and, for a done job, "result": a
// KServe v2 infer response (protocol/kserve_codec.h).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "protocol/kserve_codec.h"
#include "store/result_store.h"

namespace quern {

enum class JobJsonForm { kStored, kPoll };

// Writes `record` as one JSON object. A done record's outputs that `format`
// sends as binary data are appended to `binary_parts` (views of the
// record's tensors); kStored lists them under "binary_keys" as
// `binary_key(k)` for part k. An error: an output that cannot be written.
Status WriteJobJson(JsonWriter& w, const JobRecord& record, JobJsonForm form, const KServeOutputFormat& format,
                    std::vector<const Tensor*>& binary_parts,
                    const std::function<std::string(size_t)>& binary_key = nullptr);

// Reads a record written in the kStored form; `binary` holds its binary
// parts in order. INTERNAL, naming the job, when the record is damaged.
Result<std::shared_ptr<const JobRecord>> ReadStoredJobJson(std::string_view json,
                                                           const std::vector<std::string>& binary);

// RFC 3339 UTC with milliseconds, e.g. 2026-11-22T10:15:03.042Z.
std::string Rfc3339(int64_t unix_ms);

}  // namespace quern
