// nanobind module lookupdec._native: the compiled core as one module with a submodule per group
// (drafting, tree, kernels). One module, not three, because types cross groups: the drafting
// group's fused plan returns the tree group's Tree and reads its calibration counts.
// lookupdec/native.py hands the submodules to Python, None each where the module is not built.
#include <nanobind/nanobind.h>

#include "common/bindings.hpp"

NB_MODULE(_native, m) {
  m.doc() = "lookupdec's compiled core; its submodules drafting, tree and kernels (lookupdec/native.py).";
  nanobind::module_ tree = m.def_submodule(
      "tree", "The step's tree: merge, calibration, size choice, verify inputs, greedy walk.");
  lookupdec_bindings::bind_tree(tree);
  nanobind::module_ drafting = m.def_submodule(
      "drafting", "Drafting: the suffix automaton, the n-gram index, the recycling table, a request's fused lookups.");
  lookupdec_bindings::bind_drafting(drafting);
  nanobind::module_ kernels = m.def_submodule(
      "kernels", "The forward's CPU kernels (skinny product, RMS norm, rotary, tree attention) and K/V slot moves.");
  lookupdec_bindings::bind_kernels(kernels);
}
