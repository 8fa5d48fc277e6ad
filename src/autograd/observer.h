// Observers of the backward engine: the interface through which higher layers watch
// backward without the engine knowing them. The sanitizer checks for reference cycles
// when a backward begins (S3). (What a leaf's gradient being final starts, data
// parallel's and ZeRO's reductions, hangs on the leaf itself: a post-accumulate hook,
// core/tensor.h.)
#pragma once
#include <vector>

#include "core/tensor.h"

namespace tally::autograd {

class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  // Before any node of the backward runs; `roots` are the tensors being differentiated.
  virtual void backward_begins(const std::vector<Tensor>& roots) {}
  // After the last node ran (also when backward ends with an error).
  virtual void backward_ends() {}
  // A recomputed region (autograd/checkpoint.h) has been differentiated: `inputs` are the
  // detached copies it ran on, their gradients set (what a tool inspecting activation
  // gradients reads). They die when the region's backward returns, unless kept.
  virtual void region_recomputed(const std::vector<Tensor>& inputs) {}
};

// Registers an observer for as long as the registration lives.
class ObserverRegistration {
 public:
  explicit ObserverRegistration(EngineObserver& observer);
  ~ObserverRegistration();
  ObserverRegistration(const ObserverRegistration&) = delete;
  ObserverRegistration& operator=(const ObserverRegistration&) = delete;

 private:
  EngineObserver* observer_;  // non-owning: the registration must not outlive it
};

// The registered observers, in registration order (a snapshot).
std::vector<EngineObserver*> engine_observers();

}  // namespace tally::autograd
