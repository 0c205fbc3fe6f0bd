// Image pipeline pieces without a server: EXIF orientation, the resize
// transform, NMS, top-k, the detection decoders and multipart parsing.
// Expected values are derived by hand in the comments.
#include <gtest/gtest.h>
#include <turbojpeg.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "frontends/vision/multipart.h"
#include "image/image.h"
#include "pipeline/postprocess.h"

namespace quern {
namespace {

// A 3x2 image whose pixel (x, y) has red = 10 * y + x.
Image Numbered() {
  Image img;
  img.width = 3;
  img.height = 2;
  for (int y = 0; y < 2; ++y) {
    for (int x = 0; x < 3; ++x) img.pixels.insert(img.pixels.end(), {static_cast<uint8_t>(10 * y + x), 0, 0});
  }
  return img;
}

std::vector<int> Reds(const Image& img) {
  std::vector<int> out;
  for (size_t i = 0; i < img.pixels.size(); i += 3) out.push_back(img.pixels[i]);
  return out;
}

TEST(Orientation, EveryExifCaseMatchesItsDefinition) {
  // Stored:  0  1  2
  //         10 11 12
  EXPECT_EQ(Reds(ApplyOrientation(Numbered(), 1)), (std::vector<int>{0, 1, 2, 10, 11, 12}));
  EXPECT_EQ(Reds(ApplyOrientation(Numbered(), 2)), (std::vector<int>{2, 1, 0, 12, 11, 10}));  // mirrored
  EXPECT_EQ(Reds(ApplyOrientation(Numbered(), 3)), (std::vector<int>{12, 11, 10, 2, 1, 0}));  // 180
  EXPECT_EQ(Reds(ApplyOrientation(Numbered(), 4)), (std::vector<int>{10, 11, 12, 0, 1, 2}));  // flipped
  // 6: rotate 90 clockwise → 2 wide, 3 high: the left column read bottom-up becomes the top row.
  const Image r6 = ApplyOrientation(Numbered(), 6);
  EXPECT_EQ(r6.width, 2);
  EXPECT_EQ(r6.height, 3);
  EXPECT_EQ(Reds(r6), (std::vector<int>{10, 0, 11, 1, 12, 2}));
  EXPECT_EQ(Reds(ApplyOrientation(Numbered(), 8)), (std::vector<int>{2, 12, 1, 11, 0, 10}));  // 90 counter-clockwise
  EXPECT_EQ(Reds(ApplyOrientation(Numbered(), 5)), (std::vector<int>{0, 10, 1, 11, 2, 12}));  // transpose
  EXPECT_EQ(Reds(ApplyOrientation(Numbered(), 7)), (std::vector<int>{12, 2, 11, 1, 10, 0}));  // transverse
}

TEST(Orientation, ReadFromExifAndSafeOnGarbage) {
  // SOI, APP1 "Exif\0\0" + little-endian TIFF with one IFD entry: 0x0112 SHORT 1 value 6.
  const uint8_t tiff[] = {'I', 'I', 42, 0, 8, 0, 0, 0, 1, 0, 0x12, 0x01, 3, 0, 1, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0};
  std::string jpeg = "\xFF\xD8\xFF\xE1";
  const size_t len = 2 + 6 + sizeof(tiff);
  jpeg += static_cast<char>(len >> 8);
  jpeg += static_cast<char>(len & 0xFF);
  jpeg += std::string("Exif\0\0", 6);
  jpeg += std::string(reinterpret_cast<const char*>(tiff), sizeof(tiff));
  jpeg += "\xFF\xDA";
  EXPECT_EQ(JpegExifOrientation(jpeg), 6);
  // Truncated anywhere: never read past the end, orientation 1.
  for (size_t n = 0; n < jpeg.size() - 2; ++n) {
    const int o = JpegExifOrientation(jpeg.substr(0, n));
    EXPECT_TRUE(o == 1 || o == 6) << n;
  }
  EXPECT_EQ(JpegExifOrientation(std::string("\xFF\xD8\xFF\xE1\xFF\xFF", 6)), 1);
}

TEST(Transform, LetterboxStretchAndCrop) {
  ImageSpec spec;
  spec.width = spec.height = 64;
  spec.resize = ResizeMode::kLetterbox;
  // 128x96 → scale 0.5, 64x48 placed 8 rows down.
  ImageTransform t = ComputeTransform(128, 96, spec);
  EXPECT_DOUBLE_EQ(t.scale_x, 0.5);
  EXPECT_DOUBLE_EQ(t.offset_x, 0);
  EXPECT_DOUBLE_EQ(t.offset_y, 8);
  EXPECT_DOUBLE_EQ(t.ToSourceY(16), 16);  // (16 - 8) / 0.5
  spec.resize = ResizeMode::kStretch;
  t = ComputeTransform(128, 96, spec);
  EXPECT_DOUBLE_EQ(t.ToSourceX(64), 128);
  EXPECT_DOUBLE_EQ(t.ToSourceY(64), 96);
  spec.resize = ResizeMode::kCenterCrop;
  // Shortest side 96 → 64 (scale 2/3): 85.33 wide, 10 columns cut on the left.
  t = ComputeTransform(128, 96, spec);
  EXPECT_DOUBLE_EQ(t.offset_x, -10);
  EXPECT_NEAR(t.ToSourceX(0), 15, 1e-9);
  EXPECT_DOUBLE_EQ(t.offset_y, 0);
}

TEST(Preprocess, NormalisesIntoNchwWithPadding) {
  DecodedImage d;
  d.source_width = 4;
  d.source_height = 2;
  d.image.width = 4;
  d.image.height = 2;
  d.image.pixels.assign(4 * 2 * 3, 0);
  for (size_t i = 0; i < d.image.pixels.size(); i += 3) d.image.pixels[i] = 255;  // all red
  ImageSpec spec;
  spec.width = spec.height = 4;
  spec.resize = ResizeMode::kLetterbox;  // 4x2 into 4x4: rows 1-2 image, rows 0 and 3 padding
  spec.pad_value = 0;
  spec.channels = ChannelOrder::kBgr;
  spec.mean = {0.5f, 0.5f, 0.5f};
  spec.std = {0.5f, 0.5f, 0.5f};
  std::vector<float> out(3 * 16);
  Preprocess(d, spec, out.data());
  // BGR: plane 2 is red. Image rows: red = (1 - 0.5) / 0.5 = 1, blue = -1; padding: -1 everywhere.
  EXPECT_FLOAT_EQ(out[2 * 16 + 1 * 4 + 0], 1.0f);
  EXPECT_FLOAT_EQ(out[0 * 16 + 1 * 4 + 0], -1.0f);
  EXPECT_FLOAT_EQ(out[2 * 16 + 0 * 4 + 0], -1.0f);
  EXPECT_FLOAT_EQ(out[2 * 16 + 3 * 4 + 3], -1.0f);
}

// An image as wide as the model's input is letterboxed at scale 1: every
// output pixel is a source pixel or padding, in every layout and dtype.
TEST(Preprocess, ScaleOneLetterboxCopiesPixelsExactly) {
  DecodedImage d;
  d.source_width = d.image.width = 64;
  d.source_height = d.image.height = 40;
  d.image.pixels.resize(64 * 40 * 3);
  uint32_t state = 12345;
  for (auto& p : d.image.pixels) p = static_cast<uint8_t>((state = state * 1664525u + 1013904223u) >> 24);
  const auto src = [&](int x, int y, int c) { return d.image.pixels[static_cast<size_t>((y * 64 + x) * 3 + c)]; };
  for (const TensorLayout layout : {TensorLayout::kNchw, TensorLayout::kNhwc}) {
    ImageSpec spec;
    spec.width = spec.height = 64;  // 64x40 -> rows 12..51 image, 0..11 and 52..63 padding
    spec.resize = ResizeMode::kLetterbox;
    spec.pad_value = 114;
    spec.channels = ChannelOrder::kBgr;
    spec.layout = layout;
    spec.scale = 1.0f / 255;
    spec.mean = {0.1f, 0.2f, 0.3f};
    spec.std = {0.5f, 0.25f, 2.0f};
    std::vector<float> out(3 * 64 * 64);
    Preprocess(d, spec, out.data());
    spec.dtype = DataType::kUint8;
    std::vector<uint8_t> raw(3 * 64 * 64);
    Preprocess(d, spec, raw.data());
    for (int y = 0; y < 64; ++y) {
      for (int x = 0; x < 64; ++x) {
        for (int c = 0; c < 3; ++c) {  // output channel c is source channel 2 - c (BGR)
          const int v = y >= 12 && y < 52 ? src(x, y - 12, 2 - c) : 114;
          const size_t i = layout == TensorLayout::kNchw ? static_cast<size_t>((c * 64 + y) * 64 + x)
                                                         : static_cast<size_t>((y * 64 + x) * 3 + c);
          ASSERT_EQ(raw[i], v) << x << "," << y << "," << c;
          const float want =
              (static_cast<float>(v) / 255 - spec.mean[static_cast<size_t>(c)]) / spec.std[static_cast<size_t>(c)];
          ASSERT_NEAR(out[i], want, 1e-6) << x << "," << y << "," << c;
        }
      }
    }
  }
}

// A checkerboard of 5x5-pixel squares, shifted by 2 pixels, shrunk 10x:
// each output pixel covers source columns of square parities even/odd/even
// 3/5/2 times (rows likewise), so half its area is white and area averaging
// gives 255 / 2 = 127.5 everywhere. Bilinear sampling at the output pixel's
// centre (source 10x + 4.5) reads two pixels of the same odd/odd square:
// black everywhere (aliasing).
TEST(Preprocess, LargeDownscaleAveragesInsteadOfAliasing) {
  DecodedImage d;
  d.source_width = d.image.width = 640;
  d.source_height = d.image.height = 480;
  d.image.pixels.resize(640 * 480 * 3);
  for (int y = 0; y < 480; ++y) {
    for (int x = 0; x < 640; ++x) {
      const uint8_t v = ((x + 2) / 5 + (y + 2) / 5) % 2 ? 255 : 0;
      for (int c = 0; c < 3; ++c) d.image.pixels[static_cast<size_t>((y * 640 + x) * 3 + c)] = v;
    }
  }
  ImageSpec spec;
  spec.width = 64;
  spec.height = 48;
  spec.dtype = DataType::kUint8;
  std::vector<uint8_t> out(3 * 64 * 48);
  Preprocess(d, spec, out.data());
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_NEAR(out[i], 127.5, 1.0) << "element " << i;
  }
  // Coordinates still map exactly: a white 40x40 square at (200, 120) lands
  // on output pixels 20..23 x 12..15 (a tenth), with black around it.
  std::fill(d.image.pixels.begin(), d.image.pixels.end(), 0);
  for (int y = 120; y < 160; ++y) {
    for (int x = 200; x < 240; ++x) {
      for (int c = 0; c < 3; ++c) d.image.pixels[static_cast<size_t>((y * 640 + x) * 3 + c)] = 255;
    }
  }
  Preprocess(d, spec, out.data());
  for (int y = 0; y < 48; ++y) {
    for (int x = 0; x < 64; ++x) {
      const bool inside = x >= 20 && x < 24 && y >= 12 && y < 16;
      EXPECT_EQ(out[static_cast<size_t>(y * 64 + x)], inside ? 255 : 0) << "pixel " << x << "," << y;
    }
  }
}

TEST(Nms, ClassWiseAndOrdered) {
  std::vector<Detection> in = {
      {0, 0.9f, 0, 0, 10, 10},  // kept
      {0, 0.8f, 1, 1, 11, 11},  // IoU 81/119 = 0.68 with the first: suppressed
      {1, 0.7f, 1, 1, 11, 11},  // other class: kept
      {0, 0.6f, 20, 20, 30, 30},
  };
  auto out = NonMaxSuppression(in, 0.45f, 10);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_FLOAT_EQ(out[0].confidence, 0.9f);
  EXPECT_EQ(out[1].class_id, 1);
  EXPECT_FLOAT_EQ(out[2].confidence, 0.6f);
  EXPECT_EQ(NonMaxSuppression(in, 0.45f, 1).size(), 1u);
  EXPECT_NEAR(IntersectionOverUnion(in[0], in[1]), 81.0 / 119.0, 1e-6);
}

TEST(TopK, SoftmaxOnlyWhenNotProbabilities) {
  auto logits = TopK({1.0f, 3.0f, 2.0f}, 2, SoftmaxMode::kAuto, {"a", "b", "c"});
  ASSERT_EQ(logits.size(), 2u);
  EXPECT_EQ(logits[0].label, "b");
  // softmax(3 | 1, 3, 2) = 1 / (e^-2 + 1 + e^-1)
  EXPECT_NEAR(logits[0].confidence, 1.0 / (std::exp(-2.0) + 1.0 + std::exp(-1.0)), 1e-6);
  auto probs = TopK({0.2f, 0.5f, 0.3f}, 5, SoftmaxMode::kAuto, {});
  ASSERT_EQ(probs.size(), 3u);
  EXPECT_FLOAT_EQ(probs[0].confidence, 0.5f);
  EXPECT_EQ(probs[0].label, "1");
}

NamedTensor FloatTensor(const std::string& name, Shape shape, const std::vector<float>& v) {
  return {name, Tensor::From<float>(DataType::kFp32, std::move(shape), std::span<const float>(v))};
}

TEST(Decoders, YoloV5V8AndDetrAgree) {
  // One box at (cx 20, cy 30, w 10, h 20), class 1 with 0.8; a second box under the threshold.
  DetectionSpec spec;
  spec.format = DetectionFormat::kYoloV5;
  // [1, 2 boxes, 5 + 2 classes]: objectness 1.
  auto v5 = DecodeDetections({FloatTensor("o", {1, 2, 7}, {20, 30, 10, 20, 1, 0.1f, 0.8f, 5, 5, 2, 2, 1, 0.2f, 0.1f})},
                             spec, 0.5f, 64, 64);
  ASSERT_TRUE(v5.has_value());
  ASSERT_EQ(v5->size(), 1u);
  EXPECT_EQ((*v5)[0].class_id, 1);
  EXPECT_FLOAT_EQ((*v5)[0].x_min, 15);
  EXPECT_FLOAT_EQ((*v5)[0].y_max, 40);
  spec.format = DetectionFormat::kYoloV8;
  // [1, 4 + 2, 2 boxes], box-major columns.
  auto v8 = DecodeDetections({FloatTensor("o", {1, 6, 2}, {20, 5, 30, 5, 10, 2, 20, 2, 0.1f, 0.2f, 0.8f, 0.1f})}, spec,
                             0.5f, 64, 64);
  ASSERT_TRUE(v8.has_value());
  ASSERT_EQ(v8->size(), 1u);
  EXPECT_FLOAT_EQ((*v8)[0].x_max, 25);
  spec.format = DetectionFormat::kDetr;
  spec.normalized = true;
  spec.activation = ScoreActivation::kNone;
  // Labels + scores + normalised boxes (64x64 input).
  std::vector<NamedTensor> detr = {
      FloatTensor("boxes", {1, 1, 4}, {20.0f / 64, 30.0f / 64, 10.0f / 64, 20.0f / 64}),
      FloatTensor("scores", {1, 1}, {0.8f}),
      {"labels", Tensor::From<int64_t>(DataType::kInt64, {1, 1}, std::span<const int64_t>(std::vector<int64_t>{1}))}};
  auto d = DecodeDetections(detr, spec, 0.5f, 64, 64);
  ASSERT_TRUE(d.has_value());
  ASSERT_EQ(d->size(), 1u);
  EXPECT_EQ((*d)[0].class_id, 1);
  EXPECT_NEAR((*d)[0].y_min, 20, 1e-4);
  // A wrong shape names the output and the layout.
  spec.format = DetectionFormat::kYoloV8;
  auto bad = DecodeDetections({FloatTensor("out", {1, 3}, {1, 2, 3})}, spec, 0.5f, 64, 64);
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message().find("output 'out'"), std::string::npos);
  EXPECT_NE(bad.error().message().find("[1, 4 + classes, boxes]"), std::string::npos);
}

TEST(Multipart, PartsAndErrors) {
  const std::string body =
      "preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.jpg\"\r\n"
      "Content-Type: image/jpeg\r\n\r\n\x01\x02\r\n\x03\r\n--XyZ\r\nContent-Disposition: form-data; "
      "name=min_confidence\r\n\r\n0.5\r\n--XyZ--\r\n";
  auto b = MultipartBoundary("multipart/form-data; boundary=\"XyZ\"");
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(*b, "XyZ");
  auto parts = ParseMultipart(body, *b);
  ASSERT_TRUE(parts.has_value()) << parts.error().message();
  ASSERT_EQ(parts->size(), 2u);
  EXPECT_EQ((*parts)[0].name, "image");
  EXPECT_EQ((*parts)[0].filename, "a.jpg");
  EXPECT_EQ((*parts)[0].data, std::string_view("\x01\x02\r\n\x03", 5));  // a CRLF inside the data is data
  EXPECT_EQ((*parts)[1].name, "min_confidence");
  EXPECT_EQ((*parts)[1].data, "0.5");
  EXPECT_FALSE(MultipartBoundary("application/json").has_value());
  EXPECT_FALSE(MultipartBoundary("multipart/form-data").has_value());
  // Every truncation is an error or a shorter well-formed list, never a crash.
  for (size_t n = 0; n < body.size(); ++n) {
    auto p = ParseMultipart(std::string_view(body).substr(0, n), "XyZ");
    if (p) {
      EXPECT_LE(p->size(), 2u);
    }
  }
  EXPECT_FALSE(ParseMultipart(body.substr(0, body.size() - 9), "XyZ").has_value());
}

TEST(Form, UrlEncodedFieldsAreDecodedAndViewedSafelyAfterAMove) {
  // As Python's urllib.parse.urlencode({"api_key": "k+y/1", "userid": "Ann Lee", "empty": ""}) writes it.
  const std::string body = "api_key=k%2By%2F1&userid=Ann+Lee&empty=&&flag&bad=%zz%4";
  auto form = ParseForm("Application/X-WWW-Form-Urlencoded; charset=utf-8", body);
  ASSERT_TRUE(form.has_value()) << form.error().message();
  Form moved = std::move(*form);  // the views move with the buffer
  ASSERT_EQ(moved.parts.size(), 5u);
  EXPECT_EQ(moved.Field("api_key")->data, "k+y/1");
  EXPECT_EQ(moved.Field("userid")->data, "Ann Lee");
  EXPECT_EQ(moved.Field("empty")->data, "");
  EXPECT_EQ(moved.Field("flag")->data, "");
  EXPECT_EQ(moved.Field("bad")->data, "%zz%4") << "an invalid escape is kept as it is";
  EXPECT_EQ(moved.Field("missing"), nullptr);
}

TEST(Form, ContentTypesAndBounds) {
  EXPECT_TRUE(ParseForm("", "").has_value()) << "an empty body is an empty form";
  EXPECT_TRUE(ParseForm("text/plain", "")->parts.empty());
  EXPECT_TRUE(ParseForm("multipart/form-data; boundary=x", "")->parts.empty()) << "no body, no fields";
  // A body of names holds no buffer of its size; a name past the bound is refused.
  auto names = ParseUrlEncodedForm("a&b&c=12&" + std::string(200, 'n'));
  ASSERT_TRUE(names.has_value());
  EXPECT_LE(names->decoded.capacity(), 16u);
  EXPECT_EQ(names->Field("c")->data, "12");
  auto long_name = ParseUrlEncodedForm(std::string(kMaxFormNameBytes + 1, 'n') + "=1");
  ASSERT_FALSE(long_name.has_value());
  EXPECT_NE(long_name.error().message().find("name is over"), std::string::npos);
  auto other = ParseForm("application/json", "{}");
  ASSERT_FALSE(other.has_value());
  EXPECT_NE(other.error().message().find("application/x-www-form-urlencoded"), std::string::npos);
  EXPECT_TRUE(IsFormContentType("multipart/form-data; boundary=x"));
  EXPECT_TRUE(IsFormContentType("application/x-www-form-urlencoded"));
  EXPECT_FALSE(IsFormContentType("application/json"));
  // kMaxFormParts fields, and one more.
  std::string fields;
  for (size_t i = 0; i < kMaxFormParts; ++i) fields.append("f").append(std::to_string(i)).append("=1&");
  EXPECT_TRUE(ParseUrlEncodedForm(fields).has_value());
  auto over = ParseUrlEncodedForm(fields + "one=more");
  ASSERT_FALSE(over.has_value());
  EXPECT_NE(over.error().message().find("more than 256"), std::string::npos);
  std::string parts;
  for (size_t i = 0; i <= kMaxFormParts; ++i) parts += "--B\r\nContent-Disposition: form-data; name=x\r\n\r\n1\r\n";
  parts += "--B--\r\n";
  auto many = ParseForm("multipart/form-data; boundary=B", parts);
  ASSERT_FALSE(many.has_value());
  EXPECT_NE(many.error().message().find("more than 256"), std::string::npos);
}

}  // namespace
}  // namespace quern

namespace quern {
namespace {

TEST(Decode, BmpWithACoreHeaderCannotClaimPixelsItDoesNotHold) {
  // A 26-byte OS/2 BMP (12-byte BITMAPCOREHEADER) claiming 7000 x 7000
  // pixels of 24 bits decoded as 49 million black pixels (147 MB).
  std::string bmp(26, '\0');
  auto put16 = [&](size_t at, uint16_t v) {
    bmp[at] = static_cast<char>(v & 0xff);
    bmp[at + 1] = static_cast<char>(v >> 8);
  };
  auto put32 = [&](size_t at, uint32_t v) {
    put16(at, static_cast<uint16_t>(v & 0xffff));
    put16(at + 2, static_cast<uint16_t>(v >> 16));
  };
  bmp[0] = 'B';
  bmp[1] = 'M';
  put32(2, 26);   // file size
  put32(10, 26);  // pixel data offset
  put32(14, 12);  // header size
  put16(18, 7000);
  put16(20, 7000);
  put16(22, 1);   // planes
  put16(24, 24);  // bits per pixel
  DecodeOptions o;
  o.max_pixels = 100'000'000;
  auto r = DecodeImage(bmp, o);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message().find("truncated"), std::string::npos) << r.error().message();
}

}  // namespace
}  // namespace quern

namespace quern {
namespace {

// A JPEG of noise (libjpeg-turbo's own encoder).
std::string NoiseJpeg(int w, int h) {
  std::vector<unsigned char> rgb(static_cast<size_t>(w * h * 3));
  uint32_t x = 12345;
  for (auto& b : rgb) {
    x = x * 1103515245u + 12345u;
    b = static_cast<unsigned char>(x >> 24);
  }
  tjhandle tj = tjInitCompress();
  unsigned char* out = nullptr;
  unsigned long size = 0;
  EXPECT_EQ(tjCompress2(tj, rgb.data(), w, 0, h, TJPF_RGB, &out, &size, TJSAMP_420, 90, 0), 0);
  std::string jpeg(reinterpret_cast<char*>(out), size);
  tjFree(out);
  tjDestroy(tj);
  return jpeg;
}

TEST(Decode, ACorruptJpegDoesNotSpoilTheNextOneOnTheSameThread) {
  // The decoder keeps one libjpeg-turbo handle per thread; a decode that
  // failed half-way must not leave it unable to read the next image.
  const std::string good = NoiseJpeg(64, 48);
  ASSERT_TRUE(DecodeImage(good).has_value());
  for (const size_t cut : {good.size() * 3 / 5, good.size() / 2, size_t{200}}) {
    auto bad = DecodeImage(std::string_view(good).substr(0, cut));
    ASSERT_FALSE(bad.has_value()) << cut;
    EXPECT_NE(bad.error().message().find("corrupt or truncated JPEG"), std::string::npos) << bad.error().message();
    auto again = DecodeImage(good);
    ASSERT_TRUE(again.has_value()) << "after a " << cut << "-byte cut: " << again.error().message();
    EXPECT_EQ(again->image.width, 64);
    EXPECT_EQ(again->image.height, 48);
  }
}

}  // namespace
}  // namespace quern

namespace quern {
namespace {

TEST(ImageHeader, SizesADecoderCannotTakeAreNotReported) {
  // A PNG header claiming 0xFFFFFFFF x 0xFFFFFFFF: its product would wrap a
  // caller's admission arithmetic (a negative charge lifted the memory bound).
  std::string png("\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR", 16);
  png += std::string("\xff\xff\xff\xff\xff\xff\xff\xff\x10\x02\x00\x00\x00", 13);
  png += std::string(4, '\0');
  EXPECT_FALSE(ReadImageHeader(png).has_value());
  png[16] = png[17] = png[18] = 0;
  png[19] = 100;
  png[20] = png[21] = png[22] = 0;
  png[23] = 50;
  auto h = ReadImageHeader(png);
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->width, 100);
  EXPECT_EQ(h->height, 50);
  EXPECT_EQ(h->decoded_bytes(), 100 * 50 * 3 * 2);  // 16-bit samples
}

}  // namespace
}  // namespace quern
