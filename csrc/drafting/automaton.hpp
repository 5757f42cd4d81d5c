// Suffix automaton over 32-bit token ids: the compiled core behind lookupdec.automaton.
//
// APPEND-ONLY: tokens are only ever appended; a change in the middle needs a rebuild.
//
// Layout (about 77 bytes per stored token on real text at 10M tokens, see memory_report()):
//   tokens_   int32 [n]            the stored stream, shared with numpy views (snapshots)
//   states_   State [num_states]   28 bytes each, at most 2n states (~1.6n on real text)
//   edges_    Edge  [...]          12 bytes each, one linked list of out-edges per light state
//   heavy_tables_                  per heavy state (one with >= kHeavyDegree edges: the root,
//                                  frequent short strings) an open-addressing table of 8-byte
//                                  edges keyed by token: O(1) lookups, sequential enumeration
//                                  of its thousands of children, and growth that rehashes only
//                                  that state's edges (no pause over a global table)
// states_ and edges_ grow in fixed blocks (BlockVector, common/arrays.hpp): no copy on growth,
// little slack, transparent huge pages past the first block.
// The suffix-link tree (children of each state) is kept as singly linked sibling lists. When
// a clone takes q's place under q's parent P, the entry of P's list that points to q is left
// as it is (q is "stale" there: its link is now the clone) and the clone inherits q's next
// sibling; readers resolve a stale entry by following links up to the child of P and splice
// the resolved child in (resolve_child). So extend never needs a list predecessor.
// Occurrence counts (|endpos|) and the most recent end position of each state are exact after
// flush(): a new leaf (the state of the whole stream after each append) is recorded as
// pending, and the first query after an extend walks each pending leaf's suffix path adding 1
// (cost: the depth of that leaf in the suffix-link tree, ~15 on real text; 8 walks interleaved).
// When that would cost more than a full recount (a bulk extend), the counts are recomputed
// from scratch instead: states sorted by length, then one pass (O(num_states)).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <unordered_map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/arrays.hpp"

namespace lookupdec {

constexpr int32_t kNone = -1;
constexpr int32_t kRoot = 0;
// States with at least this many out-edges get O(1) hashed lookups; the others scan their list.
constexpr int32_t kHeavyDegree = 8;
constexpr uint32_t kCloneBit = 1u << 31;  // state was made by cloning (it is not a leaf)
constexpr uint32_t kHeavyBit = 1u << 30;  // state's edges are in a HeavyTable
constexpr uint32_t kLenMask = kHeavyBit - 1;  // lengths share a word with the two flags
// At most 2n states and 3n edges, indexed by int32: n < 2^29 keeps 3n below 2^31.
constexpr int64_t kMaxTokens = (int64_t{1} << 29) - 1;

struct Edge {  // an out-edge of a light state, in its state's linked list
  int32_t token;
  int32_t target;
  int32_t next;  // next out-edge of the same state, kNone at the end
};

struct HeavyEdge {  // an out-edge of a heavy state, a slot of its state's HeavyTable
  int32_t token;   // kNone = empty slot
  int32_t target;
};

// The out-edges of one heavy state: open addressing keyed by token, linear probing, load <= 3/4.
class HeavyTable {
 public:
  explicit HeavyTable(uint32_t capacity);  // a power of two
  HeavyTable(const HeavyTable& other);
  HeavyTable(HeavyTable&&) noexcept = default;
  HeavyTable& operator=(HeavyTable&&) noexcept = default;
  const HeavyEdge* find(int32_t token) const;
  HeavyEdge* find(int32_t token) {
    return const_cast<HeavyEdge*>(static_cast<const HeavyTable*>(this)->find(token));
  }
  void insert(int32_t token, int32_t target);  // token must be absent
  uint32_t size() const { return size_; }
  uint32_t capacity() const { return mask_ + 1; }
  const HeavyEdge* begin() const { return slots_.get(); }
  const HeavyEdge* end() const { return slots_.get() + capacity(); }

 private:
  size_t home(int32_t token) const;
  std::unique_ptr<HeavyEdge[]> slots_;
  uint32_t mask_;
  uint32_t size_ = 0;
};

struct State {
  uint32_t len_flags;    // length of the longest string of the state | kCloneBit | kHeavyBit
  int32_t link;          // suffix link, kNone for the root
  int32_t edge_head;     // light: first out-edge, kNone if none; heavy: index in heavy_tables_
  int32_t count;         // number of end positions (exact after flush)
  int32_t last_end;      // most recent end position (exact after flush), 0 if none
  int32_t first_child;   // suffix-link tree: children are states whose link is this state
  int32_t next_sibling;  // (both may point to a stale entry: see resolve_child)
};

// The stored token stream. Views handed to Python keep their buffer alive (shared_ptr), and a
// buffer is never written below the length a view was taken at, so views are stable snapshots.
struct TokenBuffer {
  std::unique_ptr<int32_t[]> data;
  size_t capacity = 0;
};

// A child of a state in expand_tree's order: count descending, then token ascending.
struct Child {
  int32_t count;
  int32_t token;
  int32_t target;
};

// The best children of one heavy state, valid while the state's continuation count (the sum
// of its children's counts: any new occurrence of a child raises it) is unchanged.
struct CachedChildren {
  int64_t total = -1;
  bool complete = false;  // holds every child
  std::vector<Child> best;
};

struct TreeDraft {
  std::vector<int32_t> token_ids;  // [num_nodes]
  std::vector<int32_t> parents;    // [num_nodes] parent node, kNone = child of the root
  std::vector<double> scores;      // [num_nodes] product of next-token frequencies on the path
};

class Automaton {
 public:
  Automaton();
  Automaton(const Automaton&) = delete;
  Automaton& operator=(const Automaton&) = delete;

  void extend(const int32_t* tokens, size_t num_tokens);
  int64_t size() const { return num_tokens_; }
  int64_t num_states() const { return static_cast<int64_t>(states_.size()); }
  int64_t num_edges() const { return num_edges_; }
  int32_t last_state() const { return last_; }
  std::shared_ptr<TokenBuffer> token_buffer() const { return tokens_; }
  const int32_t* token_data() const { return tokens_->data.get(); }

  // Longest suffix of context[0:n] that occurs in the stream: (state, length).
  std::pair<int32_t, int32_t> match(const int32_t* context, size_t n) const;
  int32_t state_len(int32_t state) const;
  int32_t suffix_link(int32_t state) const;
  int32_t count(int32_t state);
  int32_t continuation_count(int32_t state);
  int32_t most_recent_end(int32_t state);
  std::vector<int32_t> end_positions(int32_t state, int32_t limit);
  void next_counts(int32_t state, std::vector<int32_t>* tokens, std::vector<int32_t>* counts);
  TreeDraft expand_tree(int32_t state, int32_t max_nodes, int32_t max_depth);
  // match, then suffix links while fewer than min_count occurrences continue, then expand_tree;
  // empty if the match is shorter than min_match.
  TreeDraft propose_tree(const int32_t* context, size_t n, int32_t max_nodes, int32_t max_depth,
                         int32_t min_match, int32_t min_count);

  std::string check_invariants();  // "" when fine, else the first broken invariant
  std::map<std::string, int64_t> memory_report() const;
  int64_t children_cache_bytes() const;
  int64_t heavy_tables_bytes() const;
  int64_t tree_cache_hits() const { return tree_cache_hits_; }

 private:
  struct Candidate;
  uint32_t len(int32_t s) const { return states_[s].len_flags & kLenMask; }
  bool is_heavy(int32_t s) const { return states_[s].len_flags & kHeavyBit; }
  bool is_leaf(int32_t s) const { return s != kRoot && !(states_[s].len_flags & kCloneBit); }
  void check_state(int32_t s) const;
  void append_token(int32_t token);
  void extend_one(int32_t token);
  int32_t new_state(uint32_t len_flags);
  int32_t clone_state(int32_t q, uint32_t len);
  void redirect(int32_t p, int32_t token, int32_t from, int32_t to);
  const int32_t* find_target(int32_t s, int32_t token, int32_t* degree = nullptr) const;
  void set_target(int32_t s, int32_t token, int32_t target);
  template <class F>
  void for_each_edge(int32_t s, F&& f) const;
  void add_edge(int32_t s, int32_t token, int32_t target, int32_t degree);
  int32_t new_list_edge(int32_t token, int32_t target, int32_t next);
  void copy_edges(int32_t from, int32_t to);
  void make_heavy(int32_t s);
  void add_child(int32_t parent, int32_t child);
  int32_t resolve_child(int32_t parent, int32_t* entry);
  int32_t first_child(int32_t parent);
  int32_t next_sibling(int32_t parent, int32_t child);
  void record_leaf(int32_t leaf);
  void flush();
  bool walk_pending_leaves(size_t work_budget);
  void recount_all();
  std::pair<int32_t, int32_t> match_all(const int32_t* context, size_t n) const;
  void push_children(const Candidate& parent, int32_t node, int32_t budget,
                     std::vector<Candidate>* heap, int64_t* seq);
  static void push_candidate(const Candidate& candidate, std::vector<Candidate>* heap);
  const std::vector<Child>& best_children(int32_t state, int32_t budget, int64_t total);
  void cache_best_children(int32_t state, size_t keep, int64_t total, CachedChildren* cached);
  void prewarm_children_cache();
  int64_t continuation_total(int32_t state) const;
  const HeavyTable& heavy_table(int32_t s) const { return heavy_tables_[states_[s].edge_head]; }
  void collect_children(int32_t state, size_t keep, std::vector<Child>* children);
  std::string check_structure() const;
  std::string check_edges() const;
  std::string check_tree();
  std::string check_counts();

  std::shared_ptr<TokenBuffer> tokens_;
  int64_t num_tokens_ = 0;
  BlockVector<State> states_;
  BlockVector<Edge> edges_;
  int32_t free_edge_ = kNone;  // list nodes freed when their state turned heavy, for reuse
  std::vector<HeavyTable> heavy_tables_;
  std::vector<int32_t> heavy_owners_;  // [heavy_tables_.size()] the state of each table
  int64_t num_edges_ = 0;
  int32_t last_ = kRoot;
  int64_t tree_cache_hits_ = 0;
  std::vector<int32_t> pending_leaves_;  // leaves whose +1 is not yet on their suffix paths
  bool recount_all_ = false;             // pending_leaves_ overflowed: recount everything
  std::unordered_map<int32_t, CachedChildren> children_cache_;  // heavy states only
  std::vector<Child> scratch_children_;
  // expand_tree's trees since the last extend, by (state, max_nodes, max_depth): a function of
  // the stream and those three alone, and an automaton not extended between steps (the global
  // cache of earlier outputs, fixed during a request) meets the same state again and again
  std::unordered_map<uint64_t, TreeDraft> tree_cache_;
  int64_t tree_cache_bytes() const;
};

}  // namespace lookupdec
