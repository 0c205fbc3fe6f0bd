#include "frontends/http/router.h"

#include <strings.h>

#include <algorithm>

#include "auth/api_keys.h"

namespace quern {
namespace {

// Methods as bits; a method not listed is bit 0 and takes no route.
constexpr std::string_view kMethods[] = {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"};
constexpr unsigned kGet = 1u << 0, kHead = 1u << 1;

unsigned MethodBit(std::string_view method) {
  for (size_t i = 0; i < std::size(kMethods); ++i) {
    if (kMethods[i] == method) return 1u << i;
  }
  return 0;
}

// "GET POST" -> bits; GET answers HEAD too. 0: a name not known.
unsigned ParseMethods(std::string_view methods) {
  unsigned bits = 0;
  while (!methods.empty()) {
    const size_t space = methods.find(' ');
    const std::string_view name = methods.substr(0, space);
    if (!name.empty()) {
      const unsigned bit = MethodBit(name);
      if (bit == 0) return 0;
      bits |= bit;
    }
    if (space == std::string_view::npos) break;
    methods.remove_prefix(space + 1);
  }
  return bits & kGet ? bits | kHead : bits;
}

// An Allow header's list: "GET, HEAD, DELETE".
std::string AllowList(unsigned bits) {
  std::string out;
  for (size_t i = 0; i < std::size(kMethods); ++i) {
    if (!(bits & (1u << i))) continue;
    if (!out.empty()) out += ", ";
    out += kMethods[i];
  }
  return out;
}

// The api_key query parameter, percent-decoded ("" when absent).
std::string QueryKey(std::string_view target) {
  const size_t q = target.find('?');
  if (q == std::string_view::npos) return {};
  std::string_view query = target.substr(q + 1);
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    if (pair.starts_with("api_key=")) return PercentDecode(pair.substr(8));
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  return {};
}

HttpResponse DefaultRefusal(const Status& st) {
  HttpResponse resp = ErrorResponse(st);
  resp.status = AuthHttpStatus(st);
  if (resp.status == 401) resp.headers.emplace_back("WWW-Authenticate", "Bearer");
  return resp;
}

void DefaultUnmatched(const HttpRequest& r, std::string_view allowed, const HttpDone& done) {
  const std::string what = r.method.substr(0, 32) + " " + r.target.substr(0, 256);
  // A path that has routes answers any other method, known or not (TRACE, BREW), with 405 and the
  // methods it takes; an unknown method elsewhere is 501, as no route takes it.
  if (!allowed.empty()) {
    HttpResponse resp = ErrorResponse(InvalidArgument(what + ": this route takes " + std::string(allowed)));
    resp.status = 405;
    resp.headers.emplace_back("Allow", std::string(allowed));
    return done(std::move(resp));
  }
  if (MethodBit(r.method) == 0) {
    HttpResponse resp =
        ErrorResponse(Status(StatusCode::kUnimplemented, "method " + r.method.substr(0, 32) +
                                                             " is not supported (routes take GET, HEAD, "
                                                             "POST or DELETE)"));
    resp.status = 501;
    return done(std::move(resp));
  }
  done(ErrorResponse(NotFound("no route for " + what)));
}

}  // namespace

std::string_view KeyPolicyName(KeyPolicy key) {
  switch (key) {
    case KeyPolicy::kNone: return "none";
    case KeyPolicy::kUser: return "user";
    case KeyPolicy::kAdmin: return "admin";
    case KeyPolicy::kUserOrForm: return "user or form";
  }
  return "";
}

const std::string& RouteMatch::param(std::string_view name) const {
  static const std::string kNone;
  for (const auto& [n, v] : params_) {
    if (n == name) return v;
  }
  return kNone;
}

Status RouteMatch::CheckKey(std::string_view key) const {
  return authorize_ ? (*authorize_)(key, false) : Status::Ok();
}

// One way a route's pattern reads (a pattern with an optional group reads
// two ways).
struct Router::Compiled {
  size_t route = 0;  // index in routes_
  unsigned methods = 0;
  struct Segment {
    std::string text;  // the literal, or the parameter's name
    bool param = false;
  };
  std::vector<Segment> segments;

  // True when this pattern fits `path`.
  bool Fits(const TargetPath& path) const {
    if (path.size() != segments.size()) return false;
    // From the last segment: patterns of one length mostly share their first segments
    // ("/v2/models/{model}/...") and differ in their last.
    for (size_t i = segments.size(); i-- > 0;) {
      if (!segments[i].param && segments[i].text != path[i]) return false;
    }
    return true;
  }
  // At a path both fit: true when this one's first literal comes first.
  bool MoreSpecificThan(const Compiled& other) const {
    for (size_t i = 0; i < segments.size(); ++i) {
      if (segments[i].param != other.segments[i].param) return !segments[i].param;
    }
    return false;
  }
};

struct Router::Found {
  const Compiled* route = nullptr;  // takes the method; null: none does
  unsigned allowed = 0;             // the methods routes at this path take
  bool path_open = false;           // routes fit the path and each is open (KeyPolicy::kNone)
  const RouteScope* scope = nullptr;
  RouteMatch match;
};

Router::Router(RouterOptions options) : options_(std::move(options)) {}
Router::~Router() = default;

Status Router::Add(Route route) {
  const unsigned methods = ParseMethods(route.methods);
  if (methods == 0) return InvalidArgument("route " + route.pattern + ": methods '" + route.methods + "'");
  if (!route.handler) return InvalidArgument("route " + route.pattern + " has no handler");
  // The pattern, and with its optional group when it has one.
  const std::string& p = route.pattern;
  const size_t open = p.find('['), close = p.find(']');
  std::vector<std::string> readings;
  if (open == std::string::npos && close == std::string::npos) {
    readings.push_back(p);
  } else if (open != std::string::npos && close != std::string::npos && open < close &&
             p.find('[', open + 1) == std::string::npos && p.find(']', close + 1) == std::string::npos) {
    readings.push_back(p.substr(0, open) + p.substr(close + 1));
    readings.push_back(p.substr(0, open) + p.substr(open + 1, close - open - 1) + p.substr(close + 1));
  } else {
    return InvalidArgument("route " + p + ": at most one [optional] group");
  }
  std::vector<std::unique_ptr<Compiled>> compiled;
  for (const std::string& reading : readings) {
    if (!reading.starts_with('/')) return InvalidArgument("route " + p + ": a pattern starts with /");
    auto c = std::make_unique<Compiled>();
    c->route = routes_.size();
    c->methods = methods;
    std::string_view rest(reading);
    while (!rest.empty()) {
      rest.remove_prefix(1);  // the '/'
      const std::string_view segment = rest.substr(0, rest.find('/'));
      rest.remove_prefix(segment.size());
      if (segment.empty()) {
        if (rest.empty() && c->segments.empty()) break;  // "/"
        return InvalidArgument("route " + p + ": an empty segment");
      }
      const bool param = segment.front() == '{';
      if (param != (segment.back() == '}') || (param && segment.size() < 3) ||
          segment.find_first_of("{}", param ? 1 : 0) < segment.size() - (param ? 1 : 0)) {
        return InvalidArgument("route " + p + ": segment '" + std::string(segment) + "'");
      }
      c->segments.push_back({std::string(param ? segment.substr(1, segment.size() - 2) : segment), param});
    }
    for (const auto& other : compiled_) {
      bool same = other->segments.size() == c->segments.size() && (other->methods & methods) != 0;
      for (size_t i = 0; same && i < c->segments.size(); ++i) {
        same = other->segments[i].param == c->segments[i].param &&
               (c->segments[i].param || other->segments[i].text == c->segments[i].text);
      }
      if (same) return InvalidArgument("route " + p + " is declared twice (as " + routes_[other->route].pattern + ")");
    }
    compiled.push_back(std::move(c));
  }
  routes_.push_back(std::move(route));
  for (auto& c : compiled) {
    if (by_length_.size() <= c->segments.size()) by_length_.resize(c->segments.size() + 1);
    by_length_[c->segments.size()].push_back(c.get());
    compiled_.push_back(std::move(c));
  }
  return Status::Ok();
}

Status Router::AddScope(RouteScope scope) {
  for (const auto& s : scopes_) {
    if (s.prefix == scope.prefix) return InvalidArgument("scope '" + scope.prefix + "' is declared twice");
  }
  scopes_.push_back(std::move(scope));
  return Status::Ok();
}

Router::Found Router::Match(unsigned method_bits, std::string_view target) const {
  Found f;
  const TargetPath path = SplitTargetPath(target);
  static const std::vector<const Compiled*> kNone;
  for (const Compiled* c : path.size() < by_length_.size() ? by_length_[path.size()] : kNone) {
    if (!c->Fits(path)) continue;
    f.path_open = (f.allowed == 0 || f.path_open) && routes_[c->route].key == KeyPolicy::kNone;
    f.allowed |= c->methods;
    if (!(c->methods & method_bits)) continue;
    if (!f.route || c->MoreSpecificThan(*f.route)) f.route = c;
  }
  const std::string_view first = path.empty() ? std::string_view() : path[0];
  for (const auto& s : scopes_) {
    if (s.prefix == first || (s.prefix.empty() && !f.scope)) f.scope = &s;
  }
  if (f.route) {
    for (size_t i = 0; i < f.route->segments.size(); ++i) {
      if (f.route->segments[i].param) f.match.params_.emplace_back(f.route->segments[i].text, std::string(path[i]));
    }
  }
  return f;
}

KeyPolicy Router::KeyOf(const Route* route, const RouteScope* scope, bool path_open) {
  if (route) return route->key;
  // A method no route at an open path takes (TRACE /) is told so without a key: the path is open.
  if (path_open) return KeyPolicy::kNone;
  // No handler of a route reads a form's key here.
  if (!scope || scope->key == KeyPolicy::kUserOrForm) return KeyPolicy::kUser;
  return scope->key;
}

bool Router::Draining() const {
  return options_.draining != nullptr && options_.draining->load(std::memory_order_acquire);
}

bool Router::KeyInBody(const HttpRequest& head, KeyPolicy key, const RouteScope* scope) const {
  if (!options_.authorize || key != KeyPolicy::kUserOrForm || head.method != "POST") return false;
  return ::quern::PresentedKey(head.Header("authorization"), head.Header("x-api-key")).empty() &&
         (!scope || !scope->query_key || QueryKey(head.target).empty());
}

std::optional<HttpResponse> Router::Authorize(const HttpRequest& head, KeyPolicy key, const RouteScope* scope) const {
  if (!options_.authorize || key == KeyPolicy::kNone) return std::nullopt;
  Status st;
  KeyProblem problem = KeyProblem::kNotInHead;
  if (KeyInBody(head, key, scope)) {
    // Read from the form, unless the body would have to be inflated first
    // for a caller not known yet.
    const std::string_view encoding = head.Header("content-encoding");
    if (encoding.empty() || (encoding.size() == 8 && strncasecmp(encoding.data(), "identity", 8) == 0)) {
      return std::nullopt;
    }
    st = Unauthenticated("a compressed body must carry its api_key in a header or the query");
  } else {
    std::string presented(::quern::PresentedKey(head.Header("authorization"), head.Header("x-api-key")));
    if (presented.empty() && scope && scope->query_key) presented = QueryKey(head.target);
    st = options_.authorize(presented, key == KeyPolicy::kAdmin);
    if (st.ok()) return std::nullopt;
    problem = presented.empty() ? KeyProblem::kMissing : KeyProblem::kRefused;
  }
  return scope && scope->refuse ? scope->refuse(head, st, problem) : DefaultRefusal(st);
}

std::optional<HttpResponse> Router::Head(const HttpRequest& head) const {
  Found f = Match(MethodBit(head.method), head.target);
  const Route* route = f.route ? &routes_[f.route->route] : nullptr;
  if (Draining() && !(route && route->while_draining)) {
    return ErrorResponse(Unavailable("the server is shutting down"));
  }
  if (auto refused = Authorize(head, KeyOf(route, f.scope, f.path_open), f.scope)) return refused;
  // A key still to come in the body: admitted once it is known.
  if (!route || !route->head || KeyInBody(head, route->key, f.scope)) return std::nullopt;
  return route->head(head, f.match);
}

void Router::Dispatch(HttpRequest&& request, HttpDone done) const {
  Found f = Match(MethodBit(request.method), request.target);
  const Route* route = f.route ? &routes_[f.route->route] : nullptr;
  if (Draining() && !(route && route->while_draining)) {
    return done(ErrorResponse(Unavailable("the server is shutting down")));
  }
  if (!route) {
    const std::string allowed = AllowList(f.allowed);
    if (f.scope && f.scope->unmatched) return f.scope->unmatched(std::move(request), allowed, std::move(done));
    return DefaultUnmatched(request, allowed, done);
  }
  if (KeyInBody(request, route->key, f.scope)) f.match.authorize_ = &options_.authorize;
  route->handler(std::move(request), f.match, std::move(done));
}

std::string Router::ModelOf(std::string_view target) const {
  return Match(~0u, target).match.param("model");
}

std::string Router::PatternOf(std::string_view method, std::string_view target) const {
  const unsigned bit = MethodBit(method);
  if (bit == 0) return {};
  const Found f = Match(bit, target);
  return f.route ? routes_[f.route->route].pattern : std::string();
}

std::vector<Router::Entry> Router::Table() const {
  std::vector<Entry> out;
  out.reserve(routes_.size());
  for (const auto& r : routes_) out.push_back({r.methods, r.pattern, r.key});
  return out;
}

}  // namespace quern
