// Finding and loading a backend's plugin (a shared library loaded with
// dlopen when the first model that needs it loads: LibTorch's, OpenVINO's),
// so that a runtime's libraries stay out of every process that serves none
// of its models.
//
// Where it looks, in order: the file `env` names when that variable is set
// (that one only); beside the running program or library (`from_bin`,
// `from_lib`: paths relative to the folder of the quern binary or of
// libquern, for an installation); then `build_path`, the build tree's.
// Thread safety: a free function; callers load once (std::call_once).
#pragma once

#include <functional>
#include <string>

#include "quern/status.h"

namespace quern {

struct PluginLocation {
  const char* env = nullptr;       // e.g. "QUERN_PYTORCH_PLUGIN"
  const char* from_bin = nullptr;  // null when this build has no plugin
  const char* from_lib = nullptr;
  const char* build_path = nullptr;
  const char* symbol = nullptr;   // the plugin's one exported function
  const char* what = nullptr;     // "LibTorch plugin", in messages
  const char* missing = nullptr;  // why this build has none, for the error
  // Whether the symbol found is of this version of Quern (its ABI): a file
  // that is not is passed over for the next candidate.
  std::function<bool(void* symbol)> accept;
};

// The plugin's exported `symbol` (dlsym's answer) from the first candidate
// that loads and exports it, with the path it came from; or an UNAVAILABLE
// error naming every candidate tried and why it failed.
struct LoadedPlugin {
  void* symbol = nullptr;
  std::string path;
};
Result<LoadedPlugin> LoadPlugin(const PluginLocation& where);

}  // namespace quern
