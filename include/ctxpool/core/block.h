// ctxpool/core/block.h — a block of device (or host) memory inside a segment.
//
// A segment is one contiguous range the allocator got from the driver; it is
// tiled by blocks, each allocated, pending free (freed by the caller but still
// in use by some stream's queued work) or free. Blocks are intrusive: the
// address-order neighbours (prev/next) and the free-index links live in the
// Block, and Blocks come from a BlockPool that recycles them, so splitting and
// coalescing never touch the heap once the pool is warm.
//
//   BlockPool pool;
//   Block* b = pool.New();
//   b->address = base; b->size = 2 << 20;   // one free block: a whole segment
//   Block* rest = SplitBlock(b, 4096, pool); // b: 4 KiB, rest: the remainder
//   MergeNext(b, pool);                      // b covers the segment again
//
// Invariants of a segment's block list (CheckSegmentTiling in segment.h):
//   first->address == segment.base, b->next->address == b->address + b->size,
//   last->address + last->size == segment.base + segment.size,
//   b->next->prev == b, and no two neighbours are both kFree with the same
//   `unmapped` flag (coalesced).
//
// Thread-compatible: callers serialise access.
#ifndef CTXPOOL_CORE_BLOCK_H_
#define CTXPOOL_CORE_BLOCK_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/optimization.h"
#include "absl/container/inlined_vector.h"
#include "ctxpool/core/free_index.h"

namespace ctxpool {

// The state of a block (reported by snapshots as well).
enum class BlockState { kAllocated, kPendingFree, kFree };

struct Segment;

struct Block : FreeIndexNode {
  std::uint64_t address = 0;
  std::size_t size = 0;       // rounded; the block spans [address, end())
  std::size_t requested = 0;  // bytes asked for; 0 unless allocated
  Block* prev = nullptr;      // address-order neighbours in the segment
  Block* next = nullptr;
  Segment* segment = nullptr;
  BlockState state = BlockState::kFree;
  // Expandable (VMM) segments only: a free block over unmapped granules
  // (virtual space, no memory behind it). Such a block starts and ends on
  // granule boundaries and is never coalesced with a mapped free neighbour.
  bool unmapped = false;
  // Expandable only: a free block over granules that stay mapped without
  // access (a cuMemSetAccess that failed and whose rollback failed too).
  // Never indexed, coalesced or handed out; Reset unmaps it.
  bool quarantined = false;
  // Events still to complete before a kPendingFree block becomes kFree.
  int pending_events = 0;
  // Allocated blocks: who asked for it (an allocator's owner id, 0: none,
  // and the allocator's record of that owner, opaque here), its label, and
  // when (ns on absl's clock, coarse: see the allocator).
  std::uint32_t owner = 0;
  void* owner_data = nullptr;
  const char* label = nullptr;
  std::int64_t born_ns = 0;
  // Streams other than the owner that used the block (RecordStream).
  absl::InlinedVector<std::uint64_t, 2> stream_uses;

  std::uint64_t end() const { return address + size; }
  // True when the block does not span its whole segment.
  bool is_split() const { return prev != nullptr || next != nullptr; }
};

// A recycling arena of Blocks: New() pops a free-list, refilling it a chunk at
// a time; Delete() pushes back. Blocks are never returned to the heap before
// the pool is destroyed, so their addresses stay valid. The i-th chunk holds
// kChunkBlocks << min(i, kMaxDoublings) blocks: 256, 512, then 1024 each, so
// the first touch of the chunks' pages (a fault per 4 KiB) falls on three
// calls up to 1792 blocks and on one call in 1024 after that, not on one in
// 256; the cap bounds the cost of one refill and the spare blocks (fewer
// than one chunk). See docs/architecture.md (Pool) for the measurements.
class BlockPool {
 public:
  static constexpr std::size_t kChunkBlocks = 256;
  static constexpr std::size_t kMaxDoublings = 2;  // chunks of 1024 at most

  // The size of the i-th chunk (from 0).
  static constexpr std::size_t ChunkBlocks(std::size_t i) {
    return kChunkBlocks << (i < kMaxDoublings ? i : kMaxDoublings);
  }

  BlockPool() = default;
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A default-initialised Block. Allocates only when the free-list is empty.
  Block* New() {
    if (free_ == nullptr) Refill();
    Block* b = free_;
    free_ = b->next;
    b->next = nullptr;
    ++live_;
    return b;
  }
  // REQUIRES: b came from New() of this pool, is not linked in an index.
  void Delete(Block* b) {
    b->address = 0;
    b->size = 0;
    b->requested = 0;
    b->prev = nullptr;
    b->segment = nullptr;
    b->state = BlockState::kFree;
    b->unmapped = false;
    b->quarantined = false;
    b->pending_events = 0;
    b->owner = 0;
    b->owner_data = nullptr;
    b->label = nullptr;
    b->born_ns = 0;
    b->stream_uses.clear();
    b->next = free_;
    free_ = b;
    --live_;
  }
  // Makes sure the next `n` New() calls do not allocate: refills now if
  // fewer blocks are free. Throws std::bad_alloc with the pool as it was.
  void Reserve(std::size_t n = 1) {
    if (ABSL_PREDICT_TRUE(free_ != nullptr) && n == 1) return;
    while (capacity_ - live_ < n) Refill();
  }
  // Blocks handed out and not deleted.
  std::size_t live() const { return live_; }
  // Blocks owned (live + recycled).
  std::size_t capacity() const { return capacity_; }

 private:
  void Refill() {
    const std::size_t n = ChunkBlocks(chunks_.size());
    chunks_.push_back(std::make_unique<Block[]>(n));
    capacity_ += n;
    Block* chunk = chunks_.back().get();
    for (std::size_t i = n; i-- > 0;) {
      chunk[i].next = free_;
      free_ = &chunk[i];
    }
  }

  std::vector<std::unique_ptr<Block[]>> chunks_;
  Block* free_ = nullptr;
  std::size_t live_ = 0;
  std::size_t capacity_ = 0;
};

// Splits `b` into [address, address + size) (kept in `b`) and the remainder,
// a new block returned with b's state and segment, linked after `b`.
// REQUIRES: 0 < size < b->size; !b->linked().
inline Block* SplitBlock(Block* b, std::size_t size, BlockPool& pool) {
  Block* rest = pool.New();
  rest->address = b->address + size;
  rest->size = b->size - size;
  rest->segment = b->segment;
  rest->state = b->state;
  rest->unmapped = b->unmapped;
  rest->quarantined = b->quarantined;
  rest->prev = b;
  rest->next = b->next;
  if (b->next != nullptr) b->next->prev = rest;
  b->next = rest;
  b->size = size;
  return rest;
}

// Merges b->next into `b` (b grows; the neighbour returns to `pool`).
// REQUIRES: b->next != nullptr; neither is linked in an index; both have the
// same `unmapped` flag.
inline void MergeNext(Block* b, BlockPool& pool) {
  Block* n = b->next;
  b->size += n->size;
  b->next = n->next;
  if (n->next != nullptr) n->next->prev = b;
  pool.Delete(n);
}

}  // namespace ctxpool

#endif  // CTXPOOL_CORE_BLOCK_H_
