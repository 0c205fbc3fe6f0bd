#include "server/dashboard.h"

#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <chrono>
#include <string>
#include <string_view>

#include "core/model_runtime.h"
#include "server/dashboard_assets.h"  // generated from dashboard/ by CMake

namespace quern {
namespace {

// The asset `name` ("index.html"), or null.
const dashboard_assets::Asset* FindAsset(std::string_view name) {
  for (const auto& a : dashboard_assets::kAssets) {
    if (a.name == name) return &a;
  }
  return nullptr;
}

std::string_view ContentType(std::string_view name) {
  if (name.ends_with(".html")) return "text/html; charset=utf-8";
  if (name.ends_with(".js")) return "text/javascript; charset=utf-8";
  if (name.ends_with(".css")) return "text/css; charset=utf-8";
  return "application/octet-stream";
}

const char* TaskName(VisionTask t) {
  switch (t) {
    case VisionTask::kClassification: return "classification";
    case VisionTask::kDetection: return "detection";
    case VisionTask::kEmbedding: return "embedding";
  }
  return "";
}

// The file `name`, or 404.
HttpResponse DashboardFile(std::string_view name) {
  const dashboard_assets::Asset* a = FindAsset(name);
  if (!a) return ErrorResponse(NotFound("no dashboard file '" + std::string(name.substr(0, 64)) + "'"));
  HttpResponse resp;
  resp.content_type = ContentType(a->name);
  resp.body.assign(reinterpret_cast<const char*>(a->data), a->size);
  resp.headers.emplace_back("Cache-Control", "no-cache");
  resp.headers.emplace_back("X-Content-Type-Options", "nosniff");
  if (a->name.ends_with(".html")) {
    // Only the page's own files run; images drawn on the test page come
    // from the file the user picks (blob:).
    resp.headers.emplace_back("Content-Security-Policy",
                              "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                              "img-src 'self' blob: data:; form-action 'none'; base-uri 'none'; "
                              "frame-ancestors 'none'");
    resp.headers.emplace_back("Referrer-Policy", "no-referrer");
  }
  return resp;
}

}  // namespace

HttpResponse DashboardState(const DashboardSources& s) {
  // First, so that a model listed below has its series in the text (a
  // model loaded in between is drawn at the next poll).
  const std::string metrics = s.registry->Render();
  rapidjson::StringBuffer sb;
  rapidjson::Writer<rapidjson::StringBuffer> w(sb);
  w.StartObject();
  w.Key("version");
  w.String(Version());
  w.Key("now_s");
  w.Double(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  w.Key("models");
  w.StartArray();
  for (const ModelStatus& m : s.engine->ListModels()) {
    const ModelConfig& c = m.config;
    w.StartObject();
    w.Key("name");
    w.String(m.name.c_str(), static_cast<rapidjson::SizeType>(m.name.size()));
    w.Key("version");
    w.Int64(m.version);
    w.Key("state");
    const std::string_view state = ModelStateName(m.state);
    w.String(state.data(), static_cast<rapidjson::SizeType>(state.size()));
    w.Key("reason");
    w.String(m.reason.c_str(), static_cast<rapidjson::SizeType>(m.reason.size()));
    w.Key("platform");
    // The runtime (backend and precision, "openvino bf16"), or the platform of an ensemble.
    const std::string platform = c.backend.empty() ? c.platform : ModelRuntime(c);
    w.String(platform.c_str(), static_cast<rapidjson::SizeType>(platform.size()));
    w.Key("max_batch_size");
    w.Int(c.max_batch_size);
    w.Key("instances");
    w.Int(c.instance_count);
    w.Key("dynamic_batching");
    w.Bool(c.batching.has_value());
    w.Key("steps");
    w.Uint(static_cast<unsigned>(c.ensemble_steps.size()));
    if (m.state == ModelState::kReady && s.vision != nullptr && IsVisionModel(c)) {
      if (auto v = s.vision->Model(m.name); v && (*v)->version == m.version) {
        w.Key("vision");
        w.StartObject();
        w.Key("task");
        w.String(TaskName((*v)->task));
        w.Key("width");
        w.Int((*v)->image.width);
        w.Key("height");
        w.Int((*v)->image.height);
        w.Key("labels");
        w.Uint(static_cast<unsigned>((*v)->labels.size()));
        w.EndObject();
      }
    }
    w.EndObject();
  }
  w.EndArray();
  w.Key("metrics");
  w.String(metrics.c_str(), static_cast<rapidjson::SizeType>(metrics.size()));
  w.EndObject();
  HttpResponse resp;
  resp.body.assign(sb.GetString(), sb.GetSize());
  resp.headers.emplace_back("Cache-Control", "no-store");
  return resp;
}

Status AddDashboardRoutes(Router& router, const DashboardSources& sources) {
  // Each file at its own path alone ("/dashboard/app.js/" is no file), open
  // to anyone; any other path under /dashboard is no route of these.
  auto file = [](std::string name) -> RouteHandler {
    return [name](HttpRequest&& r, const RouteMatch&, HttpDone done) {
      const std::string_view path = std::string_view(r.target).substr(0, r.target.find('?'));
      done(DashboardFile(path == "/" || path == "/dashboard/" + name ? name : std::string()));
    };
  };
  QUERN_RETURN_IF_ERROR(router.Add({"GET", "/", KeyPolicy::kNone, false, nullptr, file("index.html")}));
  for (const auto& a : dashboard_assets::kAssets) {
    const std::string name(a.name);
    QUERN_RETURN_IF_ERROR(router.Add({"GET", "/dashboard/" + name, KeyPolicy::kNone, false, nullptr, file(name)}));
  }
  // It names models.
  return router.Add({"GET", "/dashboard/state", KeyPolicy::kUser, false, nullptr,
                     [&sources](HttpRequest&&, const RouteMatch&, HttpDone done) { done(DashboardState(sources)); }});
}

}  // namespace quern
