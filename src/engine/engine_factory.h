// Engines with a given set of backends. The engine knows no backend of its
// own: Engine::Create (defined by the backends library, so a program that
// calls it links them) gives it the built-in ones; a test or an embedder may
// give others.
//
// Thread safety: Create may be called from any thread.
#pragma once

#include <functional>
#include <memory>

#include "engine/backend.h"
#include "quern/engine.h"

namespace quern {

class EngineFactory {
 public:
  // As Engine::Create, with the backends `install` registers (none when it
  // is empty).
  static Result<std::unique_ptr<Engine>> Create(EngineOptions options,
                                                const std::function<void(BackendRegistry&)>& install);
};

}  // namespace quern
