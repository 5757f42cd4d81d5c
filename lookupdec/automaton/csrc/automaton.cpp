// Suffix automaton core; see automaton.hpp for the layout and the counting scheme.
#include "automaton.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace lookupdec {

namespace {

constexpr uint64_t kFibonacciHash = 0x9E3779B97F4A7C15ull;
constexpr size_t kMinIndexSlots = 64;
constexpr size_t kMinTokenCapacity = 1024;
constexpr size_t kMinPendingLeaves = 4096;  // below this, never switch to a full recount
constexpr size_t kPendingShareOfStates = 8;  // more pending leaves than states/8: full recount

// Grow a vector by 1.5x (not libstdc++'s 2x) so that capacity tracks size closely.
template <class T>
void reserve_one_more(std::vector<T>* v) {
  if (v->size() == v->capacity()) v->reserve(v->capacity() + v->capacity() / 2 + 16);
}

}  // namespace

// ---------------------------------------------------------------- EdgeIndex

size_t EdgeIndex::home(int32_t state, int32_t token) const {
  uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(state)) << 32) |
                 static_cast<uint32_t>(token);
  return static_cast<size_t>((key * kFibonacciHash) >> shift_);
}

int32_t EdgeIndex::find(int32_t state, int32_t token) const {
  if (slots_.empty()) return kNone;
  size_t mask = slots_.size() - 1;
  for (size_t i = home(state, token);; i = (i + 1) & mask) {
    const Slot& slot = slots_[i];
    if (slot.state == kNone) return kNone;
    if (slot.state == state && slot.token == token) return slot.edge;
  }
}

void EdgeIndex::insert(int32_t state, int32_t token, int32_t edge) {
  if (2 * (used_ + 1) > slots_.size()) grow();
  size_t mask = slots_.size() - 1;
  size_t i = home(state, token);
  while (slots_[i].state != kNone) i = (i + 1) & mask;
  slots_[i] = Slot{state, token, edge};
  ++used_;
}

void EdgeIndex::grow() {
  std::vector<Slot> old;
  old.swap(slots_);
  size_t capacity = std::max(kMinIndexSlots, old.size() * 2);
  slots_.assign(capacity, Slot{kNone, 0, kNone});
  shift_ = 64 - __builtin_ctzll(capacity);
  used_ = 0;
  for (const Slot& slot : old)
    if (slot.state != kNone) insert(slot.state, slot.token, slot.edge);
}

// ---------------------------------------------------------------- construction

Automaton::Automaton() : tokens_(std::make_shared<TokenBuffer>()) {
  new_state(0);  // the root: the empty string
}

void Automaton::extend(const int32_t* tokens, size_t num_tokens) {
  if (num_tokens_ + static_cast<int64_t>(num_tokens) > kMaxTokens)
    throw std::length_error("SuffixAutomaton holds at most 2^30 - 1 tokens");
  for (size_t i = 0; i < num_tokens; ++i)
    if (tokens[i] < 0) throw std::invalid_argument("token ids must be >= 0");
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
  int32_t edge = kNone;
  while (p != kNone) {
    int32_t degree = 0;
    edge = find_edge(p, token, &degree);
    if (edge != kNone) break;
    add_edge(p, token, cur, degree);
    p = states_[p].link;
  }
  int32_t parent = kRoot;
  if (p != kNone) {
    int32_t q = edges_[edge].target;
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
  reserve_one_more(&states_);
  states_.push_back(State{len_flags, kNone, kNone, 0, 0, kNone, kNone, kNone});
  return static_cast<int32_t>(states_.size() - 1);
}

// A copy of q holding q's strings of length <= len; it takes q's place in the suffix-link tree.
int32_t Automaton::clone_state(int32_t q, uint32_t len) {
  int32_t clone = new_state(len | kCloneBit);
  State& c = states_[clone];
  const State& old = states_[q];
  c.count = old.count;  // endpos(clone) = endpos(q) + the pending new leaf
  c.last_end = old.last_end;
  for (int32_t e = old.edge_head; e != kNone; e = edges_[e].next) {
    reserve_one_more(&edges_);
    Edge copy{edges_[e].token, edges_[e].target, states_[clone].edge_head};
    edges_.push_back(copy);
    states_[clone].edge_head = static_cast<int32_t>(edges_.size() - 1);
  }
  if (is_heavy(q)) make_heavy(clone);
  replace_child(q, clone);
  add_child(clone, q);
  return clone;
}

void Automaton::redirect(int32_t p, int32_t token, int32_t from, int32_t to) {
  for (; p != kNone; p = states_[p].link) {
    int32_t e = find_edge(p, token);
    if (e == kNone || edges_[e].target != from) return;
    edges_[e].target = to;
  }
}

// ---------------------------------------------------------------- edges

int32_t Automaton::find_edge(int32_t s, int32_t token, int32_t* degree) const {
  if (is_heavy(s)) return heavy_.find(s, token);
  int32_t scanned = 0;
  for (int32_t e = states_[s].edge_head; e != kNone; e = edges_[e].next, ++scanned)
    if (edges_[e].token == token) return e;
  if (degree) *degree = scanned;
  return kNone;
}

// `degree` is the number of edges s had (known from the failed find_edge); unused when heavy.
void Automaton::add_edge(int32_t s, int32_t token, int32_t target, int32_t degree) {
  reserve_one_more(&edges_);
  edges_.push_back(Edge{token, target, states_[s].edge_head});
  int32_t e = static_cast<int32_t>(edges_.size() - 1);
  states_[s].edge_head = e;
  if (is_heavy(s)) {
    heavy_.insert(s, token, e);
  } else if (degree + 1 >= kHeavyDegree) {
    make_heavy(s);
  }
}

void Automaton::make_heavy(int32_t s) {
  states_[s].len_flags |= kHeavyBit;
  for (int32_t e = states_[s].edge_head; e != kNone; e = edges_[e].next)
    heavy_.insert(s, edges_[e].token, e);
}

// ---------------------------------------------------------------- suffix-link tree

void Automaton::add_child(int32_t parent, int32_t child) {
  int32_t head = states_[parent].first_child;
  states_[child].prev_sibling = kNone;
  states_[child].next_sibling = head;
  if (head != kNone) states_[head].prev_sibling = child;
  states_[parent].first_child = child;
  states_[child].link = parent;
}

// new_child takes old_child's parent and sibling slot; old_child is left detached.
void Automaton::replace_child(int32_t old_child, int32_t new_child) {
  State& o = states_[old_child];
  State& n = states_[new_child];
  n.link = o.link;
  n.prev_sibling = o.prev_sibling;
  n.next_sibling = o.next_sibling;
  if (o.prev_sibling != kNone) {
    states_[o.prev_sibling].next_sibling = new_child;
  } else {
    states_[o.link].first_child = new_child;
  }
  if (o.next_sibling != kNone) states_[o.next_sibling].prev_sibling = new_child;
  o.prev_sibling = o.next_sibling = o.link = kNone;
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
  if (recount_all_) {
    recount_all();
    return;
  }
  size_t work_budget = states_.size() / 2 + kMinPendingLeaves;
  size_t work = 0;
  for (int32_t leaf : pending_leaves_) {
    int32_t end = static_cast<int32_t>(len(leaf));
    for (int32_t u = leaf; u != kNone; u = states_[u].link, ++work) {
      states_[u].count += 1;
      states_[u].last_end = end;  // leaves are flushed in stream order: end is the newest
    }
    if (work > work_budget) {
      recount_all();
      return;
    }
  }
  pending_leaves_.clear();
}

// count = leaves in the subtree, last_end = newest leaf in it: one post-order pass over the
// suffix-link tree, without a stack (parents are the suffix links).
void Automaton::recount_all() {
  for (size_t s = 0; s < states_.size(); ++s) {
    bool leaf = is_leaf(static_cast<int32_t>(s));
    states_[s].count = leaf ? 1 : 0;
    states_[s].last_end = leaf ? static_cast<int32_t>(len(static_cast<int32_t>(s))) : 0;
  }
  int32_t u = kRoot;
  for (;;) {
    while (states_[u].first_child != kNone) u = states_[u].first_child;
    for (;;) {  // u and its subtree are done
      if (u == kRoot) {
        pending_leaves_.clear();
        recount_all_ = false;
        return;
      }
      int32_t parent = states_[u].link;
      states_[parent].count += states_[u].count;
      states_[parent].last_end = std::max(states_[parent].last_end, states_[u].last_end);
      if (states_[u].next_sibling != kNone) {
        u = states_[u].next_sibling;
        break;
      }
      u = parent;
    }
  }
}

// ---------------------------------------------------------------- queries

void Automaton::check_state(int32_t s) const {
  if (s < 0 || static_cast<size_t>(s) >= states_.size())
    throw std::out_of_range("state " + std::to_string(s) + " out of range [0, " +
                            std::to_string(states_.size()) + ")");
}

std::pair<int32_t, int32_t> Automaton::match(const int32_t* context, size_t n) const {
  int32_t s = kRoot;
  int32_t length = 0;
  for (size_t i = 0; i < n; ++i) {
    int32_t e = find_edge(s, context[i]);
    while (e == kNone && s != kRoot) {
      s = states_[s].link;
      length = static_cast<int32_t>(len(s));
      e = find_edge(s, context[i]);
    }
    if (e == kNone) {
      length = 0;
    } else {
      s = edges_[e].target;
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
  const State& s = states_[state];
  return s.count - (num_tokens_ > 0 && s.last_end == num_tokens_ ? 1 : 0);
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
    for (int32_t c = states_[item.state].first_child; c != kNone; c = states_[c].next_sibling) {
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
  for (int32_t e = states_[state].edge_head; e != kNone; e = edges_[e].next) {
    tokens->push_back(edges_[e].token);
    counts->push_back(states_[edges_[e].target].count);
  }
}

// ---------------------------------------------------------------- tree expansion

struct Automaton::Candidate {
  double score;
  int64_t seq;  // push order: ties go to the earlier push
  int32_t parent_node;
  int32_t state;
  int32_t token;
  int32_t depth;
  bool operator<(const Candidate& other) const {  // max-heap: higher score, then lower seq
    return score < other.score || (score == other.score && seq > other.seq);
  }
};

// Push the `budget` best children of `state` (count desc, token asc); a child ranked below
// the budget can never be taken, since each of its better siblings would be taken first.
void Automaton::push_children(int32_t state, int32_t node, double score, int32_t depth,
                              int32_t budget, std::vector<Candidate>* heap, int64_t* seq) {
  struct Child {
    int32_t count, token, target;
  };
  std::vector<Child> children;
  int64_t total = 0;
  for (int32_t e = states_[state].edge_head; e != kNone; e = edges_[e].next) {
    int32_t target = edges_[e].target;
    children.push_back({states_[target].count, edges_[e].token, target});
    total += states_[target].count;
  }
  size_t keep = std::min(children.size(), static_cast<size_t>(std::max(budget, 0)));
  auto better = [](const Child& a, const Child& b) {
    return a.count > b.count || (a.count == b.count && a.token < b.token);
  };
  std::partial_sort(children.begin(), children.begin() + keep, children.end(), better);
  for (size_t i = 0; i < keep; ++i) {
    double child_score =
        score * (static_cast<double>(children[i].count) / static_cast<double>(total));
    heap->push_back({child_score, (*seq)++, node, children[i].target, children[i].token, depth});
    std::push_heap(heap->begin(), heap->end());
  }
}

TreeDraft Automaton::expand_tree(int32_t state, int32_t max_nodes, int32_t max_depth) {
  check_state(state);
  flush();
  TreeDraft tree;
  std::vector<Candidate> heap;
  int64_t seq = 0;
  if (max_depth >= 1) push_children(state, kNone, 1.0, 1, max_nodes, &heap, &seq);
  while (!heap.empty() && static_cast<int32_t>(tree.token_ids.size()) < max_nodes) {
    std::pop_heap(heap.begin(), heap.end());
    Candidate best = heap.back();
    heap.pop_back();
    int32_t node = static_cast<int32_t>(tree.token_ids.size());
    tree.token_ids.push_back(best.token);
    tree.parents.push_back(best.parent_node);
    tree.scores.push_back(best.score);
    if (best.depth < max_depth)
      push_children(best.state, node, best.score, best.depth + 1, max_nodes - node - 1, &heap,
                    &seq);
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
  std::pair<int32_t, int32_t> whole = match(token_data(), num_tokens_);
  if (whole.second != num_tokens_ || whole.first != last_)
    return "the whole stream does not lead to the last state";
  return "";
}

// Every edge (s, c) -> t: the strings of s followed by c lie in t:
//   len(link(t)) + 1 <= len(link(s)) + 2  and  len(s) + 1 <= len(t).
std::string Automaton::check_edges() const {
  size_t heavy_edges = 0;
  for (int32_t s = 0; s < static_cast<int32_t>(states_.size()); ++s) {
    std::vector<int32_t> tokens;
    std::string where = "state " + std::to_string(s) + ": ";
    for (int32_t e = states_[s].edge_head; e != kNone; e = edges_[e].next) {
      const Edge& edge = edges_[e];
      if (edge.target <= kRoot || edge.target >= static_cast<int32_t>(states_.size()))
        return where + "edge target out of range";
      if (len(edge.target) < len(s) + 1) return where + "edge to a state with len < len + 1";
      int32_t min_len_s = s == kRoot ? 0 : static_cast<int32_t>(len(states_[s].link)) + 1;
      if (static_cast<int32_t>(len(states_[edge.target].link)) + 1 > min_len_s + 1)
        return where + "edge target misses the shortest extended string";
      if (is_heavy(s) && heavy_.find(s, edge.token) != e) return where + "heavy index wrong";
      tokens.push_back(edge.token);
    }
    std::sort(tokens.begin(), tokens.end());
    if (std::adjacent_find(tokens.begin(), tokens.end()) != tokens.end())
      return where + "two edges with the same token";
    if (!is_heavy(s) && static_cast<int32_t>(tokens.size()) >= kHeavyDegree)
      return where + "light state with too many edges";
    if (is_heavy(s)) heavy_edges += tokens.size();
  }
  if (heavy_edges != heavy_.size()) return "heavy index holds edges of no heavy state";
  return "";
}

std::string Automaton::check_tree() const {
  int64_t children = 0;
  for (int32_t s = 0; s < static_cast<int32_t>(states_.size()); ++s) {
    int32_t prev = kNone;
    for (int32_t c = states_[s].first_child; c != kNone; c = states_[c].next_sibling) {
      if (states_[c].link != s || states_[c].prev_sibling != prev)
        return "suffix-link tree: child " + std::to_string(c) + " of " + std::to_string(s) +
               " is linked wrongly";
      prev = c;
      if (++children >= static_cast<int64_t>(states_.size())) return "suffix-link tree: cycle";
    }
  }
  if (children != static_cast<int64_t>(states_.size()) - 1)
    return "suffix-link tree: some state is in no child list";
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

std::map<std::string, int64_t> Automaton::memory_report() const {
  return {
      {"tokens", static_cast<int64_t>(tokens_->capacity * sizeof(int32_t))},
      {"states", static_cast<int64_t>(states_.capacity() * sizeof(State))},
      {"edges", static_cast<int64_t>(edges_.capacity() * sizeof(Edge))},
      {"heavy_index", static_cast<int64_t>(heavy_.memory_bytes())},
      {"pending_leaves", static_cast<int64_t>(pending_leaves_.capacity() * sizeof(int32_t))},
  };
}

}  // namespace lookupdec
