// RMS normalisation of float32 rows, bit for bit what torch's CPU `F.rms_norm` computes for a
// float32 input and weight (ATen's composite: x.pow(2), its mean over the row, + eps, rsqrt,
// x * that, * weight), in one call instead of about ten ATen operations. The mean's sum adds in
// the order of ATen's float `sum` over a contiguous row (`cascade_sum`'s inner reduction, built
// for 8-lane vectors: 4 vectors a step, their partial sums carried up 4 levels every 2^p steps,
// then the vectors, the scalar tail and the 8 lanes folded in order); every other operation is
// one IEEE float operation as there (norm.cpp is compiled with -ffp-contract=off). The engine
// uses it only where a probe gives bit-equal results on this machine (model/kernels.py).
#pragma once

#include <cstdint>

namespace lookupdec {

// The sum of the squares of x[0..n) in ATen's order (see above).
float ordered_sum_of_squares(const float* x, int64_t n);

// y[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w for rows r in [0, rows): rows of n floats at
// x + r * ldx and y + r * ldy.
void rms_norm(const float* x, int64_t ldx, int64_t rows, int64_t n, const float* w, float eps, float* y,
              int64_t ldy);

}  // namespace lookupdec
