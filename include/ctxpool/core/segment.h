// ctxpool/core/segment.h — a contiguous range got from the driver, tiled by
// blocks.
//
// A Segment is the unit the allocator obtains from (and returns to) the
// driver: a cuMemAlloc'd range, or (issue 4) a mapped part of a VMM
// reservation. It belongs to one stream's pool (small or large) and is tiled
// by Blocks (block.h). A segment whose only block is free is *wholly free*:
// the allocator may give it back to the driver (Trim) or hand it to another
// stream. Segments are FreeIndexNodes so wholly free segments can be indexed
// by (size, base) for best-fit cross-stream reuse.
//
//   Segment seg;
//   seg.base = 0x7f0000000000; seg.size = 2 << 20; seg.small = true;
//   seg.first = pool.New(); seg.first->address = seg.base;
//   seg.first->size = seg.size; seg.first->segment = &seg;
//   CheckSegmentTiling(seg);  // OK
//
// Invariants: the blocks of a segment tile [base, base + size) exactly (no
// gap, no overlap), in address order, each pointing back at the segment, and
// no two neighbours are free (they are coalesced on free).
//
// Thread-compatible: callers serialise access.
#ifndef CTXPOOL_CORE_SEGMENT_H_
#define CTXPOOL_CORE_SEGMENT_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "ctxpool/core/block.h"
#include "ctxpool/core/free_index.h"

namespace ctxpool {

struct Segment : FreeIndexNode {
  std::uint64_t base = 0;
  std::size_t size = 0;
  std::uint64_t stream = 0;  // the owner stream's handle bits
  bool small = false;        // small pool (else large)
  Block* first = nullptr;    // lowest-address block
  // Opaque data of the backing that provided the memory (e.g. a VMM handle).
  std::uint64_t backing_handle = 0;
  // The allocator's per-stream state owning this segment (opaque to core).
  void* owner = nullptr;

  std::uint64_t end() const { return base + size; }
  // True when one free block spans the whole segment.
  bool wholly_free() const {
    return first != nullptr && first->next == nullptr &&
           first->state == BlockState::kFree;
  }
};

// OK when the blocks of `seg` tile it exactly and are coalesced; otherwise
// INTERNAL naming the segment and the first broken rule.
inline absl::Status CheckSegmentTiling(const Segment& seg) {
  if (seg.first == nullptr) {
    return absl::InternalError(
        absl::StrFormat("segment 0x%x has no blocks", seg.base));
  }
  if (seg.first->prev != nullptr || seg.first->address != seg.base) {
    return absl::InternalError(absl::StrFormat(
        "segment 0x%x: first block does not start the segment", seg.base));
  }
  std::uint64_t expect = seg.base;
  for (const Block* b = seg.first; b != nullptr; b = b->next) {
    if (b->segment != &seg) {
      return absl::InternalError(
          absl::StrFormat("block 0x%x does not point at its segment 0x%x",
                          b->address, seg.base));
    }
    if (b->address != expect || b->size == 0) {
      return absl::InternalError(absl::StrFormat(
          "segment 0x%x: gap or overlap at 0x%x (expected 0x%x)", seg.base,
          b->address, expect));
    }
    if (b->next != nullptr) {
      if (b->next->prev != b) {
        return absl::InternalError(absl::StrFormat(
            "segment 0x%x: broken prev link after 0x%x", seg.base, b->address));
      }
      if (b->state == BlockState::kFree &&
          b->next->state == BlockState::kFree &&
          b->unmapped == b->next->unmapped && !b->quarantined &&
          !b->next->quarantined) {
        return absl::InternalError(absl::StrFormat(
            "segment 0x%x: adjacent free blocks at 0x%x and 0x%x not "
            "coalesced",
            seg.base, b->address, b->next->address));
      }
    }
    expect = b->end();
  }
  if (expect != seg.end()) {
    return absl::InternalError(
        absl::StrFormat("segment 0x%x: blocks end at 0x%x, segment at 0x%x",
                        seg.base, expect, seg.end()));
  }
  return absl::OkStatus();
}

}  // namespace ctxpool

#endif  // CTXPOOL_CORE_SEGMENT_H_
