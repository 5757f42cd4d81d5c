// Storage for the automaton's big arrays: no copy on growth, and transparent huge pages for the
// large parts (the automaton is pointer chasing over hundreds of MB: with 4 KiB pages nearly
// every access also misses the TLB).
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
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

}  // namespace lookupdec
