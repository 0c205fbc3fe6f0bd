// quern: the command-line entry point.
//   quern serve  --model-repository DIR [--config FILE]   load a repository and serve it
//   quern models DIR                      list models, their tensors and load errors
//   quern infer  DIR MODEL --input NAME=FILE.npy|zeros|random   run one request
//   quern perf   --url http://HOST:PORT|grpc://HOST:PORT --model MODEL [--concurrency N... | --rate R...]
//                                         load a running server, report its throughput and costs
//   quern openvino-ir MODEL.onnx OUT.xml [--f16]   the model as OpenVINO IR
//   quern tune MODEL_DIR                  the runtimes measured on a model, and backend "auto"'s choice
//   quern quantize MODEL_DIR --calibration IMAGES... [--check IMAGES...]
//                                         an INT8 twin of an image model and its agreement report
#include <pthread.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/memory.h"
#include "quern/engine.h"
#include "server/serve_flags.h"
#include "server/server.h"

int main(int argc, char** argv) {
  if (argc >= 2 && std::string_view(argv[1]) == "perf") return quern::cli::RunPerfTool(argc, argv);
  if (argc >= 2 && std::string_view(argv[1]) == "quantize") return quern::cli::RunQuantizeTool(argc, argv);
  CLI::App app{"quern: a fast model server (ONNX, TorchScript and Python models)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("quern ") + quern::Version());

  quern::ServerOptions options;
  auto* serve = app.add_subcommand("serve", "Load a model repository and serve it");
  quern::AddServeFlags(serve, options);

  std::string models_repo;
  auto* models = app.add_subcommand("models", "List a repository's models, their tensors and load errors");
  models->add_option("repository", models_repo, "Model repository")->required();

  std::string infer_repo, infer_model;
  std::vector<std::string> inputs;
  auto* infer = app.add_subcommand("infer", "Run one request and print the outputs");
  infer->add_option("repository", infer_repo, "Model repository")->required();
  infer->add_option("model", infer_model, "Model name")->required();
  infer->add_option("--input,-i", inputs, "NAME=FILE.npy, NAME=zeros or NAME=random (batch of 1)");

  std::string tune_dir;
  auto* tune = app.add_subcommand("tune",
                                  "Measure the runtimes this machine offers on an ONNX model folder and say which "
                                  "backend \"auto\" would choose");
  tune->add_option("model_dir", tune_dir, "The model's folder (config.pbtxt, <version>/model.onnx)")->required();

  std::string ir_in, ir_out;
  bool ir_f16 = false;
  auto* openvino_ir = app.add_subcommand(
      "openvino-ir", "Write an ONNX model as OpenVINO IR (model.xml and model.bin) for backend \"openvino\"");
  openvino_ir->add_option("model", ir_in, "The ONNX file (or an IR .xml)")->required();
  openvino_ir->add_option("xml", ir_out, "The .xml to write (its .bin beside it)")->required();
  openvino_ir->add_flag("--f16", ir_f16, "Store the weights as f16 (half the file)");

  // `quern perf ...` runs quern-perf, the load generator beside this binary
  // (the server does not carry it); listed here for --help.
  app.add_subcommand("perf",
                     "Load a running server with KServe v2 infer requests (runs quern-perf; see quern "
                     "perf --help)")
      ->prefix_command();
  app.add_subcommand("quantize",
                     "Write an INT8 twin of an ONNX image model, calibrated on your images, with a report of "
                     "its agreement with the FP32 model (runs quern-quantize, Python; see quern quantize --help)")
      ->prefix_command();

  // A configuration file's settings go in before the command line's own,
  // which override them.
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && args[0] == "serve") {
    const std::vector<std::string> given(args.begin() + 1, args.end());
    if (const std::string file = quern::ConfigFileArgument(given); !file.empty()) {
      auto from_file = quern::ConfigFileArguments(*serve, file, given);
      if (!from_file) {
        std::fprintf(stderr, "quern: %s\n", from_file.error().message().c_str());
        return 2;
      }
      args.insert(args.begin() + 1, from_file->begin(), from_file->end());
    }
  }
  std::reverse(args.begin(), args.end());  // CLI11 takes them last first
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  if (*models) return quern::cli::Models(models_repo);
  if (*infer) return quern::cli::Infer(infer_repo, infer_model, inputs);
  if (*openvino_ir) return quern::cli::OpenvinoIr(ir_in, ir_out, ir_f16);
  if (*tune) return quern::cli::Tune(tune_dir);

  // The C library's heaps limited before any thread starts (core/memory.h).
  quern::LimitMallocArenas();
  // SIGINT and SIGTERM are blocked before the server starts (its threads
  // inherit the mask) and waited for here: one that comes right after the
  // server says it serves drains it rather than killing it, and an idle
  // server's main thread sleeps until then instead of polling a flag.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  auto server = quern::Server::Start(std::move(options));
  if (!server) {
    std::fprintf(stderr, "quern: %s\n", server.error().ToString().c_str());
    return server.error().code() == quern::StatusCode::kInvalidArgument ? 2 : 1;
  }
  int signal = 0;
  while (sigwait(&stop_signals, &signal) != 0) {
  }
  (*server)->Shutdown();
  return 0;
}
