// Python models (config.pbtxt with backend: "python", <version>/model.py),
// served as Triton's Python backend serves them: every instance is a Python
// process of its own (so N instances use N cores, whatever the GIL), batches
// reach it through shared memory, and a model.py written for Triton runs
// unchanged (TritonPythonModel and triton_python_backend_utils, see
// triton_python_backend_utils.py), as does a plainer form: a module-level
// infer(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray] over the
// whole batch.
//
// Parameters (config.pbtxt):
//   quern.python                the interpreter or a virtual environment's
//                               folder (default: $QUERN_PYTHON, else
//                               /usr/bin/python3, else python3 from PATH)
//   quern.execute_timeout_ms    a batch running longer kills the process,
//                               which starts again (default 60000; 0 = none)
//   quern.initialize_timeout_ms loading model.py and initialize() (120000)
#pragma once

#include <memory>

#include "engine/backend.h"

namespace quern {

std::shared_ptr<Backend> NewPythonBackend();

}  // namespace quern
