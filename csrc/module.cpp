// nanobind module lookupdec.automaton._core: the compiled core, one module (its types cross
// groups: the drafting group's fused plan returns the tree group's Tree) bound group by group.
#include <nanobind/nanobind.h>

#include "common/bindings.hpp"

NB_MODULE(_core, m) {
  m.doc() = "Compiled suffix automaton over int32 token ids (APPEND-ONLY).";
  lookupdec_bindings::bind_tree(m);
  lookupdec_bindings::bind_drafting(m);
  lookupdec_bindings::bind_kernels(m);
}
