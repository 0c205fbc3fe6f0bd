// image_bench: time of decoding and pre-processing one image on one core,
// the work the vision pipeline does before inference.
//
//   image_bench [--iterations N] [--model-size 640] [--out-dir DIR]
//
// For 640x480, 1920x1080 and 3840x2160 JPEGs (quality 90, 4:2:0, generated
// here: smooth gradients, shapes and noise, so the entropy coder has real
// work), it reports the median over N runs of: decoding as the pipeline does
// it for a model-size x model-size letterboxed FP32 NCHW input (TurboJPEG
// with DCT-domain scaling), the resize + normalisation into the tensor, and,
// for comparison, a full-size decode. --out-dir also writes the JPEGs there
// (the end-to-end benchmark posts them).
//
// Then the post-processing of one image's detector output, median of N: a
// YOLOv5 export's [1, 25200, 85] (probabilities; 60 boxes of objectness >=
// 0.3 in 6 clusters, the rest under 0.05) and a YOLOv8 export's [1, 84,
// 8400] (60 boxes with a class score >= 0.3), decoded at min_confidence 0.4
// with NMS.
#include <turbojpeg.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "image/image.h"
#include "pipeline/postprocess.h"

namespace {

using SteadyClock = std::chrono::steady_clock;

// A synthetic photo-like RGB image: gradients, circles and noise.
std::vector<uint8_t> Scene(int w, int h, int noise_amplitude) {
  std::vector<uint8_t> px(static_cast<size_t>(w) * static_cast<size_t>(h) * 3);
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> noise(-noise_amplitude, noise_amplitude);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      const double u = static_cast<double>(x) / w, v = static_cast<double>(y) / h;
      double r = 255 * u, g = 255 * v, b = 128 + 100 * std::sin(12 * u + 7 * v);
      for (int k = 0; k < 6; ++k) {  // six discs
        const double cx = 0.15 + 0.14 * k, cy = 0.3 + 0.4 * ((k % 3) / 2.0), rad = 0.05 + 0.02 * k;
        if ((u - cx) * (u - cx) * w * w + (v - cy) * (v - cy) * h * h < rad * rad * w * h) {
          r = 40 * k;
          g = 255 - 40 * k;
          b = 90;
        }
      }
      uint8_t* p = &px[(static_cast<size_t>(y) * static_cast<size_t>(w) + static_cast<size_t>(x)) * 3];
      p[0] = static_cast<uint8_t>(std::clamp(r + noise(rng), 0.0, 255.0));
      p[1] = static_cast<uint8_t>(std::clamp(g + noise(rng), 0.0, 255.0));
      p[2] = static_cast<uint8_t>(std::clamp(b + noise(rng), 0.0, 255.0));
    }
  }
  return px;
}

std::string EncodeJpeg(const std::vector<uint8_t>& px, int w, int h) {
  tjhandle tj = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  if (tjCompress2(tj, px.data(), w, 0, h, TJPF_RGB, &buf, &size, TJSAMP_420, 90, 0) != 0) {
    std::fprintf(stderr, "JPEG encoding failed: %s\n", tjGetErrorStr2(tj));
    std::exit(1);
  }
  std::string out(reinterpret_cast<const char*>(buf), size);
  tjFree(buf);
  tjDestroy(tj);
  return out;
}

template <typename F>
double MedianMs(int iterations, F&& f) {
  std::vector<double> ms;
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = SteadyClock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Decode and pre-process time per image, one core"};
  int iterations = 30, model_size = 640;
  std::string out_dir;
  app.add_option("--iterations", iterations, "runs per measurement (median reported)");
  app.add_option("--model-size", model_size, "the model input's width and height");
  app.add_option("--out-dir", out_dir, "write the generated JPEGs here");
  CLI11_PARSE(app, argc, argv);

  quern::ImageSpec spec;
  spec.width = spec.height = model_size;
  spec.resize = quern::ResizeMode::kLetterbox;
  std::vector<char> tensor(quern::PreprocessedBytes(spec));

  std::printf("%-10s %-8s %9s %12s %10s %10s %10s %16s\n", "image", "content", "bytes", "decoded at", "decode ms",
              "resize ms", "total ms", "full decode ms");
  const std::pair<int, int> sizes[] = {{640, 480}, {1920, 1080}, {3840, 2160}};
  // Pixel noise of +-3 (a clean camera frame) and +-12 (a grainy one): the
  // entropy decoder's work grows with the detail a JPEG holds.
  for (const auto& [w, h] : sizes) {
    for (const int noise : {3, 12}) {
      const std::vector<uint8_t> px = Scene(w, h, noise);
      const std::string jpeg = EncodeJpeg(px, w, h);
      if (!out_dir.empty() && noise == 3) {
        std::ofstream(out_dir + "/" + std::to_string(w) + "x" + std::to_string(h) + ".jpg", std::ios::binary) << jpeg;
      }
      quern::DecodeOptions scaled;
      scaled.target = &spec;
      auto d = quern::DecodeImage(jpeg, scaled);
      if (!d) {
        std::fprintf(stderr, "decode failed: %s\n", d.error().message().c_str());
        return 1;
      }
      const double decode_ms = MedianMs(iterations, [&] { (void)quern::DecodeImage(jpeg, scaled); });
      const double resize_ms = MedianMs(iterations, [&] { quern::Preprocess(*d, spec, tensor.data()); });
      const double full_ms = MedianMs(iterations, [&] { (void)quern::DecodeImage(jpeg, {}); });
      std::printf("%4dx%-5d %-8s %9zu %5dx%-6d %10.2f %10.2f %10.2f %16.2f\n", w, h, noise == 3 ? "clean" : "grainy",
                  jpeg.size(), d->image.width, d->image.height, decode_ms, resize_ms, decode_ms + resize_ms, full_ms);
    }
  }

  // ---- post-processing
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  auto detector_output = [&](bool v5) {
    const int64_t boxes = v5 ? 25200 : 8400, classes = 80;
    const int64_t row = 4 + (v5 ? 1 : 0) + classes;
    std::vector<float> v(static_cast<size_t>(boxes * row));
    auto at = [&](int64_t i, int64_t j) -> float& {
      return v5 ? v[static_cast<size_t>(i * row + j)] : v[static_cast<size_t>(j * boxes + i)];
    };
    for (int64_t i = 0; i < boxes; ++i) {
      const bool object = i % (boxes / 60) == 0;  // 60 boxes, in 6 clusters of 10
      const float cx = 100.0f + 80.0f * static_cast<float>((i / (boxes / 6)) % 6), cy = 320.0f;
      at(i, 0) = object ? cx + 8 * u01(rng) : 640 * u01(rng);
      at(i, 1) = object ? cy + 8 * u01(rng) : 640 * u01(rng);
      at(i, 2) = object ? 60 + 10 * u01(rng) : 5 + 100 * u01(rng);
      at(i, 3) = object ? 60 + 10 * u01(rng) : 5 + 100 * u01(rng);
      const int64_t first = v5 ? 5 : 4;
      if (v5) at(i, 4) = object ? 0.3f + 0.65f * u01(rng) : 0.05f * u01(rng);
      for (int64_t c = 0; c < classes; ++c) at(i, first + c) = (v5 ? 1.0f : 0.05f) * u01(rng);
      if (object) at(i, first + (i % classes)) = 0.3f + 0.7f * u01(rng);
    }
    std::vector<quern::NamedTensor> out;
    out.push_back({"output0", quern::Tensor::From<float>(quern::DataType::kFp32,
                                                         v5 ? quern::Shape{1, boxes, row} : quern::Shape{1, row, boxes},
                                                         std::span<const float>(v))});
    return out;
  };
  std::printf("\n%-34s %10s %10s\n", "post-processing (min_confidence 0.4)", "ms", "boxes");
  for (const bool v5 : {true, false}) {
    const auto out = detector_output(v5);
    quern::DetectionSpec spec_d;
    spec_d.format = v5 ? quern::DetectionFormat::kYoloV5 : quern::DetectionFormat::kYoloV8;
    size_t kept = 0;
    const double ms =
        MedianMs(iterations, [&] { kept = quern::DecodeDetections(out, spec_d, 0.4f, 640, 640)->size(); });
    std::printf("%-34s %10.3f %10zu\n", v5 ? "YOLOv5 [1, 25200, 85]" : "YOLOv8 [1, 84, 8400]", ms, kept);
  }
  return 0;
}
