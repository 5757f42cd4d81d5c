// attention.hpp's task for AVX2 (compiled with -mavx2 -mfma; run only where the CPU has them).
#include <cstdint>
#include <cstring>

#include "kernels/attention.hpp"

namespace lookupdec::attention_avx2 {
#if defined(LOOKUPDEC_SKINNY_X86)
#include "attention_kernel.inc"
#else
void task(const AttentionArgs&, int64_t, int64_t, int64_t, int64_t, float*) {}
#endif
}  // namespace lookupdec::attention_avx2
