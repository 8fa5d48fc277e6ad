#include "sanitizer/sanitizer.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

#include "autograd/cycles.h"
#include "autograd/function.h"
#include "autograd/node.h"
#include "core/error.h"
#include "core/storage.h"
#include "core/tensor.h"
#include "memory/report.h"
#include "runtime/backend.h"

namespace tally::sanitizer {

using memory::format_bytes;
using memory::LiveAllocation;

namespace {

std::string birth_str(int64_t step, int64_t microbatch) {
  std::string s = "step " + (step < 0 ? std::string("-") : std::to_string(step));
  if (microbatch >= 0) s += " microbatch " + std::to_string(microbatch);
  if (microbatch == kBetweenSteps) s += " (between steps)";
  return s;
}

std::string tensor_label(const TensorImpl& v) {
  return "'" + (v.name().empty() ? std::string("<unnamed>") : v.name()) + "' " + dtype_name(v.dtype()) +
         shape_str(v.shape());
}

// ", captured by a gradient hook on 'w'" for each live hook holding `view`.
std::string hook_captures(const std::shared_ptr<const TensorImpl>& view) {
  std::string out;
  for (const std::string& target : hooks_holding(Tensor(std::const_pointer_cast<TensorImpl>(view))))
    out += ", captured by a gradient hook registered on " + target;
  return out;
}

struct Holders {
  std::vector<std::string> lines;
  bool by_hook = false;  // some holder is captured by a hook
};

// Live tensors (over every device's ledger) whose grad_fn is `node`, and the hooks that
// capture them.
Holders tensors_holding(const autograd::Node* node, const std::vector<Device>& devices) {
  Holders out;
  for (Device d : devices) {
    for (const LiveAllocation& a : runtime::ledger(d).live()) {
      auto storage = a.storage.lock();
      if (!storage) continue;
      for (const auto& v : storage->views()) {
        auto* st = std::get_if<autograd::InteriorState>(&v->autograd());
        if (!st || st->grad_fn.get() != node) continue;
        const std::string hooks = hook_captures(v);
        out.by_hook = out.by_hook || !hooks.empty();
        out.lines.push_back("tensor " + tensor_label(*v) + " (storage owner '" + a.owner.name_str() + "')" + hooks);
      }
    }
  }
  return out;
}

// Whether an allocation carries graph state: saved for a backward, a gradient, or viewed
// by a tensor that takes part in autograd.
bool graph_carrying(const LiveAllocation& a) {
  if (a.owner.category == Category::SavedForBackward || a.owner.category == Category::Gradient) return true;
  if (auto storage = a.storage.lock())
    for (const auto& v : storage->views())
      if (!std::holds_alternative<autograd::NoGrad>(v->autograd())) return true;
  return false;
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

Sanitizer::Sanitizer(SanitizeMode mode, std::vector<Device> devices)
    : mode_(mode),
      devices_(std::move(devices)),
      previous_clock_(Clock::now()) {
  for (Device d : devices_) first_id_.push_back(runtime::ledger(d).last_id());
  first_node_ = autograd::next_sequence_nr();
  Clock::set(-1, kBetweenSteps);
  if (!active()) return;
  registration_.emplace(static_cast<autograd::EngineObserver&>(*this));
  for (Device d : devices_) baseline_live_ += runtime::ledger(d).stats().live_non_persistent;
}

Sanitizer::~Sanitizer() { Clock::set(previous_clock_.step, previous_clock_.microbatch); }

void Sanitizer::report(IssueKind kind, const std::string& message) {
  Issue issue{kind, std::string("tally sanitizer: ") + issue_kind_name(kind) + ": " + message};
  issues_.push_back(issue);
  if (mode_ == SanitizeMode::Strict) throw Error(issue.message);
  if (printer_) printer_(issue);
  else std::fprintf(stderr, "%s\n", issue.message.c_str());
}

void Sanitizer::backward_begins(const std::vector<Tensor>& roots) {
  for (const std::string& c : autograd::find_cycles(roots))
    report(IssueKind::Cycle, "reference cycle in the autograd graph, which nothing can free: " + c);
}

bool Sanitizer::born_this_step(const LiveAllocation& a) const {
  const bool this_step = a.owner.step == step_ && a.owner.microbatch != kBetweenSteps;
  const bool before_it = a.owner.step == previous_step_ && a.owner.microbatch == kBetweenSteps;
  return this_step || before_it;
}

bool Sanitizer::born_here(const LiveAllocation& a, const Device& d) const {
  const size_t i = static_cast<size_t>(std::find(devices_.begin(), devices_.end(), d) - devices_.begin());
  return !a.owner.is_persistent() && a.id > first_id_[i];
}

std::vector<autograd::NodeInfo> Sanitizer::surviving_nodes(int64_t step, std::optional<int64_t> microbatch) const {
  std::vector<autograd::NodeInfo> out;
  for (autograd::NodeInfo& n : autograd::live_nodes()) {
    if (n.sequence_nr < first_node_ || n.step != step) continue;
    // A leaf's accumulator is made by the first graph that uses the leaf and shared by
    // every later one, so a microbatch still in flight may hold it: it is checked at the
    // step boundary, where every graph of the step must be gone.
    if (microbatch && (n.microbatch != *microbatch || n.accumulator)) continue;
    out.push_back(std::move(n));
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.saved_bytes > y.saved_bytes; });
  return out;
}

void Sanitizer::report_nodes(const std::vector<autograd::NodeInfo>& nodes, const std::string& where, const char* why) {
  std::ostringstream os;
  os << nodes.size() << " autograd node(s) " << why << " are alive at " << where << ":";
  size_t shown = 0;
  for (const auto& n : nodes) {
    if (shown++ == 12) {
      os << "\n    ... and " << nodes.size() - 12 << " more";
      break;
    }
    os << "\n    " << n.op << " [" << (n.module_path.empty() ? "-" : n.module_path) << "] born "
       << birth_str(n.step, n.microbatch) << ", " << n.saved_tensors << " saved tensor(s) ("
       << format_bytes(n.saved_bytes) << ")";
    std::vector<std::string> cycles = autograd::find_cycles_through(*n.node);
    if (!cycles.empty()) {
      for (const std::string& c : cycles) os << "\n        kept alive by a reference cycle: " << c;
      continue;
    }
    const Holders holders = tensors_holding(n.node.get(), devices_);
    for (const std::string& h : holders.lines) os << "\n        held by " << h;
    if (holders.by_hook)
      os << "\n        (a hook outlives the graph it captured: remove it with the HookHandle register_hook "
            "returns, or capture a detached copy)";
    else if (!holders.lines.empty())
      os << "\n        (a graph-carrying tensor kept past its backward: keep a number or a detached copy, R4)";
  }
  report(IssueKind::LiveGraph, os.str());
}

void Sanitizer::report_allocations(const std::vector<LiveAllocation>& grown, const std::string& where,
                                   const std::string& why) {
  int64_t bytes = 0;
  for (const auto& a : grown) bytes += a.bytes;
  std::ostringstream os;
  os << format_bytes(bytes) << " in " << grown.size() << " allocation(s) " << why << " are alive at " << where
     << ":\n"
     << describe_allocations(grown);
  report(IssueKind::Growth, os.str());
}

Boundary Sanitizer::measure(int64_t microbatch) const {
  Boundary b;
  b.step = step_;
  b.microbatch = microbatch;
  for (Device d : devices_) {
    memory::Stats s = runtime::ledger(d).stats();
    b.live_non_persistent += s.live_non_persistent;
    b.allocated += s.allocated;
    b.peak_allocated += s.peak_allocated;
  }
  return b;
}

void Sanitizer::begin_step(int64_t step) {
  if (active()) {
    // Nodes recorded between the previous step and this one (an evaluation with grad on)
    // had no microbatch to end: they must be gone by the time the next step starts.
    auto between = surviving_nodes(previous_step_, kBetweenSteps);
    if (!between.empty()) report_nodes(between, "the start of step " + std::to_string(step), "recorded between steps");
    for (Device d : devices_) runtime::ledger(d).reset_peaks();
  }
  step_ = step;
  current_microbatch_ = -1;
  in_flight_.clear();
  Clock::set(step, -1);
}

// S1 for hooks: a hook registered every step or microbatch and never removed holds its
// captures and runs once more each backward; its count grows where its bytes may not.
void Sanitizer::check_hooks(const std::string& where, bool warming_up) {
  const std::vector<std::string> targets = live_hook_targets();
  const int64_t count = static_cast<int64_t>(targets.size());
  if (baseline_hooks_ >= 0 && !warming_up && count > baseline_hooks_) {
    std::map<std::string, int64_t> per_tensor;
    for (const std::string& t : targets) ++per_tensor[t];
    std::vector<std::pair<std::string, int64_t>> most(per_tensor.begin(), per_tensor.end());
    std::sort(most.begin(), most.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    std::string named;
    for (size_t i = 0; i < most.size() && i < 3; ++i)
      named += (i ? ", " : "") + std::to_string(most[i].second) + " on " + most[i].first;
    report(IssueKind::Growth, "gradient hooks alive went " + std::to_string(baseline_hooks_) + " -> " +
                                  std::to_string(count) + " at " + where + " (" + named +
                                  "): a hook registered every step or microbatch and never removed; keep the "
                                  "HookHandle register_hook returns and remove() it");
  }
  baseline_hooks_ = count;
}

void Sanitizer::end_run() {
  if (!active()) return;
  auto after = surviving_nodes(previous_step_, kBetweenSteps);
  if (!after.empty()) report_nodes(after, "the end of the run", "recorded after its last step");
}

void Sanitizer::begin_microbatch(int64_t id) {
  TALLY_CHECK(id >= 0, "sanitizer: microbatch ids are >= 0, got ", id);
  in_flight_.insert(id);
  current_microbatch_ = id;
  Clock::set(step_, id);
}

void Sanitizer::end_microbatch() {
  TALLY_CHECK(current_microbatch_ >= 0, "sanitizer: end_microbatch() with no microbatch begun");
  end_microbatch(current_microbatch_);
}

void Sanitizer::end_microbatch(int64_t id) {
  TALLY_CHECK(in_flight_.count(id), "sanitizer: end_microbatch(", id, ") in step ", step_,
              " but that microbatch was not begun (or already ended)");
  in_flight_.erase(id);
  if (current_microbatch_ == id) current_microbatch_ = -1;
  Clock::set(step_, current_microbatch_);
  Boundary b = measure(id);
  if (active()) {
    const std::string where = "the end of step " + std::to_string(step_) + " microbatch " + std::to_string(id);
    // S2: its graph is gone once its backward ran.
    std::vector<autograd::NodeInfo> nodes = surviving_nodes(step_, id);
    b.live_nodes = nodes.size();
    for (const auto& n : nodes) b.live_saved += n.saved_tensors;
    if (!nodes.empty()) report_nodes(nodes, where, "of this microbatch (its backward has run)");
    // S1: nothing graph-carrying it made survives; detached values may, until the step ends.
    std::vector<LiveAllocation> kept;
    for (Device d : devices_)
      for (LiveAllocation& a : runtime::ledger(d).live())
        if (born_here(a, d) && a.owner.step == step_ && a.owner.microbatch == id && graph_carrying(a))
          kept.push_back(std::move(a));
    if (!kept.empty())
      report_allocations(kept, where,
                         "of this microbatch that still carry graph state (activations, saved tensors, gradients of "
                         "leaves that are not registered parameters)");
  }
  if (keep_boundaries_) boundaries_.push_back(b);
}

void Sanitizer::end_step() {
  Boundary b = measure(-1);
  if (active()) {
    const std::string where = "the end of step " + std::to_string(step_);
    std::vector<autograd::NodeInfo> nodes = surviving_nodes(step_, std::nullopt);
    b.live_nodes = nodes.size();
    for (const auto& n : nodes) b.live_saved += n.saved_tensors;
    if (!nodes.empty()) report_nodes(nodes, where, "recorded in this step");
    const bool warming_up = steps_ended_ < warmup_steps_;
    std::vector<LiveAllocation> survivors;
    for (Device d : devices_)
      for (LiveAllocation& a : runtime::ledger(d).live())
        if (born_here(a, d) && born_this_step(a)) survivors.push_back(std::move(a));
    // Growth is more live bytes than the previous step ended with: a buffer re-made each step
    // in place of one of the same size (a moving average written out of place) is not.
    const bool grew = b.live_non_persistent > baseline_live_;
    if (grew && !survivors.empty() && !warming_up) {
      report_allocations(survivors, where,
                         "born in this step (or since the previous one) that are not persistent; live non-persistent "
                         "memory went " +
                             format_bytes(baseline_live_) + " -> " + format_bytes(b.live_non_persistent));
    } else if (grew && !warming_up) {
      report(IssueKind::Growth, "live non-persistent memory grew by " +
                                    format_bytes(b.live_non_persistent - baseline_live_) + " at " + where +
                                    " without a new allocation surviving (an allocation became non-persistent)");
    }
    baseline_live_ = b.live_non_persistent;
    // S1 through a persistent tag: persistent bytes (model states) are flat once a step has
    // made them (optimizer moments, in the first). A parameter's gradient is tagged
    // persistent when made and keeps its tag when set aside (set_grad(None)) and kept, so
    // only this check sees it grow. From the second step on, growth names the persistent
    // allocations this step made that are still alive.
    const int64_t persistent = b.allocated - b.live_non_persistent;
    if (baseline_persistent_ >= 0 && !warming_up && persistent > baseline_persistent_) {
      std::vector<LiveAllocation> made;
      for (size_t i = 0; i < devices_.size(); ++i)
        for (LiveAllocation& a : runtime::ledger(devices_[i]).live())
          if (a.owner.is_persistent() && a.id > first_id_[i] && born_this_step(a)) made.push_back(std::move(a));
      const std::string growth = "persistent memory went " + format_bytes(baseline_persistent_) + " -> " +
                                 format_bytes(persistent) + " (model states are made once: one that was set aside, "
                                 "such as a parameter's gradient dropped with set_grad and kept, is still tagged "
                                 "persistent)";
      if (!made.empty()) report_allocations(made, where, "tagged persistent and made in this step, while " + growth);
      else report(IssueKind::Growth, "at " + where + " " + growth + ", without a persistent allocation of this step alive");
    }
    baseline_persistent_ = persistent;
    check_hooks(where, warming_up);
  }
  if (keep_boundaries_) boundaries_.push_back(b);
  ++steps_ended_;
  previous_step_ = step_;
  current_microbatch_ = -1;
  in_flight_.clear();
  Clock::set(step_, kBetweenSteps);
}

std::vector<std::string> storage_holders(const Storage& storage) {
  std::vector<std::string> out;
  for (const auto& v : storage.views()) {
    std::string role = "no grad";
    if (auto* leaf = std::get_if<autograd::LeafState>(&v->autograd())) role = leaf->parameter ? "parameter" : "leaf";
    if (auto* in = std::get_if<autograd::InteriorState>(&v->autograd()))
      role = std::string("output of ") + in->grad_fn->name() +
             (in->grad_fn->module_path().empty() ? "" : " [" + in->grad_fn->module_path() + "]");
    out.push_back(tensor_label(*v) + " offset " + std::to_string(v->offset()) + ", " + role + hook_captures(v));
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
                  category_name(a.owner.category), a.owner.name_str().empty() ? "<unnamed>" : a.owner.name_str().c_str(),
                  birth_str(a.owner.step, a.owner.microbatch).c_str());
    os << line;
    if (auto storage = a.storage.lock()) {
      for (const auto& h : storage_holders(*storage)) os << "\n        held by " << h;
      for (const auto& v : storage->views())
        for (const std::string& c : autograd::find_cycles_through(*v))
          os << "\n        kept alive by a reference cycle: " << c;
    }
    if (a.stack && !a.stack->empty()) os << "\n        allocated at " << memory::symbolize(a.stack->front());
    os << "\n";
  }
  if (sorted.size() > max_rows) os << "    ... and " << sorted.size() - max_rows << " more\n";
  return os.str();
}

}  // namespace tally::sanitizer
