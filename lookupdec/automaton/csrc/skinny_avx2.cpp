// skinny.hpp's kernel for AVX2 (compiled with -mavx2 -mfma; run only where the CPU has them), in
// intrinsics: 6 rows x one panel (two ymm halves) = 12 ymm accumulators.
#include <cstring>

#include "skinny.hpp"

#if defined(LOOKUPDEC_SKINNY_X86)
#include <immintrin.h>
#endif

namespace lookupdec::skinny_avx2 {
#if defined(LOOKUPDEC_SKINNY_X86)
namespace {

template <int R>
inline void block(const float* x, int64_t ldx, const float* panel, int64_t k, float* y, int64_t ldy, int64_t col,
                  int64_t n) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 wlo = _mm256_loadu_ps(panel + i * 16), whi = _mm256_loadu_ps(panel + i * 16 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_broadcast_ss(x + r * ldx + i);
      lo[r] = _mm256_fmadd_ps(s, wlo, lo[r]);
      hi[r] = _mm256_fmadd_ps(s, whi, hi[r]);
    }
  }
  const int64_t valid = n - col < 16 ? n - col : 16;
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[16];
    _mm256_store_ps(out, lo[r]);
    _mm256_store_ps(out + 8, hi[r]);
    std::memcpy(y + r * ldy + col, out, valid * sizeof(float));
  }
}

template <int R>
void rows(int r, const float* x, int64_t ldx, const float* panel, int64_t k, float* y, int64_t ldy, int64_t col,
          int64_t n) {
  if constexpr (R > 1) {
    if (r < R) return rows<R - 1>(r, x, ldx, panel, k, y, ldy, col, n);
  }
  block<R>(x, ldx, panel, k, y, ldy, col, n);
}

}  // namespace

void linear(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y,
            int64_t ldy) {
  constexpr int R = 6;
  const int64_t count = (n + 15) / 16;
  const int64_t blocks = (m + R - 1) / R;
  for (int64_t p = 0; p < count; ++p)
    for (int64_t b = 0, r = 0; b < blocks; ++b) {  // rows split evenly
      const int64_t end = m * (b + 1) / blocks;
      rows<R>(static_cast<int>(end - r), x + r * ldx, ldx, panels + p * k * 16, k, y + r * ldy, ldy, p * 16, n);
      r = end;
    }
}
#else
void linear(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*, int64_t) {}
#endif
}  // namespace lookupdec::skinny_avx2
