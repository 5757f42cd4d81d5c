#include "tree/hindsight.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace lookupdec {

bool make_shadow(const MergedTree& tree, int64_t nodes, double factor, Shadow* out) {
  if (!tree.parents_first) return false;
  size_t n = std::min<size_t>(tree.order.size(), static_cast<size_t>(std::max<int64_t>(nodes, 0)));
  std::vector<int32_t> local(tree.token_ids.size(), -1);
  local[0] = 0;
  out->tokens.assign(1, tree.token_ids[0]);
  out->parents.assign(1, -1);
  out->depth.assign(1, 0);
  out->gains.assign(1, 0.0);
  out->factor = factor;
  out->committed.clear();
  out->needed = 0;
  double total = 0.0;
  for (size_t i = 0; i < n; ++i) {
    int32_t node = tree.order[i];
    local[node] = static_cast<int32_t>(i + 1);
    out->tokens.push_back(tree.token_ids[node]);
    out->parents.push_back(local[tree.parents[node]]);
    out->depth.push_back(tree.depth[node]);
    total += tree.expected[node];
    out->gains.push_back(total);
  }
  return true;
}

int64_t hindsight(const Shadow& s, std::vector<int64_t>* accepted) {
  size_t n = s.tokens.size();
  int64_t known = static_cast<int64_t>(s.committed.size());
  accepted->assign(n, 0);
  std::vector<uint8_t> matched(n, 0);
  matched[0] = 1;
  int64_t best = 0;
  for (size_t node = 1; node < n; ++node) {
    if (matched[s.parents[node]]) {
      int64_t d = s.depth[node];
      if (d > known) return d;
      if (s.tokens[node] == s.committed[d - 1]) {
        matched[node] = 1;
        best = std::max(best, d);
      }
    }
    (*accepted)[node] = best;
  }
  return 0;
}

bool size_record_add(double* table, int64_t rows, double steps, int64_t first, const double* gains,
                     const int64_t* accepted, int64_t n, double factor, double decay) {
  if (first < 1 || first - 1 + n > rows) return false;
  double* r = table + 4 * (first - 1);
  for (int64_t i = 0; i < n; ++i, r += 4) {
    double last = r[2] != 0.0 ? r[3] : steps;  // a size never counted: no decay
    double keep = std::pow(decay, steps - last);
    r[0] = keep * r[0] + gains[i] * factor;
    r[1] = keep * r[1] + static_cast<double>(accepted[i]);
    r[2] = keep * r[2] + 1.0;
    r[3] = steps;
  }
  return true;
}

void ShadowBook::observe(double* table, int64_t rows, double steps, const std::string& request, const Shadow* shadow,
                         const int64_t* new_tokens, int64_t n, double decay) {
  auto found = pending_.find(request);
  if (found == pending_.end()) {
    if (shadow == nullptr) return;
    found = pending_.emplace(request, std::vector<Shadow>()).first;
  }
  std::vector<Shadow>& pending = found->second;
  if (shadow != nullptr) pending.push_back(*shadow);
  size_t kept = 0;
  for (size_t i = 0; i < pending.size(); ++i) {
    Shadow& entry = pending[i];
    entry.committed.insert(entry.committed.end(), new_tokens, new_tokens + n);
    bool waits = static_cast<int64_t>(entry.committed.size()) < entry.needed;
    if (!waits) {
      entry.needed = hindsight(entry, &accepted_);
      waits = entry.needed != 0;
    }
    if (waits) {
      if (kept != i) pending[kept] = std::move(entry);
      ++kept;
      continue;
    }
    int64_t sizes = static_cast<int64_t>(entry.gains.size()) - 1;  // 2 .. its length (the root alone: none)
    if (sizes > 0 && !size_record_add(table, rows, steps, 2, entry.gains.data() + 1, accepted_.data() + 1, sizes, entry.factor,
                         decay))
      throw std::invalid_argument("ShadowBook.observe: the size record's table is shorter than a shadow");
  }
  pending.resize(kept);
  if (pending.empty()) pending_.erase(found);
}

int64_t ShadowBook::waiting(const std::string& request) const {
  auto found = pending_.find(request);
  return found == pending_.end() ? 0 : static_cast<int64_t>(found->second.size());
}

}  // namespace lookupdec
