#include "core/storage.h"

#include <algorithm>

#include "core/error.h"

namespace tally {

Storage::Storage(int64_t nbytes, Device device, memory::OwnerTag owner) : device_(device) {
  block_ = memory::allocator(device).allocate(nbytes, std::move(owner));
  memory::ledger(device).attach_storage(block_.id, this);
}

Storage::~Storage() {
  if (!released_) {
    memory::ledger(device_).detach_storage(block_.id);
    memory::allocator(device_).free(block_);
  }
}

void* Storage::data(const std::string& user) const {
  if (released_) {
    TALLY_FAIL("tensor '", user.empty() ? "<unnamed>" : user, "' uses a storage of ", block_.bytes,
               " bytes that was released by '", released_by_,
               "'; its bytes are back in the allocator, so this view must not be used "
               "(re-gather or recompute it instead)");
  }
  return block_.ptr;
}

void Storage::release(const std::string& releaser) {
  TALLY_CHECK(!released_, "storage already released by '", released_by_, "', released again by '", releaser, "'");
  memory::ledger(device_).detach_storage(block_.id);
  memory::allocator(device_).free(block_);
  released_ = true;
  released_by_ = releaser;
}

memory::OwnerTag Storage::owner() const {
  if (released_) return {};
  return memory::ledger(device_).find(block_.id).owner;
}

void Storage::retag(memory::Category category) const {
  if (!released_) memory::ledger(device_).retag(block_.id, category);
}

void Storage::rename(const std::string& name) const {
  if (!released_) memory::ledger(device_).set_name(block_.id, name);
}

void Storage::add_saver() {
  std::lock_guard<std::mutex> lock(views_mutex_);
  if (savers_++ == 0 && !released_ && owner().category == memory::Category::Activation) {
    retag(memory::Category::SavedForBackward);
    retagged_by_save_ = true;
  }
}

void Storage::remove_saver() {
  std::lock_guard<std::mutex> lock(views_mutex_);
  if (--savers_ == 0 && retagged_by_save_) {
    retag(memory::Category::Activation);
    retagged_by_save_ = false;
  }
}

std::vector<const TensorImpl*> Storage::views() const {
  std::lock_guard<std::mutex> lock(views_mutex_);
  return views_;
}

void Storage::add_view(const TensorImpl* view) {
  std::lock_guard<std::mutex> lock(views_mutex_);
  views_.push_back(view);
}

void Storage::remove_view(const TensorImpl* view) {
  std::lock_guard<std::mutex> lock(views_mutex_);
  auto it = std::find(views_.begin(), views_.end(), view);
  if (it != views_.end()) {
    *it = views_.back();
    views_.pop_back();
  }
}

}  // namespace tally
