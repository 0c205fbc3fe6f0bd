// Fuzz target: the KServe v2 infer body (ParseKServeInferBody), JSON alone and
// JSON followed by binary tensors (Inference-Header-Content-Length), then
// the parsed inputs written back out as a KServe response, and classified
// (the classification extension) when the request asks for it.
//
// Input: byte 0 chooses how the rest is sent:
//   low two bits 0: the rest is a JSON body, no header;
//                1: bytes 1-2 are the header's value (little-endian), the
//                   rest is the body (JSON header, then binary data);
//                2: the header's value is the text up to the first '\n', the
//                   body follows it (malformed header values);
//                3: the header is "0" (an empty JSON header).
//   bit 2: version 1 instead of "the highest ready version".
// Inputs run on a small stack (fuzz_util.h): deep nesting overflows early.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "protocol/kserve_codec.h"

namespace {

void FuzzOne(const uint8_t* data, size_t size) {
  const uint8_t mode = data[0];
  std::string_view rest = quern::fuzz::AsView(data + 1, size - 1);
  std::string json_length;  // the Inference-Header-Content-Length value
  switch (mode & 3) {
    case 0: break;
    case 1: {
      if (rest.size() < 2) return;
      const unsigned n = static_cast<uint8_t>(rest[0]) | static_cast<unsigned>(static_cast<uint8_t>(rest[1])) << 8;
      json_length = std::to_string(n);
      rest.remove_prefix(2);
      break;
    }
    case 2: {
      const size_t nl = rest.find('\n');
      if (nl == std::string_view::npos) return;
      json_length = rest.substr(0, nl);
      rest.remove_prefix(nl + 1);
      break;
    }
    case 3: json_length = "0"; break;
  }
  const int64_t version = (mode & 4) ? 1 : -1;
  auto parsed = quern::ParseKServeInferBody("m", version, std::string(rest), json_length);
  if (!parsed) {
    if (parsed.error().ok()) quern::fuzz::Fail("ParseKServeInfer failed with an OK status");
    return;
  }
  if (parsed->request.model != "m" || parsed->request.version != version) {
    quern::fuzz::Fail("ParseKServeInfer changed the model or version");
  }
  for (const auto& in : parsed->request.inputs) quern::fuzz::TouchTensor(in.tensor);
  quern::fuzz::WriteBack(parsed->request.inputs, parsed->format);
  // The classification extension on whatever tensors came in, as if a model
  // had returned them (any type, any shape, any count asked), with labels.
  if (!parsed->format.classifications.empty()) {
    static const auto kLabels =
        std::make_shared<const std::vector<std::string>>(std::vector<std::string>{"a", "", "c"});
    const quern::OutputLabels labels = [](const std::string&) { return kLabels; };
    std::vector<quern::NamedTensor> outputs = parsed->request.inputs;
    if (quern::ApplyClassifications(outputs, parsed->format, "m", labels).ok()) {
      for (const auto& o : outputs) quern::fuzz::TouchTensor(o.tensor);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size >= 1) quern::fuzz::SmallStack::Run([&] { FuzzOne(data, size); });
  return 0;
}
