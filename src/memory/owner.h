// Who owns an allocation: every byte tally allocates carries an OwnerTag.
//
// The tag is filled in from thread-local context at allocation time: the module path
// (pushed by OwnerScope as the model's forward descends into submodules), the default
// category (CategoryScope), and the trainer's step/microbatch clock. Explicit tags are
// used for parameters, gradients and optimizer state.
#pragma once
#include <cstdint>
#include <string>

namespace tally::memory {

enum class Category : uint8_t {
  Parameter,
  Gradient,
  OptimizerState,
  Activation,
  SavedForBackward,
  Communication,
  Workspace,
  Data,
  Other,
};
inline constexpr int kNumCategories = 9;

const char* category_name(Category c);

// Persistent categories live across steps by design and are excluded from the
// step/microbatch boundary check (sanitizer S1).
inline bool is_persistent_category(Category c) {
  return c == Category::Parameter || c == Category::Gradient || c == Category::OptimizerState;
}

struct OwnerTag {
  Category category = Category::Other;
  std::string name;        // module path or op, e.g. "h.3.attn.qkv" or "adamw.m"
  int64_t step = -1;       // trainer step at allocation (-1: outside any step)
  int64_t microbatch = -1; // microbatch within the step (-1: outside any microbatch)
  bool persistent = false; // caches and loaders that live across steps say so

  bool is_persistent() const { return persistent || is_persistent_category(category); }
};

// The trainer's clock, read when allocations and graph nodes are born.
struct Clock {
  static int64_t step();
  static int64_t microbatch();
  static void set(int64_t step, int64_t microbatch);
};

// Pushes one component of the module path for the current thread:
//   { OwnerScope a("h"); { OwnerScope b("3"); ... current path "h.3" } }
class OwnerScope {
 public:
  explicit OwnerScope(const std::string& component);
  ~OwnerScope();
  OwnerScope(const OwnerScope&) = delete;
  OwnerScope& operator=(const OwnerScope&) = delete;

 private:
  size_t previous_length_;
};

// Sets the category that allocations without an explicit tag get (default Activation).
class CategoryScope {
 public:
  explicit CategoryScope(Category c);
  ~CategoryScope();
  CategoryScope(const CategoryScope&) = delete;
  CategoryScope& operator=(const CategoryScope&) = delete;

 private:
  Category previous_;
};

const std::string& current_module_path();

// The tag an allocation made here and now gets: current category, module path
// (suffixed with `what` when given, e.g. the op name) and clock.
OwnerTag current_owner(const char* what = nullptr);
OwnerTag make_owner(Category category, std::string name, bool persistent = false);

}  // namespace tally::memory
