// nanobind module lookupdec.automaton._core: the compiled Automaton, called by the Python
// wrapper in lookupdec/automaton/__init__.py (which converts and validates its arguments).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <vector>

#include "automaton.hpp"

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

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "Compiled suffix automaton over int32 token ids (APPEND-ONLY).";
  m.attr("HEAVY_DEGREE") = lookupdec::kHeavyDegree;
  m.attr("MAX_TOKENS") = lookupdec::kMaxTokens;
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
      .def("check_invariants", &Automaton::check_invariants)
      .def("memory_report", &Automaton::memory_report);
}
