// Reading a row of logits: its argmax and its k best entries (see topk.hpp). Used by the greedy
// walk (tree/tree.cpp), sampling's top tokens and the skinny product's picks
// (kernels/skinny.hpp), which must pick as the walk does.
#include "common/topk.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LOOKUPDEC_X86 1
#endif

namespace lookupdec {

namespace {

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (x[j] != x[j]) return j;
  return -1;
}

int64_t argmax_scalar(const float* x, int64_t n) {
  int64_t nan = first_nan(x, n);
  if (nan >= 0) return nan;
  int64_t best = 0;
  for (int64_t j = 1; j < n; ++j)
    if (x[j] > x[best]) best = j;
  return best;
}

#ifdef LOOKUPDEC_X86
// One pass over the row in blocks of 1024: each block's maximum (4 x 8 lanes) and whether a
// NaN occurs; the first block holding the largest maximum is read again for its first index.
__attribute__((target("avx2"))) int64_t argmax_avx2(const float* x, int64_t n) {
  constexpr int64_t kBlock = 1024;
  const float ninf = -std::numeric_limits<float>::infinity();
  float best = ninf;
  int64_t best_block = 0;
  __m256 unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    __m256 m0 = _mm256_set1_ps(ninf), m1 = m0, m2 = m0, m3 = m0;
    for (int64_t j = i; j < i + kBlock; j += 32) {
      __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + 8);
      __m256 c = _mm256_loadu_ps(x + j + 16), d = _mm256_loadu_ps(x + j + 24);
      m0 = _mm256_max_ps(a, m0);  // a NaN in a leaves m0: NaNs are found by `unordered`
      m1 = _mm256_max_ps(b, m1);
      m2 = _mm256_max_ps(c, m2);
      m3 = _mm256_max_ps(d, m3);
      unordered = _mm256_or_ps(unordered, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q),
                                                       _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
    }
    __m256 m = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float block_max = _mm_cvtss_f32(h);
    if (block_max > best) {
      best = block_max;
      best_block = i;
    }
  }
  bool nan = _mm256_movemask_ps(unordered) != 0;
  int64_t tail = i, tail_best = -1;
  for (; i < n; ++i) {
    nan = nan || x[i] != x[i];
    if (x[i] > best) {
      best = x[i];
      tail_best = i;
    }
  }
  if (nan) return first_nan(x, n);
  if (tail_best >= 0) return tail_best;
  __m256 target = _mm256_set1_ps(best);
  int64_t end = best_block + kBlock < tail ? best_block + kBlock : tail;
  for (int64_t j = best_block; j + 8 <= end; j += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
    if (mask) return j + __builtin_ctz(static_cast<unsigned>(mask));
  }
  return 0;  // every entry -inf: the first
}
#endif

}  // namespace

int64_t row_argmax(const float* x, int64_t n) {
  if (n <= 0) throw std::invalid_argument("row_argmax: empty row");
#ifdef LOOKUPDEC_X86
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return argmax_avx2(x, n);
#endif
  return argmax_scalar(x, n);
}

void RowTopK::add(float v, int32_t j) {
  if (want_ == 0) return;
  if (v != v) {
    if (nans_.size() < want_) nans_.push_back(j);
    return;
  }
  if (!(v > floor_)) return;
  auto at = std::upper_bound(best_.begin(), best_.end(), v,
                             [](float value, const std::pair<float, int32_t>& e) { return value > e.first; });
  best_.insert(at, {v, j});  // after equal values: the earlier index first
  if (best_.size() > want_) best_.pop_back();
  if (best_.size() == want_) floor_ = best_.back().first;
}

namespace {

#ifdef LOOKUPDEC_X86
// Entries above the floor (or NaN) of x[j, j + 8) go to `top`, in index order.
__attribute__((target("avx2"))) inline void topk_block8(const float* x, int64_t j, RowTopK* top) {
  __m256 v = _mm256_loadu_ps(x + j);
  __m256 floor = _mm256_set1_ps(top->floor());
  int mask = _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v, floor, _CMP_GT_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // RowTopK::add is plain (SSE) code: with the upper halves of the ymm registers dirty every SSE
  // instruction waits on them (a row's top k took several times its argmax without this line)
  if (mask) _mm256_zeroupper();
  while (mask) {
    int lane = __builtin_ctz(static_cast<unsigned>(mask));
    top->add(x[j + lane], static_cast<int32_t>(j + lane));
    mask &= mask - 1;
  }
}

// 32 entries per test: once the floor is high (after the first few hundred entries of a row of
// logits) almost no block holds a candidate, and a block is one max and one compare; a block
// with one (or a NaN) is taken 8 at a time, in index order, as before.
__attribute__((target("avx2"))) void scan_topk_avx2(const float* x, int64_t begin, int64_t end, RowTopK* top) {
  int64_t j = begin;
  __m256 floor = _mm256_set1_ps(top->floor());
  for (; j + 32 <= end; j += 32) {
    __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + 8);
    __m256 c = _mm256_loadu_ps(x + j + 16), d = _mm256_loadu_ps(x + j + 24);
    __m256 m = _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d));  // a NaN may vanish here...
    __m256 unordered = _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q));  // ...not here
    if (_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(m, floor, _CMP_GT_OQ), unordered)) == 0) continue;
    for (int64_t k = j; k < j + 32; k += 8) topk_block8(x, k, top);
    floor = _mm256_set1_ps(top->floor());
  }
  for (; j + 8 <= end; j += 8) topk_block8(x, j, top);
  _mm256_zeroupper();
  for (; j < end; ++j) top->add(x[j], static_cast<int32_t>(j));
}
#endif

}  // namespace

RowTopK::RowTopK(int64_t k, int64_t n) : want_(static_cast<size_t>(std::max<int64_t>(0, std::min(k, n)))) {
  best_.reserve(want_ + 1);
}

void RowTopK::merge(const RowTopK& later, int32_t offset) {
  for (int32_t j : later.nans_)
    if (nans_.size() < want_) nans_.push_back(j + offset);
  // later's best in its order (value descending, index ascending): equal values stay in index order
  for (const auto& e : later.best_) add(e.first, e.second + offset);
}

void RowTopK::scan(const float* x, int64_t begin, int64_t end) {
  if (want_ == 0) return;
#ifdef LOOKUPDEC_X86
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) {
    scan_topk_avx2(x, begin, end, this);
    return;
  }
#endif
  for (int64_t j = begin; j < end; ++j) add(x[j], static_cast<int32_t>(j));
}

void RowTopK::finish(int32_t* out) const {
  size_t got = 0;
  for (int32_t j : nans_) out[got++] = j;  // repeated argmax takes NaNs first
  for (const auto& e : best_) {
    if (got == want_) break;
    out[got++] = e.second;
  }
  while (got < want_) out[got++] = 0;  // then only -inf is left: index 0
}

void row_topk(const float* x, int64_t n, int32_t k, std::vector<int32_t>* out) {
  RowTopK top(k, n);
  top.scan(x, 0, n);
  out->resize(top.size());
  top.finish(out->data());
}

}  // namespace lookupdec
