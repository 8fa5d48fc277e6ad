#include "memory/sanitizer.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "autograd/engine.h"
#include "autograd/node.h"
#include "core/error.h"
#include "core/storage.h"
#include "core/tensor.h"

namespace tally::memory {

namespace {
Sanitizer* g_active = nullptr;

std::string birth_str(int64_t step, int64_t microbatch) {
  std::string s = "step " + (step < 0 ? std::string("-") : std::to_string(step));
  if (microbatch >= 0) s += " microbatch " + std::to_string(microbatch);
  return s;
}

// Live tensors (over every device's ledger) whose grad_fn is `node`.
std::vector<std::string> tensors_holding(const autograd::Node* node, const std::vector<Device>& devices) {
  std::vector<std::string> out;
  for (Device d : devices) {
    for (const LiveAllocation& a : ledger(d).live()) {
      if (!a.storage) continue;
      for (const TensorImpl* v : a.storage->views()) {
        if (auto* st = std::get_if<autograd::InteriorState>(&v->autograd()); st && st->grad_fn.get() == node) {
          out.push_back("tensor '" + (v->name().empty() ? std::string("<unnamed>") : v->name()) + "' " +
                        shape_str(v->shape()) + " (storage owner '" + a.owner.name + "')");
        }
      }
    }
  }
  return out;
}
}  // namespace

SanitizeMode parse_sanitize_mode(const std::string& text) {
  if (text == "off") return SanitizeMode::Off;
  if (text == "warn") return SanitizeMode::Warn;
  if (text == "strict") return SanitizeMode::Strict;
  TALLY_FAIL("--sanitize: expected off, warn or strict, got '", text, "'");
}

const char* issue_kind_name(IssueKind k) {
  switch (k) {
    case IssueKind::Growth: return "memory growth (S1)";
    case IssueKind::LiveGraph: return "live graph after backward (S2)";
    case IssueKind::Cycle: return "reference cycle (S3)";
  }
  return "?";
}

void report_issue(IssueKind kind, const std::string& message) {
  if (g_active) g_active->report(kind, message);
}

Sanitizer::Sanitizer(SanitizeMode mode, std::vector<Device> devices)
    : mode_(mode), devices_(std::move(devices)), previous_active_(g_active) {
  if (mode_ == SanitizeMode::Off) return;
  g_active = this;
  autograd::set_cycle_check(true);
  previous_live_ = live_non_persistent();
}

Sanitizer::~Sanitizer() {
  if (mode_ == SanitizeMode::Off) return;
  g_active = previous_active_;
  autograd::set_cycle_check(previous_active_ != nullptr);
}

int64_t Sanitizer::live_non_persistent() const {
  int64_t total = 0;
  for (Device d : devices_) total += ledger(d).stats().live_non_persistent;
  return total;
}

void Sanitizer::report(IssueKind kind, const std::string& message) {
  Issue issue{kind, std::string("tally sanitizer: ") + issue_kind_name(kind) + ": " + message};
  issues_.push_back(issue);
  if (mode_ == SanitizeMode::Strict) throw Error(issue.message);
  if (printer_) printer_(issue);
  else std::fprintf(stderr, "%s\n", issue.message.c_str());
}

void Sanitizer::begin_step(int64_t step) {
  step_ = step;
  microbatch_ = -1;
  step_first_node_ = autograd::next_sequence_nr();
  Clock::set(step, -1);
  if (mode_ == SanitizeMode::Off) return;
  for (Device d : devices_) ledger(d).reset_peaks();
}

void Sanitizer::begin_microbatch(int64_t microbatch) {
  microbatch_ = microbatch;
  microbatch_first_node_ = autograd::next_sequence_nr();
  Clock::set(step_, microbatch);
}

void Sanitizer::end_microbatch() {
  if (mode_ != SanitizeMode::Off) check_boundary(false);
  Clock::set(step_, -1);
}

void Sanitizer::end_step() {
  if (mode_ != SanitizeMode::Off) check_boundary(true);
  microbatch_ = -1;
}

void Sanitizer::check_boundary(bool step_boundary) {
  Boundary b;
  b.step = step_;
  b.microbatch = step_boundary ? -1 : microbatch_;
  std::string where = step_boundary ? "end of step " + std::to_string(step_)
                                    : "end of step " + std::to_string(step_) + " microbatch " + std::to_string(microbatch_);

  // S2: nodes born in this step (this microbatch, at a microbatch boundary) still alive.
  std::vector<autograd::NodeInfo> survivors;
  for (const autograd::NodeInfo& n : autograd::live_nodes()) {
    if (n.sequence_nr < (step_boundary ? step_first_node_ : microbatch_first_node_)) continue;
    survivors.push_back(n);
    b.live_saved += n.saved_tensors;
  }
  b.live_nodes = survivors.size();
  if (!survivors.empty()) {
    std::sort(survivors.begin(), survivors.end(), [](auto& x, auto& y) { return x.saved_bytes > y.saved_bytes; });
    std::ostringstream os;
    os << survivors.size() << " autograd node(s) born in this step are alive at " << where
       << " (a graph is being kept past its backward: detach values you keep, e.g. losses for logging):";
    size_t shown = 0;
    for (const auto& n : survivors) {
      if (shown++ == 12) {
        os << "\n    ... and " << survivors.size() - 12 << " more";
        break;
      }
      os << "\n    " << n.op << " [" << (n.module_path.empty() ? "-" : n.module_path) << "] born "
         << birth_str(n.step, n.microbatch) << ", " << n.saved_tensors << " saved tensor(s) ("
         << format_bytes(n.saved_bytes) << ")";
      for (const std::string& h : tensors_holding(n.node, devices_)) os << "\n        held by " << h;
    }
    report(IssueKind::LiveGraph, os.str());
  }

  // S1: growth of live non-persistent bytes since the previous boundary.
  b.live_non_persistent = live_non_persistent();
  uint64_t max_id = 0;
  for (Device d : devices_) {
    Stats s = ledger(d).stats();
    b.allocated += s.allocated;
    b.peak_allocated += s.peak_allocated;
  }
  if (b.live_non_persistent > previous_live_) {
    std::vector<LiveAllocation> grown;
    for (Device d : devices_)
      for (LiveAllocation& a : ledger(d).live())
        if (!a.owner.is_persistent() && a.id > previous_max_id_) grown.push_back(std::move(a));
    std::ostringstream os;
    os << "live non-persistent memory grew by " << format_bytes(b.live_non_persistent - previous_live_) << " at "
       << where << " (" << format_bytes(previous_live_) << " -> " << format_bytes(b.live_non_persistent)
       << "); allocations born since the previous boundary that are still alive:\n"
       << describe_allocations(grown);
    report(IssueKind::Growth, os.str());
  }
  for (Device d : devices_)
    for (const LiveAllocation& a : ledger(d).live()) max_id = std::max(max_id, a.id);
  previous_max_id_ = std::max(previous_max_id_, max_id);
  previous_live_ = b.live_non_persistent;
  boundaries_.push_back(b);
}

std::vector<std::string> storage_holders(const Storage& storage) {
  std::vector<std::string> out;
  for (const TensorImpl* v : storage.views()) {
    std::string role = "no grad";
    if (std::holds_alternative<autograd::LeafState>(v->autograd())) role = "leaf";
    if (auto* in = std::get_if<autograd::InteriorState>(&v->autograd()))
      role = std::string("output of ") + in->grad_fn->name() +
             (in->grad_fn->module_path().empty() ? "" : " [" + in->grad_fn->module_path() + "]");
    out.push_back("'" + (v->name().empty() ? std::string("<unnamed>") : v->name()) + "' " +
                  dtype_name(v->dtype()) + shape_str(v->shape()) + " offset " + std::to_string(v->offset()) + ", " +
                  role);
  }
  return out;
}

std::string describe_allocations(const std::vector<LiveAllocation>& allocations, size_t max_rows) {
  std::vector<const LiveAllocation*> sorted;
  for (const auto& a : allocations) sorted.push_back(&a);
  std::sort(sorted.begin(), sorted.end(), [](auto* x, auto* y) { return x->bytes > y->bytes; });
  std::ostringstream os;
  char line[512];
  for (size_t i = 0; i < sorted.size() && i < max_rows; ++i) {
    const LiveAllocation& a = *sorted[i];
    std::snprintf(line, sizeof line, "    %10s  %-18s  %-40s  born %s", format_bytes(a.bytes).c_str(),
                  category_name(a.owner.category), a.owner.name.empty() ? "<unnamed>" : a.owner.name.c_str(),
                  birth_str(a.owner.step, a.owner.microbatch).c_str());
    os << line;
    if (a.storage) {
      auto holders = storage_holders(*a.storage);
      for (const auto& h : holders) os << "\n        held by " << h;
    }
    if (!a.stack.empty()) os << "\n        allocated at " << symbolize(a.stack.front());
    os << "\n";
  }
  if (sorted.size() > max_rows) os << "    ... and " << sorted.size() - max_rows << " more\n";
  return os.str();
}

}  // namespace tally::memory
