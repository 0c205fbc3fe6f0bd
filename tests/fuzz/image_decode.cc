// Fuzz target: image decoding (DecodeImage for JPEG, PNG, BMP, WebP, with
// DCT scaling and EXIF orientation), then pre-processing into a small model
// input, as the vision routes do with an uploaded image.
//
// Built five times: image_decode recognises the format from the signature;
// image_decode_{jpeg,png,bmp,webp} (QUERN_FUZZ_FORMAT) write their format's
// signature over the first bytes, so each decoder gets the whole budget.
// The input's last byte (part of the image too) also chooses the decode
// options and the model geometry. After every input a small valid JPEG must
// still decode on the same thread: no input may leave a decoder's state
// spoiled for the images after it.
#include <turbojpeg.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "image/image.h"

#ifndef QUERN_FUZZ_FORMAT
#define QUERN_FUZZ_FORMAT 0  // 0 any, 1 JPEG, 2 PNG, 3 BMP, 4 WebP
#endif

namespace {

// Images beyond this are refused before decoding. The server's limit is
// larger, but no decoder path depends on the size past the check that
// refuses it, and a smaller bound keeps a decode well under a millisecond
// under the sanitizers (a 1 Mpixel bound held the BMP target to ~1,000
// executions per second, mostly spent filling pixels).
constexpr int64_t kMaxPixels = int64_t{1} << 16;

void ForceSignature(std::string& bytes) {
  auto put = [&](size_t at, const char* sig, size_t n) {
    if (bytes.size() < at + n) bytes.resize(at + n, '\0');
    std::memcpy(bytes.data() + at, sig, n);
  };
  switch (QUERN_FUZZ_FORMAT) {
    case 1: put(0, "\xFF\xD8\xFF", 3); break;
    case 2: put(0, "\x89PNG\r\n\x1a\n", 8); break;
    case 3: put(0, "BM", 2); break;
    case 4:
      put(0, "RIFF", 4);
      put(8, "WEBP", 4);
      break;
    default: break;
  }
}

// An 8x8 JPEG made by libjpeg-turbo's encoder.
const std::string& ValidJpeg() {
  static const std::string jpeg = [] {
    unsigned char rgb[8 * 8 * 3];
    for (size_t i = 0; i < sizeof(rgb); ++i) rgb[i] = static_cast<unsigned char>(i * 37);
    tjhandle tj = tjInitCompress();
    unsigned char* out = nullptr;
    unsigned long n = 0;
    if (tjCompress2(tj, rgb, 8, 0, 8, TJPF_RGB, &out, &n, TJSAMP_444, 90, 0) != 0) quern::fuzz::Fail("tjCompress2");
    std::string s(reinterpret_cast<char*>(out), n);
    tjFree(out);
    tjDestroy(tj);
    return s;
  }();
  return jpeg;
}

void CheckOne(const uint8_t* data, size_t size);

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  CheckOne(data, size);
  auto valid = quern::DecodeImage(ValidJpeg());
  if (!valid || valid->image.width != 8 || valid->image.height != 8) {
    quern::fuzz::Fail("a valid JPEG no longer decodes after this input",
                      valid ? std::string("wrong size") : valid.error().message());
  }
  return 0;
}

namespace {

void CheckOne(const uint8_t* data, size_t size) {
  if (size < 1) return;
  std::string bytes(quern::fuzz::AsView(data, size));
  ForceSignature(bytes);
  const uint8_t b = data[size - 1];

  quern::ImageSpec spec;
  spec.width = 9 + (b & 7) * 3;
  spec.height = 7 + ((b >> 3) & 7) * 2;
  spec.resize = static_cast<quern::ResizeMode>((b >> 1) % 3);
  spec.resize_shortest = (b & 0x40) ? spec.width + 3 : 0;
  spec.channels = (b & 0x80) ? quern::ChannelOrder::kBgr : quern::ChannelOrder::kRgb;
  spec.layout = (b & 0x20) ? quern::TensorLayout::kNhwc : quern::TensorLayout::kNchw;
  static constexpr quern::DataType kTypes[] = {quern::DataType::kFp32, quern::DataType::kFp16, quern::DataType::kUint8,
                                               quern::DataType::kFp32};
  spec.dtype = kTypes[(b >> 4) & 3];

  quern::DecodeOptions options;
  options.target = (b & 1) ? &spec : nullptr;
  options.max_pixels = kMaxPixels;
  options.apply_exif_orientation = (b & 2) != 0;

  const int orientation = quern::JpegExifOrientation(bytes);
  if (orientation < 1 || orientation > 8)
    quern::fuzz::Fail("EXIF orientation out of 1..8", std::to_string(orientation));

  // The header admission reads before decoding: it agrees with the decode.
  const std::optional<quern::ImageHeader> header = quern::ReadImageHeader(bytes);
  auto decoded = quern::DecodeImage(bytes, options);
  if (!decoded) return;
  if (header && decoded->exif_orientation < 5 &&
      (header->width != decoded->source_width || header->height != decoded->source_height)) {
    quern::fuzz::Fail("the header read before decoding disagrees with the decode's size");
  }
  const quern::Image& img = decoded->image;
  if (img.width <= 0 || img.height <= 0 || decoded->source_width <= 0 || decoded->source_height <= 0) {
    quern::fuzz::Fail("decoded an image with no pixels");
  }
  if (img.pixels.size() != static_cast<size_t>(img.width) * static_cast<size_t>(img.height) * 3) {
    quern::fuzz::Fail("decoded pixels do not match width x height x 3");
  }
  if (static_cast<int64_t>(img.width) * img.height > kMaxPixels) quern::fuzz::Fail("decoded past max_pixels");

  std::vector<uint8_t> out(quern::PreprocessedBytes(spec));
  const quern::ImageTransform tf = quern::Preprocess(*decoded, spec, out.data());
  (void)tf.ToSourceX(0);
  (void)quern::ComputeTransform(decoded->source_width, decoded->source_height, spec);

  // Every orientation of a small image (a large one costs too much per input).
  if (static_cast<int64_t>(img.width) * img.height <= 4096) {
    for (int o = 1; o <= 8; ++o) {
      const quern::Image r = quern::ApplyOrientation(img, o);
      if (r.pixels.size() != img.pixels.size()) quern::fuzz::Fail("ApplyOrientation changed the pixel count");
    }
  }
}

}  // namespace
