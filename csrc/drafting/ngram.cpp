// The n-gram index and drafts; see ngram.hpp. Each part names the Python it mirrors in
// lookupdec/proposers/ngram.py.
#include "drafting/ngram.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace lookupdec {

namespace {

constexpr uint64_t kMix = 0x9E3779B97F4A7C15ull;

inline uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + kMix + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

}  // namespace

NgramIndex::NgramIndex(int32_t min_ngram, int32_t max_ngram) : min_ngram_(min_ngram), max_ngram_(max_ngram) {
  if (min_ngram < 1 || max_ngram < min_ngram) throw std::invalid_argument("NgramIndex: need 1 <= min_ngram <= max_ngram");
}

// Hash of tokens_[end - n, end), read from its last token back (extend's loop grows n).
uint64_t NgramIndex::span_hash(int32_t end, int32_t n) const {
  uint64_t h = 0;
  for (int32_t i = 1; i <= n; ++i) h = mix(h, static_cast<uint32_t>(tokens_[end - i]));
  return mix(h, static_cast<uint64_t>(n));
}

const NgramIndex::Group* NgramIndex::find(int32_t end, int32_t n, uint64_t hash) const {
  const int32_t* first = first_group_.find(hash);
  if (first == nullptr) return nullptr;
  for (int32_t g = *first; g >= 0; g = groups_[g].next) {
    const Group& group = groups_[g];
    int32_t other = group.ends.front();
    if (group.n == n && std::equal(tokens_.begin() + (end - n), tokens_.begin() + end, tokens_.begin() + (other - n)))
      return &group;
  }
  return nullptr;
}

// _extend: every n-gram (min_ngram <= n <= max_ngram) ending at each new token notes that end.
void NgramIndex::extend(const int32_t* tokens, size_t count) {
  for (size_t k = 0; k < count; ++k) {
    tokens_.push_back(tokens[k]);
    int32_t end = static_cast<int32_t>(tokens_.size());
    uint64_t h = 0;
    for (int32_t n = 1; n <= std::min(max_ngram_, end); ++n) {
      h = mix(h, static_cast<uint32_t>(tokens_[end - n]));
      if (n < min_ngram_) continue;
      uint64_t hash = mix(h, static_cast<uint64_t>(n));
      Group* group = const_cast<Group*>(find(end, n, hash));
      if (group == nullptr) {
        bool added = false;
        int32_t* first = first_group_.insert(hash, -1, &added);
        groups_.push_back(Group{n, *first, {}});  // (in front of the hash's other groups)
        *first = static_cast<int32_t>(groups_.size()) - 1;
        group = &groups_.back();
      }
      group->ends.push_back(end);
    }
  }
}

// periodic_continuation: token i after `start`, repeating with period size - start.
int32_t NgramIndex::continuation_token(int32_t start, int32_t i) const {
  int32_t n = static_cast<int32_t>(tokens_.size());
  int32_t period = n - start;
  int32_t j = start + i;
  return j < n ? tokens_[j] : tokens_[start + (i % period)];
}

bool NgramIndex::same_continuation(int32_t a, int32_t b, int32_t length) const {
  for (int32_t i = 0; i < length; ++i)
    if (continuation_token(a, i) != continuation_token(b, i)) return false;
  return true;
}

std::vector<NgramDraft> NgramIndex::propose(int32_t max_draft_tokens, int32_t max_branches, int32_t max_nodes,
                                            double branch_decay, double continue_prob) const {
  std::vector<NgramDraft> out;
  if (max_nodes <= 0) return out;
  int32_t n = static_cast<int32_t>(tokens_.size());
  int32_t length = std::min(max_draft_tokens, max_nodes);
  struct Found {
    double first;
    int32_t end, match_len;
  };
  std::vector<Found> found;
  // _occurrences: match lengths from the longest, each occurrence latest first
  for (int32_t match_len = std::min(max_ngram_, n - 1); match_len >= min_ngram_; --match_len) {
    const Group* group = find(n, match_len, span_hash(n, match_len));
    if (group == nullptr) continue;
    for (auto it = group->ends.rbegin(); it != group->ends.rend(); ++it) {
      int32_t end = *it;
      if (end >= n) continue;  // the context's own suffix is not an earlier occurrence
      bool seen = false;
      for (const Found& f : found) seen = seen || same_continuation(f.end, end, length);
      if (seen) continue;
      double first = static_cast<double>(match_len) / static_cast<double>(match_len + 1) *
                     std::pow(branch_decay, static_cast<double>(found.size()));
      found.push_back(Found{first, end, match_len});
      if (static_cast<int32_t>(found.size()) == max_branches) break;
    }
    if (static_cast<int32_t>(found.size()) == max_branches) break;
  }
  // continue_prob ** d, each from pow as Python's float power computes it
  if (!(continue_prob == decay_prob_) || static_cast<int32_t>(decay_.size()) < length) {
    decay_.resize(static_cast<size_t>(std::max(length, 0)));
    decay_falls_ = true;
    for (int32_t d = 0; d < length; ++d) {
      decay_[d] = std::pow(continue_prob, static_cast<double>(d));
      decay_falls_ = decay_falls_ && (d == 0 || decay_[d] <= decay_[d - 1]);
    }
    decay_prob_ = continue_prob;
  }
  const double* decay = decay_.data();
  // lengths_within_budget: the max_nodes best (score, branch) pairs, branch descending on ties
  size_t branches = found.size();
  std::vector<int32_t> lengths(branches, length);
  bool firsts_sure = true;  // every branch's first score >= 0 (then its scores fall with decay's)
  for (const Found& f : found) firsts_sure = firsts_sure && f.first >= 0 && std::isfinite(f.first);
  if (static_cast<int64_t>(branches) * length > max_nodes && decay_falls_ && firsts_sure) {
    // each branch's pairs come best first, so the best max_nodes pairs are a prefix of each
    // branch: take them one by one, the best next pair of all branches each time (the pairs the
    // partial sort below takes, without making and sorting them all)
    std::fill(lengths.begin(), lengths.end(), 0);
    for (int32_t i = 0; i < max_nodes; ++i) {
      int32_t best = -1;
      double best_score = 0.0;
      for (size_t r = 0; r < branches; ++r) {
        if (lengths[r] == length) continue;
        double score = found[r].first * decay[lengths[r]];
        if (best < 0 || score > best_score || (score == best_score && static_cast<int32_t>(r) > best)) {
          best = static_cast<int32_t>(r);
          best_score = score;
        }
      }
      ++lengths[best];
    }
  } else if (static_cast<int64_t>(branches) * length > max_nodes) {
    std::vector<std::pair<double, int32_t>> scored;
    for (size_t r = 0; r < branches; ++r)
      for (int32_t d = 0; d < length; ++d)
        scored.emplace_back(found[r].first * decay[d], static_cast<int32_t>(r));
    std::partial_sort(scored.begin(), scored.begin() + max_nodes, scored.end(),
                      [](const auto& a, const auto& b) { return a > b; });
    std::fill(lengths.begin(), lengths.end(), 0);
    for (int32_t i = 0; i < max_nodes; ++i) ++lengths[scored[i].second];
  }
  for (size_t r = 0; r < branches; ++r) {
    if (lengths[r] == 0) continue;
    NgramDraft draft;
    draft.match_length = found[r].match_len;
    draft.token_ids.resize(lengths[r]);
    draft.parents.resize(lengths[r]);
    draft.scores.resize(lengths[r]);
    for (int32_t d = 0; d < lengths[r]; ++d) {
      draft.token_ids[d] = continuation_token(found[r].end, d);
      draft.parents[d] = d - 1;
      draft.scores[d] = found[r].first * decay[d];
    }
    out.push_back(std::move(draft));
  }
  return out;
}

}  // namespace lookupdec
