#include "core/owner.h"

#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace tally {

namespace {

// The intern table. Names are appended and never removed, so a NameId and the string
// it names stay valid for the process's life; a deque keeps references stable.
struct InternTable {
  std::mutex mutex;
  std::unordered_map<std::string_view, NameId> ids;  // views into `names`
  std::deque<std::string> names{std::string()};     // id 0: ""
};
InternTable& table() {
  static auto* t = new InternTable();  // never destroyed: tags outlive static destruction
  return *t;
}

// The clock, module path and category are per thread: a data-loading or communication
// thread must not inherit the model's path, and each pipeline thread keeps its own
// microbatch.
thread_local int64_t t_step = -1;
thread_local int64_t t_microbatch = -1;
thread_local bool t_own_clock = false;  // this thread has set its clock
thread_local std::string t_module_path;
thread_local NameId t_module_path_id = 0;
thread_local Category t_category = Category::Activation;
thread_local const char* t_phase = "";

// current_owner("op") runs for every allocation an op makes: a small per-thread cache
// maps (path id, op name) to the interned "path:op" so the hot path builds no string.
// Entries are keyed by the name's address and verified by content (an address may be
// reused for another string); names too long for an entry are interned every time.
struct SuffixCacheEntry {
  NameId path = 0;
  NameId id = 0;
  char what[48] = {};
};
thread_local SuffixCacheEntry t_suffix_cache[64];

NameId suffixed(NameId path, const char* what) {
  const size_t len = std::strlen(what);
  const auto h = (reinterpret_cast<uintptr_t>(what) >> 3) ^ (static_cast<uintptr_t>(path) * 0x9E3779B1u);
  SuffixCacheEntry& e = t_suffix_cache[h & 63];
  if (e.id != 0 && e.path == path && std::strcmp(e.what, what) == 0) return e.id;
  std::string full = name_of(path);
  if (!full.empty()) full += ':';
  full += what;
  const NameId id = intern_name(full);
  if (len < sizeof e.what) {
    e.path = path;
    e.id = id;
    std::memcpy(e.what, what, len + 1);
  }
  return id;
}

// The process's clock: what the thread that last set a clock is working on. A thread that
// set none (a worker that a run started) reads it, so what it allocates and records is
// stamped with the step and microbatch it happens in.
struct ProcessClock {
  std::mutex mutex;
  int64_t step = -1;
  int64_t microbatch = -1;
};
ProcessClock& process_clock() {
  static auto* c = new ProcessClock();  // never destroyed: threads may outlive statics
  return *c;
}

// Allocations on a thread other than the main one, outside any owner scope of its own,
// are named for the thread ("thread 2", "thread 2:matmul"): foreign, yet traceable.
const std::thread::id g_main_thread = std::this_thread::get_id();  // static init runs on main
std::atomic<int> g_next_thread_number{1};
thread_local NameId t_thread_name = 0;
NameId path_or_thread_name() {
  if (t_module_path_id != 0 || std::this_thread::get_id() == g_main_thread) return t_module_path_id;
  if (t_thread_name == 0) t_thread_name = intern_name("thread " + std::to_string(g_next_thread_number++));
  return t_thread_name;
}

}  // namespace

const char* category_name(Category c) {
  switch (c) {
    case Category::Parameter: return "parameter";
    case Category::Gradient: return "gradient";
    case Category::OptimizerState: return "optimizer_state";
    case Category::Activation: return "activation";
    case Category::SavedForBackward: return "saved_for_backward";
    case Category::Communication: return "communication";
    case Category::Workspace: return "workspace";
    case Category::Data: return "data";
    case Category::Other: return "other";
  }
  return "?";
}

NameId intern_name(std::string_view name) {
  if (name.empty()) return 0;
  InternTable& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.ids.find(name);
  if (it != t.ids.end()) return it->second;
  t.names.emplace_back(name);
  const auto id = static_cast<NameId>(t.names.size() - 1);
  t.ids.emplace(std::string_view(t.names.back()), id);
  return id;
}

const std::string& name_of(NameId id) {
  InternTable& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  return id < t.names.size() ? t.names[id] : t.names[0];
}

Clock::Reading Clock::now() {
  if (t_own_clock) return {t_step, t_microbatch};
  ProcessClock& c = process_clock();
  std::lock_guard<std::mutex> lock(c.mutex);
  return {c.step, c.microbatch};
}
void Clock::set(int64_t step, int64_t microbatch) {
  t_step = step;
  t_microbatch = microbatch;
  t_own_clock = true;
  ProcessClock& c = process_clock();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.step = step;
  c.microbatch = microbatch;
}

OwnerScope::OwnerScope(std::string_view component)
    : previous_length_(t_module_path.size()), previous_id_(t_module_path_id) {
  if (!t_module_path.empty()) t_module_path += '.';
  t_module_path += component;
  t_module_path_id = intern_name(t_module_path);
}
OwnerScope::~OwnerScope() {
  t_module_path.resize(previous_length_);
  t_module_path_id = previous_id_;
}

ModulePathScope::ModulePathScope(std::string_view path)
    : previous_(t_module_path), previous_id_(t_module_path_id) {
  t_module_path = path;
  t_module_path_id = intern_name(t_module_path);
}
ModulePathScope::~ModulePathScope() {
  t_module_path = std::move(previous_);
  t_module_path_id = previous_id_;
}

PhaseMark::PhaseMark(const char* phase) : previous_(t_phase) { t_phase = phase; }
PhaseMark::~PhaseMark() { t_phase = previous_; }
const char* current_phase() { return t_phase; }

CategoryScope::CategoryScope(Category c) : previous_(t_category) { t_category = c; }
CategoryScope::~CategoryScope() { t_category = previous_; }

const std::string& current_module_path() { return t_module_path; }
NameId current_module_path_id() { return path_or_thread_name(); }

OwnerTag current_owner(const char* what) {
  OwnerTag tag;
  tag.category = t_category;
  const NameId path = path_or_thread_name();
  tag.name = (what && *what) ? suffixed(path, what) : path;
  const Clock::Reading now = Clock::now();
  tag.step = now.step;
  tag.microbatch = now.microbatch;
  return tag;
}

OwnerTag make_owner(Category category, std::string_view name, bool persistent) {
  OwnerTag tag;
  tag.category = category;
  tag.name = intern_name(name);
  const Clock::Reading now = Clock::now();
  tag.step = now.step;
  tag.microbatch = now.microbatch;
  tag.persistent = persistent;
  return tag;
}

}  // namespace tally
