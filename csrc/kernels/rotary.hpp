// The rotary position embedding of one query or key tensor, in one pass: out = x * cos +
// rotate_half(x) * sin, where rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]), exactly the
// operations transformers' `apply_rotary_pos_emb` makes in six ATen calls per tensor (two
// products, a negation, a concatenation, a sum), each value rounded as they round it: every
// output is one float product plus one float product, summed, with no fused multiply-add
// (rotary.cpp is compiled with -ffp-contract=off), so the result is bit for bit theirs.
#pragma once

#include <cstdint>

namespace lookupdec {

// x and out [B, H, T, D] with strides (elements) xs and os; cos and sin [T, D] rows of D
// contiguous floats, row t of batch b at cos + b * cos_batch + t * D (cos_batch 0: one row set
// for every batch entry). D even.
void rotary(const float* x, const int64_t* shape, const int64_t* xs, const float* cos, const float* sin,
            int64_t cos_batch, float* out, const int64_t* os);

}  // namespace lookupdec
