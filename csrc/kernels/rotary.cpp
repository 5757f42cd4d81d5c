#include "kernels/rotary.hpp"

namespace lookupdec {

void rotary(const float* x, const int64_t* shape, const int64_t* xs, const float* cos, const float* sin,
            int64_t cos_batch, float* out, const int64_t* os) {
  const int64_t B = shape[0], H = shape[1], T = shape[2], D = shape[3], half = D / 2;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        const float* xr = x + b * xs[0] + h * xs[1] + t * xs[2];
        float* o = out + b * os[0] + h * os[1] + t * os[2];
        const float* c = cos + b * cos_batch + t * D;
        const float* s = sin + b * cos_batch + t * D;
        const int64_t xd = xs[3], od = os[3];
        for (int64_t i = 0; i < half; ++i) {
          const float a = xr[i * xd] * c[i];
          const float r = -xr[(i + half) * xd];
          o[i * od] = a + r * s[i];
        }
        for (int64_t i = half; i < D; ++i) {
          const float a = xr[i * xd] * c[i];
          o[i * od] = a + xr[(i - half) * xd] * s[i];
        }
      }
    }
  }
}

}  // namespace lookupdec
