// KServe v2 gRPC messages to and from the engine's types: the protobuf side
// of the KServe codec, free of the gRPC runtime (the front end in
// grpc_server.cc calls it; tests/fuzz/grpc_convert fuzzes it).
#pragma once

#include <google/protobuf/io/zero_copy_stream.h>

#include <string>

#include "grpc_service.pb.h"
#include "quern/engine.h"
#include "quern/status.h"

namespace quern {

// A request's model version: "" = the highest ready one (-1), else a
// positive integer (INVALID_ARGUMENT naming the model otherwise).
Result<int64_t> ParseModelVersion(const std::string& model, const std::string& version);

// The model name and id of a serialized ModelInferRequest, each cut to 256
// bytes, read from its first fields without parsing the rest: protobuf
// writes fields in number order, and these are fields 1 and 3. A message
// written otherwise (or cut short) leaves what was not found unchanged.
// Reads at most three fields' heads and 512 bytes of their values.
void PeekInferNames(google::protobuf::io::ZeroCopyInputStream* bytes, std::string* model, std::string* id);

// A ModelInferRequest as an InferRequest: raw_input_contents are viewed in
// place (the message must outlive the request), typed contents copied.
// INVALID_ARGUMENT names the model, the input and what was wrong.
Result<InferRequest> ToInferRequest(const inference::ModelInferRequest& msg);

// KServe's classification extension: each output the request asks with
// parameter "classification" (a count checked by ToInferRequest) is replaced
// in `r` by its top classes (ApplyClassifications in protocol/kserve_codec.h),
// labelled from the answering model version's label files.
Status ApplyClassifications(const inference::ModelInferRequest& msg, const Engine& engine, InferResponse& r);

// An engine response as a ModelInferResponse (outputs as raw contents).
void ToInferResponse(const InferResponse& r, const std::string& id, inference::ModelInferResponse* out);

// A model's metadata (name, versions, platform, inputs and outputs).
void FillMetadata(const ModelStatus& m, inference::ModelMetadataResponse* out);

// A model's statistics with Triton's field names.
void FillStatistics(const ModelStatistics& s, inference::ModelStatistics* out);

}  // namespace quern
