#include "server/routes.h"

#include "metrics/custom_metrics.h"
#include "server/openapi_spec.h"  // generated from docs/openapi.yaml by CMake

namespace quern {
namespace {

// A port that answers nothing but its own routes: 404 with `body` (405 with
// Allow for a method its routes' path does not take), to a request with the
// key `key` asks.
Status NothingElse(Router& router, KeyPolicy key, std::string body) {
  RouteScope others;
  others.key = key;
  others.unmatched = [body = std::move(body)](HttpRequest&&, std::string_view allowed, HttpDone done) {
    HttpResponse resp;
    resp.status = 404;
    resp.body = body;
    if (!allowed.empty()) {  // its path has routes, not for this method
      resp.status = 405;
      resp.headers.emplace_back("Allow", std::string(allowed));
    }
    done(std::move(resp));
  };
  return router.AddScope(std::move(others));
}

}  // namespace

Status AddHttpPortRoutes(Router& router, const HttpFrontEnds& f) {
  // The API's description names routes, not models: open to anyone.
  QUERN_RETURN_IF_ERROR(router.Add(
      {"GET", "/openapi.yaml", KeyPolicy::kNone, false, nullptr, [](HttpRequest&&, const RouteMatch&, HttpDone done) {
         HttpResponse resp;
         resp.content_type = "application/yaml";
         resp.body = openapi_spec::Yaml();
         done(std::move(resp));
       }}));
  QUERN_RETURN_IF_ERROR(f.kserve->AddRoutes(router));
  QUERN_RETURN_IF_ERROR(f.jobs->AddRoutes(router));
  QUERN_RETURN_IF_ERROR(f.vision->AddRoutes(router));
  return AddDashboardRoutes(router, *f.dashboard);
}

Status AddVisionPortRoutes(Router& router, const HttpFrontEnds& f) {
  QUERN_RETURN_IF_ERROR(f.vision->AddRoutes(router));
  QUERN_RETURN_IF_ERROR(AddDashboardRoutes(router, *f.dashboard));
  return NothingElse(
      router, KeyPolicy::kNone,
      "{\"success\":false,\"error\":\"this port serves the vision routes (/v1/vision/..., /predict/...)\"}");
}

Status AddMetricsPortRoutes(Router& router, const MetricsRegistry* registry, bool need_key) {
  const KeyPolicy key = need_key ? KeyPolicy::kUser : KeyPolicy::kNone;
  QUERN_RETURN_IF_ERROR(
      router.Add({"GET", "/metrics", key, false, nullptr, [registry](HttpRequest&&, const RouteMatch&, HttpDone done) {
                    HttpResponse resp;
                    resp.content_type = "text/plain; version=0.0.4";
                    resp.body = registry->Render();
                    CustomMetrics::Global().Render(resp.body);  // the models' own (pb_utils.MetricFamily)
                    done(std::move(resp));
                  }}));
  return NothingElse(router, key, "{\"error\":\"metrics are served at GET /metrics\"}");
}

}  // namespace quern
