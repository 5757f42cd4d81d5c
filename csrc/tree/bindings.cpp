// The tree group's bindings (submodule `tree`): the step's merge, calibration, choice, verify
// inputs and greedy walk (tree/tree.hpp), called by
// lookupdec/tree.py, budget.py, step.py and sampling.py.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "common/bindings.hpp"
#include "common/topk.hpp"
#include "tree/bindings.hpp"
#include "tree/tree.hpp"

namespace lookupdec_bindings {

// -- shared with the drafting group's fused plan (tree/bindings.hpp) ------------------------------

lookupdec::MergeInput merge_input(int32_t root_token, const PackedDrafts& packed, const std::vector<int32_t>& rows,
                                  const uint8_t* point_mass, int32_t max_nodes, int32_t max_depth) {
  lookupdec::MergeInput in;
  in.root_token = root_token;
  in.tokens = packed.tokens.data();
  in.parents = packed.parents.data();
  in.scores = packed.scores.data();
  in.offsets = packed.offsets.data();
  in.num_drafts = static_cast<int64_t>(packed.offsets.size()) - 1;
  in.rows = rows.data();
  in.point_mass = point_mass;
  in.max_nodes = max_nodes;
  in.max_depth = max_depth;
  return in;
}

// A merge input's calibration from the calibrator's counts (each cell read computed from them)
// instead of a table; draft_sources: each draft's source index in the counts, -1 unknown.
void with_counts(lookupdec::MergeInput* in, const lookupdec::CalibrationCounts& counts,
                 const std::vector<int32_t>& draft_sources) {
  in->fallback = nullptr;
  in->table = nullptr;
  in->table_size = counts.rows * lookupdec::kCellsPerRow;
  in->probabilities = true;
  in->counts = &counts;
  in->draft_sources = draft_sources.data();
}

void check_counts(size_t rows, std::initializer_list<size_t> shape0, std::initializer_list<size_t> shape1,
                  const char* who) {
  for (size_t r : shape0)
    if (r != rows) throw std::invalid_argument(std::string(who) + ": reached, predicted, matched: alike rows");
  for (size_t c : shape1)
    if (c != static_cast<size_t>(lookupdec::kCellsPerRow))
      throw std::invalid_argument(std::string(who) + ": rows of CELLS_PER_ROW cells");
}

void decay_counts(std::initializer_list<CountsOut*> arrays, size_t rows, double decay) {
  size_t total = rows * lookupdec::kCellsPerRow;
  for (CountsOut* a : arrays) {
    double* x = a->data();
    for (size_t k = 0; k < total; ++k) x[k] *= decay;
  }
}

namespace {

// Per node, {token: child node}: TokenTree.children.
nb::list children_dicts(const std::vector<int32_t>& token_ids, const std::vector<int32_t>& parents) {
  Py_ssize_t n = static_cast<Py_ssize_t>(token_ids.size());
  PyObject* list = PyList_New(n);
  if (list == nullptr) throw nb::python_error();
  nb::list out = nb::steal<nb::list>(list);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* dict = PyDict_New();
    if (dict == nullptr) throw nb::python_error();
    PyList_SET_ITEM(list, i, dict);
  }
  for (Py_ssize_t i = 1; i < n; ++i) {
    nb::object token = nb::steal(PyLong_FromLong(token_ids[i])), child = nb::steal(PyLong_FromSsize_t(i));
    if (PyDict_SetItem(PyList_GET_ITEM(list, parents[i]), token.ptr(), child.ptr()) != 0) throw nb::python_error();
  }
  return out;
}

nb::list source_list(const CoreTree& t) {
  const std::vector<int32_t>& sources = t.tree.sources;
  size_t root = nb::len(t.names) - 1;
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(sources.size()));
  if (list == nullptr) throw nb::python_error();
  for (size_t i = 0; i < sources.size(); ++i) {
    size_t at = sources[i] < 0 ? root : static_cast<size_t>(sources[i]);
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), Py_NewRef(PyList_GET_ITEM(t.names.ptr(), at)));
  }
  return nb::steal<nb::list>(list);
}

nb::list expected_in_prune_order(const CoreTree& t) {
  std::vector<double> values;
  values.reserve(t.tree.order.size());
  for (int32_t node : t.tree.order) values.push_back(t.tree.expected[node]);
  return float_list(values);
}

PackedDrafts pack_drafts(nb::list drafts) {
  size_t num_drafts = nb::len(drafts);
  PackedDrafts out;
  out.offsets.assign(num_drafts + 1, 0);
  out.tokens.reserve(1024);
  out.parents.reserve(1024);
  out.scores.reserve(1024);
  for (size_t d = 0; d < num_drafts; ++d) {
    PyObject* packed = PyList_GET_ITEM(drafts.ptr(), static_cast<Py_ssize_t>(d));
    if (!PyTuple_Check(packed) || PyTuple_GET_SIZE(packed) != 3)
      throw std::invalid_argument("merge_drafts: each draft is a (token_ids, parents, scores) tuple of bytes");
    PyObject* arrays[3] = {PyTuple_GET_ITEM(packed, 0), PyTuple_GET_ITEM(packed, 1), PyTuple_GET_ITEM(packed, 2)};
    for (PyObject* a : arrays)
      if (!PyBytes_Check(a)) throw std::invalid_argument("merge_drafts: packed arrays must be bytes");
    size_t n = static_cast<size_t>(PyBytes_GET_SIZE(arrays[0])) / sizeof(int32_t);
    if (static_cast<size_t>(PyBytes_GET_SIZE(arrays[0])) != n * sizeof(int32_t) ||
        static_cast<size_t>(PyBytes_GET_SIZE(arrays[1])) != n * sizeof(int32_t) ||
        static_cast<size_t>(PyBytes_GET_SIZE(arrays[2])) != n * sizeof(double))
      throw std::invalid_argument("merge_drafts: a draft's packed arrays differ in length");
    const int32_t* t = reinterpret_cast<const int32_t*>(PyBytes_AS_STRING(arrays[0]));
    const int32_t* p = reinterpret_cast<const int32_t*>(PyBytes_AS_STRING(arrays[1]));
    const double* s = reinterpret_cast<const double*>(PyBytes_AS_STRING(arrays[2]));
    out.tokens.insert(out.tokens.end(), t, t + n);
    out.parents.insert(out.parents.end(), p, p + n);
    out.scores.insert(out.scores.end(), s, s + n);
    out.offsets[d + 1] = out.offsets[d] + static_cast<int64_t>(n);
  }
  return out;
}

nb::tuple merged(const lookupdec::MergeInput& in, nb::list names) {
  CoreTree tree{lookupdec::merge_drafts(in), names};
  nb::bytes node_of = to_bytes(tree.tree.node_of);
  tree.tree.node_of.clear();
  return nb::make_tuple(std::move(tree), node_of);
}

// drafts: one (token_ids, parents, scores) bytes tuple per draft (Draft.packed()); rows,
// fallback, point_mass: one entry per draft; names: each draft's source, then the root's "".
// Returns (the kept tree as a CoreTree, each draft node's node in it as int32 bytes, -1: none).
nb::tuple merge_drafts(int32_t root_token, nb::list drafts, const std::vector<int32_t>& rows,
                       const std::vector<double>& fallback, nb::bytes point_mass, nb::bytes table,
                       bool probabilities, nb::list names, int32_t max_nodes, int32_t max_depth) {
  size_t num_drafts = nb::len(drafts);
  if (rows.size() != num_drafts || fallback.size() != num_drafts || point_mass.size() != num_drafts ||
      nb::len(names) != num_drafts + 1)
    throw std::invalid_argument("merge_drafts: rows, fallback, point_mass and names must match the drafts");
  PackedDrafts packed = pack_drafts(drafts);
  lookupdec::MergeInput in = merge_input(root_token, packed, rows, reinterpret_cast<const uint8_t*>(point_mass.c_str()),
                                             max_nodes, max_depth);
  int64_t table_size = -1;
  in.fallback = fallback.data();
  in.table = bytes_array<double>(table, &table_size, "table");
  in.table_size = table_size;
  in.probabilities = probabilities;
  return merged(in, names);
}

// A bytearray (writable: numpy and torch views of it need no copy).
nb::bytearray ancestor_mask(nb::bytes parents) {
  int64_t n = -1;
  const int32_t* p = bytes_array<int32_t>(parents, &n, "parents");
  nb::bytearray mask(nullptr, static_cast<size_t>(n * n));
  lookupdec::ancestor_mask(p, n, reinterpret_cast<uint8_t*>(mask.data()));
  return mask;
}


// A verify forward's input ids and positions (n_cached + depth) into `id` and `position` (n
// int64 each); `name` names the caller in errors. Returns whether the tree is a chain.
template <class Token>
bool write_ids_positions(const std::vector<Token>& token_ids, const std::vector<int32_t>& parents, int64_t n_cached,
                         int64_t* id, int64_t* position, const char* name) {
  int64_t n = static_cast<int64_t>(parents.size());
  bool chain = true;
  for (int64_t i = 0; i < n; ++i) {
    int32_t p = parents[i];
    if (i > 0 && (p < 0 || p >= i)) throw std::invalid_argument(std::string(name) + ": parents[i] must be in [0, i)");
    id[i] = static_cast<int64_t>(token_ids[i]);
    position[i] = i == 0 ? n_cached : position[p] + 1;
    chain = chain && p == i - 1;
  }
  return chain;
}

template <class Token>
void check_tree(const std::vector<Token>& token_ids, const std::vector<int32_t>& parents, int64_t n_cached,
                const char* name) {
  if (token_ids.size() != parents.size() || parents.empty() || parents[0] != -1 || n_cached < 0)
    throw std::invalid_argument(std::string(name) + ": need parents[0] == -1 and one token per node");
}

// A verify forward's inputs, for torch.frombuffer: (input ids, positions) as int64 bytearrays
// [n] (positions: n_cached + depth), and the additive mask bytearray [n, n_cached + n] of
// len(fill)-byte elements (tree.hpp), or None for a chain (the model's causal mask is the same).
template <class Token>
nb::tuple tree_inputs(const std::vector<Token>& token_ids, const std::vector<int32_t>& parents, int64_t n_cached,
                      nb::bytes fill) {
  check_tree(token_ids, parents, n_cached, "tree_inputs");
  int64_t n = static_cast<int64_t>(parents.size());
  nb::bytearray ids(nullptr, static_cast<size_t>(n) * sizeof(int64_t));
  nb::bytearray positions(nullptr, static_cast<size_t>(n) * sizeof(int64_t));
  if (write_ids_positions(token_ids, parents, n_cached, reinterpret_cast<int64_t*>(ids.data()),
                          reinterpret_cast<int64_t*>(positions.data()), "tree_inputs"))
    return nb::make_tuple(ids, positions, nb::none());
  size_t elem = fill.size();
  nb::bytearray mask(nullptr, static_cast<size_t>(n * (n_cached + n)) * elem);
  lookupdec::additive_tree_mask(parents.data(), n, n_cached, elem, reinterpret_cast<const uint8_t*>(fill.c_str()),
                                reinterpret_cast<uint8_t*>(mask.data()));
  return nb::make_tuple(ids, positions, mask);
}

// tree_inputs into buffers kept across steps (model.target.InputBuffers), given by address (an
// ndarray argument costs microseconds to convert each step): the tree's n input ids and positions
// into the int64 arrays at `ids` and `positions` (`rows` long), and its mask block into the
// additive mask at `mask`: `rows` rows of `cols` len(fill)-byte elements, zero outside the last
// step's tree block, which is cleared first (last_rows x last_rows elements at column last_col);
// then, unless the tree is a chain, this tree's block is written (n x n at column n_cached,
// additive_tree_block). The prefix columns are never written: they stay 0. Returns false for a
// chain (no block written: the model's causal mask is the tree mask).
template <class Token>
bool tree_inputs_at(const std::vector<Token>& token_ids, const std::vector<int32_t>& parents, int64_t n_cached,
                    nb::bytes fill, uintptr_t ids, uintptr_t positions, uintptr_t mask, int64_t rows, int64_t cols,
                    int64_t last_rows, int64_t last_col) {
  check_tree(token_ids, parents, n_cached, "tree_inputs_at");
  int64_t n = static_cast<int64_t>(parents.size());
  int64_t elem = static_cast<int64_t>(fill.size());
  if (elem == 0 || !ids || !positions || !mask || rows < std::max(n, last_rows) || cols < n_cached + n ||
      last_rows < 0 || last_col < 0 || cols < last_col + last_rows)
    throw std::invalid_argument("tree_inputs_at: buffers too small for the tree");
  bool chain = write_ids_positions(token_ids, parents, n_cached, reinterpret_cast<int64_t*>(ids),
                                   reinterpret_cast<int64_t*>(positions), "tree_inputs_at");
  uint8_t* base = reinterpret_cast<uint8_t*>(mask);
  int64_t row_bytes = cols * elem;
  for (int64_t i = 0; i < last_rows; ++i)
    std::memset(base + i * row_bytes + last_col * elem, 0, static_cast<size_t>(last_rows * elem));
  if (chain) return false;
  lookupdec::additive_tree_block(parents.data(), n, static_cast<size_t>(elem),
                                 reinterpret_cast<const uint8_t*>(fill.c_str()), base + n_cached * elem, row_bytes);
  return true;
}

// A batched verify forward's inputs (model.batch.BatchTarget.inputs) into buffers given by
// address: input ids and positions, int64 [rows, width], and the additive mask [rows, width,
// slots + width] of len(fill)-byte elements. Row b's tree (token_ids[b], parents[b]: n <= width
// nodes) follows `slots` prefix columns of which its first lengths[b] hold its own K/V (the rest
// are holes: hidden); its nodes sit at columns slots + i. Node i sees its own prefix, itself and
// its ancestors; padding nodes (i >= n) repeat the root's token at the root's position and see
// their prefix and themselves alone. Every element of the three buffers is written.
void batch_tree_inputs_at(const std::vector<std::vector<int64_t>>& token_ids,
                          const std::vector<std::vector<int32_t>>& parents, const std::vector<int64_t>& lengths,
                          int64_t slots, int64_t width, nb::bytes fill, uintptr_t ids, uintptr_t positions,
                          uintptr_t mask) {
  size_t rows = token_ids.size();
  int64_t elem = static_cast<int64_t>(fill.size());
  if (parents.size() != rows || lengths.size() != rows || width < 1 || slots < 0 || !ids || !positions || !mask ||
      (elem != 2 && elem != 4 && elem != 8))
    throw std::invalid_argument("batch_tree_inputs_at: one tree and length per row, width >= 1, buffers, "
                                "elements of 2, 4 or 8 bytes");
  int64_t cols = slots + width, row_bytes = cols * elem;
  const uint8_t* hidden = reinterpret_cast<const uint8_t*>(fill.c_str());
  std::vector<uint8_t> seen, hiddens(static_cast<size_t>(row_bytes));  // a row of hidden entries
  for (int64_t j = 0; j < cols; ++j) std::memcpy(hiddens.data() + j * elem, hidden, static_cast<size_t>(elem));
  for (size_t b = 0; b < rows; ++b) {
    const std::vector<int64_t>& tokens = token_ids[b];
    const std::vector<int32_t>& tree = parents[b];
    int64_t n = static_cast<int64_t>(tree.size()), length = lengths[b];
    if (static_cast<int64_t>(tokens.size()) != n || n < 1 || n > width || tree[0] != -1 || length < 0 ||
        length > slots)
      throw std::invalid_argument("batch_tree_inputs_at: row " + std::to_string(b) +
                                  ": need 1..width nodes, parents[0] == -1, one token per node, its length <= slots");
    int64_t* id = reinterpret_cast<int64_t*>(ids) + static_cast<int64_t>(b) * width;
    int64_t* position = reinterpret_cast<int64_t*>(positions) + static_cast<int64_t>(b) * width;
    write_ids_positions(tokens, tree, length, id, position, "batch_tree_inputs_at");
    for (int64_t i = n; i < width; ++i) {
      id[i] = tokens[0];
      position[i] = length;
    }
    seen.resize(static_cast<size_t>(n * n));
    lookupdec::ancestor_mask(tree.data(), n, seen.data());
    uint8_t* block = reinterpret_cast<uint8_t*>(mask) + static_cast<int64_t>(b) * width * row_bytes;
    for (int64_t i = 0; i < width; ++i) {
      uint8_t* row = block + i * row_bytes;
      std::memset(row, 0, static_cast<size_t>(length * elem));  // its own prefix
      std::memcpy(row + length * elem, hiddens.data() + length * elem, static_cast<size_t>((cols - length) * elem));
      if (i < n) {
        for (int64_t j = 0; j < n; ++j)
          if (seen[static_cast<size_t>(i * n + j)]) std::memset(row + (slots + j) * elem, 0, static_cast<size_t>(elem));
      } else {
        std::memset(row + (slots + i) * elem, 0, static_cast<size_t>(elem));
      }
    }
  }
}

using LogitsIn = nb::ndarray<const float, nb::ndim<2>, nb::device::cpu>;
using CellsOut = nb::ndarray<double, nb::ndim<1>, nb::device::cpu>;

// sampling.top_tokens: the k best token ids of each of `rows`, best first.
nb::list top_tokens(LogitsIn logits, const std::vector<int64_t>& rows, int32_t k) {
  if (logits.stride(1) != 1 || logits.shape(1) < 1) throw std::invalid_argument("top_tokens: contiguous rows");
  nb::list out;
  std::vector<int32_t> best;
  for (int64_t r : rows) {
    if (r < 0 || static_cast<size_t>(r) >= logits.shape(0)) throw std::out_of_range("top_tokens: row out of range");
    lookupdec::row_topk(logits.data() + r * logits.stride(0), static_cast<int64_t>(logits.shape(1)), k, &best);
    out.append(int_list(best));
  }
  return out;
}

// tree.observe_draft: one draft's reached nodes counted into a calibration row's three arrays.
void observe_draft(nb::bytes tokens, nb::bytes parents, nb::bytes scores, const std::vector<int64_t>& committed,
                   CellsOut reached, CellsOut predicted, CellsOut matched) {
  int64_t n = -1;
  const int32_t* t = bytes_array<int32_t>(tokens, &n, "tokens");
  const int32_t* p = bytes_array<int32_t>(parents, &n, "parents");
  const double* s = bytes_array<double>(scores, &n, "scores");
  for (const CellsOut* a : {&reached, &predicted, &matched})
    if (a->shape(0) != static_cast<size_t>(lookupdec::kCellsPerRow) || a->stride(0) != reached.stride(0))
      throw std::invalid_argument("observe_draft: rows of CELLS_PER_ROW cells, alike");
  lookupdec::observe_draft(t, p, s, n, committed, reached.data(), predicted.data(), matched.data(), reached.stride(0));
}

using CountsIn = nb::ndarray<const double, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// The calibrator's counts as the core reads them (arrays checked alike, one source index per row).
lookupdec::CalibrationCounts calibration_counts(CountsIn reached, CountsIn predicted, CountsIn matched,
                                               nb::bytes row_source, int64_t sources, nb::bytes cond_mids,
                                               const lookupdec::CalibrationWeights& weights, const char* who) {
  size_t rows = reached.shape(0);
  check_counts(rows, {predicted.shape(0), matched.shape(0)}, {reached.shape(1), predicted.shape(1), matched.shape(1)},
               who);
  int64_t n = static_cast<int64_t>(rows), cells = lookupdec::kCellsPerRow;
  const int32_t* src = bytes_array<int32_t>(row_source, &n, "row_source");
  const double* mids = bytes_array<double>(cond_mids, &cells, "cond_mids");
  return {reached.data(), predicted.data(), matched.data(), n, src, sources, mids, weights};
}

// budget.AcceptanceCalibrator.calibration: (table float64 bytes [rows * CELLS_PER_ROW], row
// factors float64 bytes [rows], source factors float64 bytes [sources]).
nb::tuple calibration_table(CountsIn reached, CountsIn predicted, CountsIn matched, nb::bytes row_source,
                            int64_t sources, nb::bytes cond_mids, double source_prior, double row_prior,
                            double cell_prior, double max_factor, double max_prior_prob) {
  lookupdec::CalibrationCounts c = calibration_counts(reached, predicted, matched, row_source, sources, cond_mids,
                                                      {source_prior, row_prior, cell_prior, max_factor, max_prior_prob},
                                                      "calibration_table");
  std::vector<double> by_source, by_row, table;
  lookupdec::calibration_table(c.reached, c.predicted, c.matched, c.rows, c.row_source, c.sources, c.cond_mids, c.w,
                               &by_source, &by_row, &table);
  return nb::make_tuple(to_bytes(table), to_bytes(by_row), to_bytes(by_source));
}

// TokenTree.from_drafts over an AcceptanceCalibrator's counts (merge_drafts with the cells it
// reads computed from them, not a whole table: the calibration merge_drafts would be given).
// draft_sources: each draft's source index in the counts, -1 if unknown (its factor is then 1).
nb::tuple merge_drafts_counts(int32_t root_token, nb::list drafts, const std::vector<int32_t>& rows,
                              const std::vector<int32_t>& draft_sources, nb::bytes point_mass, CountsIn reached,
                              CountsIn predicted, CountsIn matched, nb::bytes row_source, int64_t sources,
                              nb::bytes cond_mids, double source_prior, double row_prior, double cell_prior,
                              double max_factor, double max_prior_prob, nb::list names, int32_t max_nodes,
                              int32_t max_depth) {
  size_t num_drafts = nb::len(drafts);
  if (rows.size() != num_drafts || draft_sources.size() != num_drafts || point_mass.size() != num_drafts ||
      nb::len(names) != num_drafts + 1)
    throw std::invalid_argument("merge_drafts: rows, draft_sources, point_mass and names must match the drafts");
  lookupdec::CalibrationCounts counts = calibration_counts(
      reached, predicted, matched, row_source, sources, cond_mids,
      {source_prior, row_prior, cell_prior, max_factor, max_prior_prob}, "merge_drafts");
  for (int32_t r : rows)
    if (r >= counts.rows) throw std::invalid_argument("merge_drafts: a draft's row is out of range");
  PackedDrafts packed = pack_drafts(drafts);
  lookupdec::MergeInput in = merge_input(root_token, packed, rows, reinterpret_cast<const uint8_t*>(point_mass.c_str()),
                                             max_nodes, max_depth);
  with_counts(&in, counts, draft_sources);
  lookupdec::CellMemo memo;  // (as a fused plan's merge reads cells: each worked out once)
  in.cell_memo = &memo;
  return merged(in, names);
}

// budget.AcceptanceCalibrator.learn: every count decayed once (x *= decay, as numpy's), then each
// draft (packed int32 tokens, int32 parents, float64 scores) counted into its row (observe_draft).
void learn_drafts(CountsOut reached, CountsOut predicted, CountsOut matched, double decay,
                  const std::vector<int64_t>& rows, const std::vector<std::tuple<nb::bytes, nb::bytes, nb::bytes>>& drafts,
                  const std::vector<int64_t>& committed) {
  size_t nrows = reached.shape(0);
  check_counts(nrows, {predicted.shape(0), matched.shape(0)}, {reached.shape(1), predicted.shape(1), matched.shape(1)},
               "learn_drafts");
  if (rows.size() != drafts.size()) throw std::invalid_argument("learn_drafts: a row per draft");
  for (int64_t r : rows)
    if (r < 0 || static_cast<size_t>(r) >= nrows) throw std::invalid_argument("learn_drafts: a draft's row is out of range");
  decay_counts({&reached, &predicted, &matched}, nrows, decay);
  const int64_t C = lookupdec::kCellsPerRow;
  for (size_t d = 0; d < drafts.size(); ++d) {
    int64_t n = -1;
    const int32_t* t = bytes_array<int32_t>(std::get<0>(drafts[d]), &n, "tokens");
    const int32_t* p = bytes_array<int32_t>(std::get<1>(drafts[d]), &n, "parents");
    const double* s = bytes_array<double>(std::get<2>(drafts[d]), &n, "scores");
    int64_t at = rows[d] * C;
    lookupdec::observe_draft(t, p, s, n, committed, reached.data() + at, predicted.data() + at, matched.data() + at, 1);
  }
}

// budget.choose_num_nodes over the first min(len(values), max_nodes) values, the cost curve
// `curve` (CostModel.dense: curve[k] = seconds of k tokens, at least that many + 1 entries) and
// the step's correction of the gains (`scale`).
int64_t choose_num_nodes(const std::vector<double>& values, nb::ndarray<const double, nb::ndim<1>, nb::c_contig,
                         nb::device::cpu> curve, double overhead, int64_t max_nodes, double scale) {
  int64_t count = std::min<int64_t>(static_cast<int64_t>(values.size()), std::max<int64_t>(max_nodes, 0));
  if (static_cast<int64_t>(curve.shape(0)) < count + 2)
    throw std::invalid_argument("choose_num_nodes: the cost curve is shorter than the values");
  return lookupdec::choose_num_nodes(values.data(), count, curve.data(), overhead, scale);
}

// A cost model's estimates as the compiled curve takes them: one entry each per size, sizes increasing.
void check_estimates(const std::vector<double>& sizes, const std::vector<double>& seconds, const std::string& name) {
  if (sizes.empty() || seconds.size() != sizes.size())
    throw std::invalid_argument(name + ": sizes and seconds need one entry each per size");
  for (size_t i = 1; i < sizes.size(); ++i)
    if (!(sizes[i - 1] < sizes[i])) throw std::invalid_argument(name + ": sizes must increase");
}

// budget.choose_tree_nodes: budget.choose_num_nodes on the tree's gains in prune order, with the
// cost model's estimates (sizes, seconds; ints taken as floats) made into its unpadded curve only
// as far as it is read, in one call.
int64_t choose_tree_nodes(const CoreTree& t, const std::vector<double>& sizes, const std::vector<double>& seconds,
                          double overhead, int64_t max_nodes, double scale) {
  check_estimates(sizes, seconds, "choose_num_nodes");
  return lookupdec::choose_tree_nodes(t.tree, sizes.data(), seconds.data(), static_cast<int64_t>(sizes.size()),
                                      overhead, max_nodes, scale);
}

// budget.CostModel.dense from its estimates (ints taken as floats): the curve as float64 bytes.
nb::bytes cost_curve(const std::vector<double>& sizes, const std::vector<double>& seconds, int64_t upto, bool padded) {
  check_estimates(sizes, seconds, "cost_curve");
  std::vector<double> out;
  lookupdec::cost_curve(sizes.data(), seconds.data(), static_cast<int64_t>(sizes.size()), upto, padded, &out);
  return to_bytes(out);
}

// (accepted nodes, next token, bonus, tops, missing, tokens): lookupdec.sampling.accept's greedy walk;
// tops: with top_k > 0 the top_k token ids of every visited row (one list per row, best first),
// else None; missing: with row_of (int32 bytes, a row of `logits` per node, -1: not computed),
// the first node the walk reached without a row (then next token -1), else -1; choices
// ([rows of logits, >= max(top_k, 1)] int32): each row's top picks, made as it was written;
// tokens: the token ids of `start` and of each accepted node (the walked path's, read where the
// tree's arrays are: the caller needs them next and would ask for them apart).
using ChoicesIn = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
nb::tuple greedy_walk(std::optional<LogitsIn> logits_in, const std::vector<int32_t>& token_ids,
                      const std::vector<int32_t>& parents, int32_t top_k, std::optional<nb::bytes> row_of, int32_t start,
                      std::optional<ChoicesIn> choices) {
  size_t n = token_ids.size();
  if (n == 0 || parents.size() != n || parents[0] != -1) throw std::invalid_argument("greedy_walk: bad tree");
  for (size_t i = 1; i < n; ++i)
    if (parents[i] < 0 || static_cast<size_t>(parents[i]) >= i)
      throw std::invalid_argument("greedy_walk: parents[i] must be in [0, i)");
  if (!logits_in.has_value() && !choices.has_value())
    throw std::invalid_argument("greedy_walk: logits or choices");
  // with choices alone the rows are never read (a cold torch-to-numpy view of them costs more
  // than the walk): only their count matters
  const float* data = logits_in.has_value() ? logits_in->data() : nullptr;
  const int64_t num_rows = static_cast<int64_t>(logits_in.has_value() ? logits_in->shape(0) : choices->shape(0));
  const int64_t row_stride = logits_in.has_value() ? static_cast<int64_t>(logits_in->stride(0)) : 0;
  const int64_t vocab = logits_in.has_value() ? static_cast<int64_t>(logits_in->shape(1)) : 0;
  if (logits_in.has_value() && (logits_in->shape(1) < 1 || logits_in->stride(1) != 1))
    throw std::invalid_argument("greedy_walk: logits need contiguous rows");
  const int32_t* rows = nullptr;
  if (row_of.has_value()) {
    int64_t count = static_cast<int64_t>(n);
    rows = bytes_array<int32_t>(*row_of, &count, "row_of");
    for (size_t i = 0; i < n; ++i)
      if (rows[i] < -1 || rows[i] >= num_rows)
        throw std::invalid_argument("greedy_walk: row_of names a row logits does not have");
  } else if (num_rows < static_cast<int64_t>(n)) {
    throw std::invalid_argument("greedy_walk: logits need a row per node");
  }
  int64_t next_token = 0;
  bool bonus = false;
  int32_t missing = -1;
  std::vector<std::vector<int32_t>> tops;
  if (start < 0 || static_cast<size_t>(start) >= n) throw std::invalid_argument("greedy_walk: start is not a node");
  const int32_t* picked = nullptr;
  int64_t width = 0;
  if (choices.has_value()) {
    width = static_cast<int64_t>(choices->shape(1));
    if (static_cast<int64_t>(choices->shape(0)) != num_rows || width < std::max<int64_t>(top_k, 1))
      throw std::invalid_argument("greedy_walk: choices need a row per row of logits and max(top_k, 1) columns");
    picked = choices->data();
  }
  std::vector<int32_t> accepted = lookupdec::greedy_walk(data, row_stride, vocab, token_ids,
                                                         parents, &next_token, &bonus, top_k, &tops, rows, &missing,
                                                         start, picked, width);
  nb::object rows_out = nb::none();
  if (top_k > 0) {
    nb::list lists;
    for (const auto& row : tops) lists.append(int_list(row));
    rows_out = lists;
  }
  std::vector<int32_t> visited;
  visited.reserve(accepted.size() + 1);
  visited.push_back(token_ids[start]);
  for (int32_t node : accepted) visited.push_back(token_ids[node]);
  return nb::make_tuple(int_list(accepted), next_token, bonus, rows_out, missing, int_list(visited));
}

}  // namespace

void bind_tree(nb::module_& m) {
  m.attr("CELLS_PER_ROW") = lookupdec::kCellsPerRow;
  m.attr("SIBLING_RANKS") = lookupdec::kSiblingRanks;
  m.attr("DEPTH_BUCKETS") = nb::make_tuple(1, 2, 3, 5, 9, 17);
  m.attr("COND_BUCKETS") = nb::make_tuple(0.0, 0.25, 0.5, 0.75, 0.95);
  m.def("merge_drafts", &merge_drafts);
  PyObject* match_buckets = PyTuple_New(kNumMatchBuckets);
  if (match_buckets == nullptr) throw nb::python_error();
  for (int32_t b = 0; b < kNumMatchBuckets; ++b) PyTuple_SET_ITEM(match_buckets, b, PyLong_FromLong(kMatchBuckets[b]));
  m.attr("MATCH_BUCKETS") = nb::steal(match_buckets);
  m.def("merge_drafts_counts", &merge_drafts_counts);
  m.def("ancestor_mask", &ancestor_mask);
  m.def("tree_inputs", &tree_inputs<int64_t>);
  m.def("tree_inputs_at", &tree_inputs_at<int64_t>);
  m.def("batch_tree_inputs_at", &batch_tree_inputs_at);
  m.def("greedy_walk", &greedy_walk, nb::arg("logits").none(), nb::arg("token_ids"), nb::arg("parents"),
        nb::arg("top_k") = 0, nb::arg("row_of") = nb::none(), nb::arg("start") = 0, nb::arg("choices") = nb::none());
  m.def("observe_draft", &observe_draft);
  m.def("calibration_table", &calibration_table);
  m.def("learn_drafts", &learn_drafts);
  m.def("choose_num_nodes", &choose_num_nodes);
  m.def("cost_curve", &cost_curve);
  m.def("top_tokens", &top_tokens);
  nb::class_<CoreTree>(m, "Tree")
      .def("__len__", [](const CoreTree& t) { return t.tree.token_ids.size(); })
      .def("token_ids", [](const CoreTree& t) { return int_list(t.tree.token_ids); })
      .def("parents", [](const CoreTree& t) { return int_list(t.tree.parents); })
      .def("scores", [](const CoreTree& t) { return float_list(t.tree.scores); })
      .def("sources", &source_list)
      .def("point_mass", [](const CoreTree& t) { return bool_list(t.tree.point_mass); })
      .def("expected", [](const CoreTree& t) { return float_list(t.tree.expected); })
      .def("cells", [](const CoreTree& t) { return int_list(t.tree.cells); })
      .def("conds", [](const CoreTree& t) { return float_list(t.tree.conds); })
      .def("depth", [](const CoreTree& t) { return int_list(t.tree.depth); })
      .def("order", [](const CoreTree& t) { return int_list(t.tree.order); })
      .def_prop_ro("parents_first", [](const CoreTree& t) { return t.tree.parents_first; })
      .def("children", [](const CoreTree& t) { return children_dicts(t.tree.token_ids, t.tree.parents); })
      .def("expected_in_prune_order", &expected_in_prune_order)
      .def("tokens_of", [](const CoreTree& t, const std::vector<int32_t>& nodes) {
        std::vector<int32_t> out(nodes.size());
        int64_t n = static_cast<int64_t>(t.tree.token_ids.size());
        for (size_t i = 0; i < nodes.size(); ++i) {
          if (nodes[i] < 0 || nodes[i] >= n) throw std::out_of_range("tokens_of: node out of range");
          out[i] = t.tree.token_ids[nodes[i]];
        }
        return int_list(out);
      })
      .def("expected_total", [](const CoreTree& t) {
        double total = 0.0;  // left to right, as the reference's loop
        for (size_t i = 1; i < t.tree.expected.size(); ++i) total += t.tree.expected[i];
        return total;
      })
      .def("choose_num_nodes", &choose_tree_nodes)
      .def("prune", [](const CoreTree& t, int32_t max_nodes) {
        return CoreTree{lookupdec::prune_prefix(t.tree, max_nodes), t.names};
      })
      .def("inputs", [](const CoreTree& t, int64_t n_cached, nb::bytes fill) {
        return tree_inputs(t.tree.token_ids, t.tree.parents, n_cached, fill);
      })
      .def("inputs_at", [](const CoreTree& t, int64_t n_cached, nb::bytes fill, uintptr_t ids, uintptr_t positions,
                           uintptr_t mask, int64_t rows, int64_t cols, int64_t last_rows, int64_t last_col) {
        return tree_inputs_at(t.tree.token_ids, t.tree.parents, n_cached, fill, ids, positions, mask, rows, cols,
                              last_rows, last_col);
      })
      .def("greedy_walk", [](const CoreTree& t, std::optional<LogitsIn> logits, int32_t top_k,
                             std::optional<nb::bytes> row_of, int32_t start, std::optional<ChoicesIn> choices) {
        return greedy_walk(logits, t.tree.token_ids, t.tree.parents, top_k, row_of, start, choices);
      }, nb::arg("logits").none(), nb::arg("top_k") = 0, nb::arg("row_of") = nb::none(), nb::arg("start") = 0,
      nb::arg("choices") = nb::none());
}

}  // namespace lookupdec_bindings
