// The prompt n-gram proposer's index and drafts, compiled: what lookupdec.proposers.ngram's
// reference (NgramProposer with backend="reference") computes, with the same ranking, ties and
// floating-point operations (compiled with -ffp-contract=off, pow from the same libm as Python's
// float power), so the drafts are identical.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/arrays.hpp"

namespace lookupdec {

struct NgramDraft {
  std::vector<int32_t> token_ids, parents;  // a chain: parents = -1, 0, 1, ...
  std::vector<double> scores;
  int32_t match_length = 0;
};

class NgramIndex {
 public:
  NgramIndex(int32_t min_ngram, int32_t max_ngram);
  void extend(const int32_t* tokens, size_t n);
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  // NgramProposer.propose: up to max_branches distinct continuations of the latest occurrences
  // of the longest matching context suffix, lengths shared within max_nodes.
  std::vector<NgramDraft> propose(int32_t max_draft_tokens, int32_t max_branches, int32_t max_nodes,
                                  double branch_decay, double continue_prob) const;

 private:
  struct Group {  // one n-gram: every end position after it, oldest first
    int32_t n;
    int32_t next;  // next group with the same hash, -1 at the end
    std::vector<int32_t> ends;
  };
  uint64_t span_hash(int32_t end, int32_t n) const;
  const Group* find(int32_t end, int32_t n, uint64_t hash) const;
  bool same_continuation(int32_t a, int32_t b, int32_t length) const;
  int32_t continuation_token(int32_t start, int32_t i) const;

  int32_t min_ngram_, max_ngram_;
  std::vector<int32_t> tokens_;
  std::vector<Group> groups_;
  FlatMap<int32_t> first_group_;  // hash -> first group of that hash
  // continue_prob ** d from pow, d < decay_.size(), for continue_prob == decay_prob_ (propose's
  // per-depth factors: the same every step, so worked out once; NaN never matches)
  mutable std::vector<double> decay_;
  mutable double decay_prob_ = 0.0;
  mutable bool decay_falls_ = true;  // decay_ never rises (each branch's scores are best first)
};

}  // namespace lookupdec
