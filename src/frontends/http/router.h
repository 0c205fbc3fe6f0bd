// Router: a port's HTTP routes, each declared once, and the chain every
// request on that port goes through.
//
// A front end declares each of its routes once (Router::Add): the methods it
// takes, its path pattern, the key it needs, the check its head gets before
// the body is read, and its handler. The router is the HttpServer's head
// check and handler, and runs for every request, in this order:
//
//   on the head (an I/O thread; no byte of the body read yet):
//     1. match      the route whose pattern the path fits; at a path two
//                   patterns fit, a literal segment beats a {parameter}
//     2. draining   503 once the server drains, but on routes answered
//                   while draining (health)
//     3. key        the route's KeyPolicy, through RouterOptions::authorize;
//                   a refusal is answered in its scope's words
//     4. admission  the route's head check (a full queue refused here)
//   then the HttpServer reads the body (its size limits; Content-Encoding
//   undone), and on the whole request:
//     5. draining   again (it may have begun while the body came)
//     6. dispatch   the route's handler; a path no route takes, or a method
//                   the route does not take, goes to its scope's answer
//   and for the access log, ModelOf names the {model} a target's route has.
//
// Patterns: "/v2/models/{model}[/versions/{version}]/infer": literal
// segments, {name} parameters (one whole segment each) and at most one
// optional [...] group. A request's path is matched segment by segment,
// each percent-decoded ("/v2/models/m/inf%65r" is the infer route; an
// encoded '/' stays inside its segment), empty segments and the query
// ignored. Methods: "GET" (which answers HEAD too), "POST", "DELETE",
// or several separated by spaces ("GET POST").
//
// A scope (AddScope) is everything under one first segment ("v2", "v1",
// "predict"; "" = every path under no other scope): the key a request no
// route takes needs, whether a key may come in the query, and the words of
// the API for a refused key and for a path or method without a route.
//
// Thread safety: Add and AddScope before serving, from one thread; Head,
// Dispatch, ModelOf and Table from any number of threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "frontends/http/http_types.h"
#include "frontends/http/http_util.h"
#include "quern/status.h"

namespace quern {

enum class KeyPolicy : uint8_t {
  kNone,   // open to anyone (names no model: the dashboard's files, ping, GET /)
  kUser,   // a user or admin key
  kAdmin,  // an admin key (model control)
  // A user or admin key; a POST whose head carries none may carry it in its
  // multipart form (CodeProject.AI clients send an api_key field). Such a
  // request skips the head check (it is admitted once its key is known) and
  // its handler checks the field before it uses the form. A compressed
  // body is never read for a key: its key must be in the head.
  kUserOrForm,
};
std::string_view KeyPolicyName(KeyPolicy key);  // "none", "user", "admin", "user or form"

// Why a request's key was refused.
enum class KeyProblem : uint8_t {
  kMissing,    // none was presented
  kRefused,    // the one presented was refused (unknown, not an admin's, over its rate)
  kNotInHead,  // a compressed body's key must come in its head
};

// What a request's path captured (the values of its route's {parameters},
// copies: the request may be moved), and whether its key is still to be
// checked.
class RouteMatch {
 public:
  // The {name} segment, percent-decoded; "" when the route has none.
  const std::string& param(std::string_view name) const;

  // True when keys are configured and this request's key is to be found in
  // its body (KeyPolicy::kUserOrForm: a POST whose head carried none). Its
  // handler checks it with CheckKey before it uses anything of the body.
  bool key_in_body() const { return authorize_ != nullptr; }
  // The key a body carried, checked as the head's would have been: OK or
  // the refusal (UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED).
  // OK when the key was in the head (checked there).
  Status CheckKey(std::string_view key) const;

 private:
  friend class Router;
  boost::container::small_vector<std::pair<std::string_view, std::string>, 3> params_;  // name -> value
  const std::function<Status(std::string_view, bool)>* authorize_ = nullptr;
};

// Decides a request from its line and headers (body not read): a response
// refuses it, nothing lets it go on. Quick: a queue's state, a flag.
using RouteHeadCheck = std::function<std::optional<HttpResponse>(const HttpRequest& head, const RouteMatch& match)>;
// Answers a request exactly once (through `done`, from any thread). `match`
// lives for the call: a handler copies what it keeps.
using RouteHandler = std::function<void(HttpRequest&& request, const RouteMatch& match, HttpDone done)>;

struct Route {
  std::string methods;  // "GET", "POST", "GET DELETE", ...
  std::string pattern;  // "/v2/models/{model}[/versions/{version}]/infer"
  KeyPolicy key = KeyPolicy::kUser;
  bool while_draining = false;  // still answered once the server drains (health checks)
  RouteHeadCheck head;          // null: none
  RouteHandler handler;
};

struct RouteScope {
  std::string prefix;  // the first path segment ("v2"), "" = every path under no other scope
  // For a request no route takes (kUserOrForm is read as kUser: no handler
  // reads its form).
  KeyPolicy key = KeyPolicy::kUser;
  bool query_key = false;  // a key may come as ?api_key=... (CodeProject.AI clients)
  // A refused key's answer (null: 401 with WWW-Authenticate: Bearer, 403,
  // 429, as {"error": ...}).
  std::function<HttpResponse(const HttpRequest& head, const Status& refused, KeyProblem problem)> refuse;
  // A request no route takes. `allowed`: the methods the routes at its path
  // take, as an Allow header lists them ("GET, HEAD, DELETE"); empty when
  // no route has its path. Null: 405 with Allow, or 404.
  std::function<void(HttpRequest&& request, std::string_view allowed, HttpDone done)> unmatched;
};

struct RouterOptions {
  // Checks a presented key ("" when none), for a model-control route when
  // `admin`. Null: no keys are configured and every route is open.
  std::function<Status(std::string_view key, bool admin)> authorize;
  // Set: once it is true, every request but those to routes answered while
  // draining gets 503.
  const std::atomic<bool>* draining = nullptr;
};

class Router {
 public:
  explicit Router(RouterOptions options = {});
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  // Declares a route. A pattern that cannot be read, or a method and
  // pattern declared already, is a programming error: INVALID_ARGUMENT.
  Status Add(Route route);
  Status AddScope(RouteScope scope);

  // Steps 1-4 above: the HttpServer's head check.
  std::optional<HttpResponse> Head(const HttpRequest& head) const;
  // Steps 5-6: the HttpServer's handler.
  void Dispatch(HttpRequest&& request, HttpDone done) const;

  // The {model} of the route `target` fits (decoded), or "".
  std::string ModelOf(std::string_view target) const;
  // The pattern of the route that takes `method` at `target`, as declared;
  // "" when none does.
  std::string PatternOf(std::string_view method, std::string_view target) const;

  // The routes as declared, in order: for listing and checking them.
  struct Entry {
    std::string methods, pattern;
    KeyPolicy key;
  };
  std::vector<Entry> Table() const;

 private:
  struct Compiled;
  struct Found;
  // The route at `target` that takes one of `method_bits` (0, a method not
  // known: none), the methods routes take there, and its scope.
  Found Match(unsigned method_bits, std::string_view target) const;
  // Whether a request's key is still to be read from its body.
  bool KeyInBody(const HttpRequest& head, KeyPolicy key, const RouteScope* scope) const;
  std::optional<HttpResponse> Authorize(const HttpRequest& head, KeyPolicy key, const RouteScope* scope) const;
  bool Draining() const;
  // The key a request needs: its route's; else none at a path whose routes are all open; else its
  // scope's.
  static KeyPolicy KeyOf(const Route* route, const RouteScope* scope, bool path_open);

  RouterOptions options_;
  std::vector<Route> routes_;                        // as declared
  std::vector<std::unique_ptr<Compiled>> compiled_;  // one or two per route (an optional group)
  // compiled_ by number of segments, in declaration order: a path is matched against the patterns of
  // its own length only (each request's path is matched twice: its head, then its dispatch).
  std::vector<std::vector<const Compiled*>> by_length_;
  std::vector<RouteScope> scopes_;
};

}  // namespace quern
