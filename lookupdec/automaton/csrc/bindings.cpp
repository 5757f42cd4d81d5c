// nanobind module lookupdec.automaton._core: the compiled Automaton, called by the Python
// wrapper in lookupdec/automaton/__init__.py (which converts and validates its arguments), the
// suffix proposer's drafts (lookupdec/proposers/suffix.py), the n-gram proposer's index
// (lookupdec/proposers/ngram.py) and the step's tree merge and ancestor mask (lookupdec/tree.py).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "automaton.hpp"
#include "ngram.hpp"
#include "suffix_drafts.hpp"
#include "tree.hpp"

namespace nb = nanobind;
using lookupdec::Automaton;

namespace {

using TokensIn = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// Small results go back as bytes (the wrapper views them with np.frombuffer): creating a
// numpy array through nanobind costs a few microseconds each, bytes a tenth of that.
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

// Every argument but the budgets is the bytes of a flat array; see tree.hpp.
nb::tuple merge_drafts(int32_t root_token, nb::bytes tokens, nb::bytes parents, nb::bytes scores,
                       nb::bytes offsets, nb::bytes rows, nb::bytes fallback, nb::bytes point_mass,
                       nb::bytes table, int32_t max_nodes, int32_t max_depth) {
  lookupdec::MergeInput in;
  in.root_token = root_token;
  int64_t num_offsets = -1;
  in.offsets = bytes_array<int64_t>(offsets, &num_offsets, "offsets");
  if (num_offsets < 1) throw std::invalid_argument("merge_drafts: offsets needs num_drafts + 1 entries");
  in.num_drafts = num_offsets - 1;
  int64_t total = in.offsets[in.num_drafts], drafts = in.num_drafts, table_size = -1;
  in.tokens = bytes_array<int32_t>(tokens, &total, "tokens");
  in.parents = bytes_array<int32_t>(parents, &total, "parents");
  in.scores = bytes_array<double>(scores, &total, "scores");
  in.rows = bytes_array<int32_t>(rows, &drafts, "rows");
  in.fallback = bytes_array<double>(fallback, &drafts, "fallback");
  in.point_mass = bytes_array<uint8_t>(point_mass, &drafts, "point_mass");
  in.table = bytes_array<double>(table, &table_size, "table");
  in.table_size = table_size;
  in.max_nodes = max_nodes;
  in.max_depth = max_depth;
  lookupdec::MergedTree tree;
  {
    nb::gil_scoped_release release;
    tree = lookupdec::merge_drafts(in);
  }
  return nb::make_tuple(to_bytes(tree.token_ids), to_bytes(tree.parents), to_bytes(tree.scores),
                        to_bytes(tree.sources), to_bytes(tree.point_mass), to_bytes(tree.expected),
                        to_bytes(tree.cells), to_bytes(tree.conds), to_bytes(tree.depth), to_bytes(tree.order),
                        tree.parents_first, to_bytes(tree.node_of));
}

// A bytearray (writable: numpy and torch views of it need no copy).
nb::bytearray ancestor_mask(nb::bytes parents) {
  int64_t n = -1;
  const int32_t* p = bytes_array<int32_t>(parents, &n, "parents");
  nb::bytearray mask(nullptr, static_cast<size_t>(n * n));
  lookupdec::ancestor_mask(p, n, reinterpret_cast<uint8_t*>(mask.data()));
  return mask;
}

// One tuple per draft: (token_ids, parents, scores, match_length, chain, chain_cond,
// chain_certain), arrays as bytes.
nb::list suffix_drafts(Automaton& automaton, TokensIn context, int32_t max_nodes, int32_t min_match,
                       int32_t levels, int32_t shorter_divisor, int32_t separator, double empty_confidence,
                       double match_prior, double certain_step) {
  lookupdec::SuffixDraftParams params{max_nodes, min_match, levels, shorter_divisor, separator,
                                      empty_confidence, match_prior, certain_step};
  std::vector<lookupdec::SuffixDraft> drafts =
      lookupdec::suffix_drafts(automaton, context.data(), context.shape(0), params);
  nb::list out;
  for (const lookupdec::SuffixDraft& d : drafts)
    out.append(nb::make_tuple(to_bytes(d.token_ids), to_bytes(d.parents), to_bytes(d.scores), d.match_length,
                              to_bytes(d.chain), to_bytes(d.chain_cond), to_bytes(d.chain_certain)));
  return out;
}

// One tuple per draft: (token_ids, parents, scores, match_length, chain_cond), arrays as bytes.
nb::list ngram_propose(const lookupdec::NgramIndex& index, int32_t max_draft_tokens, int32_t max_branches,
                       int32_t max_nodes, double branch_decay, double continue_prob) {
  nb::list out;
  for (const lookupdec::NgramDraft& d : index.propose(max_draft_tokens, max_branches, max_nodes, branch_decay,
                                                      continue_prob))
    out.append(nb::make_tuple(to_bytes(d.token_ids), to_bytes(d.parents), to_bytes(d.scores), d.match_length,
                              to_bytes(d.chain_cond)));
  return out;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "Compiled suffix automaton over int32 token ids (APPEND-ONLY).";
  m.attr("HEAVY_DEGREE") = lookupdec::kHeavyDegree;
  m.attr("MAX_TOKENS") = lookupdec::kMaxTokens;
  m.attr("CELLS_PER_ROW") = lookupdec::kCellsPerRow;
  m.attr("SIBLING_RANKS") = lookupdec::kSiblingRanks;
  m.attr("DEPTH_BUCKETS") = nb::make_tuple(1, 2, 3, 5, 9, 17);
  m.def("merge_drafts", &merge_drafts);
  nb::class_<lookupdec::NgramIndex>(m, "NgramIndex")
      .def(nb::init<int32_t, int32_t>())
      .def("extend", [](lookupdec::NgramIndex& index, TokensIn t) { index.extend(t.data(), t.shape(0)); })
      .def("size", &lookupdec::NgramIndex::size)
      .def("propose", &ngram_propose);
  m.def("ancestor_mask", &ancestor_mask);
  nb::class_<Automaton>(m, "Automaton")
      .def(nb::init<>())
      .def("extend", [](Automaton& a, TokensIn t) { a.extend(t.data(), t.shape(0)); })
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
      .def("memory_report", &Automaton::memory_report);
}
