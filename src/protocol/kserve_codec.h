// KServe v2 (Open Inference Protocol) tensors as JSON, and the binary tensor
// data extension: parsing infer requests and writing infer results.
//
// A codec, not a front end: it takes and gives bytes (a JSON header and the
// binary data after it) and knows no transport. The HTTP handler, the job
// API, the Redis result store and the stream consumer all read and write
// KServe messages through it.
#pragma once

#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "quern/engine.h"
#include "quern/status.h"
#include "quern/tensor.h"

namespace quern {

using JsonWriter = rapidjson::Writer<rapidjson::StringBuffer>;

// What a KServe v2 caller wants its response to look like.
struct KServeOutputFormat {
  std::string id;                                            // the request's "id", echoed
  bool binary_default = false;                               // parameters.binary_data_output
  std::vector<std::pair<std::string, bool>> binary_outputs;  // requested outputs: binary or not
  // Requested outputs with parameters.classification: the top-k to return.
  std::vector<std::pair<std::string, int64_t>> classifications;
  // Whether output `name` is sent as binary data.
  bool WantsBinary(const std::string& name) const;
};

// The protocol extensions Quern implements, as server metadata lists them
// (HTTP GET /v2 and gRPC ServerMetadata alike).
inline constexpr std::string_view kKServeExtensions[] = {"binary_tensor_data",  "statistics",      "model_repository",
                                                         "model_configuration", "schedule_policy", "parameters",
                                                         "classification"};

// Whether a request parameter is one the server reads itself (priority,
// timeout, binary_data_output), or reserved by Triton's parameters extension
// (sequence_id, sequence_start, sequence_end, headers, any "triton_" key):
// those are not passed to the model (InferRequest::parameters).
bool IsServerParameter(std::string_view key);

// The parameters object `p` of a request to `model` as the model gets them
// (InferRequest::parameters): every member but the server's, as JSON; ""
// when none is left. INVALID_ARGUMENT for a value that is not a bool, a
// number or a string, a name or string that is not UTF-8, or for more than
// kMaxRequestParametersBytes of them.
Result<std::string> KServeModelParameters(const rapidjson::Value& p, const std::string& model);

// KServe's classification extension: the `count` highest values of each row
// of `output` (its first dimension is the batch when it has two or more;
// otherwise it is one row), as a BYTES tensor of shape [rows, k] (or [k])
// with k = min(count, values per row), highest first (equal values: lower
// index first, NaN last), each "<value>:<index>" or "<value>:<index>:<label>"
// when `labels` has one for that index. INVALID_ARGUMENT for a count under 1
// or an output that is not numeric.
Result<Tensor> ClassifyOutput(const Tensor& output, int64_t count, const std::vector<std::string>* labels,
                              std::string_view where);

// A model's class labels for one of its outputs (null: none).
using OutputLabels = std::function<std::shared_ptr<const std::vector<std::string>>(const std::string& output)>;

// Replaces each output the format asks to classify by its classification
// (ClassifyOutput), with labels from `labels` when it is set. The first
// error is returned and the outputs after it are left as they were.
Status ApplyClassifications(std::vector<NamedTensor>& outputs, const KServeOutputFormat& format, std::string_view model,
                            const OutputLabels& labels);

// A KServe v2 infer request, parsed.
struct KServeInfer {
  InferRequest request;
  KServeOutputFormat format;
};

// Parses an infer request from its JSON header and the binary data that
// follows it (inputs with parameters.binary_data_size take their bytes from
// `binary` in input order, and together must claim all of it). Binary inputs
// are views into `binary`, kept alive by `owner`: nothing is copied.
// INVALID_ARGUMENT names the model, the input and what was wrong.
Result<KServeInfer> ParseKServeInfer(const std::string& model, int64_t version, std::string_view json,
                                     std::string_view binary, std::shared_ptr<const void> owner);

// The same for one body: its first `json_length` bytes are the JSON header
// (the Inference-Header-Content-Length value as sent, "" = the whole body is
// JSON) and the rest binary data. Takes the body; binary inputs view it.
Result<KServeInfer> ParseKServeInferBody(const std::string& model, int64_t version, std::string body,
                                         std::string_view json_length);
// The same for a body the caller shares (ShareBody): the caller may go on
// reading it while the request's inputs view it.
Result<KServeInfer> ParseKServeInferBody(const std::string& model, int64_t version,
                                         std::shared_ptr<const std::string> body, std::string_view json_length);
// A body to share between readers: its string goes back to the pool the
// HTTP server receives bodies into when the last of them lets go.
std::shared_ptr<const std::string> ShareBody(std::string body);

// Writes KServe's "outputs" array (the key must already be written) into
// `w`; outputs the format wants as binary are listed with binary_data_size
// and collected in `binary_parts`, in order, to follow the JSON.
Status WriteKServeOutputs(JsonWriter& w, const std::vector<NamedTensor>& outputs, const KServeOutputFormat& format,
                          std::vector<const Tensor*>& binary_parts);

// Writes an infer result object: {"id" (when not empty), "model_name",
// "model_version", "outputs"}. The same object answers an infer request and
// is a finished job's "result".
Status WriteKServeResult(JsonWriter& w, std::string_view id, std::string_view model, int64_t version,
                         const std::vector<NamedTensor>& outputs, const KServeOutputFormat& format,
                         std::vector<const Tensor*>& binary_parts);

// A message as sent: the JSON, then the binary parts. `json_size` is the
// Inference-Header-Content-Length (meaningful when `binary` is true).
struct KServeMessage {
  std::string bytes;
  size_t json_size = 0;
  bool binary = false;
};
KServeMessage JoinKServeMessage(const rapidjson::StringBuffer& json, const std::vector<const Tensor*>& binary_parts);

// Writes a tensor's values as a flat JSON array. Floating-point NaN and
// infinities are written NaN / Infinity / -Infinity, as Python's json module
// and Triton write (and read) them. UNIMPLEMENTED for types JSON cannot carry
// (FP16, BF16).
Status WriteKServeData(JsonWriter& w, const Tensor& t);

}  // namespace quern
