// Triton's generate extension over HTTP, its bodies apart from any socket:
// POST /v2/models/{model}[/versions/{version}]/generate (one JSON answer) and
// .../generate_stream (server-sent events, one "data:" event per response of
// a decoupled model).
//
// The request is a JSON object. Each member named as an input of the model
// is that input: a string is a BYTES element, a number or a boolean one
// element of the input's type, an array (nested as deep as the input has
// dimensions) the elements with the array's shape; a scalar has shape [1].
// A model that batches gets the batch dimension, 1, in front. Other members
// ("parameters", names of no input) are accepted and not used.
//
// An answer is {"model_name", "model_version", and each output by name}: an
// output of one element as that element (a BYTES element as a string when it
// is UTF-8), else a flat array. An error is {"error": message}.
//
// Thread-compatible: free functions.
#pragma once

#include <string>
#include <string_view>

#include "quern/engine.h"
#include "quern/model.h"
#include "quern/status.h"

namespace quern {

// The request a generate body makes of `config`'s model (version `version`).
// INVALID_ARGUMENT names the member and what was expected.
Result<InferRequest> ParseGenerateBody(const ModelConfig& config, int64_t version, std::string_view body);

// The answer object for one response (its outputs; the status is not read).
// UNIMPLEMENTED for an output JSON cannot carry (FP16, BF16).
Result<std::string> GenerateAnswerJson(const InferResponse& response);

}  // namespace quern
