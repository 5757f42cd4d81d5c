// attention.hpp's task at the compiler's default instruction set, and the dispatch over tasks.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/attention.hpp"

#if defined(LOOKUPDEC_OPENMP)
#include <omp.h>
#endif

namespace lookupdec {

namespace attention_generic {
#include "attention_kernel.inc"
}  // namespace attention_generic

namespace {

struct Kernel {
  AttentionTask task;
  const char* isa;
};

// Every build this CPU runs, widest first.
const std::vector<Kernel>& kernels() {
  static const std::vector<Kernel> all = [] {
    std::vector<Kernel> out;
#if defined(LOOKUPDEC_SKINNY_X86)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) out.push_back({attention_avx512::task, "avx512"});
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back({attention_avx2::task, "avx2"});
#endif
    out.push_back({attention_generic::task, "generic"});
    return out;
  }();
  return all;
}

AttentionTask kernel(const char* isa) {
  if (isa == nullptr) return kernels().front().task;
  const std::string want(isa);
  for (const Kernel& k : kernels())
    if (want == k.isa) return k.task;
  throw std::invalid_argument("tree_attention: instruction set not run by this CPU: " + want);
}

}  // namespace

std::vector<std::string> attention_isas() {
  std::vector<std::string> out;
  for (const Kernel& k : kernels()) out.emplace_back(k.isa);
  return out;
}

int64_t attention_plan(const void* mask, bool boolean, int64_t B, int64_t Q, int64_t L, int64_t sb, int64_t st,
                       float hidden, int64_t width, int32_t* cols, int32_t* counts, int32_t* common, float* bias,
                       uint8_t* live) {
  const float* values = boolean ? nullptr : static_cast<const float*>(mask);
  const uint8_t* flags = boolean ? static_cast<const uint8_t*>(mask) : nullptr;
  auto seen = [&](int64_t b, int64_t t, int64_t j) {
    const int64_t at = b * sb + t * st + j;
    return boolean ? flags[at] != 0 : values[at] > hidden;
  };
  auto value = [&](int64_t b, int64_t t, int64_t j) { return boolean ? 0.0f : values[b * sb + t * st + j]; };
  const float inf = std::numeric_limits<float>::infinity();
  int64_t most = 0;
  std::vector<uint8_t> kind(static_cast<size_t>(L));  // 0 common, 1 the rest seen, 2 unseen
  for (int64_t b = 0; b < B; ++b) {
    uint8_t* lv = live + b * Q;
    for (int64_t t = 0; t < Q; ++t) {
      lv[t] = 0;
      for (int64_t j = 0; j < L && !lv[t]; ++j) lv[t] = seen(b, t, j);
    }
    for (int64_t j = 0; j < L; ++j) {
      bool any = false, plain = true;
      for (int64_t t = 0; t < Q; ++t) {
        const bool s = seen(b, t, j);
        any = any || s;
        if (lv[t] && !(s && value(b, t, j) == 0.0f)) plain = false;
      }
      kind[j] = !any ? 2 : plain ? 0 : 1;
    }
    int32_t* c = cols + b * width;
    int64_t n = 0;
    for (uint8_t k = 0; k < 2; ++k) {
      for (int64_t j = 0; j < L; ++j)
        if (kind[j] == k) c[n++] = static_cast<int32_t>(j);
      if (k == 0) common[b] = static_cast<int32_t>(n);
    }
    counts[b] = static_cast<int32_t>(n);
    most = std::max(most, n);
    for (int64_t t = 0; t < Q; ++t) {
      float* row = bias + (b * Q + t) * width;
      for (int64_t i = 0; i < n; ++i) row[i] = seen(b, t, c[i]) ? value(b, t, c[i]) : -inf;
    }
  }
  return most;
}

void tree_attention(const AttentionArgs& a, int threads, const char* isa) {
  const AttentionTask task = kernel(isa);
  const int64_t folded = a.H / a.KVH * a.Q;
  const int64_t blocks = (folded + 15) / 16;  // lanes split evenly: 24 = 12 + 12, not 16 + 8
  const int64_t tasks = a.B * a.KVH * blocks;
  const size_t scratch = static_cast<size_t>(std::max<int64_t>(a.cmax, 1)) * 16;
  auto one = [&](int64_t t, float* s) {
    const int64_t blk = t % blocks, bg = t / blocks, b = bg / a.KVH, g = bg % a.KVH;
    const int64_t first = folded * blk / blocks, last = folded * (blk + 1) / blocks;
    task(a, b, g, first, last - first, s);
  };
#if defined(LOOKUPDEC_OPENMP)
  if (threads > 1 && tasks > 1 && !omp_in_parallel()) {
    const int n = static_cast<int>(std::min<int64_t>(threads, tasks));
#pragma omp parallel num_threads(n)
    {
      std::vector<float> s(scratch + 16);
      float* aligned = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(s.data()) + 63) & ~uintptr_t{63});
      const int r = omp_get_thread_num(), got = omp_get_num_threads();
      for (int64_t t = tasks * r / got; t < tasks * (r + 1) / got; ++t) one(t, aligned);
    }
    return;
  }
#endif
  (void)threads;
  std::vector<float> s(scratch + 16);
  float* aligned = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(s.data()) + 63) & ~uintptr_t{63});
  for (int64_t t = 0; t < tasks; ++t) one(t, aligned);
}

}  // namespace lookupdec
