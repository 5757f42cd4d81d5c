// The drafting group's bindings (submodule `drafting`): the suffix automaton (wrapped by
// lookupdec/automaton/__init__.py, which converts and validates its arguments), the suffix,
// n-gram and recycling proposers' drafts (lookupdec/proposers/), and a request's lookups planned
// and merged in one call (Lookups, lookupdec/mixture.py), which builds the tree group's tree.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "common/bindings.hpp"
#include "drafting/automaton.hpp"
#include "drafting/ngram.hpp"
#include "drafting/recycle.hpp"
#include "drafting/suffix_drafts.hpp"
#include "tree/bindings.hpp"
#include "tree/tree.hpp"

namespace lookupdec_bindings {

using lookupdec::Automaton;

namespace {

using TokensIn = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

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

void bind_drafting(nb::module_& m) {
  m.attr("HEAVY_DEGREE") = lookupdec::kHeavyDegree;
  m.attr("MAX_TOKENS") = lookupdec::kMaxTokens;
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

}  // namespace lookupdec_bindings
