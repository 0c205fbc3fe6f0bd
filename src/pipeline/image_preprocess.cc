// Pre-processing: one bilinear resampling pass from the decoded RGB image
// into the model's geometry (stretch / letterbox / centre crop), then a
// per-channel lookup table turns each 8-bit value into the model's dtype
// with scale, mean and std applied.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "pipeline/image.h"

namespace quern {
namespace {

// IEEE 754 binary16 from binary32, rounding to nearest even.
uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t exp = static_cast<int32_t>((x >> 23) & 0xFF) - 127 + 15;
  uint32_t mant = x & 0x7FFFFFu;
  if (((x >> 23) & 0xFF) == 0xFF) return static_cast<uint16_t>(sign | 0x7C00u | (mant ? 0x200u : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7C00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    const uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1))) ++half;  // may carry into the exponent: still correct
  return static_cast<uint16_t>(sign | half);
}

// Sampling positions along one axis: for each output index, whether it
// falls on the image and, if so, the two source indices and the weight of
// the second (0..256).
struct Axis {
  std::vector<uint8_t> valid;
  std::vector<int> i0, i1;
  std::vector<int> w1;
};

Axis MakeAxis(int out_size, double offset, double scale, int source_size, int decoded_size) {
  Axis a;
  a.valid.resize(static_cast<size_t>(out_size));
  a.i0.resize(static_cast<size_t>(out_size));
  a.i1.resize(static_cast<size_t>(out_size));
  a.w1.resize(static_cast<size_t>(out_size));
  const double to_decoded = static_cast<double>(decoded_size) / source_size;
  for (int o = 0; o < out_size; ++o) {
    const double s = (o + 0.5 - offset) / scale;  // position in the source image (pixel edges at integers)
    const auto k = static_cast<size_t>(o);
    a.valid[k] = s >= 0.0 && s < source_size;
    double d = s * to_decoded - 0.5;
    d = std::clamp(d, 0.0, static_cast<double>(decoded_size - 1));
    const int i0 = static_cast<int>(d);
    a.i0[k] = i0;
    a.i1[k] = std::min(i0 + 1, decoded_size - 1);
    a.w1[k] = static_cast<int>(std::lround((d - i0) * 256.0));
  }
  return a;
}

}  // namespace

ImageTransform ComputeTransform(int source_width, int source_height, const ImageSpec& spec) {
  ImageTransform t;
  t.source_width = source_width;
  t.source_height = source_height;
  const double sw = source_width, sh = source_height, W = spec.width, H = spec.height;
  switch (spec.resize) {
    case ResizeMode::kStretch:
      t.scale_x = W / sw;
      t.scale_y = H / sh;
      break;
    case ResizeMode::kLetterbox: {
      const double s = std::min(W / sw, H / sh);
      t.scale_x = t.scale_y = s;
      t.offset_x = std::floor((W - std::round(sw * s)) / 2.0 + 1e-9);
      t.offset_y = std::floor((H - std::round(sh * s)) / 2.0 + 1e-9);
      break;
    }
    case ResizeMode::kCenterCrop: {
      const double s = spec.resize_shortest > 0 ? spec.resize_shortest / std::min(sw, sh) : std::max(W / sw, H / sh);
      t.scale_x = t.scale_y = s;
      // (+ 1e-9: 96 * (64 / 96) may come out a hair under 64.)
      t.offset_x = -std::floor((sw * s - W) / 2.0 + 1e-9);
      t.offset_y = -std::floor((sh * s - H) / 2.0 + 1e-9);
      break;
    }
  }
  return t;
}

size_t PreprocessedBytes(const ImageSpec& spec) {
  return static_cast<size_t>(spec.width) * static_cast<size_t>(spec.height) * 3 * DataTypeByteSize(spec.dtype);
}

ImageTransform Preprocess(const DecodedImage& decoded, const ImageSpec& spec, void* out) {
  const ImageTransform t = ComputeTransform(decoded.source_width, decoded.source_height, spec);
  const Image& img = decoded.image;
  const Axis ax = MakeAxis(spec.width, t.offset_x, t.scale_x, decoded.source_width, img.width);
  const Axis ay = MakeAxis(spec.height, t.offset_y, t.scale_y, decoded.source_height, img.height);

  // Per output channel: which RGB channel it reads, and its value table.
  int src_channel[3];
  for (int c = 0; c < 3; ++c) src_channel[c] = spec.channels == ChannelOrder::kRgb ? c : 2 - c;
  float lut_f[3][256];
  uint16_t lut_h[3][256];
  for (int c = 0; c < 3; ++c) {
    for (int v = 0; v < 256; ++v) {
      lut_f[c][v] =
          (static_cast<float>(v) * spec.scale - spec.mean[static_cast<size_t>(c)]) / spec.std[static_cast<size_t>(c)];
      lut_h[c][v] = FloatToHalf(lut_f[c][v]);
    }
  }

  const size_t W = static_cast<size_t>(spec.width), H = static_cast<size_t>(spec.height), plane = W * H;
  const size_t row_bytes = static_cast<size_t>(img.width) * 3;
  std::vector<uint8_t> row(W * 3);  // one resampled output row, RGB
  for (size_t y = 0; y < H; ++y) {
    const bool yvalid = ay.valid[y];
    const uint8_t* r0 = img.pixels.data() + static_cast<size_t>(ay.i0[y]) * row_bytes;
    const uint8_t* r1 = img.pixels.data() + static_cast<size_t>(ay.i1[y]) * row_bytes;
    const int wy1 = ay.w1[y], wy0 = 256 - wy1;
    for (size_t x = 0; x < W; ++x) {
      uint8_t* d = &row[x * 3];
      if (!yvalid || !ax.valid[x]) {
        d[0] = d[1] = d[2] = spec.pad_value;
        continue;
      }
      const size_t x0 = static_cast<size_t>(ax.i0[x]) * 3, x1 = static_cast<size_t>(ax.i1[x]) * 3;
      const int wx1 = ax.w1[x], wx0 = 256 - wx1;
      for (size_t c = 0; c < 3; ++c) {
        const int top = r0[x0 + c] * wx0 + r0[x1 + c] * wx1;
        const int bottom = r1[x0 + c] * wx0 + r1[x1 + c] * wx1;
        d[c] = static_cast<uint8_t>((top * wy0 + bottom * wy1 + (1 << 15)) >> 16);
      }
    }
    for (int c = 0; c < 3; ++c) {
      const size_t s = static_cast<size_t>(src_channel[c]);
      const auto cc = static_cast<size_t>(c);
      switch (spec.dtype) {
        case DataType::kUint8: {
          auto* o = static_cast<uint8_t*>(out);
          if (spec.layout == TensorLayout::kNchw) {
            for (size_t x = 0; x < W; ++x) o[cc * plane + y * W + x] = row[x * 3 + s];
          } else {
            for (size_t x = 0; x < W; ++x) o[(y * W + x) * 3 + cc] = row[x * 3 + s];
          }
          break;
        }
        case DataType::kFp16: {
          auto* o = static_cast<uint16_t*>(out);
          if (spec.layout == TensorLayout::kNchw) {
            for (size_t x = 0; x < W; ++x) o[cc * plane + y * W + x] = lut_h[c][row[x * 3 + s]];
          } else {
            for (size_t x = 0; x < W; ++x) o[(y * W + x) * 3 + cc] = lut_h[c][row[x * 3 + s]];
          }
          break;
        }
        default: {
          auto* o = static_cast<float*>(out);
          if (spec.layout == TensorLayout::kNchw) {
            for (size_t x = 0; x < W; ++x) o[cc * plane + y * W + x] = lut_f[c][row[x * 3 + s]];
          } else {
            for (size_t x = 0; x < W; ++x) o[(y * W + x) * 3 + cc] = lut_f[c][row[x * 3 + s]];
          }
          break;
        }
      }
    }
  }
  return t;
}

}  // namespace quern
