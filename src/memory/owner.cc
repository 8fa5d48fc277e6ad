#include "memory/owner.h"

namespace tally::memory {

namespace {
// The clock is process-wide (one trainer drives it); module path and category are
// per thread because a data-loading thread must not inherit the model's path.
int64_t g_step = -1;
int64_t g_microbatch = -1;
thread_local std::string t_module_path;
thread_local Category t_category = Category::Activation;
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

int64_t Clock::step() { return g_step; }
int64_t Clock::microbatch() { return g_microbatch; }
void Clock::set(int64_t step, int64_t microbatch) {
  g_step = step;
  g_microbatch = microbatch;
}

OwnerScope::OwnerScope(const std::string& component) : previous_length_(t_module_path.size()) {
  if (!t_module_path.empty()) t_module_path += '.';
  t_module_path += component;
}
OwnerScope::~OwnerScope() { t_module_path.resize(previous_length_); }

CategoryScope::CategoryScope(Category c) : previous_(t_category) { t_category = c; }
CategoryScope::~CategoryScope() { t_category = previous_; }

const std::string& current_module_path() { return t_module_path; }

OwnerTag current_owner(const char* what) {
  OwnerTag tag;
  tag.category = t_category;
  tag.name = t_module_path;
  if (what) {
    if (!tag.name.empty()) tag.name += ':';
    tag.name += what;
  }
  tag.step = g_step;
  tag.microbatch = g_microbatch;
  return tag;
}

OwnerTag make_owner(Category category, std::string name, bool persistent) {
  OwnerTag tag;
  tag.category = category;
  tag.name = std::move(name);
  tag.step = g_step;
  tag.microbatch = g_microbatch;
  tag.persistent = persistent;
  return tag;
}

}  // namespace tally::memory
