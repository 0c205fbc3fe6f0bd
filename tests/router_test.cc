// The HTTP router without sockets: which route a request reaches, the order
// of its checks (draining, key, admission), and the answers to paths and
// methods no route takes; and the server's route table against docs/api/http.md's.
#include "frontends/http/router.h"

#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "server/routes.h"
#include "store/result_store.h"

namespace quern {
namespace {

// Answers with the route's name and its parameters: "infer model=m version=2".
RouteHandler Named(std::string name) {
  return [name](HttpRequest&&, const RouteMatch& m, HttpDone done) {
    HttpResponse r;
    r.body = name;
    for (const char* p : {"model", "version", "id"}) {
      if (!m.param(p).empty()) r.body += std::string(" ") + p + "=" + m.param(p);
    }
    done(std::move(r));
  };
}

HttpResponse Dispatch(const Router& router, std::string method, std::string target,
                      std::vector<std::pair<std::string, std::string>> headers = {}) {
  HttpResponse out;
  bool answered = false;
  router.Dispatch({std::move(method), std::move(target), std::move(headers), ""}, [&](HttpResponse r) {
    EXPECT_FALSE(answered) << "answered twice";
    answered = true;
    out = std::move(r);
  });
  EXPECT_TRUE(answered);
  return out;
}

std::optional<HttpResponse> Head(const Router& router, std::string method, std::string target,
                                 std::vector<std::pair<std::string, std::string>> headers = {}) {
  return router.Head({std::move(method), std::move(target), std::move(headers), ""});
}

TEST(Router, LiteralSegmentsBeatParametersAndOptionalGroupsReadBothWays) {
  Router r;
  ASSERT_TRUE(r.Add({"GET", "/v2/models/stats", KeyPolicy::kUser, false, nullptr, Named("all stats")}).ok());
  ASSERT_TRUE(
      r.Add({"GET", "/v2/models/{model}[/versions/{version}]", KeyPolicy::kUser, false, nullptr, Named("metadata")})
          .ok());
  ASSERT_TRUE(
      r.Add({"POST", "/v2/models/{model}[/versions/{version}]/infer", KeyPolicy::kUser, false, nullptr, Named("infer")})
          .ok());
  EXPECT_EQ(Dispatch(r, "GET", "/v2/models/stats").body, "all stats");
  EXPECT_EQ(Dispatch(r, "GET", "/v2/models/m").body, "metadata model=m");
  EXPECT_EQ(Dispatch(r, "HEAD", "/v2/models/m").body, "metadata model=m") << "GET routes answer HEAD";
  EXPECT_EQ(Dispatch(r, "GET", "/v2/models/m/versions/3").body, "metadata model=m version=3");
  EXPECT_EQ(Dispatch(r, "POST", "/v2/models/stats/infer").body, "infer model=stats") << "a model named stats";
  // Decoded segments, empty ones and the query ignored.
  EXPECT_EQ(Dispatch(r, "POST", "//v2/models/my%20model/inf%65r?x=/y").body, "infer model=my model");
  EXPECT_EQ(Dispatch(r, "POST", "/v2/models/a%2Fb/infer").body, "infer model=a/b") << "%2F stays in its segment";
  EXPECT_EQ(r.ModelOf("/v2/models/my%20model/versions/2/infer"), "my model");
  EXPECT_EQ(r.ModelOf("/v2/models/stats"), "");
  EXPECT_EQ(r.PatternOf("POST", "/v2/models/m/versions/2/infer"), "/v2/models/{model}[/versions/{version}]/infer");
  EXPECT_EQ(r.PatternOf("GET", "/v2/models/m/infer"), "");
}

TEST(Router, PathsAndMethodsWithoutARouteGet404405Or501) {
  Router r;
  ASSERT_TRUE(r.Add({"POST", "/v2/models/{model}/infer", KeyPolicy::kUser, false, nullptr, Named("infer")}).ok());
  ASSERT_TRUE(r.Add({"GET", "/v2/jobs/{id}", KeyPolicy::kUser, false, nullptr, Named("get")}).ok());
  ASSERT_TRUE(r.Add({"DELETE", "/v2/jobs/{id}", KeyPolicy::kUser, false, nullptr, Named("cancel")}).ok());
  HttpResponse put = Dispatch(r, "PUT", "/v2/models/m/infer");
  EXPECT_EQ(put.status, 405);
  ASSERT_EQ(put.headers.size(), 1u);
  EXPECT_EQ(put.headers[0].first, "Allow");
  EXPECT_EQ(put.headers[0].second, "POST");
  HttpResponse post = Dispatch(r, "POST", "/v2/jobs/abc");
  EXPECT_EQ(post.status, 405);
  EXPECT_EQ(post.headers.at(0).second, "GET, HEAD, DELETE");
  EXPECT_EQ(Dispatch(r, "DELETE", "/v2/jobs/abc").body, "cancel id=abc");
  EXPECT_EQ(Dispatch(r, "GET", "/v2/models/m/infer/more").status, 404);
  HttpResponse brew = Dispatch(r, "BREW", "/v2/models/m/infer");  // a path with routes: 405, whatever the method
  EXPECT_EQ(brew.status, 405);
  EXPECT_EQ(brew.headers.at(0).second, "POST");
  EXPECT_EQ(Dispatch(r, "TRACE", "/v2/jobs/abc").status, 405);
  EXPECT_EQ(Dispatch(r, "BREW", "/nowhere").status, 501);
  EXPECT_EQ(Dispatch(r, "GET", "/").status, 404);
}

TEST(Router, ABadPatternOrARouteDeclaredTwiceIsRefused) {
  Router r;
  EXPECT_TRUE(r.Add({"GET", "/a/{x}", KeyPolicy::kUser, false, nullptr, Named("a")}).ok());
  EXPECT_FALSE(r.Add({"GET", "/a/{y}", KeyPolicy::kUser, false, nullptr, Named("b")}).ok()) << "the same route";
  EXPECT_TRUE(r.Add({"POST", "/a/{y}", KeyPolicy::kUser, false, nullptr, Named("c")}).ok()) << "another method";
  EXPECT_FALSE(r.Add({"GET", "a/b", KeyPolicy::kUser, false, nullptr, Named("d")}).ok());
  EXPECT_FALSE(r.Add({"GET", "/a//b", KeyPolicy::kUser, false, nullptr, Named("d")}).ok());
  EXPECT_FALSE(r.Add({"GET", "/a/{b", KeyPolicy::kUser, false, nullptr, Named("d")}).ok());
  EXPECT_FALSE(r.Add({"GET", "/a/x{b}", KeyPolicy::kUser, false, nullptr, Named("d")}).ok());
  EXPECT_FALSE(r.Add({"GET", "/a/{}", KeyPolicy::kUser, false, nullptr, Named("d")}).ok());
  EXPECT_FALSE(r.Add({"GET", "/a[/b][/c]", KeyPolicy::kUser, false, nullptr, Named("d")}).ok());
  EXPECT_FALSE(r.Add({"FETCH", "/z", KeyPolicy::kUser, false, nullptr, Named("d")}).ok());
  EXPECT_FALSE(r.Add({"GET", "/z", KeyPolicy::kUser, false, nullptr, nullptr}).ok()) << "no handler";
  EXPECT_EQ(r.Table().size(), 2u);
}

// Keys "user" and "admin"; counts the checks.
struct Keys {
  std::atomic<int> checks{0};
  RouterOptions Options(const std::atomic<bool>* draining = nullptr) {
    RouterOptions o;
    o.authorize = [this](std::string_view key, bool admin) {
      ++checks;
      if (key.empty()) return Unauthenticated("no key");
      if (key != "user" && key != "admin") return Unauthenticated("unknown key");
      if (admin && key != "admin") return PermissionDenied("not an admin");
      return Status::Ok();
    };
    o.draining = draining;
    return o;
  }
};

TEST(Router, TheKeyIsCheckedOnTheHeadBeforeAdmissionAndOnlyThere) {
  Keys keys;
  Router r(keys.Options());
  int admissions = 0;
  RouteHeadCheck full = [&](const HttpRequest&, const RouteMatch& m) -> std::optional<HttpResponse> {
    ++admissions;
    return ErrorResponse(Unavailable("model '" + m.param("model") + "': queue is full"));
  };
  ASSERT_TRUE(r.Add({"POST", "/v2/models/{model}/infer", KeyPolicy::kUser, false, full, Named("infer")}).ok());
  ASSERT_TRUE(
      r.Add({"POST", "/v2/repository/models/{model}/load", KeyPolicy::kAdmin, false, nullptr, Named("load")}).ok());
  ASSERT_TRUE(r.Add({"GET", "/open", KeyPolicy::kNone, false, nullptr, Named("open")}).ok());

  auto refused = Head(r, "POST", "/v2/models/m/infer");
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->status, 401);
  EXPECT_EQ(refused->headers.at(0).first, "WWW-Authenticate");
  EXPECT_EQ(admissions, 0) << "a caller without a key learns nothing of the queue";
  auto full_queue = Head(r, "POST", "/v2/models/m/infer", {{"authorization", "Bearer user"}});
  ASSERT_TRUE(full_queue.has_value());
  EXPECT_EQ(full_queue->status, 503);
  EXPECT_EQ(admissions, 1);
  EXPECT_EQ(Head(r, "POST", "/v2/repository/models/m/load", {{"x-api-key", "user"}})->status, 403);
  EXPECT_FALSE(Head(r, "POST", "/v2/repository/models/m/load", {{"x-api-key", "admin"}}).has_value());
  EXPECT_EQ(Head(r, "GET", "/v2/nothing/here")->status, 401) << "no route: the key still comes first";
  EXPECT_FALSE(Head(r, "GET", "/open").has_value());
  EXPECT_FALSE(Head(r, "TRACE", "/open").has_value()) << "an open path: its 405 needs no key";
  EXPECT_EQ(Head(r, "GET", "/v2/models/m/infer")->status, 401) << "a keyed path: the key before the 405";
  auto query_key = Head(r, "POST", "/v2/models/m/infer?api_key=user");
  ASSERT_TRUE(query_key.has_value()) << "no query keys outside a scope that takes them";
  EXPECT_EQ(query_key->status, 401);
  const int checks = keys.checks.load();
  EXPECT_EQ(Dispatch(r, "POST", "/v2/models/m/infer").body, "infer model=m") << "the head was checked already";
  EXPECT_EQ(keys.checks.load(), checks) << "a key is checked once, with the head";
}

TEST(Router, AFormRoutesKeyMayComeInItsBodyButNeverInACompressedOne) {
  Keys keys;
  Router r(keys.Options());
  int admissions = 0;
  RouteHeadCheck admit = [&](const HttpRequest&, const RouteMatch&) -> std::optional<HttpResponse> {
    ++admissions;
    return std::nullopt;
  };
  std::string checked;
  ASSERT_TRUE(r.Add({"POST", "/v1/vision/detection", KeyPolicy::kUserOrForm, false, admit,
                     [&](HttpRequest&&, const RouteMatch& m, HttpDone done) {
                       checked = m.key_in_body() ? m.CheckKey("user").ToString() : "in the head";
                       done({});
                     }})
                  .ok());
  RouteScope cpai;
  cpai.prefix = "v1";
  cpai.key = KeyPolicy::kUserOrForm;  // read as kUser: no route's handler reads the form
  cpai.query_key = true;
  KeyProblem seen = KeyProblem::kRefused;
  cpai.refuse = [&](const HttpRequest&, const Status& st, KeyProblem problem) {
    seen = problem;
    HttpResponse resp;
    resp.body = "{\"success\":false,\"error\":\"" + st.message() + "\"}";
    return resp;
  };
  ASSERT_TRUE(r.AddScope(cpai).ok());

  EXPECT_FALSE(Head(r, "POST", "/v1/vision/detection").has_value()) << "the key may be in the form";
  EXPECT_EQ(admissions, 0) << "admitted once its key is known";
  Dispatch(r, "POST", "/v1/vision/detection");
  EXPECT_EQ(checked, "OK");
  auto compressed = Head(r, "POST", "/v1/vision/detection", {{"content-encoding", "gzip"}});
  ASSERT_TRUE(compressed.has_value());
  EXPECT_EQ(seen, KeyProblem::kNotInHead);
  EXPECT_NE(compressed->body.find("compressed"), std::string::npos) << compressed->body;
  EXPECT_FALSE(Head(r, "POST", "/v1/vision/detection", {{"content-encoding", "IDENTITY"}}).has_value());
  auto wrong = Head(r, "POST", "/v1/vision/detection?api_key=nope");
  ASSERT_TRUE(wrong.has_value());
  EXPECT_EQ(wrong->status, 200) << "the scope's words";
  EXPECT_EQ(seen, KeyProblem::kRefused);
  EXPECT_FALSE(Head(r, "POST", "/v1/vision/detection?x=1&api_key=us%65r").has_value());
  EXPECT_EQ(admissions, 1);
  Dispatch(r, "POST", "/v1/vision/detection?api_key=user");
  EXPECT_EQ(checked, "in the head");
  auto missing = Head(r, "GET", "/v1/vision/detection");
  ASSERT_TRUE(missing.has_value()) << "a GET has no form: its key is in its head";
  EXPECT_EQ(seen, KeyProblem::kMissing);
  seen = KeyProblem::kRefused;
  auto unrouted = Head(r, "POST", "/v1/vision/detection/more");
  ASSERT_TRUE(unrouted.has_value()) << "no route's handler would read the form: its body is not read for a key";
  EXPECT_EQ(seen, KeyProblem::kMissing);
}

TEST(Router, DrainingRefusesAllButTheRoutesAnsweredWhileDraining) {
  std::atomic<bool> draining{false};
  Router r(RouterOptions{.authorize = nullptr, .draining = &draining});
  ASSERT_TRUE(r.Add({"GET", "/v2/health/ready", KeyPolicy::kUser, true, nullptr, Named("ready")}).ok());
  ASSERT_TRUE(r.Add({"GET", "/v2", KeyPolicy::kUser, false, nullptr, Named("metadata")}).ok());
  EXPECT_EQ(Dispatch(r, "GET", "/v2").body, "metadata");
  draining = true;
  EXPECT_EQ(Head(r, "GET", "/v2")->status, 503);
  EXPECT_EQ(Head(r, "GET", "/nothing")->status, 503);
  EXPECT_FALSE(Head(r, "GET", "/v2/health/ready").has_value());
  EXPECT_EQ(Dispatch(r, "GET", "/v2").status, 503) << "draining began while the body came";
  EXPECT_EQ(Dispatch(r, "GET", "/v2/health/ready").body, "ready");
}

// The route table of docs/api/http.md: (methods, path, key) -> ports.
using RouteRows = std::map<std::tuple<std::string, std::string, std::string>, std::set<std::string>>;

std::string Trim(std::string s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '`')) s.erase(0, 1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '`')) s.pop_back();
  return s;
}

// "GET, POST" or "GET POST" -> "GET POST".
std::string Methods(const std::string& s) {
  std::string out;
  std::istringstream in(s);
  for (std::string m; in >> m;) {
    if (!m.empty() && m.back() == ',') m.pop_back();
    if (!out.empty()) out += ' ';
    out += m;
  }
  return out;
}

RouteRows DocumentedRoutes() {
  std::ifstream in(QUERN_HTTP_DOC);
  EXPECT_TRUE(in.good()) << QUERN_HTTP_DOC;
  RouteRows rows;
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    if (line == "| method | path | ports | key |") {
      inside = true;
      continue;
    }
    if (!inside || line.starts_with("|---")) continue;
    if (!line.starts_with("|")) break;
    std::vector<std::string> cells;
    std::istringstream cols(line.substr(1));
    for (std::string c; std::getline(cols, c, '|');) cells.push_back(Trim(c));
    EXPECT_EQ(cells.size(), 4u) << line;
    if (cells.size() != 4) continue;
    std::set<std::string> ports;
    std::istringstream p(cells[2]);
    for (std::string port; std::getline(p, port, ',');) ports.insert(Trim(port));
    rows[{Methods(cells[0]), cells[1], cells[3]}] = ports;
  }
  return rows;
}

TEST(Routes, TheHttpPageListsEveryRouteOfEveryPortAndNoOther) {
  auto engine = Engine::Create({});
  ASSERT_TRUE(engine.has_value());
  MemoryResultStore store;
  KServeHandler kserve(engine->get());
  JobHandler jobs(engine->get(), &store);
  VisionService service(engine->get(), {});
  VisionHandler vision(&service, {});
  MetricsRegistry registry;
  DashboardSources dashboard{engine->get(), &service, &registry};
  const HttpFrontEnds front_ends{&kserve, &jobs, &vision, &dashboard};
  Router http, vision_port, metrics;
  ASSERT_TRUE(AddHttpPortRoutes(http, front_ends).ok());
  ASSERT_TRUE(AddVisionPortRoutes(vision_port, front_ends).ok());
  ASSERT_TRUE(AddMetricsPortRoutes(metrics, &registry, /*need_key=*/false).ok());
  RouteRows served;
  for (const auto& [port, router] :
       {std::pair<std::string, Router*>{"HTTP", &http}, {"vision", &vision_port}, {"metrics", &metrics}}) {
    for (const auto& e : router->Table()) {
      served[{Methods(e.methods), e.pattern, std::string(KeyPolicyName(e.key))}].insert(port);
    }
  }
  const RouteRows documented = DocumentedRoutes();
  for (const auto& [route, ports] : served) {
    auto it = documented.find(route);
    EXPECT_TRUE(it != documented.end()) << "docs/api/http.md does not list " << std::get<0>(route) << " "
                                        << std::get<1>(route) << " (key " << std::get<2>(route) << ")";
    if (it != documented.end()) {
      EXPECT_EQ(it->second, ports) << std::get<1>(route);
    }
  }
  for (const auto& [route, ports] : documented) {
    EXPECT_TRUE(served.contains(route)) << "docs/api/http.md lists " << std::get<0>(route) << " " << std::get<1>(route)
                                        << " (key " << std::get<2>(route) << "), which no port serves";
  }
}

}  // namespace
}  // namespace quern
