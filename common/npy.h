// Writes arrays as NumPy .npy files (format 1.0, little-endian float32), so a learner can load a
// run's inputs and outputs with numpy.load or torch.from_numpy.
#pragma once

#include <string>
#include <vector>

namespace attn {

// Throws std::runtime_error when the file cannot be written.
void save_npy(const std::string& path, const std::vector<float>& values,
              const std::vector<size_t>& shape);

}  // namespace attn
