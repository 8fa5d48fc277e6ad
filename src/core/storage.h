// A Storage owns one allocation; tensors are views (shape, strides, offset) over it.
//
// Ownership: every TensorImpl that views a storage holds a shared_ptr to it. The storage
// keeps a list of its views so that anyone can ask "who holds this storage" (memory
// contract S4); views() hands them out as shared_ptrs locked under the list's mutex, so
// no raw view pointer outlives the lock that made it safe. The device's ledger refers to
// the storage weakly, for the same question asked from the allocation's side.
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

#include "core/allocator.h"
#include "core/device.h"
#include "core/owner.h"

namespace tally {

class TensorImpl;

class Storage : public std::enable_shared_from_this<Storage> {
  struct Private {};

 public:
  // Allocates `nbytes` on `device` through that device's allocator, tagged with `owner`.
  static std::shared_ptr<Storage> create(int64_t nbytes, Device device, const OwnerTag& owner);
  // A storage of `nbytes` that starts released: no bytes until reacquire().
  static std::shared_ptr<Storage> create_released(int64_t nbytes, Device device, const std::string& why);
  Storage(Private, Device device, Allocator* allocator) : device_(device), allocator_(allocator) {}
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  // Pointer to the bytes; throws if the storage was released or is the meta device's,
  // which has none. `user` names the tensor asking, for the error message.
  void* data(const std::string& user = "") const {
    if (released_ || device_.is_meta()) fail_no_bytes(user);
    return allocation_.ptr;
  }
  int64_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  uint64_t allocation_id() const { return allocation_.id; }

  // Returns the bytes to the allocator now (R6). `releaser` is named in later errors.
  void release(const std::string& releaser);
  bool released() const { return released_; }
  // Gives a released storage bytes again, owned by `owner`: ZeRO-3 gathers a layer's
  // parameters into the same storage before each use and releases it after, so the
  // parameter tensors (views of it) stay the same objects. The contents are undefined
  // until written. The version counter is not bumped: re-gathering restores values, it
  // does not modify them, so tensors saved for backward stay valid.
  void reacquire(const OwnerTag& owner);
  const std::string& released_by() const { return released_by_; }

  // The owner recorded in the ledger (category, name, birth step/microbatch); a
  // default tag once released.
  OwnerTag owner() const;
  void retag(Category category) const;

  // Saved-for-backward accounting: while any saved tensor refers to this storage, an
  // activation is counted as saved_for_backward; when the last one goes, it is an
  // activation again.
  void add_saver();
  void remove_saver();

  // Version counter, bumped by in-place writes; saved tensors check it in backward.
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

  // The tensors currently viewing this storage (S4), kept alive while the caller holds them.
  std::vector<std::shared_ptr<const TensorImpl>> views() const;
  size_t num_views() const;
  void add_view(const TensorImpl* view);
  void remove_view(const TensorImpl* view);

 private:
  [[noreturn]] void fail_no_bytes(const std::string& user) const;
  // An activation's bytes become saved_for_backward while a save refers to them (mutex_ held).
  void tag_saved_activation();

  Allocation allocation_;
  int64_t nbytes_ = 0;  // what the storage holds when it holds anything
  Device device_;
  Allocator* allocator_;  // non-owning: allocators live for the whole process
  bool released_ = false;
  std::string released_by_;
  std::atomic<uint64_t> version_{0};
  mutable std::mutex mutex_;  // guards views_ and savers_
  int savers_ = 0;
  bool retagged_by_save_ = false;
  std::vector<const TensorImpl*> views_;  // registered by each view's constructor, removed by its destructor
};

}  // namespace tally
