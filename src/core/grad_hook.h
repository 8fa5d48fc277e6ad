// Gradient hooks and the handles that remove them.
//
// A hook is called with a gradient and returns a replacement (or an undefined tensor to
// keep it). It is stored as the callable's own type, not a std::function, for one
// reason: its captures stay visible. The cycle check (sanitizer S3) scans a hook's bytes
// for tensors it captures by value, so "a hook on x that captures x" is named as the
// reference cycle it is (hook -> x -> hook), the way LeakSanitizer scans memory for
// pointers. A std::function passed as the hook keeps its captures behind a heap pointer;
// holds() finds them by copying the callable, which takes one more reference to every
// tensor it holds.
//
// Ownership: the hook list (a leaf's state, or the node that made an interior tensor)
// owns each HookEntry; a HookHandle refers to it weakly. remove() destroys the callable
// and its captures at once, which breaks any cycle it formed.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace tally {

class Tensor;
class TensorImpl;

// Every hook alive is counted, with the tensor it was registered on: hooks registered each
// step or microbatch and never removed pile up, and the sanitizer reports that as growth.
class GradHook {
 public:
  GradHook();
  virtual ~GradHook();
  GradHook(const GradHook&) = delete;
  GradHook& operator=(const GradHook&) = delete;
  std::string target;  // the tensor it hooks ("float32[64] 'w'"), set when registered
  virtual Tensor operator()(const Tensor& grad) const = 0;
  // The callable's object representation: where by-value captures live.
  virtual std::span<const std::byte> captured_bytes() const = 0;
  // Whether the hook holds a handle of `t`: in its bytes, in a container among them, or,
  // for a copyable callable, anywhere its copy reaches (a std::function keeps its
  // captures on the heap): copying it then takes another reference to `t`.
  virtual bool holds(const Tensor& t) const = 0;
};

// The tensors the live hooks are registered on, one entry a hook.
std::vector<std::string> live_hook_targets();
// The tensors the live hooks that hold `t` are registered on (a hook capturing it).
std::vector<std::string> hooks_holding(const Tensor& t);

// The hook for a callable of type F (defined in core/tensor.h, where Tensor is complete).
template <class F> class GradHookOf;

struct HookEntry {
  std::unique_ptr<GradHook> hook;  // owning; null once removed
  uint32_t output_nr = 0;          // for a node's hooks: which forward output's gradient
  bool captures_own_tensor = false;  // found at registration: the hook holds the tensor it hooks
  std::weak_ptr<const TensorImpl> registered_on;  // non-owning: the tensor it hooks
};

class HookHandle {
 public:
  HookHandle() = default;
  explicit HookHandle(std::weak_ptr<HookEntry> entry) : entry_(std::move(entry)) {}
  // Removes the hook and destroys its captures now. Idempotent; a no-op once the hook's
  // owner (its graph, or its leaf) is gone.
  void remove() {
    if (auto e = entry_.lock()) e->hook.reset();
  }
  bool active() const {
    auto e = entry_.lock();
    return e && e->hook;
  }

 private:
  std::weak_ptr<HookEntry> entry_;  // non-owning: the hook list owns the entry
};

}  // namespace tally
