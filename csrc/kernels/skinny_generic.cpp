// skinny.hpp's kernel at the compiler's default instruction set, the packing, and the dispatch.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/skinny.hpp"

#if defined(LOOKUPDEC_OPENMP)
#include <omp.h>
#endif

namespace lookupdec {

namespace skinny_generic {
#define SKINNY_GROUP 1
#define SKINNY_ROWS 3
#include "skinny_kernel.inc"
}  // namespace skinny_generic

void skinny_pack(const float* w, int64_t n, int64_t k, float* panels) {
  const int64_t count = (n + 15) / 16;
  for (int64_t p = 0; p < count; ++p)
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t row = p * 16 + j;
        panels[(p * k + i) * 16 + j] = row < n ? w[row * k + i] : 0.0f;
      }
}

namespace {
using Linear = void (*)(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*, int64_t, RowTopK*,
                       float*);

struct Chosen {
  Linear linear;
  const char* isa;
};

// Every kernel this CPU runs, widest first.
const std::vector<Chosen>& supported() {
  static const std::vector<Chosen> all = [] {
    std::vector<Chosen> out;
#if defined(LOOKUPDEC_SKINNY_X86)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) out.push_back({skinny_avx512::linear, "avx512"});
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back({skinny_avx2::linear, "avx2"});
#endif
    out.push_back({skinny_generic::linear, "generic"});
    return out;
  }();
  return all;
}

const Chosen& chosen() { return supported().front(); }

// The kernel named `isa` (null: the widest this CPU runs).
Linear kernel(const char* isa) {
  if (isa == nullptr) return chosen().linear;
  const std::string want(isa);  // a given instruction set (tests compare each this CPU runs)
  for (const Chosen& c : supported())
    if (want == c.isa) return c.linear;
  throw std::invalid_argument("skinny_linear: instruction set not run by this CPU: " + want);
}
}  // namespace

namespace {
std::atomic<int> thread_cap{1 << 20};  // set_skinny_thread_cap
}  // namespace

void set_skinny_thread_cap(int cap) { thread_cap.store(std::max(cap, 1)); }

int skinny_threads(int64_t n) {
#if defined(LOOKUPDEC_OPENMP)
  if (omp_in_parallel()) return 1;
  const int64_t most = std::min<int64_t>((n + kPanel - 1) / kPanel / kMinThreadPanels, thread_cap.load());
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), most)));
#else
  (void)n;
  return 1;
#endif
}

namespace {
// fn(first, last, run) for contiguous runs [first, last) of the `count` panels, one per OpenMP
// thread (up to `threads`; here alone where threads <= 1); returns how many runs there were.
// Run r starts at panel count * r / runs.
template <class F>
int split_panels(int threads, int64_t count, F&& fn) {
  int runs = 1;
#if defined(LOOKUPDEC_OPENMP)
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    {
      const int r = omp_get_thread_num(), got = omp_get_num_threads();
      if (r == 0) runs = got;  // read after the region's barrier
      const int64_t first = count * r / got, last = count * (r + 1) / got;
      if (last > first) fn(first, last, r);
    }
    return runs;
  }
#endif
  (void)threads;
  fn(0, count, 0);
  return runs;
}
}  // namespace

void skinny_linear(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y,
                   int64_t ldy, const char* isa) {
  const Linear linear = kernel(isa);
  // each thread a run of whole panels: every output is the same sum as on one thread
  split_panels(skinny_threads(n), (n + kPanel - 1) / kPanel, [&](int64_t first, int64_t last, int) {
    linear(x, ldx, m, k, panels + first * k * kPanel, std::min(n, last * kPanel) - first * kPanel, y + first * kPanel,
           ldy, nullptr, nullptr);
  });
}

void skinny_linear_tops(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y,
                        int64_t ldy, int32_t top_k, int32_t* tops, float weight_bound, const char* isa) {
  const Linear linear = kernel(isa);
  const int threads = skinny_threads(n);
  std::vector<uint8_t> deferred(static_cast<size_t>(m));
  for (int64_t r = 0; r < m; ++r) {
    // Every output of the row is finite when its inputs are and sum |x| * max |w| stays far
    // below float's largest (each partial sum of products is bounded by it, rounding aside);
    // else the row may hold NaN or inf: the kernel offers it nothing (floor +inf) and it is
    // scanned whole once written.
    double norm = 0.0;
    for (int64_t i = 0; i < k; ++i) norm += std::fabs(static_cast<double>(x[r * ldx + i]));
    deferred[r] = !(norm * static_cast<double>(weight_bound) < 1e36);  // NaN or inf too
  }
  // per run of panels (skinny_linear's), each row's picks among its columns and their floors
  std::vector<std::vector<RowTopK>> best(static_cast<size_t>(threads));
  std::vector<std::vector<float>> floors(static_cast<size_t>(threads), std::vector<float>(static_cast<size_t>(m)));
  for (int t = 0; t < threads; ++t) {
    best[t].reserve(static_cast<size_t>(m));
    for (int64_t r = 0; r < m; ++r) {
      best[t].emplace_back(top_k, n);
      floors[t][r] = deferred[r] ? std::numeric_limits<float>::infinity() : best[t].back().floor();
    }
  }
  const int64_t count = (n + kPanel - 1) / kPanel;
  const int runs = split_panels(threads, count, [&](int64_t first, int64_t last, int run) {
    linear(x, ldx, m, k, panels + first * k * kPanel, std::min(n, last * kPanel) - first * kPanel, y + first * kPanel,
           ldy, best[run].data(), floors[run].data());
  });
  for (int64_t r = 0; r < m; ++r) {
    RowTopK& row = best[0][static_cast<size_t>(r)];
    for (int run = 1; run < runs; ++run)  // later runs' columns come after: merged in index order
      row.merge(best[run][static_cast<size_t>(r)], static_cast<int32_t>(count * run / runs * kPanel));
    if (deferred[r]) row.scan(y + r * ldy, 0, n);
    row.finish(tops + r * top_k);
  }
}

const char* skinny_isa() { return chosen().isa; }

std::vector<std::string> skinny_isas() {
  std::vector<std::string> out;
  for (const Chosen& c : supported()) out.emplace_back(c.isa);
  return out;
}

}  // namespace lookupdec
