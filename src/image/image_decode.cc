// Decoding: libjpeg-turbo (TurboJPEG API, DCT-domain scaling), libpng
// (simplified API), libwebp, stb_image (BMP). EXIF orientation is read from
// the JPEG's APP1 segment.
#include <png.h>
#include <stb_image.h>
#include <turbojpeg.h>
#include <webp/decode.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "image/image.h"

namespace quern {
namespace {

std::string SizeText(int64_t w, int64_t h) {
  return std::to_string(w) + "x" + std::to_string(h);
}

// The most pixels a byte of a valid file of format `f` can hold, with room:
// a flat JPEG still spends a bit or more per 8x8 block (DC) and scan; PNG,
// BMP and GIF at most ~1032 bytes of pixels per compressed byte (deflate's
// bound; LZW's is lower) at 8 pixels a byte (1 bit each); lossless WebP
// copies up to 4096 pixels with one symbol.
int64_t MaxPixelsPerByte(ImageFormat f) {
  switch (f) {
    case ImageFormat::kJpeg: return 2048;
    case ImageFormat::kWebp: return 32768;
    default: return 1032 * 8;
  }
}

// `file_bytes`: the encoded image's size. Compression has its limits, so a
// header claiming far more pixels than its file can hold is forged or cut.
Status CheckSize(int64_t w, int64_t h, const DecodeOptions& o, ImageFormat f, size_t file_bytes) {
  if (w <= 0 || h <= 0) {
    return InvalidArgument(std::string(ImageFormatName(f)) + " image has no pixels (" + SizeText(w, h) + ")");
  }
  const int64_t plausible = std::max(
      kPlausiblePixels, static_cast<int64_t>(std::min<size_t>(file_bytes, size_t{1} << 40)) * MaxPixelsPerByte(f));
  if (w * h > plausible) {
    return InvalidArgument(std::string(ImageFormatName(f)) + " image claims " + SizeText(w, h) + " pixels in " +
                           std::to_string(file_bytes) +
                           " bytes; no valid file that small holds that many "
                           "(truncated or forged)");
  }
  if (w * h > o.max_pixels) {
    return InvalidArgument(std::string(ImageFormatName(f)) + " image is " + SizeText(w, h) + " = " +
                           std::to_string(w * h) + " pixels, over the limit of " + std::to_string(o.max_pixels) +
                           " pixels");
  }
  return Status::Ok();
}

uint32_t Read16(const uint8_t* p, bool little) {
  return little ? (p[0] | (p[1] << 8)) : ((p[0] << 8) | p[1]);
}
uint32_t Read32(const uint8_t* p, bool little) {
  return little ? (p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24))
                : ((static_cast<uint32_t>(p[0]) << 24) | (p[1] << 16) | (p[2] << 8) | p[3]);
}

// The orientation tag (0x0112) of a TIFF block (the body of an Exif APP1).
int TiffOrientation(const uint8_t* tiff, size_t size) {
  if (size < 8) return 1;
  bool little;
  if (tiff[0] == 'I' && tiff[1] == 'I') {
    little = true;
  } else if (tiff[0] == 'M' && tiff[1] == 'M') {
    little = false;
  } else {
    return 1;
  }
  if (Read16(tiff + 2, little) != 42) return 1;
  const uint32_t ifd = Read32(tiff + 4, little);
  if (ifd > size - 2) return 1;
  const uint32_t count = Read16(tiff + ifd, little);
  for (uint32_t i = 0; i < count; ++i) {
    const size_t entry = ifd + 2 + static_cast<size_t>(i) * 12;
    if (entry + 12 > size) return 1;
    if (Read16(tiff + entry, little) != 0x0112) continue;
    if (Read16(tiff + entry + 2, little) != 3) return 1;  // SHORT
    const uint32_t v = Read16(tiff + entry + 8, little);
    return v >= 1 && v <= 8 ? static_cast<int>(v) : 1;
  }
  return 1;
}

struct TjHandle {
  tjhandle h = tjInitDecompress();
  ~TjHandle() {
    if (h) tjDestroy(h);
  }
  // A decode that failed part-way leaves libjpeg-turbo's decompressor in a
  // state the next image on this thread would inherit (it then misreads a
  // valid file): start from a fresh handle.
  void Reset() {
    if (h) tjDestroy(h);
    h = tjInitDecompress();
  }
};

Result<DecodedImage> DecodeJpeg(std::string_view bytes, const DecodeOptions& o) {
  thread_local TjHandle tj;
  if (!tj.h) return std::unexpected(Internal("cannot initialise libjpeg-turbo"));
  auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  const auto size = static_cast<unsigned long>(bytes.size());
  int w = 0, h = 0, subsamp = 0, colorspace = 0;
  if (tjDecompressHeader3(tj.h, data, size, &w, &h, &subsamp, &colorspace) != 0) {
    Status error = InvalidArgument(std::string("corrupt or truncated JPEG image: ") + tjGetErrorStr2(tj.h));
    tj.Reset();
    return std::unexpected(std::move(error));
  }
  QUERN_RETURN_IF_ERROR(CheckSize(w, h, o, ImageFormat::kJpeg, bytes.size()));
  const int orientation = o.apply_exif_orientation ? JpegExifOrientation(bytes) : 1;
  const bool transposed = orientation >= 5;
  // The size the resize needs, in the stored orientation.
  int need_w = w, need_h = h;
  if (o.target) {
    const int dw = transposed ? h : w, dh = transposed ? w : h;  // displayed
    const ImageTransform t = ComputeTransform(dw, dh, *o.target);
    const int nw = static_cast<int>(std::ceil(dw * t.scale_x)), nh = static_cast<int>(std::ceil(dh * t.scale_y));
    need_w = transposed ? nh : nw;
    need_h = transposed ? nw : nh;
  }
  int n = 0;
  const tjscalingfactor* factors = tjGetScalingFactors(&n);
  tjscalingfactor best{1, 1};
  for (int i = 0; i < n && factors; ++i) {
    const auto& f = factors[i];
    if (f.num > f.denom) continue;  // never enlarge
    const int sw = TJSCALED(w, f), sh = TJSCALED(h, f);
    if (sw >= need_w && sh >= need_h &&
        sw * static_cast<int64_t>(sh) < TJSCALED(w, best) * int64_t{TJSCALED(h, best)}) {
      best = f;
    }
  }
  Image img;
  img.width = TJSCALED(w, best);
  img.height = TJSCALED(h, best);
  const size_t count = static_cast<size_t>(img.width) * static_cast<size_t>(img.height);
  // CMYK and YCCK (scanners, print workflows, some cameras): libjpeg-turbo
  // gives CMYK, converted below.
  const bool cmyk = colorspace == TJCS_CMYK || colorspace == TJCS_YCCK;
  std::vector<uint8_t> cmyk_pixels;
  if (cmyk) cmyk_pixels.resize(count * 4);
  img.pixels.resize(count * 3);
  if (tjDecompress2(tj.h, data, size, cmyk ? cmyk_pixels.data() : img.pixels.data(), img.width, 0, img.height,
                    cmyk ? TJPF_CMYK : TJPF_RGB, TJFLAG_FASTDCT | TJFLAG_STOPONWARNING) != 0) {
    Status error = InvalidArgument(std::string("corrupt or truncated JPEG image (") + SizeText(w, h) +
                                   "): " + tjGetErrorStr2(tj.h));
    tj.Reset();
    return std::unexpected(std::move(error));
  }
  if (cmyk) {
    // JPEG CMYK is stored inverted (Adobe's convention, which every writer
    // follows): each value is 255 - ink, so the light left is value x K.
    for (size_t i = 0; i < count; ++i) {
      const uint8_t* s = &cmyk_pixels[i * 4];
      uint8_t* d = &img.pixels[i * 3];
      const unsigned k = s[3];
      d[0] = static_cast<uint8_t>((s[0] * k + 127) / 255);
      d[1] = static_cast<uint8_t>((s[1] * k + 127) / 255);
      d[2] = static_cast<uint8_t>((s[2] * k + 127) / 255);
    }
  }
  DecodedImage out;
  out.format = ImageFormat::kJpeg;
  out.exif_orientation = orientation;
  out.source_width = transposed ? h : w;
  out.source_height = transposed ? w : h;
  out.image = orientation == 1 ? std::move(img) : ApplyOrientation(img, orientation);
  return out;
}

Result<DecodedImage> DecodePng(std::string_view bytes, const DecodeOptions& o) {
  png_image png;
  std::memset(&png, 0, sizeof(png));
  png.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&png, bytes.data(), bytes.size())) {
    return std::unexpected(InvalidArgument(std::string("corrupt or truncated PNG image: ") + png.message));
  }
  if (Status st = CheckSize(png.width, png.height, o, ImageFormat::kPng, bytes.size()); !st.ok()) {
    png_image_free(&png);
    return std::unexpected(st);
  }
  png.format = PNG_FORMAT_RGB;
  DecodedImage out;
  out.format = ImageFormat::kPng;
  out.image.width = out.source_width = static_cast<int>(png.width);
  out.image.height = out.source_height = static_cast<int>(png.height);
  out.image.pixels.resize(PNG_IMAGE_SIZE(png));
  const png_color black{0, 0, 0};  // transparent pixels are composed onto black
  if (!png_image_finish_read(&png, &black, out.image.pixels.data(), 0, nullptr)) {
    std::string msg = png.message;
    png_image_free(&png);
    return std::unexpected(
        InvalidArgument("corrupt or truncated PNG image (" + SizeText(png.width, png.height) + "): " + msg));
  }
  return out;
}

Result<DecodedImage> DecodeWebp(std::string_view bytes, const DecodeOptions& o) {
  auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  int w = 0, h = 0;
  if (!WebPGetInfo(data, bytes.size(), &w, &h)) {
    return std::unexpected(InvalidArgument("corrupt or truncated WebP image (its header cannot be read)"));
  }
  WebPBitstreamFeatures features;
  if (WebPGetFeatures(data, bytes.size(), &features) == VP8_STATUS_OK && features.has_animation) {
    return std::unexpected(InvalidArgument("animated WebP images are not supported (send one frame as a still image)"));
  }
  QUERN_RETURN_IF_ERROR(CheckSize(w, h, o, ImageFormat::kWebp, bytes.size()));
  DecodedImage out;
  out.format = ImageFormat::kWebp;
  out.image.width = out.source_width = w;
  out.image.height = out.source_height = h;
  out.image.pixels.resize(static_cast<size_t>(w) * static_cast<size_t>(h) * 3);
  if (!WebPDecodeRGBInto(data, bytes.size(), out.image.pixels.data(), out.image.pixels.size(), w * 3)) {
    return std::unexpected(InvalidArgument("corrupt or truncated WebP image (" + SizeText(w, h) + ")"));
  }
  return out;
}

// stb_image reads past the end of a BMP as zeros, so a cut file would decode
// as a partly black picture. For uncompressed BMPs (BI_RGB, BI_BITFIELDS)
// the size of the pixel array follows from the header: a shorter file is
// refused. Other variants are left to stb_image's own checks.
Status CheckBmpLength(std::string_view bytes, int w, int h) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  if (bytes.size() < 18) return Status::Ok();  // stb refuses it
  const uint32_t header = Read32(p + 14, true);
  uint64_t bits = 0;
  if (header == 12 && bytes.size() >= 26) {
    bits = Read16(p + 24, true);  // OS/2 BITMAPCOREHEADER: never compressed
  } else if (header >= 40 && bytes.size() >= 34) {
    const uint32_t compression = Read32(p + 30, true);
    if (compression != 0 && compression != 3) return Status::Ok();
    bits = Read16(p + 28, true);
  } else {
    return Status::Ok();  // a header stb does not read: it refuses the file
  }
  const uint64_t stride = (static_cast<uint64_t>(w) * bits + 31) / 32 * 4;
  const uint64_t needed = Read32(p + 10, true) + stride * static_cast<uint64_t>(h);
  if (bytes.size() < needed) {
    return InvalidArgument("corrupt or truncated BMP image (" + SizeText(w, h) + "): its pixel data needs " +
                           std::to_string(needed) + " bytes, the file has " + std::to_string(bytes.size()));
  }
  return Status::Ok();
}

// BMP (stb_image's other decoders are not used: GIF, PSD, PIC, ...).
Result<DecodedImage> DecodeWithStb(std::string_view bytes, const DecodeOptions& o, ImageFormat format) {
  const std::string name(ImageFormatName(format));
  auto* data = reinterpret_cast<const stbi_uc*>(bytes.data());
  const int len = static_cast<int>(std::min<size_t>(bytes.size(), INT32_MAX));
  int w = 0, h = 0, comp = 0;
  if (!stbi_info_from_memory(data, len, &w, &h, &comp)) {
    return std::unexpected(InvalidArgument("corrupt or truncated " + name + " image: " + stbi_failure_reason()));
  }
  QUERN_RETURN_IF_ERROR(CheckSize(w, h, o, format, bytes.size()));
  if (format == ImageFormat::kBmp) QUERN_RETURN_IF_ERROR(CheckBmpLength(bytes, w, h));
  std::unique_ptr<stbi_uc, void (*)(void*)> px(stbi_load_from_memory(data, len, &w, &h, &comp, 3), stbi_image_free);
  if (!px) {
    return std::unexpected(
        InvalidArgument("corrupt or truncated " + name + " image (" + SizeText(w, h) + "): " + stbi_failure_reason()));
  }
  DecodedImage out;
  out.format = format;
  out.image.width = out.source_width = w;
  out.image.height = out.source_height = h;
  out.image.pixels.assign(px.get(), px.get() + static_cast<size_t>(w) * static_cast<size_t>(h) * 3);
  return out;
}

}  // namespace

std::string_view ImageFormatName(ImageFormat f) {
  switch (f) {
    case ImageFormat::kJpeg: return "JPEG";
    case ImageFormat::kPng: return "PNG";
    case ImageFormat::kBmp: return "BMP";
    case ImageFormat::kWebp: return "WebP";
  }
  return "image";
}

static std::optional<ImageHeader> ReadAnyImageHeader(std::string_view bytes);

int JpegExifOrientation(std::string_view jpeg) {
  auto* p = reinterpret_cast<const uint8_t*>(jpeg.data());
  const size_t n = jpeg.size();
  if (n < 4 || p[0] != 0xFF || p[1] != 0xD8) return 1;
  size_t pos = 2;
  while (pos + 4 <= n) {
    if (p[pos] != 0xFF) return 1;
    const uint8_t marker = p[pos + 1];
    if (marker == 0xFF) {  // fill byte
      ++pos;
      continue;
    }
    if (marker == 0xDA || marker == 0xD9) return 1;  // image data / end: no EXIF before it
    if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD7)) {
      pos += 2;
      continue;
    }
    const size_t len = (static_cast<size_t>(p[pos + 2]) << 8) | p[pos + 3];
    if (len < 2 || pos + 2 + len > n) return 1;
    const uint8_t* seg = p + pos + 4;
    const size_t seg_len = len - 2;
    if (marker == 0xE1 && seg_len >= 6 && std::memcmp(seg, "Exif\0\0", 6) == 0) {
      return TiffOrientation(seg + 6, seg_len - 6);
    }
    pos += 2 + len;
  }
  return 1;
}

Image ApplyOrientation(const Image& in, int orientation) {
  if (orientation < 2 || orientation > 8) return in;
  const int w = in.width, h = in.height;
  const bool transposed = orientation >= 5;
  Image out;
  out.width = transposed ? h : w;
  out.height = transposed ? w : h;
  out.pixels.resize(in.pixels.size());
  for (int y = 0; y < out.height; ++y) {
    for (int x = 0; x < out.width; ++x) {
      int sx = x, sy = y;
      switch (orientation) {
        case 2: sx = w - 1 - x; break;
        case 3: sx = w - 1 - x, sy = h - 1 - y; break;
        case 4: sy = h - 1 - y; break;
        case 5: sx = y, sy = x; break;
        case 6: sx = y, sy = h - 1 - x; break;
        case 7: sx = w - 1 - y, sy = h - 1 - x; break;
        case 8: sx = w - 1 - y, sy = x; break;
        default: break;
      }
      const uint8_t* s = &in.pixels[(static_cast<size_t>(sy) * static_cast<size_t>(w) + static_cast<size_t>(sx)) * 3];
      uint8_t* d = &out.pixels[(static_cast<size_t>(y) * static_cast<size_t>(out.width) + static_cast<size_t>(x)) * 3];
      d[0] = s[0];
      d[1] = s[1];
      d[2] = s[2];
    }
  }
  return out;
}

std::optional<ImageHeader> ReadImageHeader(std::string_view bytes) {
  std::optional<ImageHeader> h = ReadAnyImageHeader(bytes);
  // Sizes a decoder takes (a PNG's are 32-bit unsigned: their product must
  // not wrap a caller's arithmetic).
  if (h && (h->width <= 0 || h->height <= 0 || h->width > INT32_MAX || h->height > INT32_MAX)) return std::nullopt;
  return h;
}

static std::optional<ImageHeader> ReadAnyImageHeader(std::string_view bytes) {
  auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t n = bytes.size();
  ImageHeader h;
  if (n >= 3 && p[0] == 0xFF && p[1] == 0xD8 && p[2] == 0xFF) {
    thread_local TjHandle tj;
    int w = 0, ht = 0, subsamp = 0, colorspace = 0;
    if (!tj.h || tjDecompressHeader3(tj.h, p, static_cast<unsigned long>(n), &w, &ht, &subsamp, &colorspace) != 0) {
      tj.Reset();
      return std::nullopt;
    }
    h.format = ImageFormat::kJpeg;
    h.width = w;
    h.height = ht;
    return h;
  }
  if (n >= 33 && std::memcmp(p, "\x89PNG\r\n\x1a\n", 8) == 0 && std::memcmp(p + 12, "IHDR", 4) == 0) {
    h.format = ImageFormat::kPng;
    h.width = Read32(p + 16, false);
    h.height = Read32(p + 20, false);
    h.bytes_per_sample = p[24] == 16 ? 2 : 1;
    return h;
  }
  if (n >= 12 && std::memcmp(p, "RIFF", 4) == 0 && std::memcmp(p + 8, "WEBP", 4) == 0) {
    int w = 0, ht = 0;
    if (!WebPGetInfo(p, n, &w, &ht)) return std::nullopt;
    h.format = ImageFormat::kWebp;
    h.width = w;
    h.height = ht;
    return h;
  }
  if (n >= 2 && p[0] == 'B' && p[1] == 'M') {
    int w = 0, ht = 0, comp = 0;
    if (!stbi_info_from_memory(p, static_cast<int>(std::min<size_t>(n, INT32_MAX)), &w, &ht, &comp)) {
      return std::nullopt;
    }
    h.format = ImageFormat::kBmp;
    h.width = w;
    h.height = ht;
    return h;
  }
  return std::nullopt;
}

Result<DecodedImage> DecodeImage(std::string_view bytes, const DecodeOptions& options) {
  auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t n = bytes.size();
  if (n >= 3 && p[0] == 0xFF && p[1] == 0xD8 && p[2] == 0xFF) return DecodeJpeg(bytes, options);
  if (n >= 8 && std::memcmp(p, "\x89PNG\r\n\x1a\n", 8) == 0) return DecodePng(bytes, options);
  if (n >= 12 && std::memcmp(p, "RIFF", 4) == 0 && std::memcmp(p + 8, "WEBP", 4) == 0) {
    return DecodeWebp(bytes, options);
  }
  if (n >= 2 && p[0] == 'B' && p[1] == 'M') return DecodeWithStb(bytes, options, ImageFormat::kBmp);
  if (n >= 6 && (std::memcmp(p, "GIF87a", 6) == 0 || std::memcmp(p, "GIF89a", 6) == 0)) {
    // Said for what it is (a GIF is often an animation): not "corrupt".
    return std::unexpected(
        InvalidArgument("GIF images (animated or not) are not supported; send a frame as JPEG, "
                        "PNG, WebP or BMP"));
  }
  if (n == 0) return std::unexpected(InvalidArgument("the image is empty (0 bytes)"));
  return std::unexpected(InvalidArgument("the data is not an image Quern can decode (JPEG, PNG, BMP or WebP; " +
                                         std::to_string(n) + " bytes, none of these signatures)"));
}

}  // namespace quern
