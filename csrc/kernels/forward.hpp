// A whole verify forward of a llama-shaped decoder (llama, qwen2, mistral without a window) on
// a CPU in float32, in one call: the embedding rows, every layer (RMS norm, q/k/v products with
// their biases, rotary embedding, K/V written at their slots, tree attention, output product,
// residual, RMS norm, gate/up products, SiLU x up, down product, residual) and the final norm.
// Between them no Python and no dispatcher runs: a forward of one token makes about 210 products
// and 180 small operations, whose per-call cost in eager PyTorch is a visible share of a
// forward bound by reading the weights.
//
// Its parts are the kernels beside it, each with its reference: products by skinny.hpp (the
// same panels, the same sums as the engine's skinny form), norms by norm.hpp and rotation by
// rotary.hpp (bit for bit torch's), attention by attention.hpp over a plan built from the
// tree's parents (each node sees the cached prefix, its ancestors and itself). The residual
// sums are one float addition each, as torch's; SiLU is x / (1 + exp(-x)) with the C library's
// exp (torch's vectorised exp may round the last bit otherwise): logits agree with the
// engine's eager forward to rounding, and the tests hold greedy decoding to transformers'.
#pragma once

#include <cstdint>

namespace lookupdec {

// Per layer, in this order: input norm weight, q, k, v panels (skinny_pack), q, k, v biases
// (null: none), o panels, post-attention norm weight, gate, up, down panels.
constexpr int kLayerPointers = 12;

struct DecoderShape {
  int64_t layers, hidden, heads, kv_heads, head_dim, intermediate;
  float eps;      // the RMS norms' epsilon
  float scaling;  // the attention's score scale (head_dim ** -0.5 for these families)
};

// K/V of every layer: layer l's keys of K/V head h at slot s, dim d at
// kv + l * layer_stride + kind * kind_stride + h * head_stride + s * head_dim + d (kind 0: keys,
// 1: values); slots [0, capacity).
struct KVBuffer {
  float* kv;
  int64_t layer_stride, kind_stride, head_stride, capacity;
};

// The forward of `m` nodes (ids[i]; parents[i] < i, -1 for the root, which only node 0 is) after
// `n_cached` committed slots: node i at position positions[i], its K/V written at slot
// n_cached + i, seeing slots [0, n_cached), its ancestors' slots and its own. cos and sin: [m,
// head_dim] rows (the model's own rotary embedding at the nodes' positions). `embed` [vocab,
// hidden]; `weights`: layers x kLayerPointers; `final_norm` [hidden]. Writes the final hidden
// states (after the final norm) into out [m, hidden]. Products split over skinny_threads.
void decoder_forward(const DecoderShape& shape, const float* const* weights, const float* embed,
                     const float* final_norm, const KVBuffer& cache, const int64_t* ids, const int64_t* parents,
                     int64_t m, int64_t n_cached, const float* cos, const float* sin, float* out);

}  // namespace lookupdec
