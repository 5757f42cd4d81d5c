// Token recycling's table and its best-first draft (lookupdec.proposers.recycle, whose
// RecycleProposer with backend="reference" is the pure-Python definition this follows).
#pragma once

#include <cstdint>
#include <vector>

#include "common/arrays.hpp"

namespace lookupdec {

class RecycleTable {
 public:
  // successors: top tokens kept per entry; max_entries: past it, the pair table starts over.
  // rank_prior: conditional acceptance by successor rank (the last repeats).
  RecycleTable(int32_t successors, int64_t max_entries, std::vector<double> rank_prior);

  // One entry per visited node: (previous token, token, the target's top tokens after them).
  // Like the reference, the pair table is cleared first when it holds more than max_entries.
  void observe(const std::vector<int32_t>& previous, const std::vector<int32_t>& tokens,
               const std::vector<std::vector<int32_t>>& successors);

  // The draft grown best-first from (prev, root): node scores are the parent's times the rank
  // prior, heap ties by push order; at most `limit` nodes, `max_depth` deep. *match is 2 when
  // the root's successors came from the pair table, 1 from the token table, 0 with none (and
  // then the draft is empty).
  void propose(int32_t prev, int32_t root, int32_t limit, int32_t max_depth, std::vector<int32_t>* tokens,
               std::vector<int32_t>* parents, std::vector<double>* scores, int32_t* match) const;

  int64_t num_pairs() const { return static_cast<int64_t>(by_pair_.size()); }
  int64_t num_tokens() const { return static_cast<int64_t>(by_token_.size()); }

 private:
  // An entry's successors: `count` ids at `pool + offset` (slots of `width_` ids each).
  struct Slot {
    int32_t offset;
    int32_t count;
  };
  const int32_t* find(int32_t prev, int32_t token, int32_t* count, int32_t* match) const;
  void store(FlatMap<Slot>* table, std::vector<int32_t>* pool, uint64_t key, const std::vector<int32_t>& successors);

  int32_t width_;
  int64_t max_entries_;
  std::vector<double> rank_prior_;
  FlatMap<Slot> by_pair_, by_token_;  // (looked up up to twice per draft node)
  std::vector<int32_t> pair_pool_, token_pool_;
};

}  // namespace lookupdec
