#include "core/npy.h"

#include <fstream>
#include <sstream>

namespace quern {
namespace {

std::optional<DataType> FromDescr(const std::string& d) {
  if (d == "<f4") return DataType::kFp32;
  if (d == "<f8") return DataType::kFp64;
  if (d == "<f2") return DataType::kFp16;
  if (d == "<i8") return DataType::kInt64;
  if (d == "<i4") return DataType::kInt32;
  if (d == "<i2") return DataType::kInt16;
  if (d == "|i1") return DataType::kInt8;
  if (d == "|u1") return DataType::kUint8;
  if (d == "|b1") return DataType::kBool;
  return std::nullopt;
}

std::string Field(const std::string& header, const std::string& key) {
  auto k = header.find("'" + key + "'");
  if (k == std::string::npos) return "";
  auto colon = header.find(':', k);
  auto start = header.find_first_not_of(' ', colon + 1);
  if (header[start] == '\'') return header.substr(start + 1, header.find('\'', start + 1) - start - 1);
  if (header[start] == '(') return header.substr(start + 1, header.find(')', start) - start - 1);
  return header.substr(start, header.find_first_of(",}", start) - start);
}

}  // namespace

Result<Tensor> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Err(NotFound("cannot open " + path));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0) {
    return Err(InvalidArgument(path + " is not a .npy file"));
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len, offset;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9]) << 8;
    offset = 10;
  } else {
    if (bytes.size() < 12) return Err(InvalidArgument(path + ": truncated header"));
    header_len = 0;
    for (int i = 0; i < 4; ++i) header_len |= static_cast<size_t>(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    offset = 12;
  }
  if (offset + header_len > bytes.size()) return Err(InvalidArgument(path + ": truncated header"));
  const std::string header = bytes.substr(offset, header_len);
  const std::string descr = Field(header, "descr");
  auto dtype = FromDescr(descr);
  if (!dtype) return Err(InvalidArgument(path + ": unsupported dtype '" + descr + "'"));
  if (Field(header, "fortran_order") == "True") return Err(InvalidArgument(path + ": Fortran order is not supported"));
  Shape shape;
  std::stringstream dims(Field(header, "shape"));
  std::string item;
  while (std::getline(dims, item, ',')) {
    if (item.find_first_not_of(' ') == std::string::npos) continue;
    shape.push_back(std::stoll(item));
  }
  const size_t data_off = offset + header_len;
  const size_t want = static_cast<size_t>(ElementCount(shape)) * DataTypeByteSize(*dtype);
  if (bytes.size() - data_off != want) {
    return Err(InvalidArgument(path + ": holds " + std::to_string(bytes.size() - data_off) + " data bytes, shape " +
                               ShapeToString(shape) + " needs " + std::to_string(want)));
  }
  Tensor t = Tensor::Allocate(*dtype, shape, want);
  std::memcpy(t.mutable_data(), bytes.data() + data_off, want);
  return t;
}

}  // namespace quern
