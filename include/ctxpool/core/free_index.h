// ctxpool/core/free_index.h — best-fit index of free blocks by (size, address).
//
// A FreeIndex is an ordered set of free blocks keyed by (size, address):
// LowerBound(n) is the smallest block of at least n bytes, lowest address
// first among equals — best fit in O(log n), as TensorFlow's BFC bins and
// unlike the linear free lists of RMM. It is *intrusive*: the links live in
// the node (a FreeIndexNode base of the indexed type), so Insert and Erase
// never allocate. That keeps the allocators' cached hot paths free of heap
// allocation, which a node-allocating absl::btree_set cannot promise.
//
// The structure is a treap: a binary search tree on the key that is also a
// max-heap on a priority derived from the node's address (a fixed hash, so
// the shape is deterministic). Expected depth is O(log n) for any key order.
//
//   struct MyBlock : FreeIndexNode { ... };
//   FreeIndex<MyBlock> index;
//   index.Insert(&b, /*size=*/4096, /*address=*/0x1000);
//   MyBlock* fit = index.LowerBound(/*size=*/1000);  // &b
//   index.Erase(fit);
//
// Invariants (checked by Validate()): in-order keys strictly increase; every
// node's priority >= its children's; child->parent == node; the node count
// equals size(); every node's index_owner() is this index.
//
// Thread-compatible: callers serialise access.
#ifndef CTXPOOL_CORE_FREE_INDEX_H_
#define CTXPOOL_CORE_FREE_INDEX_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace ctxpool {

class FreeIndexBase;

// The links a FreeIndex keeps inside each node. A node is in at most one
// index at a time; its key is copied in at Insert and must not change while
// it is linked.
class FreeIndexNode {
 public:
  FreeIndexNode() = default;
  FreeIndexNode(const FreeIndexNode&) = delete;
  FreeIndexNode& operator=(const FreeIndexNode&) = delete;

  // The index holding this node, or null.
  const FreeIndexBase* index_owner() const { return owner_; }
  bool linked() const { return owner_ != nullptr; }
  std::size_t key_size() const { return key_size_; }
  std::uint64_t key_address() const { return key_address_; }

 private:
  friend class FreeIndexBase;
  FreeIndexNode* left_ = nullptr;
  FreeIndexNode* right_ = nullptr;
  FreeIndexNode* parent_ = nullptr;
  const FreeIndexBase* owner_ = nullptr;
  std::uint64_t priority_ = 0;
  std::size_t key_size_ = 0;
  std::uint64_t key_address_ = 0;
};

// The untyped treap. Use FreeIndex<T>.
class FreeIndexBase {
 public:
  FreeIndexBase() = default;
  FreeIndexBase(const FreeIndexBase&) = delete;
  FreeIndexBase& operator=(const FreeIndexBase&) = delete;

  bool empty() const { return root_ == nullptr; }
  std::size_t size() const { return size_; }

  // Empty string when the invariants hold, else a description of the first
  // broken one. O(n).
  std::string Validate() const {
    std::size_t count = 0;
    const FreeIndexNode* prev = nullptr;
    if (root_ != nullptr && root_->parent_ != nullptr) return "root has parent";
    for (const FreeIndexNode* n = FirstNode(); n != nullptr; n = NextNode(n)) {
      ++count;
      if (count > size_) return "more nodes than size()";
      if (n->owner_ != this) return "node owned by another index";
      if (prev != nullptr && !Less(prev, n->key_size_, n->key_address_)) {
        return "keys out of order or duplicated";
      }
      for (const FreeIndexNode* c : {n->left_, n->right_}) {
        if (c == nullptr) continue;
        if (c->parent_ != n) return "child->parent mismatch";
        if (c->priority_ > n->priority_) return "heap order broken";
      }
      prev = n;
    }
    if (count != size_) return "size() mismatch";
    return "";
  }

 protected:
  // REQUIRES: !n->linked().
  void InsertNode(FreeIndexNode* n, std::size_t size, std::uint64_t address) {
    n->key_size_ = size;
    n->key_address_ = address;
    n->priority_ = Mix(address);
    n->left_ = n->right_ = nullptr;
    n->owner_ = this;
    FreeIndexNode* parent = nullptr;
    FreeIndexNode** link = &root_;
    while (*link != nullptr) {
      parent = *link;
      link = Less(n, parent) ? &parent->left_ : &parent->right_;
    }
    *link = n;
    n->parent_ = parent;
    while (n->parent_ != nullptr && n->priority_ > n->parent_->priority_) {
      RotateUp(n);
    }
    ++size_;
  }

  // REQUIRES: n->index_owner() == this.
  void EraseNode(FreeIndexNode* n) {
    while (n->left_ != nullptr && n->right_ != nullptr) {
      RotateUp(n->left_->priority_ > n->right_->priority_ ? n->left_
                                                          : n->right_);
    }
    FreeIndexNode* child = n->left_ != nullptr ? n->left_ : n->right_;
    if (child != nullptr) child->parent_ = n->parent_;
    ReplaceChild(n->parent_, n, child);
    n->left_ = n->right_ = n->parent_ = nullptr;
    n->owner_ = nullptr;
    --size_;
  }

  // The first node with key >= (size, address), or null.
  FreeIndexNode* LowerBoundNode(std::size_t size, std::uint64_t address) const {
    FreeIndexNode* best = nullptr;
    FreeIndexNode* cur = root_;
    while (cur != nullptr) {
      if (KeyLess(cur->key_size_, cur->key_address_, size, address)) {
        cur = cur->right_;
      } else {
        best = cur;
        cur = cur->left_;
      }
    }
    return best;
  }

  FreeIndexNode* FirstNode() const {
    FreeIndexNode* n = root_;
    if (n == nullptr) return nullptr;
    while (n->left_ != nullptr) n = n->left_;
    return n;
  }
  FreeIndexNode* LastNode() const {
    FreeIndexNode* n = root_;
    if (n == nullptr) return nullptr;
    while (n->right_ != nullptr) n = n->right_;
    return n;
  }
  static FreeIndexNode* NextNode(const FreeIndexNode* n) {
    if (n->right_ != nullptr) {
      FreeIndexNode* m = n->right_;
      while (m->left_ != nullptr) m = m->left_;
      return m;
    }
    while (n->parent_ != nullptr && n->parent_->right_ == n) n = n->parent_;
    return n->parent_;
  }
  static FreeIndexNode* PrevNode(const FreeIndexNode* n) {
    if (n->left_ != nullptr) {
      FreeIndexNode* m = n->left_;
      while (m->right_ != nullptr) m = m->right_;
      return m;
    }
    while (n->parent_ != nullptr && n->parent_->left_ == n) n = n->parent_;
    return n->parent_;
  }

 private:
  static bool KeyLess(std::size_t as, std::uint64_t aa, std::size_t bs,
                      std::uint64_t ba) {
    return as < bs || (as == bs && aa < ba);
  }
  static bool Less(const FreeIndexNode* a, const FreeIndexNode* b) {
    return KeyLess(a->key_size_, a->key_address_, b->key_size_,
                   b->key_address_);
  }
  static bool Less(const FreeIndexNode* a, std::size_t size,
                   std::uint64_t address) {
    return KeyLess(a->key_size_, a->key_address_, size, address);
  }
  // splitmix64: a fixed, well-mixed priority per address.
  static std::uint64_t Mix(std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  }
  void ReplaceChild(FreeIndexNode* parent, FreeIndexNode* old_child,
                    FreeIndexNode* new_child) {
    if (parent == nullptr) {
      root_ = new_child;
    } else if (parent->left_ == old_child) {
      parent->left_ = new_child;
    } else {
      parent->right_ = new_child;
    }
  }
  // Rotates `n` above its parent. REQUIRES: n->parent_ != nullptr.
  void RotateUp(FreeIndexNode* n) {
    FreeIndexNode* p = n->parent_;
    FreeIndexNode* g = p->parent_;
    if (p->left_ == n) {
      p->left_ = n->right_;
      if (n->right_ != nullptr) n->right_->parent_ = p;
      n->right_ = p;
    } else {
      p->right_ = n->left_;
      if (n->left_ != nullptr) n->left_->parent_ = p;
      n->left_ = p;
    }
    p->parent_ = n;
    n->parent_ = g;
    ReplaceChild(g, p, n);
  }

  FreeIndexNode* root_ = nullptr;
  std::size_t size_ = 0;
};

// A FreeIndex over nodes of type T (T derives from FreeIndexNode).
template <typename T>
class FreeIndex : public FreeIndexBase {
 public:
  // Links `node` with key (size, address). O(log n), no allocation.
  // REQUIRES: !node->linked(); no linked node has the same key.
  void Insert(T* node, std::size_t size, std::uint64_t address) {
    InsertNode(node, size, address);
  }
  // Unlinks `node`. O(log n). REQUIRES: node->index_owner() == this.
  void Erase(T* node) { EraseNode(node); }
  bool Contains(const T* node) const { return node->index_owner() == this; }

  // The smallest node with key >= (size, address), or null: best fit.
  T* LowerBound(std::size_t size, std::uint64_t address = 0) const {
    return static_cast<T*>(LowerBoundNode(size, address));
  }
  T* First() const { return static_cast<T*>(FirstNode()); }
  // The largest node, or null.
  T* Last() const { return static_cast<T*>(LastNode()); }
  // The in-order successor of `node`, or null. REQUIRES: Contains(node).
  static T* Next(const T* node) { return static_cast<T*>(NextNode(node)); }
  // The in-order predecessor of `node`, or null. REQUIRES: Contains(node).
  static T* Prev(const T* node) { return static_cast<T*>(PrevNode(node)); }
};

}  // namespace ctxpool

#endif  // CTXPOOL_CORE_FREE_INDEX_H_
