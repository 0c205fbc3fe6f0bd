// Linked into every GoogleTest binary of the sanitizer build: what
// tests/CMakeLists.txt gives the black-box tests through their environment.
// A test whose engine measures an unconfigured ONNX model (backend "auto")
// loads OpenVINO, whose TBB opens its NUMA binding with RTLD_DEEPBIND unless
// told it runs beside the sanitizers; and OpenVINO's and TBB's own objects
// left at exit are not Quern's leaks (tests/openvino_lsan.supp).
#include <cstdlib>

namespace {
[[maybe_unused]] const int kTbbBesideSanitizers = setenv("TBB_ENABLE_SANITIZERS", "1", 0);
}  // namespace

extern "C" const char* __lsan_default_suppressions() {
  return "leak:libopenvino.so\nleak:libtbb.so\n";
}
