// Fuzz target: the gRPC front end's request conversion. The input is parsed
// as an inference.ModelInferRequest (protobuf wire format, as gRPC delivers
// it) and converted into a quern::InferRequest as ModelInfer does (raw
// contents viewed in place, typed contents copied); the converted inputs are
// then written back as a ModelInferResponse.
#include "frontends/grpc/grpc_convert.h"

#include <google/protobuf/stubs/logging.h>

#include <cstdint>
#include <string>

#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  // Protobuf logs every string field that is not UTF-8; quiet, to keep speed.
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  inference::ModelInferRequest msg;
  if (!msg.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto request = quern::ToInferRequest(msg);
  if (!request) {
    if (request.error().ok()) quern::fuzz::Fail("ToInferRequest failed with an OK status");
    return 0;
  }
  if (request->model.empty()) quern::fuzz::Fail("ToInferRequest accepted an empty model name");
  quern::InferResponse response;
  response.model = request->model;
  response.version = request->version < 0 ? 1 : request->version;
  for (const auto& in : request->inputs) {
    quern::fuzz::TouchTensor(in.tensor);
    if (in.tensor.Validate().ok()) response.outputs.push_back(in);
  }
  inference::ModelInferResponse out;
  quern::ToInferResponse(response, msg.id(), &out);
  if (out.raw_output_contents_size() != static_cast<int>(response.outputs.size())) {
    quern::fuzz::Fail("ModelInferResponse lost outputs");
  }
  std::string wire;
  (void)out.SerializeToString(&wire);
  return 0;
}
