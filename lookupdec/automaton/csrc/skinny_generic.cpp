// skinny.hpp's kernel at the compiler's default instruction set, the packing, and the dispatch.
#include <cstring>
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
using Linear = void (*)(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*, int64_t);

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
}  // namespace

void skinny_linear(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y,
                   int64_t ldy, const char* isa) {
  Linear linear = chosen().linear;
  if (isa != nullptr) {  // a given instruction set (tests compare each this CPU runs)
    const std::string want(isa);
    linear = nullptr;
    for (const Chosen& c : supported())
      if (want == c.isa) linear = c.linear;
    if (linear == nullptr) throw std::invalid_argument("skinny_linear: instruction set not run by this CPU: " + want);
  }
  linear(x, ldx, m, k, panels, n, y, ldy);
}

const char* skinny_isa() { return chosen().isa; }

std::vector<std::string> skinny_isas() {
  std::vector<std::string> out;
  for (const Chosen& c : supported()) out.emplace_back(c.isa);
  return out;
}

}  // namespace lookupdec
