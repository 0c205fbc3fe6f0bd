// The dashboard: a page at GET / on the HTTP and vision ports that shows
// every model's state and traffic live, and a test page that sends an image
// to a vision model and draws what it found. The page, its script and its
// style sheet are compiled into the binary (nothing is fetched from elsewhere
// at run time); the script polls GET /dashboard/state once a second.
//
// The files name no model and need no key (CodeProject.AI clients probe
// GET / to see that the server is up). The state names models, so the
// server asks for a key there wherever keys are required.
//
// Thread-safe: free functions over thread-safe sources.
#pragma once

#include <optional>

#include "frontends/http/http_types.h"
#include "frontends/http/router.h"
#include "metrics/registry.h"
#include "pipeline/vision_service.h"
#include "quern/engine.h"

namespace quern {

struct DashboardSources {
  const Engine* engine = nullptr;
  VisionService* vision = nullptr;  // may be null: no vision models described
  const MetricsRegistry* registry = nullptr;
};

// The state the page draws, as JSON: the server's version and wall-clock
// time, every model version (state, load error, layout, vision task), and
// the metrics registry rendered as Prometheus text, the same text GET
// /metrics serves, so that the page's numbers are those of /metrics.
HttpResponse DashboardState(const DashboardSources& sources);

// Declares GET / (the page) and GET /dashboard/{file} (its files), open to
// anyone, and GET /dashboard/state (a user key) on `router`; `sources` must
// outlive it.
Status AddDashboardRoutes(Router& router, const DashboardSources& sources);

}  // namespace quern
