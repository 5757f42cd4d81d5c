// The suffix proposer's drafts, compiled: what lookupdec.proposers.suffix.automaton_drafts_reference
// computes from an automaton (the longest match and shorter ones along suffix links, each level's
// best-first subtree without separator nodes, scores scaled by the match confidence with
// certain steps decayed, and each draft's best chain) in one call. Floating-point operations
// are the reference's, in its order (compiled with -ffp-contract=off): scores are bit-identical.
#pragma once

#include <cstdint>
#include <vector>

#include "drafting/automaton.hpp"

namespace lookupdec {

struct SuffixDraftParams {
  int32_t max_nodes;
  int32_t min_match;
  int32_t levels;            // MATCH_LEVELS
  int32_t shorter_divisor;   // SHORTER_MATCH_NODES_DIVISOR
  int32_t separator;         // tokens.SEPARATOR: dropped with its descendants
  double empty_confidence;   // EMPTY_MATCH_CONFIDENCE
  double match_prior;        // MATCH_PRIOR
  double certain_step;       // CertainStepEstimate.value
};

struct SuffixDraft {
  std::vector<int32_t> token_ids, parents;  // parents: -1 = child of the root
  std::vector<double> scores;
  int32_t match_length = 0;
  std::vector<int32_t> chain;         // the first draft's best chain (Draft.best_chain): tokens
  std::vector<uint8_t> chain_certain; // ... and whether each step was a certain one
};

std::vector<SuffixDraft> suffix_drafts(Automaton& automaton, const int32_t* context, size_t n,
                                       const SuffixDraftParams& params);

}  // namespace lookupdec
