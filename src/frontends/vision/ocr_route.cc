// /v1/vision/ocr and /v1/image/ocr: CodeProject.AI's OCR answer.
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <algorithm>
#include <string>

#include "frontends/vision/vision_handler.h"
#include "frontends/vision/vision_job.h"
#include "frontends/vision/vision_json.h"

namespace quern {

using vision::Json;
using vision::JsonError;
using vision::String;
using vision::Writer;

void VisionHandler::HandleOcr(const std::shared_ptr<Job>& job, std::string_view image) {
  // Admitted like every image (the service's capacity and memory bound,
  // the model's queue); the model decodes it itself.
  EncodedImageRequest r;
  r.model = options_.ocr_model;
  r.image = image;
  r.owner = job;  // the body the image is viewed in
  r.held_bytes = static_cast<int64_t>(job->request.body.size() + job->form.decoded.capacity());
  r.cancel = job->request.cancel;
  BeginPending();
  EncodedImageCallback answer = [this, job](InferResponse&& resp, const VisionTimings& t) {
    const Tensor* text = resp.FindOutput("text");
    const Tensor* confidence = resp.FindOutput("confidence");
    const Tensor* boxes = resp.FindOutput("boxes");
    Result<std::vector<std::string_view>> lines = Err(Internal("no output 'text'"));
    if (resp.status.ok() && text) lines = text->Strings();
    if (resp.status.ok() && (!lines || !confidence || !boxes || confidence->dtype() != DataType::kFp32 ||
                             boxes->dtype() != DataType::kFp32 || confidence->element_count() != ssize(*lines) ||
                             boxes->element_count() != 8 * ssize(*lines))) {
      resp.status = Internal("model '" + options_.ocr_model +
                             "' did not answer as an OCR model: outputs 'text' (BYTES [N]), 'confidence' (FP32 [N]) "
                             "and 'boxes' (FP32 [N, 4, 2])");
    }
    if (!resp.status.ok()) {
      service_->CountFailure();
      Respond(job, CpaiError(*job, resp.status, &t));
    } else {
      rapidjson::StringBuffer sb;
      Writer w(sb);
      w.StartObject();
      w.Key("success");
      w.Bool(true);
      w.Key("predictions");
      w.StartArray();
      auto c = confidence->values<float>();
      auto b = boxes->values<float>();
      for (size_t i = 0; i < lines->size(); ++i) {
        float x0 = b[8 * i], y0 = b[8 * i + 1], x1 = x0, y1 = y0;
        for (size_t k = 1; k < 4; ++k) {
          x0 = std::min(x0, b[8 * i + 2 * k]), x1 = std::max(x1, b[8 * i + 2 * k]);
          y0 = std::min(y0, b[8 * i + 2 * k + 1]), y1 = std::max(y1, b[8 * i + 2 * k + 1]);
        }
        w.StartObject();
        w.Key("label");
        String(w, (*lines)[i]);
        w.Key("confidence");
        w.Double(c[i]);
        w.Key("x_min");
        w.Int(static_cast<int>(x0));
        w.Key("y_min");
        w.Int(static_cast<int>(y0));
        w.Key("x_max");
        w.Int(static_cast<int>(x1));
        w.Key("y_max");
        w.Int(static_cast<int>(y1));
        w.EndObject();
      }
      w.EndArray();
      w.Key("count");
      w.Uint64(lines->size());
      w.Key("message");
      String(w, lines->size() == 1 ? std::string("1 text found")
                                   : std::to_string(lines->size()) + " pieces of text found");
      WriteCpaiMeta(w, *job, &t);
      w.EndObject();
      Respond(job, Json(200, sb.GetString()));
    }
    EndPending();
  };
  if (Status st = service_->SubmitEncoded(std::move(r), answer); !st.ok()) {
    EndPending();
    if (st.code() == StatusCode::kUnavailable) return Respond(job, Refusal(*job, st));  // counted as a refusal
    Fail(job, st);
  }
}

}  // namespace quern
