#include "core/owner.h"

#include <cstring>
#include <deque>
#include <mutex>
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
thread_local std::string t_module_path;
thread_local NameId t_module_path_id = 0;
thread_local Category t_category = Category::Activation;

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

int64_t Clock::step() { return t_step; }
int64_t Clock::microbatch() { return t_microbatch; }
void Clock::set(int64_t step, int64_t microbatch) {
  t_step = step;
  t_microbatch = microbatch;
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

CategoryScope::CategoryScope(Category c) : previous_(t_category) { t_category = c; }
CategoryScope::~CategoryScope() { t_category = previous_; }

const std::string& current_module_path() { return t_module_path; }
NameId current_module_path_id() { return t_module_path_id; }

OwnerTag current_owner(const char* what) {
  OwnerTag tag;
  tag.category = t_category;
  tag.name = (what && *what) ? suffixed(t_module_path_id, what) : t_module_path_id;
  tag.step = t_step;
  tag.microbatch = t_microbatch;
  return tag;
}

OwnerTag make_owner(Category category, std::string_view name, bool persistent) {
  OwnerTag tag;
  tag.category = category;
  tag.name = intern_name(name);
  tag.step = t_step;
  tag.microbatch = t_microbatch;
  tag.persistent = persistent;
  return tag;
}

}  // namespace tally
