// skinny.hpp's kernel for AVX-512 (compiled with -mavx512f -mfma; run only where the CPU has
// them), in intrinsics: 8 rows x 3 panels = 24 zmm accumulators, each panel row one load.
#include <cstring>

#include "kernels/skinny.hpp"

#if defined(LOOKUPDEC_SKINNY_X86)
#include <immintrin.h>
#endif

namespace lookupdec::skinny_avx512 {
#if defined(LOOKUPDEC_SKINNY_X86)
namespace {

constexpr int64_t kPrefetchAhead = 256;  // floats: 16 panel rows (a prefetch never faults past the end)

// Picks: each row's maximum over the block compared with its floor (floors[r]) in registers,
// without a branch per row (a deferred row's floor is +inf); the rows whose block may beat it
// are offered from memory after the stores (offer_rows: rare once the floors are high).
template <int R, int G, bool Picks>
inline void block(const float* x, int64_t ldx, const float* panels, int64_t k, float* y, int64_t ldy, int64_t col,
                  int64_t n, RowTopK* tops, float* floors) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  const float* p[G];
  for (int g = 0; g < G; ++g) p[g] = panels + g * k * 16;
  for (int64_t i = 0; i < k; ++i) {
    if ((i & 3) == 0)  // each panel's line 1 KB ahead: the hardware prefetcher alone kept too few reads in flight
      for (int g = 0; g < G; ++g) _mm_prefetch(reinterpret_cast<const char*>(p[g] + i * 16 + kPrefetchAhead), _MM_HINT_T0);
    __m512 w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm512_loadu_ps(p[g] + i * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(x[r * ldx + i]);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_fmadd_ps(s, w[g], acc[r][g]);
    }
  }
  uint32_t flagged = 0;
  if constexpr (Picks) {
    for (int r = 0; r < R; ++r) {
      __m512 best = acc[r][0];
      for (int g = 1; g < G; ++g) best = _mm512_max_ps(best, acc[r][g]);
      flagged |= static_cast<uint32_t>(_mm512_cmp_ps_mask(best, _mm512_set1_ps(floors[r]), _CMP_GT_OQ) != 0) << r;
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t c = col + g * 16;
    const int64_t valid = n - c < 16 ? n - c : 16;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + c, mask, acc[r][g]);
  }
  if constexpr (Picks) {
    if (flagged) offer_rows(tops, floors, y, ldy, col, col + G * 16 < n ? col + G * 16 : n, flagged);
  }
}

template <int G, int R, bool Picks>
void rows(int r, const float* x, int64_t ldx, const float* panels, int64_t k, float* y, int64_t ldy, int64_t col,
          int64_t n, RowTopK* tops, float* floors) {
  if constexpr (R > 1) {
    if (r < R) return rows<G, R - 1, Picks>(r, x, ldx, panels, k, y, ldy, col, n, tops, floors);
  }
  block<R, G, Picks>(x, ldx, panels, k, y, ldy, col, n, tops, floors);
}

template <bool Picks>
void run(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y, int64_t ldy,
         RowTopK* tops, float* floors) {
  constexpr int G = 3, R = 8;
  const int64_t count = (n + 15) / 16;
  const int64_t blocks = (m + R - 1) / R;
  int64_t p = 0;
  for (; p + G <= count; p += G)
    for (int64_t b = 0, r = 0; b < blocks; ++b) {  // rows split evenly: 12 = 6 + 6, not 8 + 4
      const int64_t end = m * (b + 1) / blocks;
      rows<G, R, Picks>(static_cast<int>(end - r), x + r * ldx, ldx, panels + p * k * 16, k, y + r * ldy, ldy, p * 16,
                        n, tops + r, floors + r);
      r = end;
    }
  for (; p < count; ++p)
    for (int64_t b = 0, r = 0; b < blocks; ++b) {
      const int64_t end = m * (b + 1) / blocks;
      rows<1, R, Picks>(static_cast<int>(end - r), x + r * ldx, ldx, panels + p * k * 16, k, y + r * ldy, ldy, p * 16,
                        n, tops + r, floors + r);
      r = end;
    }
}

}  // namespace

void linear(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y,
            int64_t ldy, RowTopK* tops, float* floors) {
  if (tops != nullptr)
    run<true>(x, ldx, m, k, panels, n, y, ldy, tops, floors);
  else
    run<false>(x, ldx, m, k, panels, n, y, ldy, nullptr, nullptr);
}
#else
void linear(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*, int64_t, RowTopK*, float*) {}
#endif
}  // namespace lookupdec::skinny_avx512
