// Pre-processing: one bilinear resampling pass from the decoded RGB image
// into the model's geometry (stretch / letterbox / centre crop), then a
// per-channel lookup table turns each 8-bit value into the model's dtype
// with scale, mean and std applied. An image more than twice the size the
// model needs (a PNG, or a JPEG that DCT scaling could not shrink enough) is
// resampled by area averaging instead: bilinear sampling would skip source
// pixels and alias fine detail.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/half.h"
#include "image/image.h"

namespace quern {
namespace {

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

// Decoded pixels per output pixel along one axis.
double Reduction(int decoded_size, int source_size, double scale) {
  return static_cast<double>(decoded_size) / source_size / scale;
}

// Area resampling along one axis: output pixel o averages the decoded
// pixels its footprint covers, partly covered ones by the covered fraction.
struct AreaAxis {
  std::vector<uint8_t> valid;
  std::vector<int> first;     // first decoded pixel of o's footprint
  std::vector<size_t> begin;  // o's weights: weights[begin[o] .. begin[o + 1])
  std::vector<float> weights;
};

AreaAxis MakeAreaAxis(int out_size, double offset, double scale, int source_size, int decoded_size) {
  AreaAxis a;
  const auto n = static_cast<size_t>(out_size);
  a.valid.resize(n);
  a.first.resize(n);
  a.begin.resize(n + 1);
  const double to_decoded = static_cast<double>(decoded_size) / source_size;
  for (int o = 0; o < out_size; ++o) {
    const auto k = static_cast<size_t>(o);
    const double centre = (o + 0.5 - offset) / scale;
    a.valid[k] = centre >= 0.0 && centre < source_size;
    a.begin[k] = a.weights.size();
    double d0 = std::clamp((o - offset) / scale * to_decoded, 0.0, static_cast<double>(decoded_size));
    double d1 = std::clamp((o + 1 - offset) / scale * to_decoded, 0.0, static_cast<double>(decoded_size));
    if (d1 - d0 < 1e-9) {  // footprint outside the image (padding) or empty: nearest pixel
      d0 = std::min(d0, decoded_size - 1.0);
      d1 = d0 + 1e-3;
    }
    const int i0 = static_cast<int>(d0);
    const int i1 = std::min(static_cast<int>(std::ceil(d1)), decoded_size);
    a.first[k] = i0;
    const double total = d1 - d0;
    for (int i = i0; i < std::max(i1, i0 + 1); ++i) {
      const double w = std::min<double>(i + 1, d1) - std::max<double>(i, d0);
      a.weights.push_back(static_cast<float>(std::max(w, 0.0) / total));
    }
  }
  a.begin[n] = a.weights.size();
  return a;
}

// Converts one resampled RGB row into the model's channel order, layout and
// dtype at output row `y`: one pass over the row, three table lookups per
// pixel.
template <typename T>
void WriteRowAs(const uint8_t* row, size_t y, size_t W, size_t plane, const int (&src_channel)[3], bool nchw,
                const T (&lut)[3][256], T* out) {
  const size_t s0 = static_cast<size_t>(src_channel[0]), s1 = static_cast<size_t>(src_channel[1]),
               s2 = static_cast<size_t>(src_channel[2]);
  if (nchw) {
    T* o0 = out + y * W;
    T* o1 = o0 + plane;
    T* o2 = o1 + plane;
    for (size_t x = 0; x < W; ++x) {
      const uint8_t* p = row + x * 3;
      o0[x] = lut[0][p[s0]];
      o1[x] = lut[1][p[s1]];
      o2[x] = lut[2][p[s2]];
    }
  } else {
    T* o = out + y * W * 3;
    for (size_t x = 0; x < W; ++x) {
      const uint8_t* p = row + x * 3;
      o[x * 3] = lut[0][p[s0]];
      o[x * 3 + 1] = lut[1][p[s1]];
      o[x * 3 + 2] = lut[2][p[s2]];
    }
  }
}

struct Tables {
  uint8_t u8[3][256];
  uint16_t f16[3][256];
  float f32[3][256];
};

void WriteRow(const std::vector<uint8_t>& row, size_t y, size_t W, size_t plane, const int (&src_channel)[3],
              const ImageSpec& spec, const Tables& t, void* out) {
  const bool nchw = spec.layout == TensorLayout::kNchw;
  switch (spec.dtype) {
    case DataType::kUint8:
      return WriteRowAs(row.data(), y, W, plane, src_channel, nchw, t.u8, static_cast<uint8_t*>(out));
    case DataType::kFp16:
      return WriteRowAs(row.data(), y, W, plane, src_channel, nchw, t.f16, static_cast<uint16_t*>(out));
    default: return WriteRowAs(row.data(), y, W, plane, src_channel, nchw, t.f32, static_cast<float*>(out));
  }
}

// True when the valid outputs of `a` read consecutive source pixels with no
// blending (a scale of 1: the letterbox of an image the model's width);
// `first` is the first valid output, `count` how many.
bool IsCopy(const Axis& a, size_t& first, size_t& count) {
  first = a.valid.size();
  count = 0;
  for (size_t o = 0; o < a.valid.size(); ++o) {
    if (!a.valid[o]) continue;
    if (first == a.valid.size()) first = o;
    if (a.w1[o] != 0 || a.i0[o] != a.i0[first] + static_cast<int>(o - first)) return false;
    ++count;
  }
  // Valid outputs must be one run: padding only at the ends.
  return count > 0 && first + count <= a.valid.size() &&
         std::all_of(a.valid.begin() + static_cast<std::ptrdiff_t>(first),
                     a.valid.begin() + static_cast<std::ptrdiff_t>(first + count), [](uint8_t v) { return v != 0; });
}

// One output row by area resampling: vertical weighted sums of the rows the
// output row covers, then horizontal weighted sums of those.
void AreaRow(const Image& img, const AreaAxis& ax, const AreaAxis& ay, size_t y, uint8_t pad, std::vector<float>& sums,
             std::vector<uint8_t>& row) {
  const size_t W = ax.valid.size(), row_bytes = static_cast<size_t>(img.width) * 3;
  if (!ay.valid[y]) {
    std::fill(row.begin(), row.end(), pad);
    return;
  }
  std::fill(sums.begin(), sums.end(), 0.0f);
  for (size_t j = ay.begin[y]; j < ay.begin[y + 1]; ++j) {
    const float w = ay.weights[j];
    const uint8_t* src =
        img.pixels.data() + static_cast<size_t>(ay.first[y] + static_cast<int>(j - ay.begin[y])) * row_bytes;
    for (size_t i = 0; i < row_bytes; ++i) sums[i] += w * src[i];
  }
  for (size_t x = 0; x < W; ++x) {
    uint8_t* d = &row[x * 3];
    if (!ax.valid[x]) {
      d[0] = d[1] = d[2] = pad;
      continue;
    }
    float r = 0, g = 0, b = 0;
    const float* s = &sums[static_cast<size_t>(ax.first[x]) * 3];
    for (size_t j = ax.begin[x]; j < ax.begin[x + 1]; ++j, s += 3) {
      const float w = ax.weights[j];
      r += w * s[0];
      g += w * s[1];
      b += w * s[2];
    }
    d[0] = static_cast<uint8_t>(std::clamp(r + 0.5f, 0.0f, 255.0f));
    d[1] = static_cast<uint8_t>(std::clamp(g + 0.5f, 0.0f, 255.0f));
    d[2] = static_cast<uint8_t>(std::clamp(b + 0.5f, 0.0f, 255.0f));
  }
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
  // Area resampling when the decoded image is at least twice the output's
  // size along an axis; bilinear otherwise.
  const bool area = Reduction(img.width, decoded.source_width, t.scale_x) >= 2.0 ||
                    Reduction(img.height, decoded.source_height, t.scale_y) >= 2.0;
  const Axis ax = MakeAxis(spec.width, t.offset_x, t.scale_x, decoded.source_width, img.width);
  const Axis ay = MakeAxis(spec.height, t.offset_y, t.scale_y, decoded.source_height, img.height);
  AreaAxis aax, aay;
  std::vector<float> column_sums;  // area: one output row's vertical sums, RGB per decoded column
  if (area) {
    aax = MakeAreaAxis(spec.width, t.offset_x, t.scale_x, decoded.source_width, img.width);
    aay = MakeAreaAxis(spec.height, t.offset_y, t.scale_y, decoded.source_height, img.height);
    column_sums.resize(static_cast<size_t>(img.width) * 3);
  }

  // Per output channel: which RGB channel it reads, and its value table.
  int src_channel[3];
  for (int c = 0; c < 3; ++c) src_channel[c] = spec.channels == ChannelOrder::kRgb ? c : 2 - c;
  Tables tables;
  for (int c = 0; c < 3; ++c) {
    for (int v = 0; v < 256; ++v) {
      const float f =
          (static_cast<float>(v) * spec.scale - spec.mean[static_cast<size_t>(c)]) / spec.std[static_cast<size_t>(c)];
      tables.f32[c][v] = f;
      tables.f16[c][v] = FloatToHalf(f);
      tables.u8[c][v] = static_cast<uint8_t>(v);
    }
  }

  const size_t W = static_cast<size_t>(spec.width), H = static_cast<size_t>(spec.height), plane = W * H;
  const size_t row_bytes = static_cast<size_t>(img.width) * 3;
  std::vector<uint8_t> row(W * 3, spec.pad_value);      // one resampled output row, RGB
  std::vector<uint16_t> blended(area ? 0 : row_bytes);  // bilinear: two source rows blended, x 256
  size_t copy_first = 0, copy_count = 0;
  const bool copy_x = !area && IsCopy(ax, copy_first, copy_count);
  for (size_t y = 0; y < H; ++y) {
    if (area) {
      AreaRow(img, aax, aay, y, spec.pad_value, column_sums, row);
      WriteRow(row, y, W, plane, src_channel, spec, tables, out);
      continue;
    }
    if (!ay.valid[y]) {
      std::fill(row.begin(), row.end(), spec.pad_value);
      WriteRow(row, y, W, plane, src_channel, spec, tables, out);
      continue;
    }
    const uint8_t* r0 = img.pixels.data() + static_cast<size_t>(ay.i0[y]) * row_bytes;
    const uint8_t* r1 = img.pixels.data() + static_cast<size_t>(ay.i1[y]) * row_bytes;
    const uint32_t wy1 = static_cast<uint32_t>(ay.w1[y]), wy0 = 256 - wy1;
    if (copy_x && wy1 == 0) {
      // The row is the source row as it is, between the padding.
      std::fill(row.begin(), row.begin() + static_cast<std::ptrdiff_t>(copy_first * 3), spec.pad_value);
      std::memcpy(row.data() + copy_first * 3, r0 + static_cast<size_t>(ax.i0[copy_first]) * 3, copy_count * 3);
      std::fill(row.begin() + static_cast<std::ptrdiff_t>((copy_first + copy_count) * 3), row.end(), spec.pad_value);
      WriteRow(row, y, W, plane, src_channel, spec, tables, out);
      continue;
    }
    // Separable: blend the two source rows (vectorises), then the columns.
    // The same integer arithmetic as blending columns first, so the result
    // is exact either way.
    for (size_t i = 0; i < row_bytes; ++i) blended[i] = static_cast<uint16_t>(r0[i] * wy0 + r1[i] * wy1);
    for (size_t x = 0; x < W; ++x) {
      uint8_t* d = &row[x * 3];
      if (!ax.valid[x]) {
        d[0] = d[1] = d[2] = spec.pad_value;
        continue;
      }
      const uint16_t* b0 = &blended[static_cast<size_t>(ax.i0[x]) * 3];
      const uint16_t* b1 = &blended[static_cast<size_t>(ax.i1[x]) * 3];
      const uint32_t wx1 = static_cast<uint32_t>(ax.w1[x]), wx0 = 256 - wx1;
      d[0] = static_cast<uint8_t>((b0[0] * wx0 + b1[0] * wx1 + (1u << 15)) >> 16);
      d[1] = static_cast<uint8_t>((b0[1] * wx0 + b1[1] * wx1 + (1u << 15)) >> 16);
      d[2] = static_cast<uint8_t>((b0[2] * wx0 + b1[2] * wx1 + (1u << 15)) >> 16);
    }
    WriteRow(row, y, W, plane, src_channel, spec, tables, out);
  }
  return t;
}

DecodedImage CropSquare(const DecodedImage& decoded, float x_min, float y_min, float x_max, float y_max) {
  const Image& img = decoded.image;
  // In decoded pixels.
  const double sx = static_cast<double>(img.width) / std::max(decoded.source_width, 1);
  const double sy = static_cast<double>(img.height) / std::max(decoded.source_height, 1);
  const double cx = (x_min + x_max) / 2.0 * sx, cy = (y_min + y_max) / 2.0 * sy;
  const double longer = std::max((x_max - x_min) * sx, (y_max - y_min) * sy);
  const int side = std::clamp(static_cast<int>(std::lround(longer)), 1, std::max(std::min(img.width, img.height), 1));
  const int x0 = std::clamp(static_cast<int>(std::lround(cx - side / 2.0)), 0, std::max(img.width - side, 0));
  const int y0 = std::clamp(static_cast<int>(std::lround(cy - side / 2.0)), 0, std::max(img.height - side, 0));
  DecodedImage crop;
  crop.format = decoded.format;
  crop.image.width = crop.image.height = crop.source_width = crop.source_height = side;
  crop.image.pixels.resize(static_cast<size_t>(side) * static_cast<size_t>(side) * 3);
  if (img.width < side || img.height < side) return crop;  // an empty image: black
  const size_t row = static_cast<size_t>(side) * 3, stride = static_cast<size_t>(img.width) * 3;
  for (int y = 0; y < side; ++y) {
    std::memcpy(crop.image.pixels.data() + static_cast<size_t>(y) * row,
                img.pixels.data() + static_cast<size_t>(y0 + y) * stride + static_cast<size_t>(x0) * 3, row);
  }
  return crop;
}

}  // namespace quern
