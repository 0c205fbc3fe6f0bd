#include "store/job_json.h"

#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "core/json.h"

namespace quern {
namespace {

void String(JsonWriter& w, std::string_view s) {
  w.String(s.data(), static_cast<rapidjson::SizeType>(s.size()));
}

int64_t Int(const rapidjson::Value& v, const char* key) {
  auto it = v.FindMember(key);
  return it != v.MemberEnd() && it->value.IsInt64() ? it->value.GetInt64() : 0;
}

std::string Str(const rapidjson::Value& v, const char* key) {
  auto it = v.FindMember(key);
  return it != v.MemberEnd() && it->value.IsString() ? std::string(it->value.GetString(), it->value.GetStringLength())
                                                     : std::string();
}

}  // namespace

std::string Rfc3339(int64_t ms) {
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[40];
  const size_t n = std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof(buf) - n, ".%03dZ", static_cast<int>(ms % 1000));
  return buf;
}

Status WriteJobJson(JsonWriter& w, const JobRecord& rec, JobJsonForm form, const KServeOutputFormat& format,
                    std::vector<const Tensor*>& binary_parts, const std::function<std::string(size_t)>& binary_key) {
  const bool stored = form == JobJsonForm::kStored;
  w.StartObject();
  w.Key("job_id");
  String(w, rec.id);
  w.Key("status");
  String(w, JobStateName(rec.state));
  w.Key("model_name");
  String(w, rec.model);
  if (stored || rec.version > 0) {
    w.Key("model_version");
    String(w, std::to_string(rec.version));
  }
  for (auto [key, ms] : {std::pair{"submitted", rec.submitted_ms}, std::pair{"started", rec.started_ms},
                         std::pair{"finished", rec.finished_ms}}) {
    if (stored) {
      w.Key((std::string(key) + "_ms").c_str());
      w.Int64(ms);
    } else {
      w.Key(key);
      if (ms > 0) {
        String(w, Rfc3339(ms));
      } else {
        w.Null();
      }
    }
  }
  if (stored) {
    if (!rec.owner.empty()) {
      w.Key("owner");
      String(w, rec.owner);
    }
    w.Key("binary_data_output");
    w.Bool(rec.binary_default);
    w.Key("binary_outputs");
    w.StartObject();
    for (const auto& [name, binary] : rec.binary_outputs) {
      String(w, name);
      w.Bool(binary);
    }
    w.EndObject();
  }
  if (rec.state == JobState::kDone) {
    const size_t first = binary_parts.size();
    if (rec.decoupled) {
      w.Key("responses");
      w.StartArray();
      for (const auto& outputs : rec.responses) {
        QUERN_RETURN_IF_ERROR(WriteKServeResult(w, "", rec.model, rec.version, outputs, format, binary_parts));
      }
      w.EndArray();
    } else {
      w.Key("result");
      QUERN_RETURN_IF_ERROR(WriteKServeResult(w, "", rec.model, rec.version, rec.outputs, format, binary_parts));
    }
    if (stored) {
      w.Key("binary_keys");
      w.StartArray();
      for (size_t k = first; k < binary_parts.size(); ++k) String(w, binary_key ? binary_key(k - first) : "");
      w.EndArray();
    }
  } else if (rec.state == JobState::kFailed || rec.state == JobState::kCancelled) {
    w.Key("error");
    if (stored) {
      w.StartObject();
      w.Key("code");
      String(w, StatusCodeName(rec.error.code()));
      w.Key("grpc_code");
      w.Int(static_cast<int>(rec.error.code()));
      w.Key("message");
      String(w, rec.error.message());
      w.EndObject();
    } else {
      String(w, rec.error.message());
    }
  }
  w.EndObject();
  return Status::Ok();
}

namespace {

// The outputs of one stored KServe result (`result`), its binary parts the
// next of `binary` from `next_part` on (one per output sent as binary data).
Result<std::vector<NamedTensor>> ReadStoredOutputs(const JobRecord& rec, const rapidjson::Value& result,
                                                   const std::vector<std::string>& binary, size_t& next_part) {
  if (!result.IsObject() || !result.HasMember("outputs") || !result["outputs"].IsArray()) {
    return Err(Internal("stored job '" + rec.id + "' has no result.outputs"));
  }
  // The outputs are in KServe's tensor format: read them back with the
  // infer request parser, as the "inputs" of a request.
  rapidjson::StringBuffer buf;
  // NaN and infinities are stored as NaN / Infinity (see WriteKServeOutputs).
  rapidjson::Writer<rapidjson::StringBuffer, rapidjson::UTF8<>, rapidjson::UTF8<>, rapidjson::CrtAllocator,
                    rapidjson::kWriteNanAndInfFlag>
      w(buf);
  w.StartObject();
  w.Key("inputs");
  if (!result["outputs"].Accept(w)) {
    return Err(Internal("stored result of job '" + rec.id + "' is damaged: its outputs cannot be read"));
  }
  w.EndObject();
  std::string joined;
  for (const auto& o : result["outputs"].GetArray()) {
    if (!o.IsObject()) continue;  // (the parser below refuses it)
    const auto params = o.FindMember("parameters");
    if (params == o.MemberEnd() || !params->value.IsObject() || !params->value.HasMember("binary_data_size")) continue;
    if (next_part >= binary.size()) {
      return Err(Internal("stored result of job '" + rec.id + "' is damaged: a binary part is missing"));
    }
    joined += binary[next_part++];
  }
  auto parsed = ParseKServeInfer(rec.model, rec.version, std::string_view(buf.GetString(), buf.GetSize()), joined,
                                 nullptr);  // the outputs are copied out below, while `joined` lives
  if (!parsed) return Err(Internal("stored result of job '" + rec.id + "' is damaged: " + parsed.error().message()));
  // Binary parts sit at arbitrary offsets of the body: copy each into its
  // own (aligned) buffer, which also frees the body.
  std::vector<NamedTensor> outputs;
  outputs.reserve(parsed->request.inputs.size());
  for (const auto& t : parsed->request.inputs) {
    if (Status st = t.tensor.Validate(); !st.ok()) {
      return Err(
          Internal("stored result of job '" + rec.id + "' is damaged: output '" + t.name + "': " + st.message()));
    }
    outputs.push_back({t.name, OwnedCopy(t.tensor)});
  }
  return outputs;
}

}  // namespace

Result<std::shared_ptr<const JobRecord>> ReadStoredJobJson(std::string_view json,
                                                           const std::vector<std::string>& binary) {
  rapidjson::Document doc;
  if (JsonParseError e; !ParseJson(doc, json.data(), json.size(), e) || !doc.IsObject()) {
    return Err(Internal("a stored job result is not valid JSON"));
  }
  auto rec = std::make_shared<JobRecord>();
  rec->id = Str(doc, "job_id");
  rec->model = Str(doc, "model_name");
  rec->owner = Str(doc, "owner");
  rec->version = std::atoll(Str(doc, "model_version").c_str());
  rec->submitted_ms = Int(doc, "submitted_ms");
  rec->started_ms = Int(doc, "started_ms");
  rec->finished_ms = Int(doc, "finished_ms");
  const std::string status = Str(doc, "status");
  if (status == "done") {
    rec->state = JobState::kDone;
  } else if (status == "failed") {
    rec->state = JobState::kFailed;
  } else if (status == "cancelled") {
    rec->state = JobState::kCancelled;
  } else if (status == "queued" || status == "running") {
    rec->state = status == "queued" ? JobState::kQueued : JobState::kRunning;
  } else {
    return Err(Internal("stored job '" + rec->id + "' has status '" + status + "', not a job's"));
  }
  if (auto it = doc.FindMember("binary_data_output"); it != doc.MemberEnd() && it->value.IsBool()) {
    rec->binary_default = it->value.GetBool();
  }
  if (auto it = doc.FindMember("binary_outputs"); it != doc.MemberEnd() && it->value.IsObject()) {
    for (const auto& m : it->value.GetObject()) {
      if (m.value.IsBool()) rec->binary_outputs.emplace_back(m.name.GetString(), m.value.GetBool());
    }
  }
  if (rec->state == JobState::kQueued || rec->state == JobState::kRunning) {
    return std::shared_ptr<const JobRecord>(std::move(rec));
  }
  if (rec->state != JobState::kDone) {
    auto it = doc.FindMember("error");
    if (it == doc.MemberEnd() || !it->value.IsObject()) {
      return Err(Internal("stored job '" + rec->id + "' has no error"));
    }
    const int code = static_cast<int>(Int(it->value, "grpc_code"));
    rec->error = Status(code > 0 && code <= 16 ? static_cast<StatusCode>(code) : StatusCode::kUnknown,
                        Str(it->value, "message"));
    return std::shared_ptr<const JobRecord>(std::move(rec));
  }
  size_t next_part = 0;
  if (auto responses = doc.FindMember("responses"); responses != doc.MemberEnd()) {
    if (!responses->value.IsArray())
      return Err(Internal("stored job '" + rec->id + "' has responses that are not a list"));
    rec->decoupled = true;
    for (const auto& response : responses->value.GetArray()) {
      QUERN_ASSIGN_OR_RETURN(auto outputs, ReadStoredOutputs(*rec, response, binary, next_part));
      rec->responses.push_back(std::move(outputs));
    }
  } else {
    auto result = doc.FindMember("result");
    if (result == doc.MemberEnd()) return Err(Internal("stored job '" + rec->id + "' has no result"));
    QUERN_ASSIGN_OR_RETURN(rec->outputs, ReadStoredOutputs(*rec, result->value, binary, next_part));
  }
  if (next_part != binary.size()) {
    return Err(Internal("stored result of job '" + rec->id + "' is damaged: " + std::to_string(binary.size()) +
                        " binary parts for " + std::to_string(next_part) + " binary outputs"));
  }
  return std::shared_ptr<const JobRecord>(std::move(rec));
}

}  // namespace quern
