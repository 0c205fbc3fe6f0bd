// What a face registration costs a gallery kept in a file, and whether
// recognitions wait for it: a gallery of U users x F faces of D values is
// written, then R registrations of one face each are timed (bytes the file
// grew by, or was rewritten with, and wall time each), while another thread
// asks for the faces (FaceGallery::Current, what every recognition does
// first) in a loop and records its slowest answer.
//   build/release/bench/face_gallery_bench --dir /tmp [--users 1000 --faces 16 --dim 1024 --registrations 10]
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>

#include "pipeline/face_gallery.h"

namespace {

// Bytes written to storage by this process so far (/proc/self/io).
long long WrittenBytes() {
  FILE* f = std::fopen("/proc/self/io", "r");
  if (!f) return -1;
  char key[64];
  long long value = 0, written = -1;
  while (std::fscanf(f, "%63s %lld", key, &value) == 2) {
    if (std::string(key) == "write_bytes:") written = value;
  }
  std::fclose(f);
  return written;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"face gallery registration cost"};
  std::string dir = "/tmp";
  size_t users = 1000, faces = 16, dim = 1024, registrations = 10;
  app.add_option("--dir", dir);
  app.add_option("--users", users);
  app.add_option("--faces", faces);
  app.add_option("--dim", dim);
  app.add_option("--registrations", registrations);
  CLI11_PARSE(app, argc, argv);
  const auto file = std::filesystem::path(dir) / "face_gallery_bench.bin";
  std::filesystem::remove(file);
  quern::FaceGalleryOptions options;
  options.max_faces_per_user = faces;
  options.max_users = users + 1;
  auto opened = quern::FaceGallery::Open(options, quern::FileFaceStore(file));
  if (!opened) {
    std::fprintf(stderr, "%s\n", opened.error().ToString().c_str());
    return 1;
  }
  auto& g = *opened;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto face = [&] {
    std::vector<float> v(dim);
    for (auto& x : v) x = normal(rng);
    return v;
  };
  for (size_t u = 0; u < users; ++u) {
    quern::Faces mine;
    for (size_t f = 0; f < faces; ++f) mine.push_back(face());
    if (auto st = g->Register("user" + std::to_string(u), mine); !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
  }
  std::printf("gallery: %zu users x %zu faces x %zu values, file %.1f MB\n", users, faces, dim,
              std::filesystem::file_size(file) / 1e6);
  std::atomic<bool> done{false};
  std::atomic<long long> slowest_us{0}, looks{0};
  std::thread reader([&] {
    while (!done) {
      const auto t0 = std::chrono::steady_clock::now();
      auto set = g->Current();
      const long long us =
          std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
      slowest_us = std::max<long long>(slowest_us, us);
      ++looks;
    }
  });
  const long long before = WrittenBytes();
  const auto t0 = std::chrono::steady_clock::now();
  double slowest_ms = 0;
  for (size_t r = 0; r < registrations; ++r) {
    const auto s = std::chrono::steady_clock::now();
    if (auto st = g->Register("user" + std::to_string(r * 37 % users), {face()}); !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
    slowest_ms =
        std::max(slowest_ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s).count());
  }
  const double total_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const long long written = WrittenBytes() - before;
  done = true;
  reader.join();
  std::printf(
      "%zu registrations: %.1f ms (slowest %.1f ms), %.2f MB written to storage (%.1f KB each); "
      "%lld looks at the faces meanwhile, slowest %.2f ms\n",
      registrations, total_ms, slowest_ms, written / 1e6, written / 1e3 / registrations, looks.load(),
      slowest_us / 1e3);
  std::filesystem::remove(file);
  return 0;
}
