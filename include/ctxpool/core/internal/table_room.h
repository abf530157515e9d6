// ctxpool/core/internal/table_room.h — growing an Abseil hash table without
// risking it when host memory runs out. Not API.
//
// Abseil's raw_hash_set (flat_hash_map/set, 20220623 and later) is not
// exception-safe: resize() stores the new capacity before it allocates the
// new arrays, so when that allocation throws std::bad_alloc the table keeps
// the old arrays under the new capacity, and its next use or its destructor
// corrupts the heap (glibc aborts: "free(): invalid pointer"). So a table
// the allocator must keep through a bad_alloc never grows by itself:
// MakeRoom grows it first, on a fresh table that is abandoned undestroyed
// when its allocation throws (it then owns no memory), and after that the
// inserts it made room for do not allocate.
//
//   if (!TableHasRoom(live, 1)) MakeRoom(live, 1);  // may throw; live intact
//   live.emplace(key, value);                       // cannot allocate
//
// Why "room" is size + n <= capacity * 25 / 32: an insert allocates only when
// the table has no growth left, and then, for a capacity over one group (16),
// rehashes in place without allocating while size * 32 <= capacity * 25
// (raw_hash_set::rehash_and_grow_if_necessary). MakeRoom keeps the capacity
// at 31 or more.
#ifndef CTXPOOL_CORE_INTERNAL_TABLE_ROOM_H_
#define CTXPOOL_CORE_INTERNAL_TABLE_ROOM_H_

#include <algorithm>
#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

namespace ctxpool {
namespace core_internal {

// True when `n` more elements insert into `t` without allocating.
template <typename Table>
bool TableHasRoom(const Table& t, std::size_t n) {
  const std::size_t cap = t.capacity();
  return cap > 16 && t.size() + n <= cap * 25 / 32;
}

// Grows `t` so that TableHasRoom(t, n). Throws std::bad_alloc, with `t` as
// it was and nothing leaked, when the host cannot supply the new table or
// a copy of an element (elements whose move may throw are copied).
template <typename Table>
void MakeRoom(Table& t, std::size_t n) {
  if (TableHasRoom(t, n)) return;
  // Room for n more, at least doubling (as a growth would), more than one
  // group; reserve(x) gives capacity * 7 / 8 >= x, so x = want * 28 / 25
  // gives capacity * 25 / 32 >= want.
  const std::size_t want =
      std::max({t.size() + n, 2 * t.size(), std::size_t{15}}) * 28 / 25 + 1;
  alignas(Table) unsigned char storage[sizeof(Table)];
  Table* fresh = ::new (static_cast<void*>(storage)) Table();
  try {
    fresh->reserve(want);
  } catch (...) {
    // Not destroyed: the failed resize left it claiming a capacity whose
    // arrays it never got; it owns nothing.
    throw;
  }
  // Elements whose move cannot throw move over. Others (a const std::string
  // key is copied even when "moved") are copied, so that when a copy
  // throws, `t` still holds every element and the fresh table, whole since
  // its reserve, is destroyed with the copies it made.
  using Value = typename Table::value_type;
  try {
    for (auto& v : t) {
      if constexpr (std::is_nothrow_move_constructible_v<Value>) {
        fresh->insert(std::move(v));
      } else {
        fresh->insert(static_cast<const Value&>(v));
      }
    }
  } catch (...) {
    fresh->~Table();
    throw;
  }
  t.swap(*fresh);
  fresh->~Table();
}

// Room for `n` more elements in a std::vector, growing it at least twofold,
// so that that many push_backs cannot allocate. Throws std::bad_alloc with
// `v` as it was (a vector's reserve is exception-safe).
template <typename Vector>
void MakeVectorRoom(Vector& v, std::size_t n) {
  if (v.capacity() - v.size() >= n) return;
  v.reserve(std::max(2 * v.capacity(), v.size() + n));
}

}  // namespace core_internal
}  // namespace ctxpool

#endif  // CTXPOOL_CORE_INTERNAL_TABLE_ROOM_H_
