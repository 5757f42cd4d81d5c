#include "kernels/norm.hpp"

#include <algorithm>
#include <cmath>

namespace lookupdec {

namespace {

constexpr int kLanes = 8;    // ATen's float Vectorized for its sum kernel (AVX2 build: 8 lanes)
constexpr int kIlp = 4;      // vectors summed side by side
constexpr int kLevels = 4;   // levels of partial sums

int64_t ceil_log2(int64_t v) {  // as ATen's utils::CeilLog2: 1 for v <= 2
  if (v <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t u = static_cast<uint64_t>(v - 1); u; u >>= 1) ++bits;
  return bits;
}

}  // namespace

float ordered_sum_of_squares(const float* x, int64_t n) {
  const int64_t vectors = n / kLanes;
  const int64_t steps = vectors / kIlp;  // steps of kIlp vectors
  float acc[kLevels][kIlp][kLanes] = {};
  auto add_vector = [&](float* into, int64_t vector) {
    const float* v = x + vector * kLanes;
    for (int l = 0; l < kLanes; ++l) {
      const float sq = v[l] * v[l];
      into[l] = into[l] + sq;
    }
  };
  const int64_t power = std::max<int64_t>(4, ceil_log2(steps) / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  int64_t i = 0;
  while (i + step <= steps) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
    for (int level = 1; level < kLevels; ++level) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < kLanes; ++l) {
          acc[level][k][l] = acc[level][k][l] + acc[level - 1][k][l];
          acc[level - 1][k][l] = 0.0f;
        }
      if ((i & (mask << (level * power))) != 0) break;
    }
  }
  for (; i < steps; ++i)
    for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
  for (int level = 1; level < kLevels; ++level)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < kLanes; ++l) acc[0][k][l] = acc[0][k][l] + acc[level][k][l];
  for (int64_t v = steps * kIlp; v < vectors; ++v) add_vector(acc[0][0], v);  // vectors past the last step
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < kLanes; ++l) acc[0][0][l] = acc[0][0][l] + acc[0][k][l];
  float total = 0.0f;
  for (int64_t t = vectors * kLanes; t < n; ++t) {
    const float sq = x[t] * x[t];
    total = total + sq;
  }
  for (int l = 0; l < kLanes; ++l) total = total + acc[0][0][l];
  return total;
}

void rms_norm(const float* x, int64_t ldx, int64_t rows, int64_t n, const float* w, float eps, float* y,
              int64_t ldy) {
  const float count = static_cast<float>(n);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
    const float sum = ordered_sum_of_squares(xr, n);
    const float mean = sum / count;  // (ATen divides: a product by 1 / n rounds otherwise)
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < n; ++i) {
      const float normed = xr[i] * scale;
      yr[i] = normed * w[i];
    }
  }
}

}  // namespace lookupdec
