// The step's tree merge; see tree.hpp. Comments name the lines of lookupdec/tree.py's
// reference (from_drafts_reference, coherent_scores, select_top_nodes) each part mirrors.
#include "tree/tree.hpp"

#include "common/topk.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace lookupdec {

namespace {

constexpr uint64_t kFibonacci = 0x9E3779B97F4A7C15ull;

// Python's min(a, b) and max(a, b): the first argument unless the second is strictly
// smaller (larger). Spelled out so that NaN and -0.0 come out as in the reference.
inline double py_min(double a, double b) { return b < a ? b : a; }
inline double py_max(double a, double b) { return b > a ? b : a; }

// (counted, not searched: no branch to mispredict; the buckets are sorted, so the count of
// bounds at or below a value is where bisect_right puts it)
int32_t depth_bucket(int32_t depth) {  // bisect_right(DEPTH_BUCKETS, depth) - 1 (depths >= 1)
  int32_t b = 0;
  for (int32_t j = 1; j < kNumDepthBuckets; ++j) b += kDepthBuckets[j] <= depth;
  return b;
}

int32_t cond_bucket(double cond) {  // bisect_right(COND_BUCKETS, cond) - 1, Python's bisection (NaN: last)
  int32_t b = -1;
  for (int32_t j = 0; j < kNumCondBuckets; ++j) b += !(cond < kCondBuckets[j]);
  return b;
}

// A draft node's conditional probability: its score over its parent's (a child of the root: over
// 1), 0 under a parent scored 0 or less (from_drafts_reference, draft_cells, observe_draft).
inline double node_cond(const int32_t* parents, const double* scores, int64_t i) {
  double parent_score = parents[i] >= 0 ? scores[parents[i]] : 1.0;
  return parent_score > 0 ? scores[i] / parent_score : 0.0;
}

// A node's cell within its calibration row: depth bucket, sibling rank (capped), bucket of its
// conditional probability (lookupdec.tree.draft_cells); -1 for a negative probability at the
// first depth and rank, which Python's indexing takes from the end (callers wrap it).
inline int32_t row_cell(int32_t depth, int32_t rank, double cond) {
  return (depth_bucket(depth) * kSiblingRanks + std::min(rank, kSiblingRanks - 1)) * kNumCondBuckets +
         cond_bucket(cond);
}

// (parent node, token) -> node: open addressing, linear probing, sized and emptied per merge
// (reset; its arrays kept from merge to merge).
class TrieIndex {
 public:
  void reset(size_t expected) {
    size_t capacity = 16;
    while (capacity < 2 * expected + 2) capacity *= 2;
    keys_.assign(capacity, kEmpty);
    nodes_.resize(capacity);
    mask_ = capacity - 1;
  }
  // The slot of `key`: its node if present (found = true), else where to insert it.
  size_t find(uint64_t key, bool* found) const {
    size_t i = static_cast<size_t>((key * kFibonacci) >> 32) & mask_;
    while (keys_[i] != kEmpty && keys_[i] != key) i = (i + 1) & mask_;
    *found = keys_[i] == key;
    return i;
  }
  int32_t node(size_t slot) const { return nodes_[slot]; }
  void insert(size_t slot, uint64_t key, int32_t node) {
    keys_[slot] = key;
    nodes_[slot] = node;
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  std::vector<uint64_t> keys_;
  std::vector<int32_t> nodes_;
  size_t mask_ = 0;
};

struct Trie {  // the full trie before pruning (from_drafts_reference's lists)
  std::vector<int32_t> token_ids, parents, sources, cells, depth;
  std::vector<double> scores, conds;
  std::vector<uint8_t> point_mass;
  std::vector<int32_t> local_node;  // [total] draft node -> trie node, -1 if cut

  void clear_and_reserve(size_t n) {  // (emptied, capacity kept: a scratch's trie is reused)
    for (auto* v : {&token_ids, &parents, &sources, &cells, &depth}) {
      v->clear();
      v->reserve(n);
    }
    for (auto* v : {&scores, &conds}) {
      v->clear();
      v->reserve(n);
    }
    point_mass.clear();
    point_mass.reserve(n);
  }

  int32_t add(int32_t token, int32_t parent, double score, int32_t source, uint8_t pm, int32_t cell,
              double cond, int32_t d) {
    token_ids.push_back(token);
    parents.push_back(parent);
    scores.push_back(score);
    sources.push_back(source);
    point_mass.push_back(pm);
    cells.push_back(cell);
    conds.push_back(cond);
    depth.push_back(d);
    return static_cast<int32_t>(token_ids.size()) - 1;
  }
};

// Children lists by parent (counting sort), reused across calls.
struct Children {
  std::vector<int32_t> first, kids, fill;
};

void sibling_ranks_into(const int32_t* parents, const double* scores, int64_t n, std::vector<int32_t>* rank,
                        Children* c);

void check_draft(const MergeInput& in, int64_t d) {
  int64_t begin = in.offsets[d], end = in.offsets[d + 1];
  if (begin < 0 || end < begin) throw std::invalid_argument("merge_drafts: offsets must not decrease");
  for (int64_t i = begin; i < end; ++i) {
    int32_t p = in.parents[i];
    if (p < -1 || p >= i - begin)
      throw std::invalid_argument("merge_drafts: draft " + std::to_string(d) + " parents[" +
                                  std::to_string(i - begin) + "]=" + std::to_string(p) +
                                  " must be in [-1, " + std::to_string(i - begin) + ")");
  }
}

// The factors a merge reads from calibration counts (MergeInput::counts): each source's and row's.
struct CountLevels {
  std::vector<double> by_source, by_row;
  CellMemo* memo = nullptr;  // (MergeInput::cell_memo)

  // calibration_cell(k), from the memo where this merge worked it out already
  double probability(const CalibrationCounts& c, int64_t k) {
    if (memo == nullptr) return calibration_cell(c, by_row, k);
    uint32_t slot = static_cast<uint32_t>((static_cast<uint64_t>(k) * kFibonacci) >> 40) & (CellMemo::kSlots - 1);
    for (;; slot = (slot + 1) & (CellMemo::kSlots - 1)) {
      CellMemo::Slot& s = memo->slots[slot];
      if (s.merge != memo->merge) {  // free in this merge
        double value = calibration_cell(c, by_row, k);
        if (2 * memo->used < CellMemo::kSlots) {
          s.cell = static_cast<int32_t>(k);
          s.merge = memo->merge;
          s.value = value;
          ++memo->used;
        }
        return value;
      }
      if (s.cell == k) return s.value;
    }
  }
};

// Each node's factor and flat cell (Calibration.node_factors); `levels`: the counts' factors,
// when the cells are computed from counts (then a draft without a row takes its source's).
void node_factors(const MergeInput& in, CountLevels* levels, int64_t d, std::vector<double>* factors,
                  std::vector<int32_t>* cells, std::vector<int32_t>* depth, std::vector<int32_t>* rank,
                  Children* children) {
  int64_t begin = in.offsets[d], n = in.offsets[d + 1] - begin;
  int32_t row = in.rows[d];
  double fallback;
  if (levels == nullptr) {
    fallback = in.fallback[d];
  } else {  // (read only where the draft has no row: its source's factor, 1 for a source not seen)
    int32_t source = in.draft_sources[d];
    fallback = source >= 0 && source < static_cast<int32_t>(levels->by_source.size()) ? levels->by_source[source] : 1.0;
  }
  factors->assign(n, fallback);
  cells->assign(n, -1);
  int32_t* node_cells = in.node_cells != nullptr ? in.node_cells + begin : nullptr;
  if (row < 0 && node_cells == nullptr) return;  // (every node takes the fallback)
  const int32_t* parents = in.parents + begin;
  depth->resize(n);
  for (int64_t i = 0; i < n; ++i) (*depth)[i] = parents[i] < 0 ? 1 : (*depth)[parents[i]] + 1;
  sibling_ranks_into(parents, in.scores + begin, n, rank, children);
  const double* scores = in.scores + begin;
  for (int64_t i = 0; i < n; ++i) {
    double cond = node_cond(parents, scores, i);
    int64_t within = row_cell((*depth)[i], (*rank)[i], cond);
    if (node_cells != nullptr) node_cells[i] = static_cast<int32_t>(within < 0 ? within + kCellsPerRow : within);
    if (row < 0) continue;  // (its cells for a later learn only: its factors are the fallback)
    int64_t cell = static_cast<int64_t>(row) * kCellsPerRow + within;
    int64_t at = cell < 0 ? cell + in.table_size : cell;  // Python's indexing (a negative score's cell)
    if (at < 0 || at >= in.table_size) throw std::out_of_range("merge_drafts: calibration cell outside the table");
    (*cells)[i] = static_cast<int32_t>(cell);
    double value = levels != nullptr ? levels->probability(*in.counts, at) : in.table[at];
    (*factors)[i] = !in.probabilities ? value : cond > 0 ? value / cond : 0.0;
  }
}

}  // namespace

struct MergeScratch {
  Trie trie;
  TrieIndex index;
  std::vector<double> factors, expected, cond;  // a draft's factors; coherent_scores' output and conditionals
  std::vector<int32_t> cells, depth, rank;      // a draft's cells, depths and sibling ranks
  Children children;
  std::vector<int32_t> order, chosen_order, remap, position;
  std::vector<uint8_t> chosen;
};

void MergeScratchDeleter::operator()(MergeScratch* scratch) const { delete scratch; }

std::unique_ptr<MergeScratch, MergeScratchDeleter> new_merge_scratch() {
  return std::unique_ptr<MergeScratch, MergeScratchDeleter>(new MergeScratch());
}

namespace {

// The trie merge (from_drafts_reference's loop over drafts), into s.trie.
void build_trie(const MergeInput& in, MergeScratch& s) {
  int64_t total = in.offsets[in.num_drafts];
  Trie& trie = s.trie;
  trie.clear_and_reserve(static_cast<size_t>(total) + 1);
  trie.local_node.assign(total, -1);
  trie.add(in.root_token, -1, 1.0, -1, 1, -1, 1.0, 0);
  TrieIndex& index = s.index;
  index.reset(static_cast<size_t>(total));
  std::vector<double>& factors = s.factors;
  std::vector<int32_t>&cells = s.cells, &depth = s.depth, &rank = s.rank;
  CountLevels levels;
  if (in.counts != nullptr) {
    calibration_levels(*in.counts, &levels.by_source, &levels.by_row);
    if (in.cell_memo != nullptr) {
      levels.memo = in.cell_memo;
      if (++levels.memo->merge == 0) {  // (the numbers wrapped: every slot is free again)
        for (CellMemo::Slot& slot : levels.memo->slots) slot.merge = 0;
        levels.memo->merge = 1;
      }
      levels.memo->used = 0;
    }
  }
  for (int64_t d = 0; d < in.num_drafts; ++d) {
    check_draft(in, d);
    node_factors(in, in.counts != nullptr ? &levels : nullptr, d, &factors, &cells, &depth, &rank, &s.children);
    int64_t begin = in.offsets[d], n = in.offsets[d + 1] - begin;
    const double* raw = in.scores + begin;
    int32_t* local = trie.local_node.data() + begin;
    uint8_t pm = in.point_mass[d];
    for (int64_t i = 0; i < n; ++i) {
      int32_t par = in.parents[begin + i];
      int32_t parent = par < 0 ? 0 : local[par];
      if (parent < 0) continue;  // an ancestor was cut by max_depth
      int32_t token = in.tokens[begin + i];
      uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
      bool found;
      size_t slot = index.find(key, &found);
      double cond = node_cond(in.parents + begin, raw, i);
      double score = trie.scores[parent] * py_min(1.0, factors[i] * cond);
      if (!found) {
        if (trie.depth[parent] >= in.max_depth) continue;
        int32_t node = trie.add(token, parent, score, static_cast<int32_t>(d), pm, cells[i], cond,
                                trie.depth[parent] + 1);
        index.insert(slot, key, node);
        local[i] = node;
      } else {
        int32_t node = index.node(slot);
        trie.point_mass[node] = trie.point_mass[node] || pm;
        if (score > trie.scores[node]) {
          trie.scores[node] = score;
          trie.sources[node] = static_cast<int32_t>(d);
          trie.cells[node] = cells[i];
          trie.conds[node] = cond;
        }
        local[i] = node;
      }
    }
  }
}

// coherent_scores: children keep their conditional probability in order of confidence until
// the mass left runs out.
// (into `out`; `c` and `cond`: scratch)
void coherent_scores(const std::vector<int32_t>& parents, const std::vector<double>& scores, std::vector<double>* out_,
                     Children* c, std::vector<double>* cond_) {
  size_t n = parents.size();
  std::vector<int32_t>&first = c->first, &kids = c->kids, &fill = c->fill;
  first.assign(n + 1, 0);
  kids.resize(n > 0 ? n - 1 : 0);
  for (size_t i = 1; i < n; ++i) ++first[parents[i] + 1];
  for (size_t i = 1; i <= n; ++i) first[i] += first[i - 1];
  fill.assign(first.begin(), first.end() - 1);
  for (size_t i = 1; i < n; ++i) kids[fill[parents[i]]++] = static_cast<int32_t>(i);  // index order
  std::vector<double>&out = *out_, &cond = *cond_;
  out.assign(scores.begin(), scores.end());
  cond.resize(n);
  for (size_t node = 0; node < n; ++node) {
    int32_t* begin = kids.data() + first[node];
    int32_t* end = kids.data() + first[node + 1];
    if (begin == end) continue;
    double old_parent = scores[node];
    for (int32_t* k = begin; k != end; ++k) cond[*k] = old_parent > 0 ? scores[*k] / old_parent : 0.0;
    std::sort(begin, end, [&](int32_t a, int32_t b) { return cond[a] > cond[b] || (cond[a] == cond[b] && a < b); });
    double left = 1.0;
    for (int32_t* k = begin; k != end; ++k) {
      double c = py_min(cond[*k], py_max(left, 0.0));
      left -= c;
      out[*k] = out[node] * c;
    }
  }
}

// Nodes 1..n-1 by score descending, then index (select_top_nodes' sort key): the first `count`
// of them in order (the rest unordered), into `order`.
void prune_order(const std::vector<double>& scores, size_t count, std::vector<int32_t>* order_) {
  std::vector<int32_t>& order = *order_;
  order.clear();
  order.reserve(scores.size());
  for (size_t i = 1; i < scores.size(); ++i) order.push_back(static_cast<int32_t>(i));
  auto before = [&](int32_t a, int32_t b) { return scores[a] > scores[b] || (scores[a] == scores[b] && a < b); };
  if (count < order.size()) {  // (the order is total: the first `count` are those partial_sort would give)
    std::nth_element(order.begin(), order.begin() + count, order.end(), before);
    std::sort(order.begin(), order.begin() + count, before);
  } else {
    std::sort(order.begin(), order.end(), before);
  }
}

// Whether no node scores above its parent: then a parent always precedes its children in prune
// order (ties go to the lower index), and select_top_nodes takes a prefix of that order.
bool scores_never_rise(const std::vector<int32_t>& parents, const std::vector<double>& scores) {
  for (size_t i = 1; i < parents.size(); ++i)
    if (!(scores[i] <= scores[parents[i]])) return false;
  return true;
}

}  // namespace

void sibling_ranks(const int32_t* parents, const double* scores, int64_t n, std::vector<int32_t>* rank) {
  Children children;
  sibling_ranks_into(parents, scores, n, rank, &children);
}

namespace {

void sibling_ranks_into(const int32_t* parents, const double* scores, int64_t n, std::vector<int32_t>* rank,
                        Children* c) {
  rank->assign(n, 0);
  bool chain = true;
  for (int64_t i = 0; i < n && chain; ++i) chain = parents[i] == i - 1;
  if (chain) return;
  // children of each parent (index order), parent -1 shifted to 0
  std::vector<int32_t>&first = c->first, &kids = c->kids, &fill = c->fill;
  first.assign(n + 2, 0);
  kids.resize(n);
  for (int64_t i = 0; i < n; ++i) ++first[parents[i] + 2];
  for (int64_t i = 2; i <= n + 1; ++i) first[i] += first[i - 1];
  fill.assign(first.begin(), first.end() - 1);
  for (int64_t i = 0; i < n; ++i) kids[fill[parents[i] + 1]++] = static_cast<int32_t>(i);
  for (int64_t p = 0; p <= n; ++p) {
    int32_t* begin = kids.data() + first[p];
    int32_t* end = kids.data() + first[p + 1];
    if (end - begin < 2) continue;
    std::sort(begin, end, [&](int32_t a, int32_t b) {
      return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
    });
    for (int32_t* k = begin; k != end; ++k) (*rank)[*k] = static_cast<int32_t>(k - begin);
  }
}

}  // namespace

MergedTree merge_drafts(const MergeInput& in) {
  if (in.max_nodes < 0 || in.max_depth < 0) throw std::invalid_argument("merge_drafts: negative budget");
  std::unique_ptr<MergeScratch, MergeScratchDeleter> own;  // (a caller without a scratch: one for this merge)
  if (in.scratch == nullptr) own = new_merge_scratch();
  MergeScratch& s = in.scratch != nullptr ? *in.scratch : *own;
  build_trie(in, s);
  const Trie& trie = s.trie;
  int32_t n = static_cast<int32_t>(trie.token_ids.size());
  const size_t order_all = static_cast<size_t>(n);
  coherent_scores(trie.parents, trie.scores, &s.expected, &s.children, &s.cond);
  const std::vector<double>& expected = s.expected;
  // select_top_nodes never skips a node when scores never rise: its first max_nodes suffice
  bool prefix = n - 1 > in.max_nodes && scores_never_rise(trie.parents, trie.scores);
  prune_order(trie.scores, prefix ? static_cast<size_t>(in.max_nodes) : order_all, &s.order);
  const std::vector<int32_t>& order = s.order;
  // select_top_nodes: in order, a node whose parent is the root or chosen, until max_nodes
  std::vector<uint8_t>& chosen = s.chosen;
  chosen.assign(n, 0);
  chosen[0] = 1;
  std::vector<int32_t>& chosen_order = s.chosen_order;
  chosen_order.clear();
  chosen_order.reserve(std::min(n, in.max_nodes));
  if (n - 1 <= in.max_nodes) {
    std::fill(chosen.begin(), chosen.end(), 1);
    chosen_order = order;
  } else if (prefix) {
    chosen_order.assign(order.begin(), order.begin() + in.max_nodes);
    for (int32_t i : chosen_order) chosen[i] = 1;
  } else {
    for (int32_t i : order) {
      if (static_cast<int32_t>(chosen_order.size()) == in.max_nodes) break;
      if (trie.parents[i] == 0 || chosen[trie.parents[i]]) {
        chosen[i] = 1;
        chosen_order.push_back(i);
      }
    }
  }
  std::vector<int32_t>& remap = s.remap;
  remap.assign(n, -1);
  MergedTree out;
  out.reserve(chosen_order.size() + 1);
  for (int32_t i = 0; i < n; ++i) {
    if (!chosen[i]) continue;
    remap[i] = static_cast<int32_t>(out.token_ids.size());
    out.token_ids.push_back(trie.token_ids[i]);
    out.parents.push_back(i == 0 ? -1 : remap[trie.parents[i]]);
    out.sources.push_back(trie.sources[i]);
    out.cells.push_back(trie.cells[i]);
    out.depth.push_back(trie.depth[i]);
    out.scores.push_back(trie.scores[i]);
    out.expected.push_back(expected[i]);
    out.conds.push_back(trie.conds[i]);
    out.point_mass.push_back(trie.point_mass[i]);
  }
  // the kept nodes in prune order: chosen_order restricted to them (all of it), renumbered
  std::vector<int32_t>& position = s.position;
  position.assign(out.token_ids.size(), -1);
  for (int32_t i : chosen_order) {
    int32_t node = remap[i];
    int32_t parent = out.parents[node];
    if (parent > 0 && position[parent] < 0) out.parents_first = false;
    position[node] = static_cast<int32_t>(out.order.size());
    out.order.push_back(node);
  }
  out.node_of.resize(trie.local_node.size());
  for (size_t i = 0; i < trie.local_node.size(); ++i)
    out.node_of[i] = trie.local_node[i] < 0 ? -1 : remap[trie.local_node[i]];
  return out;
}

MergedTree prune_prefix(const MergedTree& tree, int32_t max_nodes) {
  if (!tree.parents_first || max_nodes < 0) throw std::invalid_argument("prune_prefix: needs parents first in order");
  size_t n = tree.token_ids.size();
  size_t take = std::min(static_cast<size_t>(max_nodes), tree.order.size());
  std::vector<int32_t> keep(tree.order.begin(), tree.order.begin() + take);
  std::sort(keep.begin(), keep.end());
  keep.insert(keep.begin(), 0);
  std::vector<int32_t> remap(n, -1);
  MergedTree out;
  out.reserve(keep.size());
  for (size_t k = 0; k < keep.size(); ++k) {
    int32_t i = keep[k];
    remap[i] = static_cast<int32_t>(k);
    out.token_ids.push_back(tree.token_ids[i]);
    out.parents.push_back(i == 0 ? -1 : remap[tree.parents[i]]);
    out.sources.push_back(tree.sources[i]);
    out.cells.push_back(tree.cells[i]);
    out.depth.push_back(tree.depth[i]);
    out.scores.push_back(tree.scores[i]);
    out.expected.push_back(tree.expected[i]);
    out.conds.push_back(tree.conds[i]);
    out.point_mass.push_back(tree.point_mass[i]);
  }
  for (size_t k = 0; k < take; ++k) out.order.push_back(remap[tree.order[k]]);
  return out;
}

void observe_draft(const int32_t* tokens, const int32_t* parents, const double* scores, int64_t n,
                   const std::vector<int64_t>& committed, double* reached, double* predicted, double* matched,
                   int64_t stride) {
  std::vector<int32_t> depth(n), rank, cells(n);
  for (int64_t i = 0; i < n; ++i) {
    if (parents[i] < -1 || parents[i] >= i) throw std::invalid_argument("observe_draft: parents[i] must be in [-1, i)");
    depth[i] = parents[i] < 0 ? 1 : depth[parents[i]] + 1;
  }
  sibling_ranks(parents, scores, n, &rank);
  for (int64_t i = 0; i < n; ++i) {
    int32_t cell = row_cell(depth[i], rank[i], node_cond(parents, scores, i));
    cells[i] = cell < 0 ? cell + kCellsPerRow : cell;  // Python's indexing (a negative score's cell)
  }
  std::vector<uint8_t> hit(n);
  observe_draft_cells(tokens, parents, scores, cells.data(), n, committed, reached, predicted, matched, stride,
                      depth.data(), hit.data());
}

void observe_draft_cells(const int32_t* tokens, const int32_t* parents, const double* scores, const int32_t* cells,
                         int64_t n, const std::vector<int64_t>& committed, double* reached, double* predicted,
                         double* matched, int64_t stride, int32_t* depth, uint8_t* hit) {
  // hit[i]: node i was reached and accepted; depth[i] its depth (parents[i] < i, checked by the caller)
  std::fill(hit, hit + n, 0);
  int64_t known = static_cast<int64_t>(committed.size());
  for (int64_t i = 0; i < n; ++i) {
    int32_t p = parents[i];
    depth[i] = p < 0 ? 1 : depth[p] + 1;
    if (depth[i] > known || (p >= 0 && !hit[p])) continue;
    double cond = node_cond(parents, scores, i);
    int64_t at = static_cast<int64_t>(cells[i]) * stride;
    reached[at] += 1.0;
    predicted[at] += cond;
    if (tokens[i] == committed[depth[i] - 1]) {
      matched[at] += 1.0;
      hit[i] = 1;
    }
  }
}

void calibration_levels(const CalibrationCounts& c, std::vector<double>* by_source, std::vector<double>* by_row) {
  const int64_t C = kCellsPerRow;
  std::vector<double> row_p(c.rows, 0.0), row_m(c.rows, 0.0), src_p(c.sources, 0.0), src_m(c.sources, 0.0);
  for (int64_t r = 0; r < c.rows; ++r) {
    double p = 0.0, m = 0.0;
    for (int64_t k = 0; k < C; ++k) {
      p += c.predicted[r * C + k];
      m += c.matched[r * C + k];
    }
    row_p[r] = p;
    row_m[r] = m;
    int32_t s = c.row_source[r];
    if (s < 0 || s >= c.sources) throw std::invalid_argument("calibration_table: a row's source index is out of range");
    src_p[s] += p;
    src_m[s] += m;
  }
  const CalibrationWeights& w = c.w;
  by_source->assign(c.sources, 0.0);
  for (int64_t s = 0; s < c.sources; ++s)
    (*by_source)[s] = std::min(w.max_factor, (src_m[s] + w.source_prior) / (src_p[s] + w.source_prior));
  by_row->assign(c.rows, 0.0);
  for (int64_t r = 0; r < c.rows; ++r) {
    double prior = (*by_source)[c.row_source[r]];
    (*by_row)[r] = std::min(w.max_factor, (row_m[r] + w.row_prior * prior) / (row_p[r] + w.row_prior));
  }
}

double calibration_cell(const CalibrationCounts& c, const std::vector<double>& by_row, int64_t k) {
  double factor = by_row[k / kCellsPerRow];
  double claimed = c.reached[k] > 0 ? c.predicted[k] / std::max(c.reached[k], 1e-12) : c.cond_mids[k % kCellsPerRow];
  double cell_prior = std::min(factor * claimed, c.w.max_prior_prob);
  return (c.matched[k] + c.w.cell_prior * cell_prior) / (c.reached[k] + c.w.cell_prior);
}

void calibration_table(const double* reached, const double* predicted, const double* matched, int64_t rows,
                       const int32_t* row_source, int64_t sources, const double* cond_mids,
                       const CalibrationWeights& w, std::vector<double>* by_source, std::vector<double>* by_row,
                       std::vector<double>* table) {
  CalibrationCounts c{reached, predicted, matched, rows, row_source, sources, cond_mids, w};
  calibration_levels(c, by_source, by_row);
  table->assign(rows * kCellsPerRow, 0.0);
  for (int64_t k = 0; k < rows * kCellsPerRow; ++k) (*table)[k] = calibration_cell(c, *by_row, k);
}

int64_t choose_num_nodes(const double* values, int64_t count, const double* curve, double overhead, double scale) {
  int64_t best_n = 0;
  double best = 1.0 / (curve[1] + overhead), sum = 0.0;
  for (int64_t n = 1; n <= count; ++n) {
    sum += values[n - 1];
    double expected = sum * scale;
    expected += 1.0;
    double rate = expected / (curve[1 + n] + overhead);
    if (rate > best) {
      best = rate;
      best_n = n;
    }
  }
  return best_n;
}

namespace {

// np.interp(x, xs, ys) at one point, numpy's own steps (compiled_base.c, arr_interp): left of
// the first size its estimate, right of the last the last's, at a size its estimate, between
// two the slope (ys[j+1] - ys[j]) / (xs[j+1] - xs[j]) times (x - xs[j]) plus ys[j].
double interp(double x, const double* xs, const double* ys, int64_t n) {
  if (n == 1 || x < xs[0]) return ys[0];
  if (x >= xs[n - 1]) return ys[n - 1];
  int64_t j = static_cast<int64_t>(std::upper_bound(xs, xs + n, x) - xs) - 1;  // xs[j] <= x < xs[j + 1]
  if (xs[j] == x) return ys[j];
  double slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]);
  double y = slope * (x - xs[j]) + ys[j];
  if (std::isnan(y)) {
    y = slope * (x - xs[j + 1]) + ys[j + 1];
    if (std::isnan(y) && ys[j] == ys[j + 1]) y = ys[j];
  }
  return y;
}

// budget.tail_slope.
double tail_slope(const double* xs, const double* ys, int64_t n) {
  int64_t last = n - 1;
  if (last < 1) return 0.0;
  int64_t base = 0;
  for (int64_t j = 0; j < last; ++j)
    if (xs[j] <= xs[last] / 2) base = j;
  double slope = (ys[last] - ys[base]) / (xs[last] - xs[base]);
  double clipped = 0.0 > slope ? 0.0 : slope;  // Python's max(slope, 0.0): slope unless 0.0 is larger
  double cap = ys[last] / xs[last];
  return cap < clipped ? cap : clipped;  // min(clipped, cap): clipped unless cap is smaller
}

// The unpadded curve at k tokens (k >= 1) from the estimates ys: interpolated, linear past the last
// size (`slope`: tail_slope's, read only there and only with n > 1).
inline double curve_at(int64_t k, const double* sizes, const double* ys, int64_t n, double slope) {
  double x = static_cast<double>(k);
  if (n > 1 && x > sizes[n - 1]) return ys[n - 1] + slope * (x - sizes[n - 1]);
  return interp(x, sizes, ys, n);
}

}  // namespace

void cost_curve(const double* sizes, const double* seconds, int64_t n, int64_t upto, bool padded,
                std::vector<double>* out) {
  if (n < 1) throw std::invalid_argument("cost_curve: no sizes");
  const double* ys = seconds;
  int64_t top = std::max<int64_t>(upto, static_cast<int64_t>(sizes[n - 1]));
  out->clear();
  if (top < 1) return;  // np.arange(1, top + 1) is empty: so is the reference's curve
  std::vector<double> curve(static_cast<size_t>(top));
  double slope = n > 1 && static_cast<double>(top) > sizes[n - 1] ? tail_slope(sizes, ys, n) : 0.0;
  for (int64_t k = 1; k <= top; ++k) curve[k - 1] = curve_at(k, sizes, ys, n, slope);
  if (padded) {  // np.minimum.accumulate from the end, np.minimum(a, b) = a if a < b or a is NaN, else b
    for (int64_t k = top - 2; k >= 0; --k) {
      double a = curve[k + 1], b = curve[k];
      curve[k] = (a < b || std::isnan(a)) ? a : b;
    }
  }
  out->assign(1, curve[0]);
  out->insert(out->end(), curve.begin(), curve.end());
}

int64_t choose_tree_nodes(const MergedTree& tree, const double* sizes, const double* seconds, int64_t n,
                          double overhead, int64_t max_nodes, double scale) {
  if (n < 1) throw std::invalid_argument("choose_tree_nodes: no sizes");
  int64_t count = std::min<int64_t>(static_cast<int64_t>(tree.order.size()), std::max<int64_t>(max_nodes, 0));
  if (count == 0) return 0;  // (the reference: no values, nothing chosen)
  const double* ys = seconds;
  // cost_curve takes its tail slope where its top, max(upto, last size), passes the last size:
  // read only past the last size, where top does too
  double slope = n > 1 && static_cast<double>(count + 1) > sizes[n - 1] ? tail_slope(sizes, ys, n) : 0.0;
  std::vector<double> values(static_cast<size_t>(count)), curve(static_cast<size_t>(count) + 2);
  for (int64_t i = 0; i < count; ++i) values[i] = tree.expected[tree.order[i]];
  for (int64_t k = 1; k <= count + 1; ++k) curve[k] = curve_at(k, sizes, ys, n, slope);
  return choose_num_nodes(values.data(), count, curve.data(), overhead, scale);
}

void ancestor_mask(const int32_t* parents, int64_t n, uint8_t* mask) {
  std::memset(mask, 0, static_cast<size_t>(n * n));
  for (int64_t i = 0; i < n; ++i) {
    int32_t p = parents[i];
    if (p >= 0) {
      if (p >= i) throw std::invalid_argument("ancestor_mask: parents[i] must be < i");
      std::memcpy(mask + i * n, mask + static_cast<int64_t>(p) * n, static_cast<size_t>(p) + 1);
    }
    mask[i * n + i] = 1;
  }
}

namespace {

template <class T>
void fill_block(const uint8_t* seen, int64_t n, const uint8_t* fill, uint8_t* block, int64_t row_bytes) {
  T value;
  std::memcpy(&value, fill, sizeof(T));
  for (int64_t i = 0; i < n; ++i) {
    T* row = reinterpret_cast<T*>(block + i * row_bytes);
    const uint8_t* visible = seen + i * n;
    for (int64_t j = 0; j < n; ++j) row[j] = visible[j] ? T{0} : value;
  }
}

}  // namespace

void additive_tree_block(const int32_t* parents, int64_t n, size_t elem_size, const uint8_t* fill, uint8_t* block,
                         int64_t row_bytes) {
  std::vector<uint8_t> seen(static_cast<size_t>(n * n));
  ancestor_mask(parents, n, seen.data());
  switch (elem_size) {  // the element as an unsigned integer of its size: zero bits are 0.0
    case 2: return fill_block<uint16_t>(seen.data(), n, fill, block, row_bytes);
    case 4: return fill_block<uint32_t>(seen.data(), n, fill, block, row_bytes);
    case 8: return fill_block<uint64_t>(seen.data(), n, fill, block, row_bytes);
    default: throw std::invalid_argument("additive_tree_block: elements of 2, 4 or 8 bytes");
  }
}

void additive_tree_mask(const int32_t* parents, int64_t n, int64_t n_cached, size_t elem_size, const uint8_t* fill,
                        uint8_t* mask) {
  int64_t row_bytes = (n_cached + n) * static_cast<int64_t>(elem_size);
  std::memset(mask, 0, static_cast<size_t>(n * row_bytes));  // every cached slot is seen
  additive_tree_block(parents, n, elem_size, fill, mask + n_cached * static_cast<int64_t>(elem_size), row_bytes);
}

std::vector<int32_t> greedy_walk(const float* logits, int64_t row_stride, int64_t vocab,
                                 const std::vector<int32_t>& token_ids, const std::vector<int32_t>& parents,
                                 int64_t* next_token, bool* bonus, int32_t top_k,
                                 std::vector<std::vector<int32_t>>* tops, const int32_t* row_of, int32_t* missing,
                                 int32_t start, const int32_t* choices, int64_t choice_width) {
  size_t n = token_ids.size();
  std::vector<int32_t> first(n + 1, 0), kids(n > 0 ? n - 1 : 0);  // children of each node
  for (size_t i = 1; i < n; ++i) ++first[parents[i] + 1];
  for (size_t i = 1; i <= n; ++i) first[i] += first[i - 1];
  std::vector<int32_t> fill(first.begin(), first.end() - 1);
  for (size_t i = 1; i < n; ++i) kids[fill[parents[i]]++] = static_cast<int32_t>(i);
  std::vector<int32_t> accepted;
  int32_t node = start;
  if (missing != nullptr) *missing = -1;
  for (;;) {
    int64_t row = node;
    if (row_of != nullptr) {
      row = row_of[node];
      if (row < 0) {  // this node's logits were not computed: the caller computes them and walks again
        *missing = node;
        *next_token = -1;
        *bonus = false;
        return accepted;
      }
    }
    int64_t token;
    if (choices != nullptr) {  // picked as the row was written
      const int32_t* picked = choices + row * choice_width;
      if (top_k > 0) tops->emplace_back(picked, picked + top_k);
      token = picked[0];
    } else if (top_k > 0) {  // one pass over the row: its top k, whose first is its argmax
      tops->emplace_back();
      row_topk(logits + row * row_stride, vocab, top_k, &tops->back());
      token = tops->back()[0];
    } else {
      token = row_argmax(logits + row * row_stride, vocab);
    }
    int32_t child = -1;
    for (int32_t k = first[node]; k < first[node + 1]; ++k)
      if (token_ids[kids[k]] == token) child = kids[k];
    if (child < 0) {
      *next_token = token;
      *bonus = first[node] == first[node + 1];
      return accepted;
    }
    accepted.push_back(child);
    node = child;
  }
}

}  // namespace lookupdec
