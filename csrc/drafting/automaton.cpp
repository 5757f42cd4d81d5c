// Suffix automaton core; see automaton.hpp for the layout and the counting scheme.
#include "drafting/automaton.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace lookupdec {

namespace {

constexpr uint64_t kFibonacciHash = 0x9E3779B97F4A7C15ull;
constexpr uint32_t kFirstHeavyCapacity = 2 * kHeavyDegree;  // slots of a new HeavyTable
constexpr size_t kMinTokenCapacity = 1024;
constexpr size_t kMinPendingLeaves = 4096;  // below this, never switch to a full recount
constexpr size_t kPendingShareOfStates = 8;  // more pending leaves than states/8: full recount
constexpr size_t kFirstMatchWindow = 16;     // context tokens matched first (see match)
constexpr size_t kMatchWindowGrowth = 4;     // ... and widened by this factor while filled
constexpr size_t kPrefetchAhead = 8;          // children whose counts are prefetched in advance
constexpr size_t kWalkLanes = 8;              // suffix-path walks interleaved by flush
constexpr size_t kMinCachedChildren = 64;     // best children cached per heavy state, at least
constexpr size_t kMaxCachedStates = 32768;    // the cache is emptied when it holds this many
constexpr size_t kMaxCachedTrees = 1024;      // expand_tree's cache is emptied when it holds this many
constexpr uint32_t kPrewarmDegree = 32;       // see prewarm_children_cache

}  // namespace

// ---------------------------------------------------------------- HeavyTable

HeavyTable::HeavyTable(uint32_t capacity) : slots_(new HeavyEdge[capacity]), mask_(capacity - 1) {
  for (uint32_t i = 0; i < capacity; ++i) slots_[i] = HeavyEdge{kNone, kNone};
}

HeavyTable::HeavyTable(const HeavyTable& other)
    : slots_(new HeavyEdge[other.capacity()]), mask_(other.mask_), size_(other.size_) {
  std::memcpy(slots_.get(), other.slots_.get(), other.capacity() * sizeof(HeavyEdge));
}

size_t HeavyTable::home(int32_t token) const {
  return static_cast<size_t>((static_cast<uint64_t>(static_cast<uint32_t>(token)) *
                              kFibonacciHash) >> 32) & mask_;
}

const HeavyEdge* HeavyTable::find(int32_t token) const {
  for (size_t i = home(token);; i = (i + 1) & mask_) {
    const HeavyEdge& slot = slots_[i];
    if (slot.token == token) return &slot;
    if (slot.token == kNone) return nullptr;
  }
}

void HeavyTable::insert(int32_t token, int32_t target) {
  if (4 * (size_ + 1) > 3 * capacity()) {  // grow: rehash into twice the slots
    HeavyTable grown(2 * capacity());
    for (const HeavyEdge& slot : *this)
      if (slot.token != kNone) grown.insert(slot.token, slot.target);
    *this = std::move(grown);
  }
  size_t i = home(token);
  while (slots_[i].token != kNone) i = (i + 1) & mask_;
  slots_[i] = HeavyEdge{token, target};
  ++size_;
}

// ---------------------------------------------------------------- construction

Automaton::Automaton() : tokens_(std::make_shared<TokenBuffer>()) {
  new_state(0);  // the root: the empty string
}

void Automaton::extend(const int32_t* tokens, size_t num_tokens) {
  if (num_tokens_ + static_cast<int64_t>(num_tokens) > kMaxTokens)
    throw std::length_error("SuffixAutomaton holds at most 2^29 - 1 tokens");
  for (size_t i = 0; i < num_tokens; ++i)
    if (tokens[i] < 0) throw std::invalid_argument("token ids must be >= 0");
  if (num_tokens && !tree_cache_.empty()) tree_cache_.clear();  // the trees change with the stream
  for (size_t i = 0; i < num_tokens; ++i) {
    append_token(tokens[i]);
    extend_one(tokens[i]);
  }
}

void Automaton::append_token(int32_t token) {
  TokenBuffer& buffer = *tokens_;
  if (static_cast<size_t>(num_tokens_) == buffer.capacity) {
    // A new buffer: views of the old one stay valid (they own it through the shared_ptr).
    auto grown = std::make_shared<TokenBuffer>();
    grown->capacity = std::max(kMinTokenCapacity, buffer.capacity + buffer.capacity / 2);
    grown->data.reset(new int32_t[grown->capacity]);
    if (num_tokens_) std::memcpy(grown->data.get(), buffer.data.get(), num_tokens_ * 4);
    tokens_ = grown;
  }
  tokens_->data[num_tokens_++] = token;
}

// The classic online construction (Blumer et al.), plus suffix-link-tree bookkeeping.
void Automaton::extend_one(int32_t token) {
  int32_t cur = new_state(len(last_) + 1);
  int32_t p = last_;
  const int32_t* target = nullptr;
  while (p != kNone) {
    if (states_[p].link != kNone) __builtin_prefetch(&states_[states_[p].link]);
    int32_t degree = 0;
    target = find_target(p, token, &degree);
    if (target != nullptr) break;
    add_edge(p, token, cur, degree);
    p = states_[p].link;
  }
  int32_t parent = kRoot;
  if (p != kNone) {
    int32_t q = *target;
    if (len(p) + 1 == len(q)) {
      parent = q;
    } else {
      parent = clone_state(q, len(p) + 1);
      redirect(p, token, q, parent);
    }
  }
  states_[cur].link = parent;
  add_child(parent, cur);
  last_ = cur;
  record_leaf(cur);
}

int32_t Automaton::new_state(uint32_t len_flags) {
  return static_cast<int32_t>(
      states_.push_back(State{len_flags, kNone, kNone, 0, 0, kNone, kNone}));
}

// A copy of q holding q's strings of length <= len. It takes q's place in the suffix-link
// tree: q's entry in its parent's list goes stale and the clone inherits q's next sibling.
int32_t Automaton::clone_state(int32_t q, uint32_t len) {
  int32_t clone = new_state(len | kCloneBit);
  State& c = states_[clone];
  State& old = states_[q];
  c.count = old.count;  // endpos(clone) = endpos(q) + the pending new leaf
  c.last_end = old.last_end;
  c.link = old.link;
  c.next_sibling = old.next_sibling;
  c.first_child = q;
  old.link = clone;
  old.next_sibling = kNone;
  copy_edges(q, clone);
  return clone;
}

void Automaton::copy_edges(int32_t from, int32_t to) {
  if (!is_heavy(from)) {
    for (int32_t e = states_[from].edge_head; e != kNone; e = edges_[e].next)
      states_[to].edge_head = new_list_edge(edges_[e].token, edges_[e].target,
                                            states_[to].edge_head);
    return;
  }
  HeavyTable copy(heavy_tables_[states_[from].edge_head]);
  num_edges_ += copy.size();
  states_[to].len_flags |= kHeavyBit;
  states_[to].edge_head = static_cast<int32_t>(heavy_tables_.size());
  heavy_tables_.push_back(std::move(copy));
  heavy_owners_.push_back(to);
}

void Automaton::redirect(int32_t p, int32_t token, int32_t from, int32_t to) {
  for (; p != kNone; p = states_[p].link) {
    const int32_t* target = find_target(p, token);
    if (target == nullptr || *target != from) return;
    set_target(p, token, to);
  }
}

// ---------------------------------------------------------------- edges

// The target of s's edge on `token`, null if none; for a light state without it, *degree
// gets the number of its edges.
const int32_t* Automaton::find_target(int32_t s, int32_t token, int32_t* degree) const {
  const State& state = states_[s];
  if (state.len_flags & kHeavyBit) {
    const HeavyEdge* edge = heavy_tables_[state.edge_head].find(token);
    return edge == nullptr ? nullptr : &edge->target;
  }
  int32_t scanned = 0;
  for (int32_t e = state.edge_head; e != kNone; e = edges_[e].next, ++scanned)
    if (edges_[e].token == token) return &edges_[e].target;
  if (degree) *degree = scanned;
  return nullptr;
}

// Redirect s's existing edge on `token`.
void Automaton::set_target(int32_t s, int32_t token, int32_t target) {
  if (is_heavy(s)) {
    heavy_tables_[states_[s].edge_head].find(token)->target = target;
    return;
  }
  for (int32_t e = states_[s].edge_head; e != kNone; e = edges_[e].next)
    if (edges_[e].token == token) edges_[e].target = target;
}

template <class F>
void Automaton::for_each_edge(int32_t s, F&& f) const {
  if (is_heavy(s)) {
    for (const HeavyEdge& edge : heavy_tables_[states_[s].edge_head])
      if (edge.token != kNone) f(edge.token, edge.target);
    return;
  }
  for (int32_t e = states_[s].edge_head; e != kNone; e = edges_[e].next)
    f(edges_[e].token, edges_[e].target);
}

// `degree` is the number of edges s had (known from the failed lookup); unused when heavy.
void Automaton::add_edge(int32_t s, int32_t token, int32_t target, int32_t degree) {
  if (is_heavy(s)) {
    heavy_tables_[states_[s].edge_head].insert(token, target);
    ++num_edges_;
    return;
  }
  states_[s].edge_head = new_list_edge(token, target, states_[s].edge_head);
  if (degree + 1 >= kHeavyDegree) make_heavy(s);
}

int32_t Automaton::new_list_edge(int32_t token, int32_t target, int32_t next) {
  ++num_edges_;
  if (free_edge_ == kNone) return static_cast<int32_t>(edges_.push_back(Edge{token, target, next}));
  int32_t e = free_edge_;
  free_edge_ = edges_[e].next;
  edges_[e] = Edge{token, target, next};
  return e;
}

// Move s's edges from its list (whose nodes go to the free list) to a HeavyTable.
void Automaton::make_heavy(int32_t s) {
  HeavyTable table(kFirstHeavyCapacity);
  for (int32_t e = states_[s].edge_head; e != kNone;) {
    int32_t next = edges_[e].next;
    table.insert(edges_[e].token, edges_[e].target);
    edges_[e].next = free_edge_;
    free_edge_ = e;
    e = next;
  }
  states_[s].len_flags |= kHeavyBit;
  states_[s].edge_head = static_cast<int32_t>(heavy_tables_.size());
  heavy_tables_.push_back(std::move(table));
  heavy_owners_.push_back(s);
}

// ---------------------------------------------------------------- suffix-link tree

void Automaton::add_child(int32_t parent, int32_t child) {
  states_[child].next_sibling = states_[parent].first_child;
  states_[parent].first_child = child;
  states_[child].link = parent;
}

// The child of `parent` that the list entry `*entry` stands for: the entry itself, or, if it
// went stale (clones were put above it), its ancestor just below `parent`, spliced in.
int32_t Automaton::resolve_child(int32_t parent, int32_t* entry) {
  int32_t child = *entry;
  while (child != kNone && states_[child].link != parent) child = states_[child].link;
  *entry = child;
  return child;
}

int32_t Automaton::first_child(int32_t parent) {
  return resolve_child(parent, &states_[parent].first_child);
}

int32_t Automaton::next_sibling(int32_t parent, int32_t child) {
  return resolve_child(parent, &states_[child].next_sibling);
}

// ---------------------------------------------------------------- counts

void Automaton::record_leaf(int32_t leaf) {
  if (recount_all_) return;
  pending_leaves_.push_back(leaf);
  size_t limit = std::max(kMinPendingLeaves, states_.size() / kPendingShareOfStates);
  if (pending_leaves_.size() > limit) {
    recount_all_ = true;
    pending_leaves_.clear();
  }
}

// Make count and last_end exact: walk the pending leaves' suffix paths, or recount everything
// when the walks would cost more than the full pass.
void Automaton::flush() {
  if (recount_all_ || !walk_pending_leaves(states_.size() / 2 + kMinPendingLeaves)) recount_all();
  pending_leaves_.clear();
}

// +1 and the leaf's end position on every state of each pending leaf's suffix path. kWalkLanes
// walks advance in turn, each prefetching its next state, so that their cache misses overlap.
// false (counts half-updated) once the work passes `work_budget`.
bool Automaton::walk_pending_leaves(size_t work_budget) {
  size_t work = 0;
  for (size_t first = 0; first < pending_leaves_.size(); first += kWalkLanes) {
    size_t lanes = std::min(kWalkLanes, pending_leaves_.size() - first);
    int32_t cursor[kWalkLanes], end[kWalkLanes];
    for (size_t i = 0; i < lanes; ++i) {
      cursor[i] = pending_leaves_[first + i];
      end[i] = static_cast<int32_t>(len(cursor[i]));
    }
    for (size_t live = lanes; live > 0;) {
      live = 0;
      for (size_t i = 0; i < lanes; ++i) {
        if (cursor[i] == kNone) continue;
        State& u = states_[cursor[i]];
        u.count += 1;
        u.last_end = std::max(u.last_end, end[i]);
        cursor[i] = u.link;
        if (cursor[i] == kNone) continue;
        __builtin_prefetch(&states_[cursor[i]], 1);
        ++live;
      }
      work += lanes;
    }
    if (work > work_budget) return false;
  }
  return true;
}

// count = leaves in the suffix-link subtree, last_end = newest leaf in it: states sorted by
// length (counting sort; a suffix link always points to a shorter state), then one pass from
// the longest adds each state into its suffix link.
void Automaton::recount_all() {
  size_t num_states = states_.size();
  std::vector<int32_t> start_of_len(static_cast<size_t>(num_tokens_) + 2, 0);
  for (size_t s = 0; s < num_states; ++s) ++start_of_len[len(static_cast<int32_t>(s)) + 1];
  for (size_t l = 1; l < start_of_len.size(); ++l) start_of_len[l] += start_of_len[l - 1];
  std::vector<int32_t> by_len(num_states);
  for (size_t s = 0; s < num_states; ++s) {
    by_len[start_of_len[len(static_cast<int32_t>(s))]++] = static_cast<int32_t>(s);
    bool leaf = is_leaf(static_cast<int32_t>(s));
    states_[s].count = leaf ? 1 : 0;
    states_[s].last_end = leaf ? static_cast<int32_t>(len(static_cast<int32_t>(s))) : 0;
  }
  for (size_t i = num_states - 1; i > 0; --i) {  // by_len[0] is the root, the only len 0
    const State& child = states_[by_len[i]];
    State& parent = states_[child.link];
    parent.count += child.count;
    parent.last_end = std::max(parent.last_end, child.last_end);
  }
  recount_all_ = false;
  prewarm_children_cache();
}

// ---------------------------------------------------------------- queries

void Automaton::check_state(int32_t s) const {
  if (s < 0 || static_cast<size_t>(s) >= states_.size())
    throw std::out_of_range("state " + std::to_string(s) + " out of range [0, " +
                            std::to_string(states_.size()) + ")");
}

// The longest match is usually much shorter than the context: match a short tail first and
// widen it only while the match fills it. A context that is the stream's own tail (a request's
// automaton and its context: every step) matches whole, at the state on the suffix links from
// the last state whose strings have its length: a few states read instead of 16 + 64
// transitions, each a cache miss after a forward.
std::pair<int32_t, int32_t> Automaton::match(const int32_t* context, size_t n) const {
  if (n > 0 && static_cast<int64_t>(n) <= num_tokens_ &&
      std::memcmp(token_data() + (num_tokens_ - static_cast<int64_t>(n)), context, n * sizeof(int32_t)) == 0) {
    int32_t s = last_;
    while (s != kRoot && len(states_[s].link) >= n) s = states_[s].link;
    return {s, static_cast<int32_t>(n)};
  }
  size_t window = std::min(n, kFirstMatchWindow);
  for (;;) {
    std::pair<int32_t, int32_t> found = match_all(context + (n - window), window);
    if (static_cast<size_t>(found.second) < window || window == n) return found;
    window = std::min(n, window * kMatchWindowGrowth);
  }
}

// Run the automaton over all of context[0:n], falling back along suffix links on a mismatch.
std::pair<int32_t, int32_t> Automaton::match_all(const int32_t* context, size_t n) const {
  int32_t s = kRoot;
  int32_t length = 0;
  for (size_t i = 0; i < n; ++i) {
    const int32_t* target = find_target(s, context[i]);
    while (target == nullptr && s != kRoot) {
      s = states_[s].link;
      length = static_cast<int32_t>(len(s));
      target = find_target(s, context[i]);
    }
    if (target == nullptr) {
      length = 0;
    } else {
      s = *target;
      length += 1;
    }
  }
  return {s, length};
}

int32_t Automaton::state_len(int32_t state) const {
  check_state(state);
  return static_cast<int32_t>(len(state));
}

int32_t Automaton::suffix_link(int32_t state) const {
  check_state(state);
  return states_[state].link;
}

int32_t Automaton::count(int32_t state) {
  check_state(state);
  flush();
  return states_[state].count;
}

// Occurrences followed by a token: all but the one ending at the end of the stream, if any.
int32_t Automaton::continuation_count(int32_t state) {
  check_state(state);
  flush();
  return static_cast<int32_t>(continuation_total(state));
}

int32_t Automaton::most_recent_end(int32_t state) {
  check_state(state);
  flush();
  return states_[state].last_end;
}

// Best-first over the suffix-link subtree, keyed by each subtree's newest end position.
std::vector<int32_t> Automaton::end_positions(int32_t state, int32_t limit) {
  check_state(state);
  flush();
  struct Item {
    int32_t key;    // an end position, or the newest end position in a subtree
    int32_t state;
    bool own;       // the leaf's own end position (emit), else its whole subtree (expand)
    bool operator<(const Item& other) const { return key < other.key; }
  };
  std::vector<int32_t> ends;
  std::vector<Item> heap{{states_[state].last_end, state, false}};
  while (!heap.empty() && static_cast<int32_t>(ends.size()) < limit) {
    std::pop_heap(heap.begin(), heap.end());
    Item item = heap.back();
    heap.pop_back();
    if (item.own) {
      ends.push_back(item.key);
      continue;
    }
    if (is_leaf(item.state)) {
      heap.push_back({static_cast<int32_t>(len(item.state)), item.state, true});
      std::push_heap(heap.begin(), heap.end());
    }
    for (int32_t c = first_child(item.state); c != kNone; c = next_sibling(item.state, c)) {
      heap.push_back({states_[c].last_end, c, false});
      std::push_heap(heap.begin(), heap.end());
    }
  }
  return ends;
}

void Automaton::next_counts(int32_t state, std::vector<int32_t>* tokens,
                            std::vector<int32_t>* counts) {
  check_state(state);
  flush();
  for_each_edge(state, [&](int32_t token, int32_t target) {
    tokens->push_back(token);
    counts->push_back(states_[target].count);
  });
}

// ---------------------------------------------------------------- tree expansion

struct Automaton::Candidate {
  double score;
  int64_t seq;  // push order: ties go to the earlier push
  int32_t parent_node;
  int32_t state;      // automaton state of the node's string, or kNone on a chain (below)
  int32_t chain_end;  // >= 0: the string occurs once, ending here; its child is tokens[chain_end]
  int32_t token;
  int32_t depth;
  bool operator<(const Candidate& other) const {  // max-heap: higher score, then lower seq
    return score < other.score || (score == other.score && seq > other.seq);
  }
};

// All children of `state`, the best `keep` of them sorted first. Targets' counts are read in a
// second pass with prefetches, so that their cache misses overlap.
void Automaton::collect_children(int32_t state, size_t keep, std::vector<Child>* children) {
  children->clear();
  for_each_edge(state, [&](int32_t token, int32_t target) {
    children->push_back({0, token, target});
  });
  size_t n = children->size();
  for (size_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) {
      __builtin_prefetch(&states_[(*children)[i + kPrefetchAhead].target]);
    }
    (*children)[i].count = states_[(*children)[i].target].count;
  }
  keep = std::min(keep, n);
  std::partial_sort(children->begin(), children->begin() + keep, children->end(),
                    [](const Child& a, const Child& b) {
                      return a.count > b.count || (a.count == b.count && a.token < b.token);
                    });
  children->resize(keep);
}

// The best `budget` children (or all, if fewer), best first. Heavy states' lists are cached.
const std::vector<Child>& Automaton::best_children(int32_t state, int32_t budget, int64_t total) {
  size_t wanted = static_cast<size_t>(std::max(budget, 0));
  if (!is_heavy(state)) {
    collect_children(state, wanted, &scratch_children_);
    return scratch_children_;
  }
  if (children_cache_.size() >= kMaxCachedStates) children_cache_.clear();
  CachedChildren& cached = children_cache_[state];
  if (cached.total != total || (!cached.complete && cached.best.size() < wanted))
    cache_best_children(state, std::max(wanted, kMinCachedChildren), total, &cached);
  return cached.best;
}

void Automaton::cache_best_children(int32_t state, size_t keep, int64_t total,
                                    CachedChildren* cached) {
  collect_children(state, keep, &cached->best);
  cached->complete = cached->best.size() < keep || heavy_table(state).size() == keep;
  cached->total = total;
}

// After a full recount (a bulk load), cache the best children of every state with at least
// kPrewarmDegree edges, so that no query pays their scan (a cache miss per edge) cold; the others
// cost at most kPrewarmDegree edges per expansion. Entries go stale one by one as later
// extends add occurrences, and are recomputed on use.
void Automaton::prewarm_children_cache() {
  children_cache_.clear();
  for (size_t t = 0; t < heavy_tables_.size(); ++t) {
    if (children_cache_.size() >= kMaxCachedStates / 2) return;
    if (heavy_tables_[t].size() < kPrewarmDegree) continue;
    int32_t state = heavy_owners_[t];
    int64_t total = continuation_total(state);
    if (total > 0) cache_best_children(state, kMinCachedChildren, total, &children_cache_[state]);
  }
}

// Occurrences followed by a token: the sum of the children's counts.
int64_t Automaton::continuation_total(int32_t state) const {
  const State& s = states_[state];
  return s.count - (num_tokens_ > 0 && s.last_end == num_tokens_ ? 1 : 0);
}

// Push the `budget` best children of `parent`; a child ranked below the budget can never be
// taken, since each of its better siblings would be taken first. A string that occurs once
// has at most one child, read from the stream (sequential) instead of the automaton.
void Automaton::push_children(const Candidate& parent, int32_t node, int32_t budget,
                              std::vector<Candidate>* heap, int64_t* seq) {
  if (budget <= 0) return;
  int32_t end = parent.chain_end;
  if (end == kNone && states_[parent.state].count == 1) end = states_[parent.state].last_end;
  if (end != kNone) {
    if (end < num_tokens_) {
      push_candidate({parent.score, (*seq)++, node, kNone, end + 1, token_data()[end],
                      parent.depth + 1}, heap);
    }
    return;
  }
  int64_t total = continuation_total(parent.state);
  if (total <= 0) return;
  const std::vector<Child>& children = best_children(parent.state, budget, total);
  size_t keep = std::min(children.size(), static_cast<size_t>(budget));
  for (size_t i = 0; i < keep; ++i) {
    double frequency = static_cast<double>(children[i].count) / static_cast<double>(total);
    push_candidate({parent.score * frequency, (*seq)++, node, children[i].target, kNone,
                    children[i].token, parent.depth + 1}, heap);
  }
}

void Automaton::push_candidate(const Candidate& candidate, std::vector<Candidate>* heap) {
  heap->push_back(candidate);
  std::push_heap(heap->begin(), heap->end());
}

TreeDraft Automaton::propose_tree(const int32_t* context, size_t n, int32_t max_nodes,
                                  int32_t max_depth, int32_t min_match, int32_t min_count) {
  flush();
  std::pair<int32_t, int32_t> found = match(context, n);
  int32_t state = found.first, length = found.second;
  while (length > 0 && continuation_total(state) < min_count) {
    state = states_[state].link;
    length = static_cast<int32_t>(len(state));
  }
  if (length < min_match) return TreeDraft{};
  return expand_tree(state, max_nodes, max_depth);
}

TreeDraft Automaton::expand_tree(int32_t state, int32_t max_nodes, int32_t max_depth) {
  check_state(state);
  // (budgets past 16 bits are not cached: the key holds 16 each)
  bool cacheable = max_nodes >= 0 && max_nodes < (1 << 16) && max_depth >= 0 && max_depth < (1 << 16);
  uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(state)) << 32) |
                 (static_cast<uint64_t>(max_nodes) << 16) | static_cast<uint64_t>(max_depth);
  if (cacheable) {
    auto found = tree_cache_.find(key);
    if (found != tree_cache_.end()) {
      ++tree_cache_hits_;
      return found->second;
    }
  }
  flush();
  TreeDraft tree;
  std::vector<Candidate> heap;
  size_t expected = static_cast<size_t>(std::min(std::max(max_nodes, 0), 1024));  // (grown node by node else)
  tree.token_ids.reserve(expected);
  tree.parents.reserve(expected);
  tree.scores.reserve(expected);
  heap.reserve(2 * expected + 8);
  int64_t seq = 0;
  Candidate root{1.0, -1, kNone, state, kNone, 0, 0};  // the matched string, depth 0
  if (max_depth >= 1) push_children(root, kNone, max_nodes, &heap, &seq);
  while (!heap.empty() && static_cast<int32_t>(tree.token_ids.size()) < max_nodes) {
    std::pop_heap(heap.begin(), heap.end());
    Candidate best = heap.back();
    heap.pop_back();
    int32_t node = static_cast<int32_t>(tree.token_ids.size());
    tree.token_ids.push_back(best.token);
    tree.parents.push_back(best.parent_node);
    tree.scores.push_back(best.score);
    if (best.depth < max_depth) push_children(best, node, max_nodes - node - 1, &heap, &seq);
  }
  if (cacheable) {
    if (tree_cache_.size() >= kMaxCachedTrees) tree_cache_.clear();
    tree_cache_.emplace(key, tree);
  }
  return tree;
}

// ---------------------------------------------------------------- invariants and memory

std::string Automaton::check_invariants() {
  std::string error = check_structure();
  if (error.empty()) error = check_edges();
  if (error.empty()) error = check_tree();
  if (error.empty()) error = check_counts();
  return error;
}

std::string Automaton::check_structure() const {
  if (states_[kRoot].link != kNone || len(kRoot) != 0) return "root must have len 0 and no link";
  int64_t leaves = 0;
  for (int32_t s = 1; s < static_cast<int32_t>(states_.size()); ++s) {
    int32_t link = states_[s].link;
    if (link < 0 || link >= static_cast<int32_t>(states_.size()))
      return "state " + std::to_string(s) + ": suffix link out of range";
    if (len(link) >= len(s)) return "state " + std::to_string(s) + ": len(link) >= len";
    leaves += is_leaf(s);
  }
  if (leaves != num_tokens_) return "number of leaf states != number of tokens";
  if (static_cast<int64_t>(len(last_)) != num_tokens_) return "last state's len != tokens";
  std::pair<int32_t, int32_t> whole = match_all(token_data(), num_tokens_);
  if (whole.second != num_tokens_ || whole.first != last_)
    return "the whole stream does not lead to the last state";
  return "";
}

// Every edge (s, c) -> t: the strings of s followed by c lie in t:
//   len(link(t)) + 1 <= len(link(s)) + 2  and  len(s) + 1 <= len(t).
std::string Automaton::check_edges() const {
  int64_t edges = 0;
  for (int32_t s = 0; s < static_cast<int32_t>(states_.size()); ++s) {
    std::vector<int32_t> tokens;
    std::string error;
    int32_t min_len_s = s == kRoot ? 0 : static_cast<int32_t>(len(states_[s].link)) + 1;
    for_each_edge(s, [&](int32_t token, int32_t target) {
      if (target <= kRoot || target >= static_cast<int32_t>(states_.size())) {
        error = "edge target out of range";
      } else if (len(target) < len(s) + 1) {
        error = "edge to a state with len < len + 1";
      } else if (static_cast<int32_t>(len(states_[target].link)) + 1 > min_len_s + 1) {
        error = "edge target misses the shortest extended string";
      } else if (find_target(s, token) == nullptr || *find_target(s, token) != target) {
        error = "the lookup of an edge's token misses it";
      }
      tokens.push_back(token);
    });
    if (!error.empty()) return "state " + std::to_string(s) + ": " + error;
    edges += static_cast<int64_t>(tokens.size());
    if (is_heavy(s) && heavy_tables_[states_[s].edge_head].size() != tokens.size())
      return "state " + std::to_string(s) + ": heavy table size is wrong";
    std::sort(tokens.begin(), tokens.end());
    if (std::adjacent_find(tokens.begin(), tokens.end()) != tokens.end())
      return "state " + std::to_string(s) + ": two edges with the same token";
    if (!is_heavy(s) && static_cast<int32_t>(tokens.size()) >= kHeavyDegree)
      return "state " + std::to_string(s) + ": light state with too many edges";
  }
  if (edges != num_edges_) return "edge count is wrong";
  return "";
}

// Every state but the root is listed exactly once, under its suffix link.
std::string Automaton::check_tree() {
  std::vector<bool> listed(states_.size(), false);
  for (int32_t s = 0; s < static_cast<int32_t>(states_.size()); ++s) {
    for (int32_t c = first_child(s); c != kNone; c = next_sibling(s, c)) {
      if (listed[c]) return "suffix-link tree: state " + std::to_string(c) + " listed twice";
      listed[c] = true;
    }
  }
  for (int32_t s = 1; s < static_cast<int32_t>(states_.size()); ++s)
    if (!listed[s]) return "suffix-link tree: state " + std::to_string(s) + " is in no list";
  return "";
}

std::string Automaton::check_counts() {
  flush();
  std::vector<int64_t> count(states_.size(), 0);
  std::vector<int32_t> last_end(states_.size(), 0);
  std::vector<int32_t> by_len(states_.size());
  for (size_t s = 0; s < states_.size(); ++s) by_len[s] = static_cast<int32_t>(s);
  std::sort(by_len.begin(), by_len.end(), [&](int32_t a, int32_t b) { return len(a) > len(b); });
  for (int32_t s : by_len) {
    if (is_leaf(s)) {
      count[s] += 1;
      last_end[s] = std::max(last_end[s], static_cast<int32_t>(len(s)));
    }
    if (count[s] != states_[s].count || last_end[s] != states_[s].last_end)
      return "state " + std::to_string(s) + ": count or last_end differs from a recount";
    if (s == kRoot) break;
    int32_t parent = states_[s].link;
    count[parent] += count[s];
    last_end[parent] = std::max(last_end[parent], last_end[s]);
  }
  if (states_[kRoot].count != num_tokens_) return "root count != number of tokens";
  return "";
}

int64_t Automaton::heavy_tables_bytes() const {
  constexpr int64_t kMallocOverhead = 16;
  int64_t bytes = static_cast<int64_t>(heavy_tables_.capacity() * sizeof(HeavyTable) +
                                      heavy_owners_.capacity() * sizeof(int32_t));
  for (const HeavyTable& table : heavy_tables_)
    bytes += kMallocOverhead + static_cast<int64_t>(table.capacity() * sizeof(HeavyEdge));
  return bytes;
}

int64_t Automaton::children_cache_bytes() const {
  constexpr int64_t kEntryOverhead = 64;  // hash node, bucket and CachedChildren, roughly
  int64_t bytes = static_cast<int64_t>(children_cache_.bucket_count() * sizeof(void*));
  for (const auto& entry : children_cache_)
    bytes += kEntryOverhead + static_cast<int64_t>(entry.second.best.capacity() * sizeof(Child));
  return bytes;
}

int64_t Automaton::tree_cache_bytes() const {
  constexpr int64_t kEntryOverhead = 96;  // hash node, bucket and the TreeDraft's three vectors, roughly
  int64_t bytes = static_cast<int64_t>(tree_cache_.bucket_count() * sizeof(void*));
  for (const auto& entry : tree_cache_)
    bytes += kEntryOverhead + static_cast<int64_t>(entry.second.token_ids.capacity() * 8 +
                                                   entry.second.scores.capacity() * sizeof(double));
  return bytes;
}

std::map<std::string, int64_t> Automaton::memory_report() const {
  return {
      {"tokens", static_cast<int64_t>(tokens_->capacity * sizeof(int32_t))},
      {"states", static_cast<int64_t>(states_.memory_bytes())},
      {"edges", static_cast<int64_t>(edges_.memory_bytes())},
      {"heavy_tables", heavy_tables_bytes()},
      {"pending_leaves", static_cast<int64_t>(pending_leaves_.capacity() * sizeof(int32_t))},
      {"children_cache", children_cache_bytes()},
      {"tree_cache", tree_cache_bytes()},
  };
}

}  // namespace lookupdec
