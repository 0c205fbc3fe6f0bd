// Image decoding and pre-processing for vision models: bytes (JPEG, PNG, BMP,
// WebP) → RGB pixels → a model input tensor, with the transform that maps the
// model's pixel coordinates back to the original image.
//
// Thread safety: every function here is pure (no shared state) and may run
// on any number of threads at once. Errors are InvalidArgument with a message
// that says what was wrong with the image; nothing here throws.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "quern/status.h"
#include "quern/tensor.h"

namespace quern {

enum class ImageFormat { kJpeg, kPng, kBmp, kWebp };
std::string_view ImageFormatName(ImageFormat f);

// 8-bit RGB, row-major, 3 bytes per pixel, no row padding.
struct Image {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> pixels;
};

struct ImageSpec;

struct DecodeOptions {
  // The model geometry the image is decoded for: a JPEG much larger than
  // that needs is shrunk while decoding (DCT-domain scaling by 1/2, 1/4,
  // 1/8 ...), never below the size the resize would produce. nullptr =
  // decode at full size.
  const ImageSpec* target = nullptr;
  // Images with more pixels than this are rejected before decoding.
  int64_t max_pixels = 50'000'000;
  // Apply the EXIF orientation of a JPEG (rotate/flip to the displayed form).
  bool apply_exif_orientation = true;
};

inline constexpr int64_t kPlausiblePixels = int64_t{1} << 20;

struct DecodedImage {
  Image image;  // displayed orientation; may be smaller than the source (DCT scaling)
  // The source image's size in its displayed orientation: results are
  // reported in these pixel coordinates.
  int source_width = 0;
  int source_height = 0;
  ImageFormat format = ImageFormat::kJpeg;
  int exif_orientation = 1;  // 1..8 as in EXIF; 1 = as stored
};

// Decodes `bytes` (format recognised from its signature; a CMYK JPEG
// converted to RGB). Fails with InvalidArgument for an unknown format, a
// GIF or an animated WebP (said so), a corrupt or truncated image, one over
// options.max_pixels, or one claiming more pixels than a file of its size
// can hold (beyond kPlausiblePixels, more pixels per byte than the format's
// compression can reach: a forged header is refused before its pixels'
// memory is taken).
Result<DecodedImage> DecodeImage(std::string_view bytes, const DecodeOptions& options = {});

// What an image's header says, read without decoding it (microseconds).
struct ImageHeader {
  ImageFormat format = ImageFormat::kJpeg;
  int64_t width = 0, height = 0;
  int bytes_per_sample = 1;  // 2 for a 16-bit PNG
  // The memory a full decode takes: pixels x 3 channels, and its 16-bit
  // rows' worth for a 16-bit PNG.
  int64_t decoded_bytes() const { return width * height * 3 * bytes_per_sample; }
};
// The header of `bytes`; nullopt when it cannot be read (the decode then
// fails, and says why).
std::optional<ImageHeader> ReadImageHeader(std::string_view bytes);

// The EXIF orientation (1..8) of a JPEG, 1 when there is none or it cannot
// be read. Reads only the markers before the image data.
int JpegExifOrientation(std::string_view jpeg);

// Rotates/flips `image` from its stored form to the displayed form for the
// given EXIF orientation.
Image ApplyOrientation(const Image& image, int orientation);

// ---------------------------------------------------------------- pre-processing

enum class ResizeMode {
  kStretch,     // scale each axis to the model's size (aspect ratio not kept)
  kLetterbox,   // keep the aspect ratio, centre, pad the rest with pad_value
  kCenterCrop,  // scale the shortest side to resize_shortest, crop the centre
};
enum class ChannelOrder { kRgb, kBgr };
enum class TensorLayout { kNchw, kNhwc };

// How one model wants its images.
struct ImageSpec {
  int width = 0;  // the model input's width and height in pixels
  int height = 0;
  ResizeMode resize = ResizeMode::kStretch;
  uint8_t pad_value = 114;  // letterbox padding, per channel
  // kCenterCrop: the shortest side is scaled to this before the crop; 0 =
  // just enough to cover the model's size.
  int resize_shortest = 0;
  ChannelOrder channels = ChannelOrder::kRgb;
  TensorLayout layout = TensorLayout::kNchw;
  DataType dtype = DataType::kFp32;  // kFp32, kFp16 or kUint8
  // Float inputs: value = (pixel * scale - mean[c]) / std[c], c in the
  // model's channel order. Ignored for kUint8 (raw pixel values).
  float scale = 1.0f / 255.0f;
  std::array<float, 3> mean{0.0f, 0.0f, 0.0f};
  std::array<float, 3> std{1.0f, 1.0f, 1.0f};
};

// Maps the model input's pixel coordinates to the source image's:
// source_x = (model_x - offset_x) / scale_x (likewise y).
struct ImageTransform {
  double scale_x = 1.0;
  double scale_y = 1.0;
  double offset_x = 0.0;
  double offset_y = 0.0;
  int source_width = 0;
  int source_height = 0;

  double ToSourceX(double model_x) const { return (model_x - offset_x) / scale_x; }
  double ToSourceY(double model_y) const { return (model_y - offset_y) / scale_y; }
};

// The transform `spec` applies to a source image of the given size.
ImageTransform ComputeTransform(int source_width, int source_height, const ImageSpec& spec);

// Bytes of one pre-processed image (3 x height x width elements of dtype).
size_t PreprocessedBytes(const ImageSpec& spec);

// Resizes (bilinear), pads or crops, reorders channels, normalises and
// writes one image into `out` (PreprocessedBytes(spec) bytes, in the spec's
// layout and dtype). Returns the transform for mapping results back.
ImageTransform Preprocess(const DecodedImage& decoded, const ImageSpec& spec, void* out);

// The square around a box (x_min, y_min, x_max, y_max in the source image's
// pixels): its longer side, centred on the box, moved inside the image and
// no larger than the image's shorter side, cut out of `decoded` (which may
// be smaller than the source) as an image of its own. A face descriptor
// reads faces this way.
DecodedImage CropSquare(const DecodedImage& decoded, float x_min, float y_min, float x_max, float y_max);

}  // namespace quern
