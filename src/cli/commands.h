// The `quern` subcommands besides serve.
#pragma once

#include <string>
#include <vector>

namespace quern::cli {

// Lists a repository's models, their tensors and load errors; 3 when a
// model did not load.
int Models(const std::string& repo);

// Runs one request: each spec is NAME=FILE.npy, NAME=zeros or NAME=random
// (a batch of 1), and prints the outputs and the request's timings.
int Infer(const std::string& repo, const std::string& model, const std::vector<std::string>& specs);

// `quern openvino-ir MODEL_FILE OUT.xml [--f16]`: writes an ONNX (or IR)
// model as OpenVINO IR (OUT.xml and OUT.bin) for a model folder of backend
// "openvino"; 1 with the reason when it cannot.
int OpenvinoIr(const std::string& model_file, const std::string& xml_file, bool f16);

// `quern tune MODEL_DIR`: loads the model folder's newest version with
// backend "auto" (whatever its configuration names), which measures the
// runtimes this machine offers on it and logs the table and its choice; 1
// when the model does not load.
int Tune(const std::string& model_dir);

// `quern perf ARGS`: runs quern-perf (the load generator, a binary of its
// own beside this one) with ARGS; returns only when it cannot (127, saying
// why).
int RunPerfTool(int argc, char** argv);

// `quern quantize ARGS`: runs quern-quantize (scripts/quantize.py, installed
// beside this binary) with ARGS, with $QUERN_PYTHON when set, else with the
// python3 on PATH; returns only when it cannot (127, saying why).
int RunQuantizeTool(int argc, char** argv);

}  // namespace quern::cli
