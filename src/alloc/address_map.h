// src/alloc/address_map.h — the lock-free lookups of the device allocator's
// cached paths (internal; not installed): which shard a stream handle names,
// and which segment holds a device address.
//
// The pool serves an Allocate or a Deallocate under the lock of one stream's
// shard (docs/architecture.md, "Front end, pool, backing"), so finding that
// shard must not take a lock that threads on other streams share. These
// maps are written by one writer at a time (the caller holds the
// allocator's global lock) and read by any number of threads with no lock:
// writers publish with release stores, readers load with acquire. Nothing a
// reader may hold is freed before the map: a table that grew is kept until
// the map is destroyed, and so are segments (the allocator recycles them,
// never deletes them), so a reader that raced with a change sees a stale
// but valid object and the shard's own books (under its lock) decide.
//
//   StreamTable<Shard> streams;
//   streams.Insert(stream.value(), shard);        // writer
//   Shard* s = streams.Find(stream.value());      // any thread
//
//   SegmentPageMap pages(/*page_shift=*/21);      // classic segments
//   pages.Insert(seg);  Segment* at = pages.Find(ptr);  pages.Erase(seg);
//
//   RangeTable ranges;                             // expandable ranges
//   ranges.Insert(seg); Segment* at = ranges.Find(ptr); ranges.Erase(seg);
//
// Thread-safety: Find is safe from any thread at any time; Insert and Erase
// must be serialised by the caller.
#ifndef CTXPOOL_SRC_ALLOC_ADDRESS_MAP_H_
#define CTXPOOL_SRC_ALLOC_ADDRESS_MAP_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "ctxpool/core/segment.h"

namespace ctxpool {
namespace alloc_internal {

// An open-addressed hash table from a 64-bit key (a stream handle, 0
// included) to a T*, lock-free to read. Entries are never removed; the
// table doubles when half full, the old one kept until destruction.
template <typename T>
class StreamTable {
 public:
  StreamTable() { table_.store(NewTable(16), std::memory_order_release); }
  StreamTable(const StreamTable&) = delete;
  StreamTable& operator=(const StreamTable&) = delete;

  // The value of `key`, or null.
  T* Find(std::uint64_t key) const {
    const Table* t = table_.load(std::memory_order_acquire);
    const std::uint64_t k = key + 1;  // 0 marks an empty slot
    for (std::size_t i = Hash(k) & t->mask;; i = (i + 1) & t->mask) {
      const std::uint64_t at = t->slots[i].key.load(std::memory_order_acquire);
      if (at == k) return t->slots[i].value.load(std::memory_order_relaxed);
      if (at == 0) return nullptr;
    }
  }

  // REQUIRES: writers serialised; `key` absent (key != UINT64_MAX); `value`
  // outlives the table.
  void Insert(std::uint64_t key, T* value) {
    Reserve();
    Put(table_.load(std::memory_order_relaxed), key + 1, value);
    ++count_;
  }
  // Makes sure the next Insert does not allocate. Throws std::bad_alloc
  // with the table as it was. REQUIRES: writers serialised.
  void Reserve() {
    Table* t = table_.load(std::memory_order_relaxed);
    if ((count_ + 1) * 2 <= t->mask + 1) return;
    Table* bigger = NewTable(2 * (t->mask + 1));
    for (std::size_t i = 0; i <= t->mask; ++i) {
      const std::uint64_t k = t->slots[i].key.load(std::memory_order_relaxed);
      if (k != 0) {
        Put(bigger, k, t->slots[i].value.load(std::memory_order_relaxed));
      }
    }
    table_.store(bigger, std::memory_order_release);
  }

  std::size_t size() const { return count_; }

 private:
  struct Slot {
    std::atomic<std::uint64_t> key{0};
    std::atomic<T*> value{nullptr};
  };
  struct Table {
    std::size_t mask = 0;
    std::unique_ptr<Slot[]> slots;
  };

  static std::size_t Hash(std::uint64_t k) {
    return static_cast<std::size_t>((k * 0x9E3779B97F4A7C15ull) >> 17);
  }
  Table* NewTable(std::size_t n) {
    auto t = std::make_unique<Table>();
    t->mask = n - 1;
    t->slots = std::make_unique<Slot[]>(n);
    tables_.push_back(std::move(t));
    return tables_.back().get();
  }
  static void Put(Table* t, std::uint64_t k, T* value) {
    std::size_t i = Hash(k) & t->mask;
    while (t->slots[i].key.load(std::memory_order_relaxed) != 0) {
      i = (i + 1) & t->mask;
    }
    t->slots[i].value.store(value, std::memory_order_relaxed);
    t->slots[i].key.store(k, std::memory_order_release);
  }

  std::atomic<Table*> table_{nullptr};
  std::vector<std::unique_ptr<Table>> tables_;  // every table, until the end
  std::size_t count_ = 0;
};

// Classic segments by address: a four-level radix tree over pages of
// 2^page_shift bytes, created on demand and never freed. A page is at least
// as small as the smallest segment, so at most one segment starts strictly
// inside it: its entry names the segment that covers the page's first byte
// and the one that starts inside it (with its base).
class SegmentPageMap {
 public:
  explicit SegmentPageMap(int page_shift)
      : shift_(page_shift),
        bits_((64 - page_shift + kLevels - 1) / kLevels),
        root_(std::make_unique<Node>(std::size_t{1} << bits_)) {}
  SegmentPageMap(const SegmentPageMap&) = delete;
  SegmentPageMap& operator=(const SegmentPageMap&) = delete;

  int page_shift() const { return shift_; }

  // The segment whose range may hold `address`, or null. A candidate only:
  // the caller checks it (under the owning shard's lock) unless the address
  // is known to be inside a live block, whose segment cannot change.
  Segment* Find(std::uint64_t address) const {
    const Entry* e = Leaf(address >> shift_, /*create=*/false);
    if (e == nullptr) return nullptr;
    Segment* inside = e->start.load(std::memory_order_acquire);
    if (inside != nullptr &&
        address >= e->start_base.load(std::memory_order_relaxed)) {
      return inside;
    }
    return e->cover.load(std::memory_order_acquire);
  }

  // REQUIRES: writers serialised; seg->size >= the page size.
  // Makes the nodes Insert(seg) needs, so that it does not allocate. Throws
  // std::bad_alloc leaving only empty nodes behind.
  void Prepare(const Segment* seg) {
    ForPages(seg, [](Entry*, bool) {});
  }
  void Insert(Segment* seg) {
    ForPages(seg, [&](Entry* e, bool starts_inside) {
      if (starts_inside) {
        e->start_base.store(seg->base, std::memory_order_relaxed);
        e->start.store(seg, std::memory_order_release);
      } else {
        e->cover.store(seg, std::memory_order_release);
      }
    });
  }

  // REQUIRES: writers serialised; `seg` was inserted.
  void Erase(const Segment* seg) {
    ForPages(seg, [&](Entry* e, bool starts_inside) {
      std::atomic<Segment*>& slot = starts_inside ? e->start : e->cover;
      if (slot.load(std::memory_order_relaxed) == seg) {
        slot.store(nullptr, std::memory_order_release);
      }
    });
  }

 private:
  static constexpr int kLevels = 4;
  struct Entry {
    std::atomic<Segment*> cover{nullptr};  // covers the page's first byte
    std::atomic<Segment*> start{nullptr};  // starts inside the page
    std::atomic<std::uint64_t> start_base{0};
  };
  struct Node {
    explicit Node(std::size_t n) : children(new std::atomic<void*>[n]) {
      for (std::size_t i = 0; i < n; ++i) children[i].store(nullptr);
    }
    ~Node() { delete[] children; }
    std::atomic<void*>* children;
  };

  // Calls fn(entry, starts_inside) for each page of `seg`.
  template <typename Fn>
  void ForPages(const Segment* seg, Fn fn) {
    const std::uint64_t first = seg->base >> shift_;
    const std::uint64_t last = (seg->base + seg->size - 1) >> shift_;
    for (std::uint64_t p = first;; ++p) {
      Entry* e = const_cast<Entry*>(Leaf(p, /*create=*/true));
      fn(e, p == first && (seg->base & ((std::uint64_t{1} << shift_) - 1)));
      if (p == last) break;
    }
  }

  // The entry of page `page`; with `create`, the nodes on the way are made.
  const Entry* Leaf(std::uint64_t page, bool create) const {
    const std::size_t width = std::size_t{1} << bits_;
    const Node* node = root_.get();
    for (int level = kLevels - 1; level > 0; --level) {
      const std::size_t i = (page >> (level * bits_)) & (width - 1);
      void* child = node->children[i].load(std::memory_order_acquire);
      if (child == nullptr) {
        if (!create) return nullptr;
        if (level == 1) {
          leaves_.push_back(std::make_unique<Entry[]>(width));
          child = leaves_.back().get();
        } else {
          nodes_.push_back(std::make_unique<Node>(width));
          child = nodes_.back().get();
        }
        node->children[i].store(child, std::memory_order_release);
      }
      if (level == 1) {
        return static_cast<const Entry*>(child) + (page & (width - 1));
      }
      node = static_cast<const Node*>(child);
    }
    return nullptr;  // not reached
  }

  const int shift_;
  const int bits_;  // per level
  std::unique_ptr<Node> root_;
  // Made under the writer's serialisation; freed with the map.
  mutable std::vector<std::unique_ptr<Node>> nodes_;
  mutable std::vector<std::unique_ptr<Entry[]>> leaves_;
};

// Expandable ranges by address: a sorted array changed in place under a
// sequence count (a seqlock). A reader retries when a change overlapped its
// search; it never waits on a lock, and it reads every field with acquire
// loads, so the count's second read cannot move before them. The array
// grows by doubling (the one it replaced kept until destruction, as a
// reader may still be in it), so the host memory follows the most ranges
// held at once: ranges come and go (a stream's extra ranges, given back by
// Trim) without a new table per change.
class RangeTable {
 private:
  struct Table;

 public:
  RangeTable() { table_.store(&empty_, std::memory_order_release); }
  RangeTable(const RangeTable&) = delete;
  RangeTable& operator=(const RangeTable&) = delete;

  // The range holding `address`, or null.
  Segment* Find(std::uint64_t address) const {
    const Table* t = table_.load(std::memory_order_acquire);
    for (;;) {
      const std::uint64_t seq = t->seq.load(std::memory_order_acquire);
      if ((seq & 1) != 0) {
        // A writer is mid-change: brief, unless it was preempted.
        std::this_thread::yield();
        continue;
      }
      std::size_t lo = 0;
      std::size_t hi = t->size.load(std::memory_order_acquire);
      while (lo < hi) {  // the first entry with base > address
        const std::size_t mid = lo + (hi - lo) / 2;
        if (address < t->slots[mid].base.load(std::memory_order_acquire)) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      Segment* found = nullptr;
      if (lo != 0) {
        const Slot& e = t->slots[lo - 1];
        if (address < e.end.load(std::memory_order_acquire)) {
          found = e.segment.load(std::memory_order_acquire);
        }
      }
      if (t->seq.load(std::memory_order_relaxed) == seq) return found;
    }
  }

  // REQUIRES: writers serialised; ranges do not overlap. Throws
  // std::bad_alloc with the table as it was.
  void Insert(Segment* seg) {
    Table* t = Writable();
    std::size_t n = t->size.load(std::memory_order_relaxed);
    if (n == t->capacity) {
      // Host memory first: the bigger table and the room to keep this one.
      auto bigger =
          std::make_unique<Table>(t->capacity == 0 ? 8 : 2 * t->capacity);
      kept_.reserve(kept_.size() + 1);
      for (std::size_t i = 0; i < n; ++i)
        bigger->slots[i].CopyFrom(t->slots[i]);
      bigger->size.store(n, std::memory_order_relaxed);
      kept_.push_back(std::move(bigger));
      t = kept_.back().get();
      table_.store(t, std::memory_order_release);
    }
    std::size_t at = 0;
    while (at < n &&
           t->slots[at].base.load(std::memory_order_relaxed) < seg->base) {
      ++at;
    }
    Begin(t);
    for (std::size_t i = n; i > at; --i) t->slots[i].CopyFrom(t->slots[i - 1]);
    t->slots[at].Set(seg->base, seg->base + seg->size, seg);
    t->size.store(n + 1, std::memory_order_release);
    End(t);
  }
  void Erase(const Segment* seg) { CommitErase(PrepareErase(seg)); }
  // Erase in two steps, for a caller that must not meet std::bad_alloc
  // after it gave the range back: PrepareErase throws with nothing changed
  // (it allocates nothing now: the change is in place), CommitErase makes
  // the change and cannot throw. REQUIRES: no other write between the two.
  struct Prepared {
    const Segment* segment;
  };
  Prepared PrepareErase(const Segment* seg) { return Prepared{seg}; }
  void CommitErase(Prepared p) noexcept {
    Table* t = Writable();
    const std::size_t n = t->size.load(std::memory_order_relaxed);
    std::size_t at = 0;
    while (at < n &&
           t->slots[at].segment.load(std::memory_order_relaxed) != p.segment) {
      ++at;
    }
    if (at == n) return;
    Begin(t);
    for (std::size_t i = at; i + 1 < n; ++i) {
      t->slots[i].CopyFrom(t->slots[i + 1]);
    }
    t->size.store(n - 1, std::memory_order_release);
    End(t);
  }

  // Host bytes of the tables kept (the current one and those it replaced).
  std::size_t TableBytes() const {
    std::size_t bytes = 0;
    for (const auto& t : kept_) bytes += t->capacity * sizeof(Slot);
    return bytes;
  }

 private:
  struct Slot {
    std::atomic<std::uint64_t> base{0};
    std::atomic<std::uint64_t> end{0};
    std::atomic<Segment*> segment{nullptr};
    // Release stores: a reader that sees one also sees the odd count
    // stored before it (and retries).
    void Set(std::uint64_t b, std::uint64_t e, Segment* s) {
      base.store(b, std::memory_order_release);
      end.store(e, std::memory_order_release);
      segment.store(s, std::memory_order_release);
    }
    void CopyFrom(const Slot& o) {
      Set(o.base.load(std::memory_order_relaxed),
          o.end.load(std::memory_order_relaxed),
          o.segment.load(std::memory_order_relaxed));
    }
  };
  struct Table {
    Table() = default;
    explicit Table(std::size_t n)
        : capacity(n), slots(std::make_unique<Slot[]>(n)) {}
    const std::size_t capacity = 0;
    std::unique_ptr<Slot[]> slots;
    std::atomic<std::size_t> size{0};
    std::atomic<std::uint64_t> seq{0};  // odd while a change is made
  };
  Table* Writable() { return kept_.empty() ? &empty_ : kept_.back().get(); }
  static void Begin(Table* t) {
    t->seq.store(t->seq.load(std::memory_order_relaxed) + 1,
                 std::memory_order_relaxed);
  }
  static void End(Table* t) {
    t->seq.store(t->seq.load(std::memory_order_relaxed) + 1,
                 std::memory_order_release);
  }

  Table empty_;
  std::atomic<const Table*> table_{nullptr};
  std::vector<std::unique_ptr<Table>> kept_;  // every table grown, in order
};

}  // namespace alloc_internal
}  // namespace ctxpool

#endif  // CTXPOOL_SRC_ALLOC_ADDRESS_MAP_H_
