// Who owns an allocation: every byte tally allocates carries an OwnerTag.
//
// A tag is filled in from the allocating thread's context: the module path (pushed by
// OwnerScope as a model's forward descends into submodules), the default category
// (CategoryScope), and the clock, the (step, microbatch) the trainer or a pipeline
// schedule is working on. Parameters, gradients and optimizer state get explicit tags.
//
// Names are interned: a tag holds a 32-bit NameId, so tagging an allocation copies no
// string. The clock is per thread and is set explicitly by whoever runs a schedule
// (sanitizer::Sanitizer::begin_microbatch): a pipeline running F0 F1 B0 B1 tags each
// allocation and graph node with the microbatch it really belongs to. A thread that has
// set no clock of its own (a worker a run starts) reads the process's: the one last set
// by any thread. Outside any owner scope of its own, a thread other than the main one
// names what it allocates for itself ("thread 2:matmul").
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace tally {

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

// ---- interned names
using NameId = uint32_t;  // 0 is the empty name
NameId intern_name(std::string_view name);
// The interned string; the reference stays valid for the life of the process.
const std::string& name_of(NameId id);

struct OwnerTag {
  Category category = Category::Other;
  // Lives across steps by design (a registered parameter's gradient, a loader's buffers,
  // a cache that says so). Parameters and optimizer state are persistent by category.
  bool persistent = false;
  NameId name = 0;          // module path or op, e.g. "h.3.attn:matmul" or "adamw.m"
  int64_t step = -1;        // clock at birth (-1: outside any step)
  int64_t microbatch = -1;  // -1: outside any microbatch; kBetweenSteps after a step ended

  bool is_persistent() const {
    return persistent || category == Category::Parameter || category == Category::OptimizerState;
  }
  const std::string& name_str() const { return name_of(name); }
};

// ---- the clock: the (step, microbatch) this thread is working on
inline constexpr int64_t kBetweenSteps = -2;  // microbatch value after end_step, before the next begin_step
struct Clock {
  struct Reading {
    int64_t step = -1;
    int64_t microbatch = -1;
  };
  // Both halves read at once: a worker reading the process's clock never sees a new step
  // with the previous step's microbatch.
  static Reading now();
  static void set(int64_t step, int64_t microbatch);
};

// Pushes one component of the module path for the current thread:
//   { OwnerScope a("h"); { OwnerScope b("3"); ... current path "h.3" } }
class OwnerScope {
 public:
  explicit OwnerScope(std::string_view component);
  ~OwnerScope();
  OwnerScope(const OwnerScope&) = delete;
  OwnerScope& operator=(const OwnerScope&) = delete;

 private:
  size_t previous_length_;
  NameId previous_id_;
};

// Sets the whole module path for the current thread, whatever path it was under: the
// autograd engine runs each node's backward under the path the node was recorded at (an
// absolute path already), also when that backward runs inside another's (recomputation).
class ModulePathScope {
 public:
  explicit ModulePathScope(std::string_view path);
  ~ModulePathScope();
  ModulePathScope(const ModulePathScope&) = delete;
  ModulePathScope& operator=(const ModulePathScope&) = delete;

 private:
  std::string previous_;
  NameId previous_id_;
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

// Names the part of a step the thread is in until the scope ends ("forward",
// "backward", "optimizer", ...; `phase` a string literal), then the enclosing one again:
// what the ledger says of the moment a peak happened (memory/ledger.h). A thread outside
// any is in "".
class PhaseMark {
 public:
  explicit PhaseMark(const char* phase);
  ~PhaseMark();
  PhaseMark(const PhaseMark&) = delete;
  PhaseMark& operator=(const PhaseMark&) = delete;

 private:
  const char* previous_;
};
const char* current_phase();

const std::string& current_module_path();
NameId current_module_path_id();

// The tag an allocation made here and now gets: current category, module path
// (suffixed with ":what" when given, e.g. the op name) and clock.
OwnerTag current_owner(const char* what = nullptr);
OwnerTag make_owner(Category category, std::string_view name, bool persistent = false);

}  // namespace tally
