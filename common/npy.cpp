#include "npy.h"

#include <fstream>
#include <stdexcept>

namespace attn {

void save_npy(const std::string& path, const std::vector<float>& values,
              const std::vector<size_t>& shape) {
  std::string dims;
  for (size_t d : shape) dims += std::to_string(d) + ",";
  if (shape.size() > 1) dims.pop_back();  // a 1-d shape keeps its trailing comma: (n,)
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Magic, version, header length; the header is padded with spaces to a multiple of 64 bytes
  // and ends in a newline.
  const size_t preamble = 10;
  header.append(64 - (preamble + header.size() + 1) % 64, ' ');
  header += '\n';
  std::ofstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot write " + path);
  const unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  file.write(reinterpret_cast<const char*>(magic), sizeof magic);
  const unsigned short header_len = static_cast<unsigned short>(header.size());
  const char len_bytes[2] = {char(header_len & 0xFF), char(header_len >> 8)};
  file.write(len_bytes, 2);
  file << header;
  file.write(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  if (!file) throw std::runtime_error("cannot write " + path);
}

}  // namespace attn
