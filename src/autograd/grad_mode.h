// Grad mode: whether ops record graph nodes. Thread-local, like PyTorch's.
#pragma once

namespace tally::autograd {

bool grad_enabled();
void set_grad_enabled(bool enabled);

// Disables graph recording in a scope (evaluation, optimizer updates).
class NoGradGuard {
 public:
  NoGradGuard() : previous_(grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// Inference: no graph, and a marker that lets code know nothing will ever be
// differentiated here (sampling, evaluation).
bool inference_mode();
class InferenceModeGuard {
 public:
  InferenceModeGuard();
  ~InferenceModeGuard();
  InferenceModeGuard(const InferenceModeGuard&) = delete;
  InferenceModeGuard& operator=(const InferenceModeGuard&) = delete;

 private:
  bool previous_grad_;
  bool previous_inference_;
};

}  // namespace tally::autograd
