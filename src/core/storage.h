// A Storage owns one allocation; tensors are views (shape, strides, offset) over it.
//
// Ownership: every TensorImpl that views a storage holds a shared_ptr to it; the
// storage holds only raw, non-owning back-pointers to its views so that the ledger can
// answer "who holds this storage" (memory contract S4). Views unregister themselves on
// destruction, so the back-pointers are never dangling.
//
// Explicit release (R6): release() hands the bytes back to the allocator at once, even
// while views exist. Any later data access through any view throws an error that names
// the releaser, instead of reading freed memory.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/device.h"
#include "memory/allocator.h"
#include "memory/owner.h"

namespace tally {

class TensorImpl;

class Storage {
 public:
  Storage(int64_t nbytes, Device device, memory::OwnerTag owner);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  // Pointer to the bytes; throws if the storage was released. `user` names the tensor
  // asking, for the error message.
  void* data(const std::string& user = "") const;
  int64_t nbytes() const { return block_.bytes; }
  Device device() const { return device_; }
  uint64_t allocation_id() const { return block_.id; }

  // Returns the bytes to the allocator now (R6). `releaser` is named in later errors.
  void release(const std::string& releaser);
  bool released() const { return released_; }
  const std::string& released_by() const { return released_by_; }

  // The owner recorded in the ledger (category, name, birth step/microbatch).
  memory::OwnerTag owner() const;
  void retag(memory::Category category) const;
  void rename(const std::string& name) const;

  // Saved-for-backward accounting: while any saved tensor refers to this storage, an
  // activation is counted as saved_for_backward; when the last one goes, it is an
  // activation again.
  void add_saver();
  void remove_saver();

  // Version counter, bumped by in-place writes; saved tensors check it in backward.
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

  // Views currently referring to this storage (S4).
  std::vector<const TensorImpl*> views() const;
  void add_view(const TensorImpl* view);
  void remove_view(const TensorImpl* view);

 private:
  memory::Block block_;
  Device device_;
  bool released_ = false;
  std::string released_by_;
  std::atomic<uint64_t> version_{0};
  int savers_ = 0;
  bool retagged_by_save_ = false;
  mutable std::mutex views_mutex_;
  std::vector<const TensorImpl*> views_;
};

}  // namespace tally
