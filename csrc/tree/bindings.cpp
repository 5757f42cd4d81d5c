// nanobind module lookupdec.automaton._core: the compiled Automaton, called by the Python
// wrapper in lookupdec/automaton/__init__.py (which converts and validates its arguments), the
// suffix proposer's drafts (lookupdec/proposers/suffix.py), the n-gram proposer's index
// (lookupdec/proposers/ngram.py) and the step's tree merge and ancestor mask (lookupdec/tree.py).
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
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <stdexcept>
#include <string>
#include <vector>

#include "drafting/automaton.hpp"
#include "drafting/ngram.hpp"
#include "drafting/recycle.hpp"
#include "drafting/suffix_drafts.hpp"
#include "kernels/skinny.hpp"
#include "kernels/rotary.hpp"
#include "kernels/norm.hpp"
#include "kernels/attention.hpp"
#if defined(LOOKUPDEC_OPENMP)
#include <omp.h>
#endif
#include "common/topk.hpp"
#include "tree/tree.hpp"
#include "tree/hindsight.hpp"

namespace nb = nanobind;
using lookupdec::Automaton;

namespace {

using TokensIn = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// Small results go back as bytes (the wrapper views them with np.frombuffer): creating a
// numpy array through nanobind costs an order of magnitude more than a bytes object.
template <class T>
nb::bytes to_bytes(const std::vector<T>& values) {
  return nb::bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// Read-only view of the first size() tokens; it keeps its buffer alive after later extends.
nb::ndarray<nb::numpy, const int32_t, nb::ndim<1>> tokens_view(const Automaton& automaton) {
  auto* buffer = new std::shared_ptr<lookupdec::TokenBuffer>(automaton.token_buffer());
  nb::capsule owner(buffer, [](void* p) noexcept {
    delete static_cast<std::shared_ptr<lookupdec::TokenBuffer>*>(p);
  });
  size_t size = static_cast<size_t>(automaton.size());
  return nb::ndarray<nb::numpy, const int32_t, nb::ndim<1>>((*buffer)->data.get(), {size}, owner);
}

nb::tuple next_counts(Automaton& automaton, int32_t state) {
  std::vector<int32_t> tokens, counts;
  automaton.next_counts(state, &tokens, &counts);
  return nb::make_tuple(to_bytes(tokens), to_bytes(counts));
}

nb::tuple tree_bytes(const lookupdec::TreeDraft& tree) {
  return nb::make_tuple(to_bytes(tree.token_ids), to_bytes(tree.parents), to_bytes(tree.scores));
}

nb::tuple expand_tree(Automaton& automaton, int32_t state, int32_t max_nodes, int32_t max_depth) {
  return tree_bytes(automaton.expand_tree(state, max_nodes, max_depth));
}

nb::tuple propose_tree(Automaton& automaton, TokensIn context, int32_t max_nodes,
                       int32_t max_depth, int32_t min_match, int32_t min_count) {
  return tree_bytes(automaton.propose_tree(context.data(), context.shape(0), max_nodes, max_depth,
                                           min_match, min_count));
}

// A bytes argument as an array of `count` T (count = -1: as many as it holds).
template <class T>
const T* bytes_array(const nb::bytes& b, int64_t* count, const char* name) {
  if (b.size() % sizeof(T) != 0 || (*count >= 0 && static_cast<int64_t>(b.size() / sizeof(T)) != *count))
    throw std::invalid_argument(std::string("merge_drafts: ") + name + " has the wrong size");
  *count = static_cast<int64_t>(b.size() / sizeof(T));
  return reinterpret_cast<const T*>(b.c_str());
}

// Python lists built directly (no numpy on the way: each list is read by Python code anyway).
nb::list int_list(const std::vector<int32_t>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) throw nb::python_error();
  for (size_t i = 0; i < values.size(); ++i) PyList_SET_ITEM(list, i, PyLong_FromLong(values[i]));
  return nb::steal<nb::list>(list);
}

nb::list float_list(const std::vector<double>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) throw nb::python_error();
  for (size_t i = 0; i < values.size(); ++i) PyList_SET_ITEM(list, i, PyFloat_FromDouble(values[i]));
  return nb::steal<nb::list>(list);
}

nb::list bool_list(const std::vector<uint8_t>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) throw nb::python_error();
  for (size_t i = 0; i < values.size(); ++i) PyList_SET_ITEM(list, i, Py_NewRef(values[i] ? Py_True : Py_False));
  return nb::steal<nb::list>(list);
}

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

// A merged tree held in the core: TokenTree reads its lists from it on first use, and prunes
// and builds verify inputs from it without Python lists.
struct CoreTree {
  lookupdec::MergedTree tree;
  nb::list names;  // each draft's source, then the root's ""
};

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

// drafts: one (token_ids, parents, scores) bytes tuple per draft (Draft.packed()); rows,
// fallback, point_mass: one entry per draft; names: each draft's source, then the root's "".
// Returns (the kept tree as a CoreTree, each draft node's node in it as int32 bytes, -1: none).
// Every draft's packed (token_ids, parents, scores) bytes, concatenated, with their offsets.
struct PackedDrafts {
  std::vector<int64_t> offsets;
  std::vector<int32_t> tokens, parents;
  std::vector<double> scores;
};

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

nb::tuple merged(const lookupdec::MergeInput& in, nb::list names) {
  CoreTree tree{lookupdec::merge_drafts(in), names};
  nb::bytes node_of = to_bytes(tree.tree.node_of);
  tree.tree.node_of.clear();
  return nb::make_tuple(std::move(tree), node_of);
}

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

// One tuple per draft: (token_ids, parents, scores, match_length, chain, chain_certain): the
// draft's arrays as bytes; the first draft's best chain and its certain-step flags as lists (the
// proposer checks that chain against the step's tokens), None for the later drafts (shorter
// matches: nothing reads their chains in a step; Draft.best_chain() reads it from the arrays).
// (context: a list of token ids; int32 overflow is a TypeError, which the wrapper reports; a
// negative id a ValueError, as the wrapper's own check of other inputs says it)
nb::list suffix_drafts(Automaton& automaton, const std::vector<int32_t>& context, int32_t max_nodes,
                       int32_t min_match, int32_t levels, int32_t shorter_divisor, int32_t separator,
                       double empty_confidence, double match_prior, double certain_step) {
  for (int32_t token : context) {
    if (token < 0) throw nb::value_error("token ids must be in [0, 2**31 - 1]");
  }
  lookupdec::SuffixDraftParams params{max_nodes, min_match, levels, shorter_divisor, separator,
                                      empty_confidence, match_prior, certain_step};
  std::vector<lookupdec::SuffixDraft> drafts =
      lookupdec::suffix_drafts(automaton, context.data(), context.size(), params);
  nb::list out;
  for (const lookupdec::SuffixDraft& d : drafts) {
    bool first = out.size() == 0;
    out.append(nb::make_tuple(to_bytes(d.token_ids), to_bytes(d.parents), to_bytes(d.scores), d.match_length,
                              first ? nb::object(int_list(d.chain)) : nb::none(),
                              first ? nb::object(bool_list(d.chain_certain)) : nb::none()));
  }
  return out;
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

// model/cache.SlotStore.gather (and BatchStore.gather_row) on a CPU buffer, in place: in each
// row of slots (`outer` x `inner` rows at base + o * outer_stride + i * inner_stride bytes, each
// `capacity` slots of `slot_bytes`), slot slots[j] is copied to start + j. The slots increase
// and none lies before its target, so copying in order never overwrites a slot still to be
// read; runs of consecutive slots move in one memmove. No allocation: index_select's temporary
// (180 rows x the accepted slots of SmolLM2's cache, often past malloc's mmap threshold) cost
// page faults on every step that moved K/V.
void gather_slots(uintptr_t base, int64_t outer, int64_t outer_stride, int64_t inner, int64_t inner_stride,
                  int64_t slot_bytes, int64_t capacity, const std::vector<int64_t>& slots, int64_t start) {
  int64_t count = static_cast<int64_t>(slots.size());
  if (!base || outer < 0 || inner < 0 || slot_bytes <= 0 || start < 0 || start + count > capacity)
    throw std::invalid_argument("gather_slots: buffer shape out of range");
  for (int64_t j = 0; j < count; ++j)
    if (slots[j] < start + j || slots[j] >= capacity || (j > 0 && slots[j] <= slots[j - 1]))
      throw std::invalid_argument("gather_slots: slots must increase, each at or after its target, below capacity");
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first j, length) of consecutive slots not in place
  for (int64_t j = 0; j < count;) {
    int64_t k = j + 1;
    while (k < count && slots[k] == slots[k - 1] + 1) ++k;
    if (slots[j] != start + j) runs.emplace_back(j, k - j);
    j = k;
  }
  uint8_t* data = reinterpret_cast<uint8_t*>(base);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      uint8_t* row = data + o * outer_stride + i * inner_stride;
      for (const auto& run : runs)
        std::memmove(row + (start + run.first) * slot_bytes, row + slots[run.first] * slot_bytes,
                     static_cast<size_t>(run.second * slot_bytes));
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

// model/kernels.SkinnyLinears: a weight [n, k] packed into panels, and the product with them.
using MatrixIn = nb::ndarray<const float, nb::ndim<2>, nb::device::cpu>;
using MatrixOut = nb::ndarray<float, nb::ndim<2>, nb::device::cpu>;
using PanelsIn = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using PanelsOut = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void skinny_pack(MatrixIn w, PanelsOut panels) {
  const int64_t n = static_cast<int64_t>(w.shape(0)), k = static_cast<int64_t>(w.shape(1));
  if (w.stride(1) != 1 || w.stride(0) != k) throw std::invalid_argument("skinny_pack: a contiguous weight");
  if (static_cast<int64_t>(panels.shape(0)) != (n + lookupdec::kPanel - 1) / lookupdec::kPanel * lookupdec::kPanel * k)
    throw std::invalid_argument("skinny_pack: panels of ceil(n / 16) * 16 * k floats");
  lookupdec::skinny_pack(w.data(), n, k, panels.data());
}

using TopsOut = nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// With `tops` [m, top_k] int32: each row's top_k output indices too (skinny_linear_tops; weight_bound:
// max |w| of the packed weight, inf where unknown).
void skinny_linear(MatrixIn x, PanelsIn panels, MatrixOut y, std::optional<std::string> isa,
                   std::optional<TopsOut> tops, float weight_bound) {
  const int64_t m = static_cast<int64_t>(x.shape(0)), k = static_cast<int64_t>(x.shape(1));
  const int64_t n = static_cast<int64_t>(y.shape(1));
  if (x.stride(1) != 1 || y.stride(1) != 1) throw std::invalid_argument("skinny_linear: rows contiguous");
  if (static_cast<int64_t>(y.shape(0)) != m) throw std::invalid_argument("skinny_linear: y has x's rows");
  if (static_cast<int64_t>(panels.shape(0)) != (n + lookupdec::kPanel - 1) / lookupdec::kPanel * lookupdec::kPanel * k)
    throw std::invalid_argument("skinny_linear: panels of ceil(n / 16) * 16 * k floats (y's columns, x's)");
  if (tops.has_value()) {
    const int64_t top_k = static_cast<int64_t>(tops->shape(1));
    if (static_cast<int64_t>(tops->shape(0)) != m || top_k < 1 || top_k > n)
      throw std::invalid_argument("skinny_linear: tops of x's rows and 1 to n columns");
    nb::gil_scoped_release release;
    lookupdec::skinny_linear_tops(x.data(), x.stride(0), m, k, panels.data(), n, y.data(), y.stride(0),
                                  static_cast<int32_t>(top_k), tops->data(), weight_bound, isa ? isa->c_str() : nullptr);
    return;
  }
  nb::gil_scoped_release release;
  lookupdec::skinny_linear(x.data(), x.stride(0), m, k, panels.data(), n, y.data(), y.stride(0),
                           isa ? isa->c_str() : nullptr);
}

// skinny_linear without the ndarray conversions (a torch tensor's DLPack import cost more than
// the rest of a small call, and a forward makes one call per linear layer): addresses and sizes
// the caller has checked
// (model/kernels.py: float32 CPU tensors, x's rows contiguous, panels of ceil(n / 16) * 16 * k
// floats, y [m, n] contiguous).
void skinny_linear_at(uintptr_t x, int64_t ldx, int64_t m, int64_t k, uintptr_t panels, int64_t n, uintptr_t y) {
  if (m < 0 || k < 1 || n < 1 || ldx < k) throw std::invalid_argument("skinny_linear_at: bad sizes");
  nb::gil_scoped_release release;
  lookupdec::skinny_linear(reinterpret_cast<const float*>(x), ldx, m, k, reinterpret_cast<const float*>(panels), n,
                           reinterpret_cast<float*>(y), n);
}

// The rotary embedding of a float32 CPU tensor x [B, H, T, D] into out (the same shape), from
// addresses, sizes and strides the caller has checked (model/kernels.py, fused_rotary_for):
// cos and sin rows of D contiguous floats (rotary.hpp).
void rotary_at(uintptr_t x, int64_t b, int64_t h, int64_t t, int64_t d, int64_t sb, int64_t sh, int64_t st, int64_t sd,
               uintptr_t cos, uintptr_t sin, int64_t cos_batch, uintptr_t out, int64_t ob, int64_t oh, int64_t ot,
               int64_t od) {
  if (b < 0 || h < 0 || t < 0 || d < 2 || d % 2 || cos_batch < 0) throw std::invalid_argument("rotary_at: bad sizes");
  const int64_t shape[4] = {b, h, t, d}, xs[4] = {sb, sh, st, sd}, os[4] = {ob, oh, ot, od};
  lookupdec::rotary(reinterpret_cast<const float*>(x), shape, xs, reinterpret_cast<const float*>(cos),
                    reinterpret_cast<const float*>(sin), cos_batch, reinterpret_cast<float*>(out), os);
}

// RMS norm of float32 rows (norm.hpp) from addresses and sizes the caller has checked
// (model/kernels.py, fused_norms_for): rows of n floats at x + r * ldx into y + r * ldy.
void rms_norm_at(uintptr_t x, int64_t ldx, int64_t rows, int64_t n, uintptr_t w, double eps, uintptr_t y,
                 int64_t ldy) {
  if (rows < 0 || n < 1 || ldx < n || ldy < n) throw std::invalid_argument("rms_norm_at: bad sizes");
  lookupdec::rms_norm(reinterpret_cast<const float*>(x), ldx, rows, n, reinterpret_cast<const float*>(w),
                      static_cast<float>(eps), reinterpret_cast<float*>(y), ldy);
}

// Tree attention (attention.hpp) from addresses the caller has checked (model/kernels.py,
// core_attention): float32 q, k, v (last dim contiguous), the plan's int32 cols [B, cmax],
// counts and common [B], float32 bias [B, Q, cmax], uint8 live [B, Q], out [B, Q, H, D]
// contiguous. `sizes`: B, H, KVH, Q, D, cmax, then q's, k's and v's four strides.
void tree_attention_at(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t cols, uintptr_t counts, uintptr_t common,
                       uintptr_t bias, uintptr_t live, uintptr_t out, const std::vector<int64_t>& sizes, double scale,
                       std::optional<std::string> isa) {
  if (sizes.size() != 18) throw std::invalid_argument("tree_attention_at: sizes holds B, H, KVH, Q, D, cmax, 12 strides");
  lookupdec::AttentionArgs a{};
  a.B = sizes[0], a.H = sizes[1], a.KVH = sizes[2], a.Q = sizes[3], a.D = sizes[4], a.cmax = sizes[5];
  if (a.B < 0 || a.Q < 0 || a.KVH < 1 || a.H % a.KVH || a.cmax < 0 || a.D < 16 || a.D > 128 || a.D % 16)
    throw std::invalid_argument("tree_attention_at: bad sizes");
  for (int i = 0; i < 4; ++i) a.qs[i] = sizes[6 + i], a.ks[i] = sizes[10 + i], a.vs[i] = sizes[14 + i];
  if (a.qs[3] != 1 || a.ks[3] != 1 || a.vs[3] != 1) throw std::invalid_argument("tree_attention_at: head dims not contiguous");
  a.q = reinterpret_cast<const float*>(q), a.k = reinterpret_cast<const float*>(k), a.v = reinterpret_cast<const float*>(v);
  a.cols = reinterpret_cast<const int32_t*>(cols), a.counts = reinterpret_cast<const int32_t*>(counts);
  a.common = reinterpret_cast<const int32_t*>(common), a.bias = reinterpret_cast<const float*>(bias);
  a.live = reinterpret_cast<const uint8_t*>(live), a.out = reinterpret_cast<float*>(out);
  a.scale = static_cast<float>(scale);
  const int threads = lookupdec::skinny_threads(int64_t{1} << 40);
  nb::gil_scoped_release release;
  lookupdec::tree_attention(a, threads, isa ? isa->c_str() : nullptr);
}

// attention.hpp's plan of a mask the caller has checked (model/kernels.py, attention_plan_core):
// float32 or uint8 (bool) elements at b * sb + t * st + j, outputs of `width` >= L per row.
int64_t attention_plan_at(uintptr_t mask, bool boolean, int64_t B, int64_t Q, int64_t L, int64_t sb, int64_t st,
                          double hidden, int64_t width, uintptr_t cols, uintptr_t counts, uintptr_t common,
                          uintptr_t bias, uintptr_t live) {
  if (B < 0 || Q < 0 || L < 0 || width < L) throw std::invalid_argument("attention_plan_at: bad sizes");
  return lookupdec::attention_plan(reinterpret_cast<const void*>(mask), boolean, B, Q, L, sb, st,
                                   static_cast<float>(hidden), width, reinterpret_cast<int32_t*>(cols),
                                   reinterpret_cast<int32_t*>(counts), reinterpret_cast<int32_t*>(common),
                                   reinterpret_cast<float*>(bias), reinterpret_cast<uint8_t*>(live));
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
using CountsOut = nb::ndarray<double, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

void check_counts(size_t rows, std::initializer_list<size_t> shape0, std::initializer_list<size_t> shape1,
                  const char* who) {
  for (size_t r : shape0)
    if (r != rows) throw std::invalid_argument(std::string(who) + ": reached, predicted, matched: alike rows");
  for (size_t c : shape1)
    if (c != static_cast<size_t>(lookupdec::kCellsPerRow))
      throw std::invalid_argument(std::string(who) + ": rows of CELLS_PER_ROW cells");
}

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

// Every count of the calibrator's arrays decayed once (x *= decay, as numpy's).
void decay_counts(std::initializer_list<CountsOut*> arrays, size_t rows, double decay) {
  size_t total = rows * lookupdec::kCellsPerRow;
  for (CountsOut* a : arrays) {
    double* x = a->data();
    for (size_t k = 0; k < total; ++k) x[k] *= decay;
  }
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
// the correction of each n's gains (scales[n], n = 0 .. that many).
int64_t choose_num_nodes(const std::vector<double>& values, nb::ndarray<const double, nb::ndim<1>, nb::c_contig,
                         nb::device::cpu> curve, double overhead, int64_t max_nodes, const std::vector<double>& scales) {
  int64_t count = std::min<int64_t>(static_cast<int64_t>(values.size()), std::max<int64_t>(max_nodes, 0));
  if (static_cast<int64_t>(curve.shape(0)) < count + 2)
    throw std::invalid_argument("choose_num_nodes: the cost curve is shorter than the values");
  if (static_cast<int64_t>(scales.size()) < count + 1)
    throw std::invalid_argument("choose_num_nodes: a scale per node count 0 .. n");
  return lookupdec::choose_num_nodes(values.data(), count, curve.data(), overhead, scales.data());
}

// A cost model's estimates as the compiled curve takes them: one entry each per size, sizes increasing.
void check_estimates(const std::vector<double>& sizes, const std::vector<double>& seconds,
                     const std::vector<double>& counts, const std::string& name) {
  if (sizes.empty() || seconds.size() != sizes.size() || counts.size() != sizes.size())
    throw std::invalid_argument(name + ": sizes, seconds and counts need one entry each per size");
  for (size_t i = 1; i < sizes.size(); ++i)
    if (!(sizes[i - 1] < sizes[i])) throw std::invalid_argument(name + ": sizes must increase");
}

// CostModel.counts from what the model keeps (CostModel.raw_counts, count_scale): each raw sum
// times the scale, the same products, in place.
void scale_counts(std::vector<double>* counts, double count_scale) {
  if (count_scale != 1.0)
    for (double& c : *counts) c *= count_scale;
}

// budget.choose_tree_nodes: budget.choose_num_nodes on the tree's gains in prune order, with the
// cost model's estimates (sizes, seconds, counts; ints taken as floats) made into its optimistic,
// unpadded curve only as far as it is read, in one call.
int64_t choose_tree_nodes(const CoreTree& t, const std::vector<double>& sizes, const std::vector<double>& seconds,
                          std::vector<double> counts, double optimism, double overhead, int64_t max_nodes,
                          const std::vector<double>& scales, double count_scale) {
  check_estimates(sizes, seconds, counts, "choose_num_nodes");
  scale_counts(&counts, count_scale);
  return lookupdec::choose_tree_nodes(t.tree, sizes.data(), seconds.data(), counts.data(),
                                      static_cast<int64_t>(sizes.size()), optimism, overhead, max_nodes,
                                      scales.data(), static_cast<int64_t>(scales.size()));
}

// budget.SizeRecord.scales(longest, scale, factor) from its table [rows, 4] (promised, accepted,
// steps, last step; row = size - 1) and step count: the same operations in the same order.
using RecordIn = nb::ndarray<const double, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
std::vector<double> size_scales(RecordIn record, double steps, double scale, double prior_steps, double decay,
                                int64_t longest, double factor) {
  if (record.shape(1) != 4) throw std::invalid_argument("size_scales: a record row is (promised, accepted, steps, last)");
  std::vector<double> out(static_cast<size_t>(std::max<int64_t>(longest, 0)) + 1, factor * scale);
  int64_t rows = std::min<int64_t>(static_cast<int64_t>(record.shape(0)), longest + 1);
  const double* r = record.data();
  for (int64_t k = 0; k < rows; ++k) {
    double promised = r[4 * k], accepted = r[4 * k + 1], count = r[4 * k + 2], last = r[4 * k + 3];
    if (promised > 0) {
      double prior = prior_steps * promised / count;
      double age = std::pow(decay, steps - last);
      out[k] = factor * ((age * accepted + prior * scale) / (age * promised + prior));
    }
  }
  return out;
}

// choose_tree_nodes with each size's correction made from a SizeRecord's table (size_scales).
int64_t choose_tree_nodes_record(const CoreTree& t, const std::vector<double>& sizes,
                                 const std::vector<double>& seconds, std::vector<double> counts,
                                 double optimism, double overhead, int64_t max_nodes, RecordIn record, double steps,
                                 double scale, double prior_steps, double decay, double factor, double count_scale) {
  check_estimates(sizes, seconds, counts, "choose_num_nodes");
  scale_counts(&counts, count_scale);
  int64_t count = std::min<int64_t>(static_cast<int64_t>(t.tree.order.size()), std::max<int64_t>(max_nodes, 0));
  std::vector<double> scales = size_scales(record, steps, scale, prior_steps, decay, count, factor);
  return lookupdec::choose_tree_nodes(t.tree, sizes.data(), seconds.data(), counts.data(),
                                      static_cast<int64_t>(sizes.size()), optimism, overhead, max_nodes,
                                      scales.data(), static_cast<int64_t>(scales.size()));
}

// Tree.shadow: step.Shadow.of, or None where the tree's parents do not come first in prune order.
nb::object tree_shadow(const CoreTree& t, int64_t nodes, double factor) {
  lookupdec::Shadow shadow;
  if (!lookupdec::make_shadow(t.tree, nodes, factor, &shadow)) return nb::none();
  return nb::cast(std::move(shadow));
}

void book_observe(lookupdec::ShadowBook& book, CountsOut table, double steps, const std::string& request,
                  const lookupdec::Shadow* shadow, const std::vector<int64_t>& new_tokens, double decay) {
  if (table.shape(1) != 4) throw std::invalid_argument("ShadowBook.observe: a record row is (promised, accepted, steps, last)");
  book.observe(table.data(), static_cast<int64_t>(table.shape(0)), steps, request, shadow, new_tokens.data(),
               static_cast<int64_t>(new_tokens.size()), decay);
}

// budget.CostModel.dense from its estimates (ints taken as floats): the curve as float64 bytes.
nb::bytes cost_curve(const std::vector<double>& sizes, const std::vector<double>& seconds,
                     std::vector<double> counts, int64_t upto, double optimism, bool optimistic, bool padded,
                     double count_scale) {
  check_estimates(sizes, seconds, counts, "cost_curve");
  scale_counts(&counts, count_scale);
  std::vector<double> out;
  lookupdec::cost_curve(sizes.data(), seconds.data(), counts.data(), static_cast<int64_t>(sizes.size()), upto,
                        optimism, optimistic, padded, &out);
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

// One tuple per draft: (token_ids, parents, scores, match_length): the arrays as bytes
// (Draft.packed()). (Draft.best_chain() of a chain is read from them when asked: no step does.)
nb::list ngram_propose(const lookupdec::NgramIndex& index, int32_t max_draft_tokens, int32_t max_branches,
                       int32_t max_nodes, double branch_decay, double continue_prob) {
  nb::list out;
  for (const lookupdec::NgramDraft& d : index.propose(max_draft_tokens, max_branches, max_nodes, branch_decay,
                                                      continue_prob))
    out.append(nb::make_tuple(to_bytes(d.token_ids), to_bytes(d.parents), to_bytes(d.scores), d.match_length));
  return out;
}

// (token_ids, parents, scores as bytes, match length): RecycleProposer's draft (Draft.packed()).
nb::tuple recycle_propose(const lookupdec::RecycleTable& table, int32_t prev, int32_t root, int32_t limit,
                          int32_t max_depth) {
  std::vector<int32_t> tokens, parents;
  std::vector<double> scores;
  int32_t match = 0;
  table.propose(prev, root, limit, max_depth, &tokens, &parents, &scores, &match);
  return nb::make_tuple(to_bytes(tokens), to_bytes(parents), to_bytes(scores), match);
}


using CertainTable = nb::ndarray<double, nb::shape<2, 2>, nb::c_contig, nb::device::cpu>;

// Mixture.propose and TokenTree.from_drafts (over the calibrator's counts) in one call, for the
// compiled lookups of one request: the n-gram index, the request's suffix automaton (and the
// global one, given per call: it is rebuilt when trimmed), the recycling table, each optional,
// in the mixture's order (`order`: 'n', 's', 'r'). The drafts are those the proposers' own calls
// make (ngram_propose, suffix_drafts, recycle_propose: the same functions), merged as
// merge_drafts_counts merges them, without a trip through Python between the two.
struct Lookups {
  nb::object ngram_owner, suffix_owner, recycle_owner;  // keep the Python objects alive
  lookupdec::NgramIndex* ngram = nullptr;
  Automaton* suffix = nullptr;
  lookupdec::RecycleTable* recycle = nullptr;
  std::string order;
  int32_t ngram_max_draft_tokens = 0, ngram_max_branches = 0;
  double branch_decay = 0, continue_prob = 0;
  int32_t min_match = 0, global_min_match = 0, levels = 0, shorter_divisor = 0, separator = 0;
  double empty_confidence = 0, match_prior = 0;
  int32_t recycle_max_nodes = 0, recycle_max_depth = 0;
  nb::list names;  // the four sources' names: ngram, suffix, suffix-global, recycle
  // the suffix proposer's certain-step estimates, (trials, hits) per automaton (its table, held),
  // and each automaton's pending best chain (the first plan's since the last observe: settled then)
  std::optional<CertainTable> certain;
  double certain_decay = 1.0;
  std::vector<int32_t> pending_chain[2];
  std::vector<uint8_t> pending_certain[2];
  bool pending[2] = {false, false};
  // the calibrator's counts as plan and learn read them (set_calibration: set again whenever the
  // calibrator adds a row, which replaces its arrays); the arrays are held, not copied
  std::optional<CountsOut> reached, predicted, matched;
  std::vector<int32_t> row_source, row_table, source_index;
  std::vector<double> cond_mids;
  int64_t sources = 0;
  lookupdec::CalibrationWeights weights{};
  // the last plan's drafts (learn counts them once the step's tokens are known)
  PackedDrafts last;
  std::vector<int32_t> last_codes, last_matches;
  std::vector<int32_t> last_cells;  // each of its nodes' cell within its row (MergeInput::node_cells)
  std::vector<int32_t> next_cells;  // (the plan under way writes here: a plan that throws leaves last_cells)
  lookupdec::CellMemo cell_memo;     // the merges' calibration cells (MergeInput::cell_memo)
  // the merges' working arrays (MergeInput::scratch), kept from plan to plan
  std::unique_ptr<lookupdec::MergeScratch, lookupdec::MergeScratchDeleter> merge_scratch = lookupdec::new_merge_scratch();
  int64_t serial = 0;  // plans made
};

constexpr int32_t kMatchBuckets[] = {0, 1, 2, 3, 5, 9, 17, 33};  // tree.MATCH_BUCKETS
constexpr int32_t kNumMatchBuckets = 8;

int32_t match_bucket_index(int32_t match_length) {
  int32_t b = 0;
  while (b + 1 < kNumMatchBuckets && kMatchBuckets[b + 1] <= match_length) ++b;
  return b;
}

// (tree, drafts, serial) or None when the n-gram index has not seen `context_len` tokens (the
// caller names the request). drafts, in merge order, as int32 bytes of source codes (0-3) and
// match lengths, int64 bytes of offsets, and every draft's token_ids, parents and scores
// concatenated (bytes); serial: this plan's number (Lookups.learn counts its drafts). Each suffix
// automaton's first draft leaves its best chain pending (Lookups.finish settles it). The
// calibrator's counts, row table ([4 * 8]: a row per source code and match bucket, -1 none) and
// source indexes are those set_calibration gave.
nb::object lookups_plan(Lookups& L, const std::vector<int32_t>& ctx, int64_t context_len, int32_t prev,
                        int32_t root, int32_t max_nodes, Automaton* global, int32_t max_depth) {
  if (!L.reached) throw std::invalid_argument("Lookups.plan: set_calibration first");
  if (L.ngram != nullptr && L.ngram->size() != context_len) return nb::none();
  const std::vector<int32_t>& row_table = L.row_table;
  const std::vector<int32_t>& source_index = L.source_index;
  lookupdec::CalibrationCounts counts{L.reached->data(), L.predicted->data(), L.matched->data(),
                                      static_cast<int64_t>(L.reached->shape(0)), L.row_source.data(), L.sources,
                                      L.cond_mids.data(), L.weights};
  PackedDrafts packed;
  packed.offsets.assign(1, 0);
  packed.tokens.reserve(512);
  packed.parents.reserve(512);
  packed.scores.reserve(512);
  std::vector<int32_t> codes, matches;
  auto add = [&](int32_t code, int32_t match, const std::vector<int32_t>& t, const std::vector<int32_t>& p,
                 const std::vector<double>& s) {
    packed.tokens.insert(packed.tokens.end(), t.begin(), t.end());
    packed.parents.insert(packed.parents.end(), p.begin(), p.end());
    packed.scores.insert(packed.scores.end(), s.begin(), s.end());
    packed.offsets.push_back(packed.offsets.back() + static_cast<int64_t>(t.size()));
    codes.push_back(code);
    matches.push_back(match);
  };
  auto suffix = [&](Automaton& automaton, int32_t code, int32_t min_match, double certain) {
    lookupdec::SuffixDraftParams params{max_nodes, min_match, L.levels, L.shorter_divisor, L.separator,
                                        L.empty_confidence, L.match_prior, certain};
    std::vector<lookupdec::SuffixDraft> drafts = lookupdec::suffix_drafts(automaton, ctx.data(), ctx.size(), params);
    for (size_t i = 0; i < drafts.size(); ++i) {
      const lookupdec::SuffixDraft& d = drafts[i];
      add(code, d.match_length, d.token_ids, d.parents, d.scores);
      if (i == 0 && !L.pending[code - 1]) {  // (settle_pending's input: the first chain since the last observe)
        L.pending[code - 1] = true;
        L.pending_chain[code - 1] = d.chain;
        L.pending_certain[code - 1] = d.chain_certain;
      }
    }
  };
  // CertainStepEstimate.value of each automaton's estimate
  auto certain_value = [&](int row) {
    const double* c = L.certain->data();
    return c[2 * row + 1] / c[2 * row];
  };
  if (max_nodes > 0) {
    for (char kind : L.order) {
      if (kind == 'n' && L.ngram != nullptr) {
        for (const lookupdec::NgramDraft& d : L.ngram->propose(L.ngram_max_draft_tokens, L.ngram_max_branches,
                                                               max_nodes, L.branch_decay, L.continue_prob))
          add(0, d.match_length, d.token_ids, d.parents, d.scores);
      } else if (kind == 's' && L.suffix != nullptr) {
        for (int32_t token : ctx)
          if (token < 0) throw nb::value_error("token ids must be in [0, 2**31 - 1]");
        suffix(*L.suffix, 1, L.min_match, certain_value(0));
        if (global != nullptr) suffix(*global, 2, L.global_min_match, certain_value(1));
      } else if (kind == 'r' && L.recycle != nullptr) {
        int32_t limit = std::min(max_nodes, L.recycle_max_nodes);
        if (limit <= 0 || context_len <= 0) continue;
        std::vector<int32_t> tokens, parents;
        std::vector<double> scores;
        int32_t match = 0;
        L.recycle->propose(prev, root, limit, L.recycle_max_depth, &tokens, &parents, &scores, &match);
        if (!tokens.empty()) add(3, match, tokens, parents, scores);
      }
    }
  }
  size_t num_drafts = codes.size();
  std::vector<int32_t> rows(num_drafts), draft_sources(num_drafts);
  nb::list names;
  for (size_t d = 0; d < num_drafts; ++d) {
    rows[d] = row_table[codes[d] * kNumMatchBuckets + match_bucket_index(matches[d])];
    if (rows[d] >= counts.rows) throw std::invalid_argument("Lookups.plan: a draft's row is out of range");
    draft_sources[d] = source_index[codes[d]];
    names.append(L.names[codes[d]]);
  }
  names.append(nb::str(""));
  nb::tuple drafts = nb::make_tuple(to_bytes(codes), to_bytes(matches), to_bytes(packed.offsets),
                                    to_bytes(packed.tokens), to_bytes(packed.parents), to_bytes(packed.scores));
  std::vector<uint8_t> point_mass(num_drafts, 1);
  lookupdec::MergeInput in = merge_input(root, packed, rows, point_mass.data(), max_nodes, max_depth);
  with_counts(&in, counts, draft_sources);
  L.next_cells.resize(packed.tokens.size());
  in.node_cells = L.next_cells.data();
  in.cell_memo = &L.cell_memo;
  in.scratch = L.merge_scratch.get();
  CoreTree tree{lookupdec::merge_drafts(in), names};
  tree.tree.node_of.clear();
  std::swap(L.last_cells, L.next_cells);
  L.last = std::move(packed);
  L.last_codes = std::move(codes);
  L.last_matches = std::move(matches);
  return nb::make_tuple(std::move(tree), drafts, ++L.serial);
}

// Lookups.finish's observe: the n-gram index and the request's automaton extend (ids
// checked first: a rejected call keeps nothing), then each pending chain is settled against the
// new tokens (settle_pending: CertainStepEstimate.update).
void lookups_observe(Lookups& L, const std::vector<int32_t>& t) {
  for (int32_t token : t)
    if (token < 0) throw nb::value_error("token ids must be in [0, 2**31 - 1]");
  if (L.ngram != nullptr) L.ngram->extend(t.data(), t.size());
  if (L.suffix != nullptr) L.suffix->extend(t.data(), t.size());
  for (int row = 0; row < 2; ++row) {
    if (!L.pending[row]) continue;
    double* c = L.certain->data() + 2 * row;
    double trials = c[0], hits = c[1];
    const std::vector<int32_t>& chain = L.pending_chain[row];
    size_t n = std::min({chain.size(), L.pending_certain[row].size(), t.size()});
    for (size_t i = 0; i < n; ++i) {
      if (L.pending_certain[row][i]) {
        trials = trials * L.certain_decay + 1;
        hits = hits * L.certain_decay + (chain[i] == t[i] ? 1.0 : 0.0);
      }
      if (chain[i] != t[i]) break;
    }
    c[0] = trials;
    c[1] = hits;
    L.pending[row] = false;
  }
}

// RecycleTable.observe_path: observe() of a walked path, each token's previous the token before
// it (prev first).
void recycle_observe_path(lookupdec::RecycleTable& table, int32_t prev, const std::vector<int32_t>& tokens,
                          const std::vector<std::vector<int32_t>>& successors) {
  std::vector<int32_t> previous(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) previous[i] = i == 0 ? prev : tokens[i - 1];
  table.observe(previous, tokens, successors);
}

// AcceptanceCalibrator.learn of the plan numbered `serial`, as learn_drafts does it: every count
// decayed once, then each draft counted into its row (row_table as Lookups.plan reads it).
// False, with nothing changed, where that plan is not the last one or a draft has no row yet
// (the calibrator then learns from the drafts themselves, adding their rows).
bool lookups_learn(Lookups& L, int64_t serial, double decay, const std::vector<int64_t>& committed) {
  if (serial != L.serial) return false;
  if (!L.reached) throw std::invalid_argument("Lookups.learn: set_calibration first");
  CountsOut &reached = *L.reached, &predicted = *L.predicted, &matched = *L.matched;
  const std::vector<int32_t>& row_table = L.row_table;
  size_t nrows = reached.shape(0);
  size_t num_drafts = L.last_codes.size();
  std::vector<int64_t> rows(num_drafts);
  for (size_t d = 0; d < num_drafts; ++d) {
    rows[d] = row_table[L.last_codes[d] * kNumMatchBuckets + match_bucket_index(L.last_matches[d])];
    if (rows[d] < 0) return false;
    if (static_cast<size_t>(rows[d]) >= nrows) throw std::invalid_argument("Lookups.learn: a draft's row is out of range");
  }
  decay_counts({&reached, &predicted, &matched}, nrows, decay);
  const int64_t C = lookupdec::kCellsPerRow;
  int64_t longest = 0;
  for (size_t d = 0; d < num_drafts; ++d) longest = std::max(longest, L.last.offsets[d + 1] - L.last.offsets[d]);
  std::vector<int32_t> depth(longest);
  std::vector<uint8_t> hit(longest);
  for (size_t d = 0; d < num_drafts; ++d) {
    int64_t a = L.last.offsets[d], n = L.last.offsets[d + 1] - a;
    int64_t at = rows[d] * C;
    // (with the cells the plan's merge worked out: a draft whose row came after the plan, added
    // by another request's learn, has them too)
    lookupdec::observe_draft_cells(L.last.tokens.data() + a, L.last.parents.data() + a, L.last.scores.data() + a,
                                   L.last_cells.data() + a, n, committed, reached.data() + at,
                                   predicted.data() + at, matched.data() + at, 1, depth.data(), hit.data());
  }
  return true;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "Compiled suffix automaton over int32 token ids (APPEND-ONLY).";
  m.attr("HEAVY_DEGREE") = lookupdec::kHeavyDegree;
  m.attr("MAX_TOKENS") = lookupdec::kMaxTokens;
  m.attr("CELLS_PER_ROW") = lookupdec::kCellsPerRow;
  m.attr("SIBLING_RANKS") = lookupdec::kSiblingRanks;
  m.attr("DEPTH_BUCKETS") = nb::make_tuple(1, 2, 3, 5, 9, 17);
  m.attr("COND_BUCKETS") = nb::make_tuple(0.0, 0.25, 0.5, 0.75, 0.95);
  m.def("merge_drafts", &merge_drafts);
  m.attr("MATCH_BUCKETS") = nb::make_tuple(0, 1, 2, 3, 5, 9, 17, 33);
  nb::class_<Lookups>(m, "Lookups")
      .def("__init__",
           [](Lookups* self, nb::object ngram, int32_t ngram_max_draft_tokens, int32_t ngram_max_branches,
              double branch_decay, double continue_prob, nb::object suffix, int32_t min_match,
              int32_t global_min_match, int32_t levels, int32_t shorter_divisor, int32_t separator,
              double empty_confidence, double match_prior, nb::object recycle, int32_t recycle_max_nodes,
              int32_t recycle_max_depth, const std::string& order, nb::list names,
              std::optional<CertainTable> certain, double certain_decay) {
             if (nb::len(names) != 4) throw std::invalid_argument("Lookups: four source names");
             for (char kind : order)
               if (kind != 'n' && kind != 's' && kind != 'r') throw std::invalid_argument("Lookups: order of 'n', 's', 'r'");
             Lookups* L = new (self) Lookups();
             L->ngram_owner = ngram;
             L->suffix_owner = suffix;
             L->recycle_owner = recycle;
             if (!ngram.is_none()) L->ngram = nb::cast<lookupdec::NgramIndex*>(ngram);
             if (!suffix.is_none()) L->suffix = nb::cast<Automaton*>(suffix);
             if (!recycle.is_none()) L->recycle = nb::cast<lookupdec::RecycleTable*>(recycle);
             L->order = order;
             L->ngram_max_draft_tokens = ngram_max_draft_tokens;
             L->ngram_max_branches = ngram_max_branches;
             L->branch_decay = branch_decay;
             L->continue_prob = continue_prob;
             L->min_match = min_match;
             L->global_min_match = global_min_match;
             L->levels = levels;
             L->shorter_divisor = shorter_divisor;
             L->separator = separator;
             L->empty_confidence = empty_confidence;
             L->match_prior = match_prior;
             L->recycle_max_nodes = recycle_max_nodes;
             L->recycle_max_depth = recycle_max_depth;
             L->names = names;
             if (L->suffix != nullptr && !certain) throw std::invalid_argument("Lookups: the suffix proposer's certain-step table");
             L->certain = certain;
             L->certain_decay = certain_decay;
           },
           nb::arg("ngram").none(), nb::arg("ngram_max_draft_tokens"), nb::arg("ngram_max_branches"),
           nb::arg("branch_decay"), nb::arg("continue_prob"), nb::arg("suffix").none(), nb::arg("min_match"),
           nb::arg("global_min_match"), nb::arg("levels"), nb::arg("shorter_divisor"), nb::arg("separator"),
           nb::arg("empty_confidence"), nb::arg("match_prior"), nb::arg("recycle").none(),
           nb::arg("recycle_max_nodes"), nb::arg("recycle_max_depth"), nb::arg("order"), nb::arg("names"),
           nb::arg("certain").none(), nb::arg("certain_decay"))
      .def("finish",
           [](Lookups& L, int32_t prev, const std::vector<int32_t>& visited,
              std::optional<std::vector<std::vector<int32_t>>> successors, const std::vector<int32_t>& new_tokens,
              int64_t serial, double decay) {
             // Mixture.finish's compiled part, in its order: the recycling table's hand-off of the
             // walked path (RecycleTable.observe_path, with successors), observe, and the learn of
             // plan `serial` (lookups_learn; False: not learnt, the caller learns apart)
             for (int32_t token : new_tokens)
               if (token < 0) throw nb::value_error("token ids must be in [0, 2**31 - 1]");
             if (successors.has_value()) {
               if (L.recycle == nullptr) throw std::invalid_argument("Lookups.finish: successors without a recycling table");
               recycle_observe_path(*L.recycle, prev, visited, *successors);
             }
             lookups_observe(L, new_tokens);
             if (serial != L.serial) return false;
             std::vector<int64_t> committed(new_tokens.begin(), new_tokens.end());
             return lookups_learn(L, serial, decay, committed);
           },
           nb::arg("prev"), nb::arg("visited"), nb::arg("successors").none(), nb::arg("new_tokens"),
           nb::arg("serial"), nb::arg("decay"))
      .def("pending", [](const Lookups& L) {
        // (source code, chain, certain flags) of each pending chain (tests: settle_pending's dict)
        nb::list out;
        for (int row = 0; row < 2; ++row)
          if (L.pending[row])
            out.append(nb::make_tuple(row + 1, int_list(L.pending_chain[row]), bool_list(L.pending_certain[row])));
        return out;
      })
      .def("set_calibration",
           [](Lookups& L, CountsOut reached, CountsOut predicted, CountsOut matched, nb::bytes row_source,
              int64_t sources, nb::bytes cond_mids, double source_prior, double row_prior, double cell_prior,
              double max_factor, double max_prior_prob, const std::vector<int32_t>& row_table,
              const std::vector<int32_t>& source_index) {
             // the checks calibration_counts makes, once
             size_t rows = reached.shape(0);
             check_counts(rows, {predicted.shape(0), matched.shape(0)},
                          {reached.shape(1), predicted.shape(1), matched.shape(1)}, "Lookups.set_calibration");
             int64_t n = static_cast<int64_t>(rows), cells = lookupdec::kCellsPerRow;
             const int32_t* src = bytes_array<int32_t>(row_source, &n, "row_source");
             const double* mids = bytes_array<double>(cond_mids, &cells, "cond_mids");
             lookupdec::CalibrationCounts c{nullptr, nullptr, nullptr, n, src, sources, mids,
                                            {source_prior, row_prior, cell_prior, max_factor, max_prior_prob}};
             if (row_table.size() != 4 * kNumMatchBuckets || source_index.size() != 4)
               throw std::invalid_argument("Lookups.set_calibration: a row per source and match bucket, an index per source");
             for (int32_t r : row_table)
               if (r >= c.rows) throw std::invalid_argument("Lookups.set_calibration: a row out of range");
             L.reached = reached;
             L.predicted = predicted;
             L.matched = matched;
             L.row_source.assign(c.row_source, c.row_source + c.rows);
             L.cond_mids.assign(c.cond_mids, c.cond_mids + lookupdec::kCellsPerRow);
             L.sources = sources;
             L.weights = c.w;
             L.row_table = row_table;
             L.source_index = source_index;
           })
      .def("learn", &lookups_learn)
      .def("plan", &lookups_plan, nb::arg("ctx"), nb::arg("context_len"), nb::arg("prev"), nb::arg("root"),
           nb::arg("max_nodes"), nb::arg("global_").none(), nb::arg("max_depth"));
  m.def("merge_drafts_counts", &merge_drafts_counts);
  nb::class_<lookupdec::NgramIndex>(m, "NgramIndex")
      .def(nb::init<int32_t, int32_t>())
      .def("extend", [](lookupdec::NgramIndex& index, const std::vector<int32_t>& t) {
        for (int32_t token : t) {  // checked first: a rejected call keeps nothing
          if (token < 0) throw nb::value_error("token ids must be in [0, 2**31 - 1]");
        }
        index.extend(t.data(), t.size());
      })
      .def("size", &lookupdec::NgramIndex::size)
      .def("propose", &ngram_propose);
  nb::class_<lookupdec::RecycleTable>(m, "RecycleTable")
      .def(nb::init<int32_t, int64_t, std::vector<double>>())
      .def("observe", &lookupdec::RecycleTable::observe)
      .def("observe_path", &recycle_observe_path)
      .def("propose", &recycle_propose)
      .def("num_pairs", &lookupdec::RecycleTable::num_pairs)
      .def("num_tokens", &lookupdec::RecycleTable::num_tokens);
  m.def("ancestor_mask", &ancestor_mask);
  m.def("tree_inputs", &tree_inputs<int64_t>);
  m.def("tree_inputs_at", &tree_inputs_at<int64_t>);
  m.def("greedy_walk", &greedy_walk, nb::arg("logits").none(), nb::arg("token_ids"), nb::arg("parents"),
        nb::arg("top_k") = 0, nb::arg("row_of") = nb::none(), nb::arg("start") = 0, nb::arg("choices") = nb::none());
  m.def("observe_draft", &observe_draft);
  m.def("calibration_table", &calibration_table);
  m.def("learn_drafts", &learn_drafts);
  m.def("choose_num_nodes", &choose_num_nodes);
  m.def("size_scales", &size_scales);
  m.def("cost_curve", &cost_curve);
  m.def("top_tokens", &top_tokens);
  m.def("gather_slots", &gather_slots);
  m.def("skinny_pack", &skinny_pack);
  m.def("skinny_linear", &skinny_linear, nb::arg("x"), nb::arg("panels"), nb::arg("y"), nb::arg("isa") = nb::none(),
        nb::arg("tops") = nb::none(), nb::arg("weight_bound") = std::numeric_limits<float>::infinity());
  m.def("skinny_linear_at", &skinny_linear_at);
  m.def("rotary_at", &rotary_at);
  m.def("rms_norm_at", &rms_norm_at);
  m.def("tree_attention_at", &tree_attention_at, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("cols"),
        nb::arg("counts"), nb::arg("common"), nb::arg("bias"), nb::arg("live"), nb::arg("out"), nb::arg("sizes"),
        nb::arg("scale"), nb::arg("isa") = nb::none());
  m.def("attention_isas", &lookupdec::attention_isas);
  m.def("attention_plan_at", &attention_plan_at);
  m.def("skinny_isa", &lookupdec::skinny_isa);
  m.def("skinny_isas", &lookupdec::skinny_isas);
  m.def("skinny_threads", &lookupdec::skinny_threads);
  m.def("set_skinny_thread_cap", &lookupdec::set_skinny_thread_cap);
#if defined(LOOKUPDEC_OPENMP)
  m.attr("OPENMP") = true;  // the skinny product splits over torch's OpenMP threads
  // the thread count of the OpenMP runtime the core runs on, for this thread (torch's where
  // torch.set_num_threads moves it: model/kernels.py checks)
  m.def("omp_max_threads", []() { return omp_get_max_threads(); });
#else
  m.attr("OPENMP") = false;
#endif
  nb::class_<lookupdec::Shadow>(m, "Shadow")
      .def("__init__", [](lookupdec::Shadow* s, std::vector<int32_t> tokens, std::vector<int32_t> parents,
                          std::vector<int32_t> depth, std::vector<double> gains, double factor) {
        size_t n = tokens.size();
        if (n == 0 || parents.size() != n || depth.size() != n || gains.size() != n)
          throw std::invalid_argument("Shadow: tokens, parents, depth and gains: one per node, the root first");
        for (size_t i = 1; i < n; ++i)
          if (parents[i] < 0 || static_cast<size_t>(parents[i]) >= i || depth[i] != depth[parents[i]] + 1)
            throw std::invalid_argument("Shadow: every node's parent comes before it, one level up");
        new (s) lookupdec::Shadow{std::move(tokens), std::move(parents), std::move(depth), std::move(gains), factor, {}, 0};
      })
      .def("lists", [](const lookupdec::Shadow& s) {
        return nb::make_tuple(int_list(s.tokens), int_list(s.parents), int_list(s.depth), float_list(s.gains));
      })
      .def_ro("factor", &lookupdec::Shadow::factor)
      .def("__len__", [](const lookupdec::Shadow& s) { return s.tokens.size(); });
  nb::class_<lookupdec::ShadowBook>(m, "ShadowBook")
      .def(nb::init<>())
      .def("observe", &book_observe, nb::arg("table"), nb::arg("steps"), nb::arg("request"), nb::arg("shadow").none(),
           nb::arg("new_tokens"), nb::arg("decay"))
      .def("drop", &lookupdec::ShadowBook::drop)
      .def("waiting", &lookupdec::ShadowBook::waiting);
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
      .def("choose_num_nodes_record", &choose_tree_nodes_record)
      .def("shadow", &tree_shadow)
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
  nb::class_<Automaton>(m, "Automaton")
      .def(nb::init<>())
      .def("extend", [](Automaton& a, TokensIn t) { a.extend(t.data(), t.shape(0)); })
      .def("extend_list", [](Automaton& a, const std::vector<int32_t>& t) { a.extend(t.data(), t.size()); })
      .def("size", &Automaton::size)
      .def("num_states", &Automaton::num_states)
      .def("num_edges", &Automaton::num_edges)
      .def("last_state", &Automaton::last_state)
      .def("tokens", &tokens_view)
      .def("match", [](const Automaton& a, TokensIn c) { return a.match(c.data(), c.shape(0)); })
      .def("state_len", &Automaton::state_len)
      .def("suffix_link", &Automaton::suffix_link)
      .def("count", &Automaton::count)
      .def("continuation_count", &Automaton::continuation_count)
      .def("most_recent_end", &Automaton::most_recent_end)
      .def("end_positions", [](Automaton& a, int32_t state, int32_t limit) {
        return to_bytes(a.end_positions(state, limit));
      })
      .def("next_counts", &next_counts)
      .def("expand_tree", &expand_tree)
      .def("propose_tree", &propose_tree)
      .def("suffix_drafts", &suffix_drafts)
      .def("check_invariants", &Automaton::check_invariants)
      .def("memory_report", &Automaton::memory_report)
      .def("tree_cache_hits", &Automaton::tree_cache_hits);
}
