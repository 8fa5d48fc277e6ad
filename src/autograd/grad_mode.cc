#include "autograd/grad_mode.h"

namespace tally::autograd {

namespace {
thread_local bool t_grad_enabled = true;
thread_local bool t_inference = false;
}  // namespace

bool grad_enabled() { return t_grad_enabled; }
void set_grad_enabled(bool enabled) { t_grad_enabled = enabled; }
bool inference_mode() { return t_inference; }

InferenceModeGuard::InferenceModeGuard() : previous_grad_(t_grad_enabled), previous_inference_(t_inference) {
  t_grad_enabled = false;
  t_inference = true;
}
InferenceModeGuard::~InferenceModeGuard() {
  t_grad_enabled = previous_grad_;
  t_inference = previous_inference_;
}

}  // namespace tally::autograd
