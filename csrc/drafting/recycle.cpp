#include "drafting/recycle.hpp"

#include <algorithm>
#include <queue>
#include <stdexcept>
#include <tuple>

namespace lookupdec {

namespace {

uint64_t pair_key(int32_t prev, int32_t token) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(prev)) << 32) | static_cast<uint32_t>(token);
}

}  // namespace

RecycleTable::RecycleTable(int32_t successors, int64_t max_entries, std::vector<double> rank_prior)
    : width_(successors), max_entries_(max_entries), rank_prior_(std::move(rank_prior)) {
  if (successors < 1 || max_entries < 1 || rank_prior_.empty())
    throw std::invalid_argument("RecycleTable: successors and max_entries >= 1, a rank prior");
}

void RecycleTable::store(FlatMap<Slot>* table, std::vector<int32_t>* pool, uint64_t key,
                         const std::vector<int32_t>& successors) {
  int32_t count = static_cast<int32_t>(std::min<size_t>(successors.size(), static_cast<size_t>(width_)));
  bool added = false;
  Slot* slot = table->insert(key, Slot{static_cast<int32_t>(pool->size()), count}, &added);
  if (added) {
    pool->resize(pool->size() + static_cast<size_t>(width_));
  } else {
    slot->count = count;
  }
  std::copy(successors.begin(), successors.begin() + count, pool->begin() + slot->offset);
}

void RecycleTable::observe(const std::vector<int32_t>& previous, const std::vector<int32_t>& tokens,
                           const std::vector<std::vector<int32_t>>& successors) {
  if (previous.size() != tokens.size() || successors.size() != tokens.size())
    throw std::invalid_argument("RecycleTable.observe: previous, tokens and successors lengths differ");
  if (static_cast<int64_t>(by_pair_.size()) > max_entries_) {
    by_pair_.clear();
    pair_pool_.clear();
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    store(&by_pair_, &pair_pool_, pair_key(previous[i], tokens[i]), successors[i]);
    store(&by_token_, &token_pool_, static_cast<uint32_t>(tokens[i]), successors[i]);
  }
}

const int32_t* RecycleTable::find(int32_t prev, int32_t token, int32_t* count, int32_t* match) const {
  if (const Slot* pair = by_pair_.find(pair_key(prev, token))) {
    *count = pair->count;
    *match = 2;
    return pair_pool_.data() + pair->offset;
  }
  if (const Slot* one = by_token_.find(static_cast<uint32_t>(token))) {
    *count = one->count;
    *match = 1;
    return token_pool_.data() + one->offset;
  }
  *count = 0;
  *match = 0;
  return nullptr;
}

void RecycleTable::propose(int32_t prev, int32_t root, int32_t limit, int32_t max_depth, std::vector<int32_t>* tokens,
                           std::vector<int32_t>* parents, std::vector<double>* scores, int32_t* match) const {
  tokens->clear();
  parents->clear();
  scores->clear();
  int32_t count = 0;
  const int32_t* first = find(prev, root, &count, match);
  if (limit <= 0 || count == 0) return;
  auto prior = [&](int32_t rank) { return rank_prior_[std::min<size_t>(rank, rank_prior_.size() - 1)]; };
  // (negated score, push order, parent node, previous token, token, depth): the reference's heap tuples
  using Entry = std::tuple<double, int64_t, int32_t, int32_t, int32_t, int32_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  int64_t order = 0;
  for (int32_t r = 0; r < count; ++r) heap.emplace(-prior(r), order++, -1, root, first[r], 1);
  while (!heap.empty() && static_cast<int32_t>(tokens->size()) < limit) {
    auto [neg, pushed, parent, before, token, depth] = heap.top();
    (void)pushed;
    heap.pop();
    int32_t node = static_cast<int32_t>(tokens->size());
    tokens->push_back(token);
    parents->push_back(parent);
    scores->push_back(-neg);
    if (depth < max_depth) {
      int32_t n = 0, unused = 0;
      const int32_t* next = find(before, token, &n, &unused);
      for (int32_t r = 0; r < n; ++r) heap.emplace(neg * prior(r), order++, node, token, next[r], depth + 1);
    }
  }
}

}  // namespace lookupdec
