// The step's tree merge, compiled: what lookupdec.tree.TokenTree.from_drafts_reference computes
// (per-draft calibration cells, conditional probabilities, the trie merge with the best score
// winning, the max_depth cut, coherent scores, the max_nodes best nodes with their ancestors),
// in one call. Every floating-point operation is the reference's, in the reference's order,
// so scores are bit-identical (this file is compiled with -ffp-contract=off).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>


namespace lookupdec {

// Calibration cells: as lookupdec.tree's DEPTH_BUCKETS, SIBLING_RANKS and COND_BUCKETS (checked
// at import): a node's cell in its row is (depth bucket, sibling rank, bucket of its own
// conditional probability), lookupdec.tree.draft_cells.
constexpr int32_t kDepthBuckets[] = {1, 2, 3, 5, 9, 17};
constexpr int32_t kNumDepthBuckets = 6;
constexpr int32_t kSiblingRanks = 3;
constexpr double kCondBuckets[] = {0.0, 0.25, 0.5, 0.75, 0.95};
constexpr int32_t kNumCondBuckets = 5;
constexpr int32_t kCellsPerRow = kNumDepthBuckets * kSiblingRanks * kNumCondBuckets;

struct CalibrationWeights {
  double source_prior, row_prior, cell_prior, max_factor, max_prior_prob;
};

// The calibrator's decayed counts [rows, kCellsPerRow] (row-major) and each row's source index.
struct CalibrationCounts {
  const double* reached;
  const double* predicted;
  const double* matched;
  int64_t rows;
  const int32_t* row_source;
  int64_t sources;
  const double* cond_mids;  // [kCellsPerRow] a cell's claimed probability before any observation
  CalibrationWeights w;
};

// The calibration cells a merge worked out (MergeInput::cell_memo): a small open-addressed
// table its owner keeps from merge to merge (a request's Lookups), each merge numbered, so
// nothing is cleared; a merge's nodes share a few dozen cells, and a table of one page reads
// fewer cache lines after a forward than one entry per cell of the calibrator's arrays would.
struct CellMemo {
  static constexpr int32_t kSlots = 256;  // a power of two; a merge stores at most half
  struct Slot {
    int32_t cell = -1;
    uint32_t merge = 0;
    double value = 0.0;
  };
  Slot slots[kSlots];
  uint32_t merge = 0;  // this merge's number (0: none yet)
  int32_t used = 0;    // slots this merge filled
};

// A merge's working arrays (its full trie, the trie's index, per-draft factors and ranks, the
// children lists, the prune order): their owner (a request's Lookups) keeps them from merge to
// merge, so a merge allocates only the tree it returns (the allocator's instructions per step
// were a visible share of the overhead replay's). They grow to the largest merge seen
// and stay. Every array is emptied or sized before it is read: a merge's result never depends on
// the one before (tests/test_mixture_plan.py's twins fail when one is not). Defined in tree.cpp;
// make one with new_merge_scratch().
struct MergeScratch;
struct MergeScratchDeleter {
  void operator()(MergeScratch* scratch) const;
};
std::unique_ptr<MergeScratch, MergeScratchDeleter> new_merge_scratch();

struct MergeInput {
  int32_t root_token;
  const int32_t* tokens;   // [total] every draft's token ids, draft after draft
  const int32_t* parents;  // [total] parent within its draft, -1 = child of the root
  const double* scores;    // [total] the proposers' scores
  const int64_t* offsets;  // [num_drafts + 1] where each draft starts
  int64_t num_drafts;
  const int32_t* rows;       // [num_drafts] calibration row, -1 = none (fallback then)
  const double* fallback;    // [num_drafts] factor of every node of a draft without a row
  const uint8_t* point_mass; // [num_drafts] 1 = a lookup draft (no draft-model samples)
  const double* table;       // [table_size] calibration values, row * kCellsPerRow + cell
  int64_t table_size;
  // or, instead of table and fallback (nullptr: those): the counts the table is made of, each
  // cell read computed from them (probabilities), table_size = rows * kCellsPerRow; a draft
  // without a row takes its source's factor (draft_sources[d] >= 0) or 1
  const CalibrationCounts* counts = nullptr;
  const int32_t* draft_sources = nullptr;  // [num_drafts] source index in counts, -1 = unknown
  bool probabilities;        // the table holds acceptance probabilities: factor = value / cond
  int32_t max_nodes;
  int32_t max_depth;
  // optional output [total]: each draft node's cell within its row as observe_draft counts it
  // (a negative index wrapped by kCellsPerRow), for every draft, one without a row too (the
  // merge works them out for its factors: a later learn of the same drafts reads them here)
  int32_t* node_cells = nullptr;
  CellMemo* cell_memo = nullptr;  // optional, with counts: each cell's probability worked out once
  MergeScratch* scratch = nullptr;  // optional: the merge's working arrays, kept by their owner
};

struct MergedTree {  // the kept tree, node 0 = the root, parents before children
  std::vector<int32_t> token_ids, parents, sources, cells, depth;
  std::vector<double> scores, expected, conds;
  std::vector<uint8_t> point_mass;
  std::vector<int32_t> order;     // draft nodes in prune order: score desc, then index
  bool parents_first = true;      // every node's parent precedes it in `order` (prune = a prefix)
  std::vector<int32_t> node_of;   // [total] each draft node's node in the kept tree, -1 if none

  void reserve(size_t n) {  // one allocation per list (grown node by node: ~7 each at 64 nodes)
    for (auto* v : {&token_ids, &parents, &sources, &cells, &depth}) v->reserve(n);
    for (auto* v : {&scores, &expected, &conds}) v->reserve(n);
    point_mass.reserve(n);
    order.reserve(n);
  }
};

MergedTree merge_drafts(const MergeInput& in);

// TokenTree.prune for a tree whose parents come first in prune order: the root and the first
// max_nodes nodes of `order` (max_nodes >= 0), renumbered in tree order (node_of left empty).
MergedTree prune_prefix(const MergedTree& tree, int32_t max_nodes);

// Sibling rank of each node within one draft: 0 = the best-scored child of its parent, ties
// to the earlier node (lookupdec.tree.draft_features).
void sibling_ranks(const int32_t* parents, const double* scores, int64_t n, std::vector<int32_t>* rank);

// mask[i * n + j] = 1 when node j is node i or one of its ancestors (parents[i] < i).
void ancestor_mask(const int32_t* parents, int64_t n, uint8_t* mask);

// The additive attention mask of a verify forward, [n, n_cached + n] elements of `elem_size`
// bytes, row-major: zero bytes where node i sees slot j (every cached slot, itself, its
// ancestors), `fill` (the dtype's minimum, elem_size bytes) elsewhere.
void additive_tree_mask(const int32_t* parents, int64_t n, int64_t n_cached, size_t elem_size, const uint8_t* fill,
                        uint8_t* mask);

// Its tree part alone: the n x n block of node-to-node entries (0 where node j is node i or an
// ancestor, `fill` elsewhere), row i at `block + i * row_bytes` (a mask row's stride).
void additive_tree_block(const int32_t* parents, int64_t n, size_t elem_size, const uint8_t* fill, uint8_t* block,
                         int64_t row_bytes);

// AcceptanceCalibrator.learn's count of one draft (lookupdec.tree.observe_draft_reference):
// every node whose parent path matches `committed` was reached, accepted if its own token is
// the next committed one; reached/predicted/matched ([kCellsPerRow] each, `stride` apart) get
// 1, its conditional probability and 1 (if accepted) at its cell, in node order.
void observe_draft(const int32_t* tokens, const int32_t* parents, const double* scores, int64_t n,
                   const std::vector<int64_t>& committed, double* reached, double* predicted, double* matched,
                   int64_t stride);
// observe_draft's walk over a draft whose cells are known (observe_draft works them out; a fused
// plan's merge wrote them, MergeInput::node_cells): the same counts, in the same order, without
// working out depths' buckets and sibling ranks again. depth, hit: n each (scratch).
void observe_draft_cells(const int32_t* tokens, const int32_t* parents, const double* scores, const int32_t* cells,
                         int64_t n, const std::vector<int64_t>& committed, double* reached, double* predicted,
                         double* matched, int64_t stride, int32_t* depth, uint8_t* hit);

// AcceptanceCalibrator.calibration's arithmetic (lookupdec.budget, its `backend="reference"`
// the definition): from the decayed reached/predicted/matched counts [rows, kCellsPerRow]
// (row-major) and each row's source index, each source's factor, each row's factor and each
// cell's acceptance probability, every sum taken left to right as the reference takes them.
void calibration_table(const double* reached, const double* predicted, const double* matched, int64_t rows,
                       const int32_t* row_source, int64_t sources, const double* cond_mids,
                       const CalibrationWeights& w, std::vector<double>* by_source, std::vector<double>* by_row,
                       std::vector<double>* table);
// Its source and row factors alone, and one cell's probability (what calibration_table writes
// at k = row * kCellsPerRow + cell, the same operations): a merge reads a few dozen of the
// table's cells, so it computes those instead of the whole table (MergeInput::counts).
void calibration_levels(const CalibrationCounts& c, std::vector<double>* by_source, std::vector<double>* by_row);
double calibration_cell(const CalibrationCounts& c, const std::vector<double>& by_row, int64_t k);

// budget.choose_num_nodes: the n in [0, count] maximising (1 + scale * (v[0] + ... + v[n-1])) /
// (curve[1 + n] + overhead), the first of equal rates (the reference's numpy operations, in order).
int64_t choose_num_nodes(const double* values, int64_t count, const double* curve, double overhead, double scale);

// budget.choose_num_nodes on a merged tree's own gains (its nodes' expected in prune order, the
// first min(order size, max_nodes)) with the unpadded cost curve of the estimates (sizes
// increasing, seconds: n >= 1 of each; cost_curve(..., !padded)) read at 1 .. count + 1 tokens
// only: without padding each size's cost is its own, so those entries are cost_curve's, bit for bit.
int64_t choose_tree_nodes(const MergedTree& tree, const double* sizes, const double* seconds, int64_t n,
                          double overhead, int64_t max_nodes, double scale);

// budget.CostModel.dense: out[k] = the cost of k tokens, k = 0 .. max(upto, sizes[last]) (out[0] =
// out[1]), from the estimates (sizes increasing, seconds: n >= 1 of each), interpolated as
// np.interp does it, linear past the last size with budget.tail_slope's slope; `padded`: the
// cheapest of any size from k up (a suffix minimum). The reference's numpy operations, one by one.
void cost_curve(const double* sizes, const double* seconds, int64_t n, int64_t upto, bool padded,
                std::vector<double>* out);

// Greedy acceptance (lookupdec.sampling.accept, greedy without logits processing): from the
// root, follow the child whose token is the argmax of the node's row of `logits` ([rows,
// vocab], rows >= nodes, row r at logits + r * row_stride); stop at the first node without
// such a child. Returns the accepted nodes; *next_token is that node's argmax, *bonus whether
// it has no children at all. With top_k > 0, each visited row is read once for its top_k
// (row_topk, common/topk.hpp, appended to *tops in visiting order: the root's row, then each accepted node's),
// whose first is the argmax: what token recycling keeps, without a second pass.
// With row_of (one entry per node), node u's logits are row row_of[u] of `logits`; where the
// walk reaches a node whose entry is -1 it stops, sets *missing to that node (else -1) and
// returns the nodes accepted before it (the caller computes the missing rows and walks again,
// from `start` = that node: the walk then begins there, its accepted nodes those below it).
// With `choices` ([rows, choice_width] int32, row r at choices + r * choice_width, top_k <=
// choice_width), each row's top picks were made already (skinny_linear_tops, as the output
// projection wrote the row): the walk reads them instead of the row.
std::vector<int32_t> greedy_walk(const float* logits, int64_t row_stride, int64_t vocab,
                                 const std::vector<int32_t>& token_ids, const std::vector<int32_t>& parents,
                                 int64_t* next_token, bool* bonus, int32_t top_k = 0,
                                 std::vector<std::vector<int32_t>>* tops = nullptr, const int32_t* row_of = nullptr,
                                 int32_t* missing = nullptr, int32_t start = 0, const int32_t* choices = nullptr,
                                 int64_t choice_width = 0);

}  // namespace lookupdec
