#include "backends/plugin_loader.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

namespace quern {

Result<LoadedPlugin> LoadPlugin(const PluginLocation& where) {
  std::vector<std::string> candidates;
  if (const char* env = where.env ? std::getenv(where.env) : nullptr; env && *env) {
    candidates.emplace_back(env);  // that one only
  } else if (where.build_path) {
    // Installed: beside the binary's or the library's own folder. For the
    // main program dladdr names argv[0] ("quern" when run from PATH): its
    // file is /proc/self/exe.
    Dl_info self{};
    char real[PATH_MAX];
    const char* object = nullptr;
    if (::dladdr(reinterpret_cast<void*>(&LoadPlugin), &self) && self.dli_fname) {
      object = std::strcmp(self.dli_fname, program_invocation_name) == 0 || !std::strchr(self.dli_fname, '/')
                   ? "/proc/self/exe"
                   : self.dli_fname;
    }
    if (object && ::realpath(object, real)) {
      const std::filesystem::path dir = std::filesystem::path(real).parent_path();
      for (const char* rel : {where.from_bin, where.from_lib}) {
        if (!rel) continue;
        std::error_code ec;
        const auto p = (dir / rel).lexically_normal();
        if (std::filesystem::is_regular_file(p, ec)) candidates.push_back(p.string());
      }
    }
    candidates.emplace_back(where.build_path);
  }
  if (candidates.empty()) return Err(Unavailable(where.missing));
  std::string tried;
  for (const auto& path : candidates) {
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const char* why = ::dlerror();
      tried += (tried.empty() ? "" : "; ") + path + ": " + (why ? why : "cannot load");
      continue;
    }
    void* symbol = ::dlsym(handle, where.symbol);
    if (!symbol) {
      tried += (tried.empty() ? "" : "; ") + path + ": not a " + where.what;
      ::dlclose(handle);
      continue;
    }
    if (where.accept && !where.accept(symbol)) {
      tried += (tried.empty() ? "" : "; ") + path + ": not a " + where.what + " of this version of Quern";
      ::dlclose(handle);  // with the libraries it brought, which the next candidate must not bind to
      continue;
    }
    return LoadedPlugin{symbol, path};
  }
  return Err(Unavailable(std::string("cannot load Quern's ") + where.what + " (" + tried + ")"));
}

}  // namespace quern
