// Which routes each of the server's ports serves: the one place the front
// ends' routes are put together (each front end declares its own routes
// once, in its AddRoutes).
//
//   HTTP port     KServe (/v2), jobs (/v2), vision (/v1, /predict), the dashboard
//   vision port   vision (/v1, /predict), the dashboard; any other path: 404
//   metrics port  GET /metrics; any other path: 404
//
// The README's route table lists the same routes; a test compares them.
#pragma once

#include "frontends/http/kserve_handler.h"
#include "frontends/http/router.h"
#include "frontends/jobs/job_handler.h"
#include "frontends/vision/vision_handler.h"
#include "metrics/registry.h"
#include "server/dashboard.h"

namespace quern {

// The front ends a port's routes reach; each must outlive the routers.
struct HttpFrontEnds {
  KServeHandler* kserve = nullptr;
  JobHandler* jobs = nullptr;
  VisionHandler* vision = nullptr;
  const DashboardSources* dashboard = nullptr;
};

Status AddHttpPortRoutes(Router& router, const HttpFrontEnds& front_ends);
Status AddVisionPortRoutes(Router& router, const HttpFrontEnds& front_ends);
// `registry` must outlive the router; `need_key`: --metrics-need-key.
Status AddMetricsPortRoutes(Router& router, const MetricsRegistry* registry, bool need_key);

}  // namespace quern
