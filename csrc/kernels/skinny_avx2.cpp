// skinny.hpp's kernel for AVX2 (compiled with -mavx2 -mfma; run only where the CPU has them), in
// intrinsics: 6 rows x one panel (two ymm halves) = 12 ymm accumulators.
#include <cstring>

#include "kernels/skinny.hpp"

#if defined(LOOKUPDEC_SKINNY_X86)
#include <immintrin.h>
#endif

namespace lookupdec::skinny_avx2 {
#if defined(LOOKUPDEC_SKINNY_X86)
namespace {

template <int R>
inline void block(const float* x, int64_t ldx, const float* panel, int64_t k, float* y, int64_t ldy, int64_t col,
                  int64_t n, RowTopK* tops, float* floors) {
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
  uint32_t flagged = 0;  // as the AVX-512 kernel: rows that may beat their floor, found before the stores
  if (tops != nullptr)
    for (int r = 0; r < R; ++r)
      flagged |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_max_ps(lo[r], hi[r]),
                                                                         _mm256_set1_ps(floors[r]), _CMP_GT_OQ)) != 0)
                 << r;
  const int64_t valid = n - col < 16 ? n - col : 16;
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[16];
    _mm256_store_ps(out, lo[r]);
    _mm256_store_ps(out + 8, hi[r]);
    std::memcpy(y + r * ldy + col, out, valid * sizeof(float));
  }
  if (flagged) offer_rows(tops, floors, y, ldy, col, col + valid, flagged);
}

template <int R>
void rows(int r, const float* x, int64_t ldx, const float* panel, int64_t k, float* y, int64_t ldy, int64_t col,
          int64_t n, RowTopK* tops, float* floors) {
  if constexpr (R > 1) {
    if (r < R) return rows<R - 1>(r, x, ldx, panel, k, y, ldy, col, n, tops, floors);
  }
  block<R>(x, ldx, panel, k, y, ldy, col, n, tops, floors);
}

}  // namespace

void linear(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y,
            int64_t ldy, RowTopK* tops, float* floors) {
  constexpr int R = 6;
  const int64_t count = (n + 15) / 16;
  const int64_t blocks = (m + R - 1) / R;
  for (int64_t p = 0; p < count; ++p)
    for (int64_t b = 0, r = 0; b < blocks; ++b) {  // rows split evenly
      const int64_t end = m * (b + 1) / blocks;
      rows<R>(static_cast<int>(end - r), x + r * ldx, ldx, panels + p * k * 16, k, y + r * ldy, ldy, p * 16, n,
                tops ? tops + r : nullptr, floors ? floors + r : nullptr);
      r = end;
    }
}
#else
void linear(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*, int64_t, RowTopK*, float*) {}
#endif
}  // namespace lookupdec::skinny_avx2
