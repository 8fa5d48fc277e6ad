#include "memory/ledger.h"

#include <unordered_map>

#include <execinfo.h>

#include <algorithm>
#include <chrono>

#include "core/error.h"

namespace tally::memory {

namespace {
double now_us() {
  using namespace std::chrono;
  static const auto t0 = steady_clock::now();
  return duration<double, std::micro>(steady_clock::now() - t0).count();
}

std::shared_ptr<const StackTrace> capture_stack() {
  void* frames[24];
  int n = backtrace(frames, 24);
  // Skip the ledger and allocator frames themselves.
  int skip = n > 4 ? 4 : 0;
  return std::make_shared<const StackTrace>(frames + skip, frames + n);
}
}  // namespace

uint32_t Ledger::record_alloc(int64_t bytes, const OwnerTag& owner, std::weak_ptr<const Storage> storage,
                              uint64_t* id_out) {
  const uint64_t id = next_id_++;
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  const auto c = static_cast<int>(owner.category);
  stats_.allocated += bytes;
  const bool new_peak = stats_.allocated > stats_.peak_allocated;
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  stats_.allocated_by_category[c] += bytes;
  stats_.peak_by_category[c] = std::max(stats_.peak_by_category[c], stats_.allocated_by_category[c]);
  if (!owner.is_persistent()) stats_.live_non_persistent += bytes;
  stats_.num_allocs++;
  LiveAllocation& rec = slots_[slot];
  rec.id = id;
  rec.bytes = bytes;
  rec.owner = owner;
  rec.storage = std::move(storage);
  rec.stack.reset();
  if (history_enabled_) {
    if (history_stacks_) rec.stack = capture_stack();
    history_.push_back({now_us(), bytes, owner.category, owner.name, owner.step, owner.microbatch, rec.stack, false, id});
  }
  *id_out = id;
  if (new_peak && track_peak_owners_) {
    snapshot_peak_owners();
    peak_moment_ = {owner, current_phase(), stats_.peak_allocated};
  }
  return slot;
}

void Ledger::snapshot_peak_owners() {
  std::unordered_map<uint64_t, int64_t> by_owner;
  for (const LiveAllocation& rec : slots_)
    if (rec.id != 0)
      by_owner[(static_cast<uint64_t>(rec.owner.category) << 32) | rec.owner.name] += rec.bytes;
  peak_owners_.clear();
  for (const auto& [key, bytes] : by_owner)
    peak_owners_.push_back({static_cast<Category>(key >> 32), static_cast<NameId>(key & 0xFFFFFFFFu), bytes});
  std::sort(peak_owners_.begin(), peak_owners_.end(),
            [](const OwnerBytes& a, const OwnerBytes& b) { return a.bytes != b.bytes ? a.bytes > b.bytes : a.name < b.name; });
}

void Ledger::track_peak_owners(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  track_peak_owners_ = on;
}

std::vector<OwnerBytes> Ledger::peak_owners() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_owners_;
}

PeakMoment Ledger::peak_moment() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_moment_;
}

LiveAllocation* Ledger::record_at(uint32_t slot, uint64_t id) {
  if (slot >= slots_.size() || slots_[slot].id != id || id == 0) return nullptr;
  return &slots_[slot];
}

const LiveAllocation* Ledger::record_at(uint32_t slot, uint64_t id) const {
  if (slot >= slots_.size() || slots_[slot].id != id || id == 0) return nullptr;
  return &slots_[slot];
}

void Ledger::record_free(uint32_t slot, uint64_t id) {
  LiveAllocation* rec = record_at(slot, id);
  if (!rec) return;
  const auto c = static_cast<int>(rec->owner.category);
  stats_.allocated -= rec->bytes;
  stats_.allocated_by_category[c] -= rec->bytes;
  if (!rec->owner.is_persistent()) stats_.live_non_persistent -= rec->bytes;
  stats_.num_frees++;
  if (history_enabled_) {
    history_.push_back({now_us(), -rec->bytes, rec->owner.category, rec->owner.name, rec->owner.step,
                        rec->owner.microbatch, nullptr, false, rec->id});
  }
  rec->id = 0;
  rec->storage.reset();
  rec->stack.reset();
  free_slots_.push_back(slot);
}

void Ledger::record_reserve(int64_t delta) {
  stats_.reserved += delta;
  stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
  if (delta > 0) stats_.num_system_allocs++;
}

void Ledger::record_retag(uint32_t slot, uint64_t id, Category category) {
  LiveAllocation* rec = record_at(slot, id);
  if (!rec) return;
  OwnerTag& owner = rec->owner;
  if (owner.category == category) return;
  const int64_t bytes = rec->bytes;
  const Category previous = owner.category;
  const bool was_persistent = owner.is_persistent();
  stats_.allocated_by_category[static_cast<int>(previous)] -= bytes;
  owner.category = category;
  const auto c = static_cast<int>(category);
  stats_.allocated_by_category[c] += bytes;
  stats_.peak_by_category[c] = std::max(stats_.peak_by_category[c], stats_.allocated_by_category[c]);
  const bool now_persistent = owner.is_persistent();
  if (was_persistent && !now_persistent) stats_.live_non_persistent += bytes;
  if (!was_persistent && now_persistent) stats_.live_non_persistent -= bytes;
  if (history_enabled_) {  // a move between categories: -bytes from the old, +bytes to the new
    const double t = now_us();
    history_.push_back({t, -bytes, previous, owner.name, owner.step, owner.microbatch, nullptr, true, id});
    history_.push_back({t, bytes, category, owner.name, owner.step, owner.microbatch, nullptr, true, id});
  }
}

Stats Ledger::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void Ledger::reset_peaks() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_allocated = stats_.allocated;
  stats_.peak_reserved = stats_.reserved;
  stats_.peak_by_category = stats_.allocated_by_category;
}

std::vector<LiveAllocation> Ledger::live() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<LiveAllocation> out;
  out.reserve(slots_.size() - free_slots_.size());
  for (const LiveAllocation& rec : slots_)
    if (rec.id != 0) out.push_back(rec);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return out;
}

LiveAllocation Ledger::find(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const LiveAllocation& rec : slots_)
    if (id != 0 && rec.id == id) return rec;
  return {};
}

uint64_t Ledger::last_id() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_id_ - 1;
}

void Ledger::enable_history(bool enabled, bool with_stacks) {
  std::lock_guard<std::mutex> lock(mutex_);
  history_enabled_ = enabled;
  history_stacks_ = with_stacks;
}

bool Ledger::history_enabled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return history_enabled_;
}

bool Ledger::history_stacks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return history_stacks_;
}

std::vector<MemoryEvent> Ledger::history() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return history_;
}

std::vector<MemoryEvent> Ledger::take_history() {
  std::lock_guard<std::mutex> lock(mutex_);
  history_enabled_ = false;
  std::vector<MemoryEvent> taken;
  taken.swap(history_);
  return taken;
}

void Ledger::clear_history() {
  std::lock_guard<std::mutex> lock(mutex_);
  history_.clear();
}

}  // namespace tally::memory
