// The tree group's binding types and helpers that the drafting group's fused plan
// (drafting/bindings.cpp, Lookups) shares: it merges its drafts into the same core-held tree, over
// the same calibration counts, as tree/bindings.cpp's merge_drafts_counts.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "tree/tree.hpp"

namespace lookupdec_bindings {

namespace nb = nanobind;

// A merged tree held in the core: TokenTree reads its lists from it on first use, and prunes
// and builds verify inputs from it without Python lists.
struct CoreTree {
  lookupdec::MergedTree tree;
  nb::list names;  // each draft's source, then the root's ""
};

// Every draft's packed (token_ids, parents, scores) bytes, concatenated, with their offsets.
struct PackedDrafts {
  std::vector<int64_t> offsets;
  std::vector<int32_t> tokens, parents;
  std::vector<double> scores;
};

// lookupdec.tree.MATCH_BUCKETS: the match lengths where a draft's calibration row changes, as
// Lookups reads them; the tree submodule's MATCH_BUCKETS is made from this array, and tree.py
// checks that at import.
constexpr int32_t kMatchBuckets[] = {0, 1, 2, 3, 5, 9, 17, 33};
constexpr int32_t kNumMatchBuckets = sizeof(kMatchBuckets) / sizeof(kMatchBuckets[0]);

using CountsOut = nb::ndarray<double, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// The merge input of `packed` (each draft's calibration row, point-mass flags, budgets); its
// calibration is set apart (a table, or with_counts).
lookupdec::MergeInput merge_input(int32_t root_token, const PackedDrafts& packed, const std::vector<int32_t>& rows,
                                  const uint8_t* point_mass, int32_t max_nodes, int32_t max_depth);

// A merge input's calibration from the calibrator's counts (each cell read computed from them)
// instead of a table; draft_sources: each draft's source index in the counts, -1 unknown.
void with_counts(lookupdec::MergeInput* in, const lookupdec::CalibrationCounts& counts,
                 const std::vector<int32_t>& draft_sources);

// The calibrator's arrays checked alike: `rows` rows each (shape0), of CELLS_PER_ROW cells (shape1).
void check_counts(size_t rows, std::initializer_list<size_t> shape0, std::initializer_list<size_t> shape1,
                  const char* who);

// Every count of the calibrator's arrays decayed once (x *= decay, as numpy's).
void decay_counts(std::initializer_list<CountsOut*> arrays, size_t rows, double decay);

}  // namespace lookupdec_bindings
