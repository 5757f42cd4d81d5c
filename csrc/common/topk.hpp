// Reading a row of logits (topk.cpp): its argmax and its k best entries, as the greedy walk
// (tree/tree.hpp), sampling's top tokens and the skinny product's picks (kernels/skinny.hpp) read
// them: one definition, so a row's picks are the same whichever of them makes them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace lookupdec {

// The index of the largest of x[0:n], numpy's and torch's argmax: the first NaN if there is one,
// else the first maximum (AVX2 where the CPU has it).
int64_t row_argmax(const float* x, int64_t n);

// The k largest of x[0:n] as repeated argmax with each pick set to -inf takes them
// (lookupdec.request.top_tokens_reference): NaNs first (by index), then values descending (ties
// by index), entries of -inf never, then index 0 repeated once those run out; min(k, n) picks.
void row_topk(const float* x, int64_t n, int32_t k, std::vector<int32_t>* out);

// row_topk (above) of a row of n entries given in pieces or one entry at a time, in index
// order (scan x[begin, end), x the row's first entry; or add): the same min(k, n) picks as
// row_topk of the whole row. The skinny product (skinny_linear_tops) adds the entries of each
// block of outputs it computes that beat the floor, as it stores them.
class RowTopK {
 public:
  RowTopK(int64_t k, int64_t n);
  void scan(const float* x, int64_t begin, int64_t end);
  size_t size() const { return want_; }
  void finish(int32_t* out) const;  // size() picks
  // one entry (index j) after every entry before it; what scan does per entry
  void add(float v, int32_t j);
  float floor() const { return floor_; }  // what an entry must beat (NaNs aside)
  // the picks of `later`, a RowTopK of the entries after every entry this one saw (indices
  // shifted by `offset`): as if those entries had been added here, in index order
  void merge(const RowTopK& later, int32_t offset);

 private:
  size_t want_;
  std::vector<int32_t> nans_;                    // NaN indices, the first want_
  std::vector<std::pair<float, int32_t>> best_;  // the best want_ above -inf by (value desc, index asc)
  float floor_ = -__builtin_inff();
};

}  // namespace lookupdec
