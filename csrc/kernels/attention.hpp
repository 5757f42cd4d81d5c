// Tree attention for a verify forward on a CPU: few query tokens per sequence (a draft tree, 2
// to 64 nodes), a long cached prefix, K/V heads shared by groups of query heads, a ragged batch
// whose rows hide slots (holes) their masks never show.
//
// torch's CPU SDPA kernel, on these shapes, walks a K/V head once per query head of its group
// and reads every slot, hidden or not (a sizeable share of a batch's verify forward, even with its
// query heads already folded; bench/README.md). Here each task
// -- a row, a K/V head, a block of up to 16 of that head's (query head, token) pairs -- reads
// only the slots some query of the row sees (`cols`), once, and holds the block's queries in
// the lanes of one vector: a score is one vector of fused multiply-adds over the head's dims,
// the softmax runs lane-wise, and the weighted sum of V reads each slot's values once per four
// lanes from cache.
//
// The plan (model/kernels.py, `attention_plan`, once per forward: the layers share the mask):
// per row, its visible slots, those every live query sees with bias 0 first ("common"; the
// prefix), then the rest (the tree: each query's own bias read for them, -inf where hidden).
// A query that sees no slot (a padded node) gets zeros.
//
// Three builds of one kernel (attention_kernel.inc): AVX-512, AVX2 (each with its -m flags, run
// only where the CPU has them) and the compiler's default, which the tests compare with the
// others and with a float64 reference.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lookupdec {

struct AttentionArgs {
  const float* q;  // [B, H, Q, D] at strides qs (qs[3] == 1)
  int64_t qs[4];
  const float* k;  // [B, KVH, L, D] at strides ks (ks[3] == 1)
  int64_t ks[4];
  const float* v;  // as k
  int64_t vs[4];
  const int32_t* cols;     // [B, cmax]: each row's visible slots, common first (< L)
  const int32_t* counts;   // [B]: visible slots per row
  const int32_t* common;   // [B]: of them, those every live query sees with bias 0
  const float* bias;       // [B, Q, cmax]: each query's additive bias at cols (-inf: hidden)
  const uint8_t* live;     // [B, Q]: 0 where the query sees no slot (its output: zeros)
  int64_t cmax;
  float* out;              // [B, Q, H, D] contiguous
  int64_t B, H, KVH, Q, D;
  float scale;
};

// One task: row b, K/V head g, folded queries [first, first + lanes) of that head's H / KVH x Q
// (query head g * groups + f / Q, token f % Q), lanes <= 16.
using AttentionTask = void (*)(const AttentionArgs&, int64_t b, int64_t g, int64_t first, int64_t lanes, float* scratch);

namespace attention_avx512 {
void task(const AttentionArgs&, int64_t, int64_t, int64_t, int64_t, float*);
}
namespace attention_avx2 {
void task(const AttentionArgs&, int64_t, int64_t, int64_t, int64_t, float*);
}
namespace attention_generic {
void task(const AttentionArgs&, int64_t, int64_t, int64_t, int64_t, float*);
}

// The plan of a mask [B, 1, Q, L] (element (b, t, j) at b * sb + t * st + j; float32 additive,
// hidden at -inf or at or below `hidden`, or with `boolean` uint8, nonzero: seen) into cols and
// bias of row width `width` >= L, counts, common and live: model/kernels.py's attention_plan
// (the reference), the same values. Returns the largest count.
int64_t attention_plan(const void* mask, bool boolean, int64_t B, int64_t Q, int64_t L, int64_t sb, int64_t st,
                       float hidden, int64_t width, int32_t* cols, int32_t* counts, int32_t* common, float* bias,
                       uint8_t* live);

// Every task of `a` on up to `threads` OpenMP threads (tasks independent: the output is the
// same whatever the count); `isa` (null: the widest) one of attention_isas().
void tree_attention(const AttentionArgs& a, int threads, const char* isa = nullptr);
std::vector<std::string> attention_isas();

}  // namespace lookupdec
