// `quern serve`'s settings as command-line flags and as a configuration
// file. The file is TOML and its keys are the flags' names without the
// leading dashes:
//
//   model-repository = "/srv/models"
//   http-port = 8000
//   max-queue-wait-ms = 2000
//   consume-models = ["detector", "classifier"]
//   allow-links-outside-repository = true
//
// `quern serve --config FILE [flags]`: flags given on the command line
// override the file. An unknown key, or a value of the wrong kind, is an
// error naming the file, the line and the key.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "quern/status.h"
#include "server/server.h"

namespace quern {

// Adds every setting of ServerOptions to `serve` as a flag bound to `o`,
// and --config.
void AddServeFlags(CLI::App* serve, ServerOptions& o);

// The value of --config in `args` (the arguments after "serve"), or "".
std::string ConfigFileArgument(const std::vector<std::string>& args);

// Reads `path` and returns the arguments it stands for ("--key", "value"...)
// for the flags of `serve` that `given` (the command line's own arguments
// after "serve") does not set. INVALID_ARGUMENT "FILE:LINE: ..." for a file
// that does not parse, an unknown key or a value of the wrong kind.
Result<std::vector<std::string>> ConfigFileArguments(const CLI::App& serve, const std::string& path,
                                                     const std::vector<std::string>& given);

}  // namespace quern
