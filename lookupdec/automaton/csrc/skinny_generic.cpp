// skinny.hpp's kernel at the compiler's default instruction set, the packing, and the dispatch.
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "skinny.hpp"

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

void skinny_linear(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y,
                   int64_t ldy, const char* isa) {
  kernel(isa)(x, ldx, m, k, panels, n, y, ldy, nullptr, nullptr);
}

void skinny_linear_tops(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y,
                        int64_t ldy, int32_t top_k, int32_t* tops, float weight_bound, const char* isa) {
  std::vector<RowTopK> best;
  std::vector<float> floors(static_cast<size_t>(m));
  std::vector<uint8_t> deferred(static_cast<size_t>(m));
  best.reserve(static_cast<size_t>(m));
  for (int64_t r = 0; r < m; ++r) {
    best.emplace_back(top_k, n);
    // Every output of the row is finite when its inputs are and sum |x| * max |w| stays far
    // below float's largest (each partial sum of products is bounded by it, rounding aside);
    // else the row may hold NaN or inf: the kernel offers it nothing (floor +inf) and it is
    // scanned whole once written.
    double norm = 0.0;
    for (int64_t i = 0; i < k; ++i) norm += std::fabs(static_cast<double>(x[r * ldx + i]));
    deferred[r] = !(norm * static_cast<double>(weight_bound) < 1e36);  // NaN or inf too
    floors[r] = deferred[r] ? std::numeric_limits<float>::infinity() : best.back().floor();
  }
  kernel(isa)(x, ldx, m, k, panels, n, y, ldy, best.data(), floors.data());
  for (int64_t r = 0; r < m; ++r) {
    RowTopK& row = best[static_cast<size_t>(r)];
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
