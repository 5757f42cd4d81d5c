// The k best entries of a row (implemented in tree.cpp, next to row_topk and the greedy walk).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace lookupdec {

// row_topk (tree.hpp) of a row of n entries given in pieces or one entry at a time, in index
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
