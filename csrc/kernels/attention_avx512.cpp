// attention.hpp's task for AVX-512 (compiled with -mavx512f -mfma; run only where the CPU has them).
#include <cstdint>
#include <cstring>

#include "kernels/attention.hpp"

namespace lookupdec::attention_avx512 {
#if defined(LOOKUPDEC_SKINNY_X86)
#include "attention_kernel.inc"
#else
void task(const AttentionArgs&, int64_t, int64_t, int64_t, int64_t, float*) {}
#endif
}  // namespace lookupdec::attention_avx512
