// The size records' hindsight of the sizes a step did not verify (lookupdec.step: Shadow,
// hindsight, SizeHindsight with backend="reference" are the pure-Python definitions this follows;
// SizeRecord.add in lookupdec.budget the record's update).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "tree/tree.hpp"

namespace lookupdec {

// step.Shadow: the root and the first draft nodes of a merged tree in prune order, renumbered in
// that order; the gains' running sums from 0; the request's factor; the tokens committed since.
struct Shadow {
  std::vector<int32_t> tokens, parents, depth;
  std::vector<double> gains;
  double factor = 1.0;
  std::vector<int64_t> committed;
  int64_t needed = 0;
};

// Shadow.of: false (out untouched) where the tree's parents do not come first in prune order.
bool make_shadow(const MergedTree& tree, int64_t nodes, double factor, Shadow* out);

// step.hindsight: 0 with accepted[k] for every prefix size k (accepted resized to the shadow's
// length), or the number of committed tokens needed before it can tell.
int64_t hindsight(const Shadow& s, std::vector<int64_t>* accepted);

// SizeRecord.add of sizes first, first + 1, ... on a table of `rows` rows of (promised,
// accepted, steps, last step), in place; false (nothing changed) where the sizes pass the table.
bool size_record_add(double* table, int64_t rows, double steps, int64_t first, const double* gains,
                     const int64_t* accepted, int64_t n, double factor, double decay);

// step.SizeHindsight: each request's shadows whose hindsight is not known yet, oldest first.
class ShadowBook {
 public:
  // A step of `request` committed `new_tokens` (shadow: its candidates, or null): every pending
  // shadow of the request takes them, and each one known adds its sizes 2, 3, ... to the table
  // (`rows` rows, at least the longest shadow's length) at step `steps`.
  void observe(double* table, int64_t rows, double steps, const std::string& request, const Shadow* shadow,
               const int64_t* new_tokens, int64_t n, double decay);
  void drop(const std::string& request) { pending_.erase(request); }
  int64_t waiting(const std::string& request) const;

 private:
  std::unordered_map<std::string, std::vector<Shadow>> pending_;
  std::vector<int64_t> accepted_;  // scratch
};

}  // namespace lookupdec
