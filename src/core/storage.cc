#include "core/storage.h"

#include <algorithm>

#include "core/device_hooks.h"
#include "core/error.h"
#include "core/tensor.h"

namespace tally {

std::shared_ptr<Storage> Storage::create(int64_t nbytes, Device device, const OwnerTag& owner) {
  Allocator& allocator = device_hooks(device).allocator();
  auto storage = std::make_shared<Storage>(Private{}, device, &allocator);
  storage->allocation_ = allocator.allocate(nbytes, owner, storage);
  storage->nbytes_ = nbytes;
  return storage;
}

std::shared_ptr<Storage> Storage::create_released(int64_t nbytes, Device device, const std::string& why) {
  auto storage = std::make_shared<Storage>(Private{}, device, &device_hooks(device).allocator());
  storage->nbytes_ = nbytes;
  storage->released_ = true;
  storage->released_by_ = why;
  return storage;
}

void Storage::reacquire(const OwnerTag& owner) {
  TALLY_CHECK(released_, "reacquire on a storage that holds its bytes (", nbytes_, " bytes, owner '",
              this->owner().name_str(), "')");
  allocation_ = allocator_->allocate(nbytes_, owner, weak_from_this());
  released_ = false;
  released_by_.clear();
  // Tensors saved before the release still refer to this storage: the new bytes are tagged
  // as add_saver() tags them.
  std::lock_guard<std::mutex> lock(mutex_);
  if (savers_ > 0) tag_saved_activation();
}

void Storage::tag_saved_activation() {
  if (!released_ && owner().category == Category::Activation) {
    retag(Category::SavedForBackward);
    retagged_by_save_ = true;
  }
}

Storage::~Storage() {
  if (!released_) allocator_->free(allocation_);
}

void Storage::fail_no_bytes(const std::string& user) const {
  TALLY_CHECK(released_, "tensor '", user.empty() ? "<unnamed>" : user, "' is on the ", device_.str(),
              " device, which holds no bytes (it plans memory: its kernels read and write nothing)");
  TALLY_FAIL("tensor '", user.empty() ? "<unnamed>" : user, "' uses a storage of ", nbytes_,
             " bytes that was released by '", released_by_,
             "'; its bytes are back in the allocator, so this view must not be used "
             "(re-gather or recompute it instead)");
}

void Storage::release(const std::string& releaser) {
  TALLY_CHECK(!released_, "storage already released by '", released_by_, "', released again by '", releaser, "'");
  allocator_->free(allocation_);
  released_ = true;
  released_by_ = releaser;
  // The save's retag was of the bytes just freed: the next owner's are not retagged back.
  std::lock_guard<std::mutex> lock(mutex_);
  retagged_by_save_ = false;
}

OwnerTag Storage::owner() const {
  if (released_) return {};
  return allocator_->owner(allocation_);
}

void Storage::retag(Category category) const {
  if (!released_) allocator_->retag(allocation_, category);
}

void Storage::add_saver() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (savers_++ == 0) tag_saved_activation();
}

void Storage::remove_saver() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (--savers_ == 0 && retagged_by_save_) {
    retag(Category::Activation);
    retagged_by_save_ = false;
  }
}

std::vector<std::shared_ptr<const TensorImpl>> Storage::views() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<const TensorImpl>> out;
  out.reserve(views_.size());
  // A view whose last owner is gone but whose destructor is still waiting for this
  // lock fails to lock: it is skipped, never handed out half-destroyed. The weak pointer
  // is taken from the non-const object on purpose: converting weak_ptr<T> to
  // weak_ptr<const T> locks it inside libstdc++, and that temporary could be the last
  // owner, running the view's destructor (which takes this lock) right here.
  for (const TensorImpl* v : views_) {
    std::weak_ptr<TensorImpl> weak = const_cast<TensorImpl*>(v)->weak_from_this();
    if (std::shared_ptr<TensorImpl> p = weak.lock()) out.push_back(std::move(p));
  }
  return out;
}

size_t Storage::num_views() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return views_.size();
}

void Storage::add_view(const TensorImpl* view) {
  std::lock_guard<std::mutex> lock(mutex_);
  views_.push_back(view);
}

void Storage::remove_view(const TensorImpl* view) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find(views_.begin(), views_.end(), view);
  if (it != views_.end()) {
    *it = views_.back();
    views_.pop_back();
  }
}

}  // namespace tally
