// Storage for the automaton's big arrays: no copy on growth, and transparent huge pages for the
// large parts (the automaton is pointer chasing over hundreds of MB: with 4 KiB pages nearly
// every access also misses the TLB).
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <utility>
#include <vector>

namespace lookupdec {

constexpr size_t kHugePage = size_t{1} << 21;
constexpr size_t kSmallPage = size_t{1} << 12;

inline size_t round_up(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }

// `huge`: 2 MiB aligned and advised for huge pages (a hint; the kernel may decline).
inline void* allocate_array(size_t bytes, bool huge) {
  void* p = huge ? std::aligned_alloc(kHugePage, round_up(bytes, kHugePage)) : std::malloc(bytes);
  if (p == nullptr) throw std::bad_alloc();
  if (huge) madvise(p, round_up(bytes, kHugePage), MADV_HUGEPAGE);
  return p;
}

// Append-only array in blocks of 2^19 elements (a whole number of 2 MiB pages for element sizes
// that are multiples of 4). Growing never copies and never moves elements, so references stay
// valid. Block 0 uses ordinary pages, so a small automaton (one request) costs only the pages
// it touches; later blocks use huge pages.
template <class T>
class BlockVector {
 public:
  static constexpr int kLogBlock = 19;
  static constexpr size_t kBlock = size_t{1} << kLogBlock;

  BlockVector() = default;
  BlockVector(const BlockVector&) = delete;
  BlockVector& operator=(const BlockVector&) = delete;
  ~BlockVector() {
    for (T* block : blocks_) std::free(block);
  }

  T& operator[](size_t i) { return blocks_[i >> kLogBlock][i & (kBlock - 1)]; }
  const T& operator[](size_t i) const { return blocks_[i >> kLogBlock][i & (kBlock - 1)]; }
  size_t size() const { return size_; }

  size_t push_back(const T& value) {
    if (size_ == blocks_.size() * kBlock) {
      bool huge = !blocks_.empty();
      blocks_.push_back(static_cast<T*>(allocate_array(kBlock * sizeof(T), huge)));
    }
    (*this)[size_] = value;
    return size_++;
  }

  // Resident bytes: the touched pages (4 KiB in block 0, 2 MiB after it).
  size_t memory_bytes() const {
    size_t used = size_ * sizeof(T);
    size_t block0 = kBlock * sizeof(T);
    if (used <= block0) return round_up(used, kSmallPage);
    return block0 + round_up(used - block0, kHugePage);
  }

 private:
  std::vector<T*> blocks_;
  size_t size_ = 0;
};

// uint64 key -> V: open addressing, linear probing, load at most 1/2, doubling. A lookup reads
// one slot, its key and value side by side, where std::unordered_map reads a bucket and then a
// node elsewhere: after a verify forward every one of those reads is a cache miss, and the
// n-gram index and the recycling table look keys up dozens of times a step.
template <class V>
class FlatMap {
 public:
  const V* find(uint64_t key) const {
    if (key == kEmpty) return has_empty_key_ ? &empty_key_value_ : nullptr;
    if (entries_.empty()) return nullptr;
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      const Entry& e = entries_[i];
      if (e.key == key) return &e.value;
      if (e.key == kEmpty) return nullptr;
    }
  }
  V* find(uint64_t key) { return const_cast<V*>(static_cast<const FlatMap*>(this)->find(key)); }

  // The value of `key`, inserted as `value` where absent (*added tells which). Pointers
  // returned earlier are invalid after an insert.
  V* insert(uint64_t key, const V& value, bool* added) {
    if (key == kEmpty) {
      *added = !has_empty_key_;
      if (*added) empty_key_value_ = value;
      has_empty_key_ = true;
      return &empty_key_value_;
    }
    if (2 * (size_ + 1) > entries_.size()) grow();
    size_t i = home(key);
    while (entries_[i].key != kEmpty && entries_[i].key != key) i = (i + 1) & mask_;
    *added = entries_[i].key == kEmpty;
    if (*added) {
      entries_[i].key = key;
      entries_[i].value = value;
      ++size_;
    }
    return &entries_[i].value;
  }

  size_t size() const { return size_ + (has_empty_key_ ? 1 : 0); }
  void clear() {  // (the capacity stays)
    for (Entry& e : entries_) e.key = kEmpty;
    size_ = 0;
    has_empty_key_ = false;
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  struct Entry {
    uint64_t key = kEmpty;
    V value{};
  };
  size_t home(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  void grow() {
    std::vector<Entry> old = std::move(entries_);
    size_t capacity = old.empty() ? 16 : 2 * old.size();
    entries_.assign(capacity, Entry{});
    mask_ = capacity - 1;
    shift_ = 64;
    for (size_t c = capacity; c > 1; c >>= 1) --shift_;
    for (const Entry& e : old) {
      if (e.key == kEmpty) continue;
      size_t i = home(e.key);
      while (entries_[i].key != kEmpty) i = (i + 1) & mask_;
      entries_[i] = e;
    }
  }

  std::vector<Entry> entries_;
  size_t mask_ = 0;
  int shift_ = 64;
  size_t size_ = 0;  // entries_ in use (the empty key's value apart)
  bool has_empty_key_ = false;
  V empty_key_value_{};
};

}  // namespace lookupdec
