// Fuzz target: the gRPC front end's request conversion. The input is parsed
// as an inference.ModelInferRequest (protobuf wire format, as gRPC delivers
// it) and converted into a quern::InferRequest as ModelInfer does (raw
// contents viewed in place, typed contents copied); the converted inputs are
// then written back as a ModelInferResponse. PeekInferNames (the access
// log's look at a message's first fields) runs on the input as it is and on
// the message written back in protobuf's order, where it must find the
// model name and id the parse found.
#include "frontends/grpc/grpc_convert.h"

#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/stubs/logging.h>

#include <cstdint>
#include <string>

#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  // Protobuf logs every string field that is not UTF-8; quiet, to keep speed.
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  return 0;
}

namespace {

void Peek(const void* data, size_t size, std::string* model, std::string* id) {
  google::protobuf::io::ArrayInputStream bytes(data, static_cast<int>(size), 7);  // small chunks: reads across them
  quern::PeekInferNames(&bytes, model, id);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string peeked_model, peeked_id;
  Peek(data, size, &peeked_model, &peeked_id);
  if (peeked_model.size() > 256 || peeked_id.size() > 256) quern::fuzz::Fail("PeekInferNames kept over 256 bytes");
  inference::ModelInferRequest msg;
  if (!msg.ParseFromArray(data, static_cast<int>(size))) return 0;
  {
    std::string canonical;
    if (msg.SerializeToString(&canonical)) {
      std::string model, id;
      Peek(canonical.data(), canonical.size(), &model, &id);
      if (model != msg.model_name().substr(0, 256) || id != msg.id().substr(0, 256)) {
        quern::fuzz::Fail("PeekInferNames disagrees with the parse");
      }
    }
  }
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
