// The suffix proposer's drafts; see suffix_drafts.hpp. Each part names the Python function of
// lookupdec/proposers/suffix.py (or tree.py) it mirrors.
#include "drafting/suffix_drafts.hpp"

#include <algorithm>

namespace lookupdec {

namespace {

// without_separator: drop separator nodes and their descendants, renumber parents.
void drop_separator(const TreeDraft& tree, int32_t separator, SuffixDraft* out) {
  size_t n = tree.token_ids.size();
  std::vector<int32_t> new_index(n, -1);
  out->token_ids.reserve(n);
  out->parents.reserve(n);
  out->scores.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    int32_t par = tree.parents[i];
    if (tree.token_ids[i] == separator || (par >= 0 && new_index[par] < 0)) continue;
    new_index[i] = static_cast<int32_t>(out->token_ids.size());
    out->token_ids.push_back(tree.token_ids[i]);
    out->parents.push_back(par < 0 ? -1 : new_index[par]);
    out->scores.push_back(tree.scores[i]);
  }
}

// decay_certain_steps: scores times `scale`, a certain step (conditional frequency 1) counting
// `certain_step`; the raw scores are replaced in place. Returns the certain flags.
std::vector<uint8_t> decay_certain_steps(SuffixDraft* draft, double scale, double certain_step) {
  size_t n = draft->token_ids.size();
  std::vector<double> out(n);
  std::vector<uint8_t> certain(n);
  const std::vector<double>& raw = draft->scores;
  for (size_t i = 0; i < n; ++i) {
    int32_t p = draft->parents[i];
    double parent_raw = p < 0 ? 1.0 : raw[p];
    double parent_new = p < 0 ? scale : out[p];
    double cond = parent_raw > 0 ? raw[i] / parent_raw : 0.0;
    certain[i] = cond >= 1.0 - 1e-9;
    out[i] = parent_new * (certain[i] ? certain_step : cond);
  }
  draft->scores.swap(out);
  return certain;
}

// Draft.best_chain's tokens: from the root, the best-scored child (the first of equals); and
// _chain_flags: the certain flags on it.
void best_chain(SuffixDraft* draft, const std::vector<uint8_t>& certain) {
  size_t n = draft->token_ids.size();
  std::vector<int32_t> best_child(n + 1, -1);  // parent + 1 -> best child so far
  for (size_t i = 0; i < n; ++i) {
    int32_t& best = best_child[draft->parents[i] + 1];
    if (best < 0 || draft->scores[i] > draft->scores[best]) best = static_cast<int32_t>(i);
  }
  for (int32_t node = best_child[0]; node >= 0; node = best_child[node + 1]) {
    draft->chain.push_back(draft->token_ids[node]);
    draft->chain_certain.push_back(certain[node]);
  }
}

}  // namespace

// automaton_drafts: the longest match, then shorter ones along suffix links.
std::vector<SuffixDraft> suffix_drafts(Automaton& automaton, const int32_t* context, size_t n,
                                       const SuffixDraftParams& params) {
  std::vector<SuffixDraft> out;
  std::pair<int32_t, int32_t> found = automaton.match(context, n);
  int32_t state = found.first, length = found.second;
  while (state >= 0 && length >= params.min_match && static_cast<int32_t>(out.size()) < params.levels) {
    if (automaton.continuation_count(state)) {
      int32_t level_nodes = out.empty() ? params.max_nodes
                                        : std::max(1, params.max_nodes / params.shorter_divisor);
      TreeDraft tree = automaton.expand_tree(state, level_nodes, level_nodes);
      SuffixDraft draft;
      drop_separator(tree, params.separator, &draft);
      if (!draft.token_ids.empty()) {
        double confidence = (length + params.empty_confidence) /
                            (length + params.empty_confidence + params.match_prior);
        std::vector<uint8_t> certain = decay_certain_steps(&draft, confidence, params.certain_step);
        draft.match_length = length;
        if (out.empty()) best_chain(&draft, certain);  // (the pending chain: the longest match's)
        out.push_back(std::move(draft));
      }
    }
    state = automaton.suffix_link(state);
    length = state >= 0 ? automaton.state_len(state) : -1;
  }
  return out;
}

}  // namespace lookupdec
