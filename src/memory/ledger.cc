#include "memory/ledger.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace tally::memory {

namespace {
double now_us() {
  using namespace std::chrono;
  static const auto t0 = steady_clock::now();
  return duration<double, std::micro>(steady_clock::now() - t0).count();
}

std::vector<void*> capture_stack() {
  void* frames[24];
  int n = backtrace(frames, 24);
  // Skip the ledger and allocator frames themselves.
  int skip = n > 3 ? 3 : 0;
  return std::vector<void*>(frames + skip, frames + n);
}
}  // namespace

uint64_t Ledger::on_alloc(int64_t bytes, OwnerTag owner) {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t id = next_id_++;
  auto c = static_cast<int>(owner.category);
  stats_.allocated += bytes;
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  stats_.allocated_by_category[c] += bytes;
  stats_.peak_by_category[c] = std::max(stats_.peak_by_category[c], stats_.allocated_by_category[c]);
  if (!owner.is_persistent()) stats_.live_non_persistent += bytes;
  stats_.num_allocs++;
  LiveAllocation rec;
  rec.id = id;
  rec.bytes = bytes;
  if (history_enabled_) {
    MemoryEvent ev{now_us(), bytes, owner.category, owner.name, owner.step, owner.microbatch, {}};
    if (history_stacks_) {
      ev.stack = capture_stack();
      rec.stack = ev.stack;
    }
    history_.push_back(std::move(ev));
  }
  rec.owner = std::move(owner);
  live_.emplace(id, std::move(rec));
  return id;
}

void Ledger::on_free(uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(id);
  if (it == live_.end()) return;
  const LiveAllocation& rec = it->second;
  auto c = static_cast<int>(rec.owner.category);
  stats_.allocated -= rec.bytes;
  stats_.allocated_by_category[c] -= rec.bytes;
  if (!rec.owner.is_persistent()) stats_.live_non_persistent -= rec.bytes;
  stats_.num_frees++;
  if (history_enabled_) {
    history_.push_back({now_us(), -rec.bytes, rec.owner.category, rec.owner.name, rec.owner.step,
                        rec.owner.microbatch, {}});
  }
  live_.erase(it);
}

void Ledger::on_reserve(int64_t delta) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.reserved += delta;
  stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
  if (delta > 0) stats_.num_system_allocs++;
}

void Ledger::on_cache_hit() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.num_cache_hits++;
}

void Ledger::attach_storage(uint64_t id, const Storage* storage) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(id);
  if (it != live_.end()) it->second.storage = storage;
}

void Ledger::detach_storage(uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(id);
  if (it != live_.end()) it->second.storage = nullptr;
}

void Ledger::retag(uint64_t id, Category category) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(id);
  if (it == live_.end()) return;
  OwnerTag& owner = it->second.owner;
  if (owner.category == category) return;
  int64_t bytes = it->second.bytes;
  const Category previous = owner.category;
  bool was_persistent = owner.is_persistent();
  stats_.allocated_by_category[static_cast<int>(owner.category)] -= bytes;
  owner.category = category;
  auto c = static_cast<int>(category);
  stats_.allocated_by_category[c] += bytes;
  stats_.peak_by_category[c] = std::max(stats_.peak_by_category[c], stats_.allocated_by_category[c]);
  bool now_persistent = owner.is_persistent();
  if (was_persistent && !now_persistent) stats_.live_non_persistent += bytes;
  if (!was_persistent && now_persistent) stats_.live_non_persistent -= bytes;
  if (history_enabled_) {  // a move between categories: -bytes from the old, +bytes to the new
    const double t = now_us();
    history_.push_back({t, -bytes, previous, owner.name, owner.step, owner.microbatch, {}, true});
    history_.push_back({t, bytes, category, owner.name, owner.step, owner.microbatch, {}, true});
  }
}

void Ledger::set_name(uint64_t id, const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(id);
  if (it != live_.end()) it->second.owner.name = name;
}

Stats Ledger::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void Ledger::reset_peaks() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_allocated = stats_.allocated;
  stats_.peak_reserved = stats_.reserved;
  stats_.peak_by_category = stats_.allocated_by_category;
}

std::vector<LiveAllocation> Ledger::live() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<LiveAllocation> out;
  out.reserve(live_.size());
  for (const auto& [id, rec] : live_) out.push_back(rec);
  return out;
}

LiveAllocation Ledger::find(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(id);
  return it == live_.end() ? LiveAllocation{} : it->second;
}

void Ledger::enable_history(bool enabled, bool with_stacks) {
  std::lock_guard<std::mutex> lock(mutex_);
  history_enabled_ = enabled;
  history_stacks_ = with_stacks;
}

std::vector<MemoryEvent> Ledger::history() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return history_;
}

void Ledger::clear_history() {
  std::lock_guard<std::mutex> lock(mutex_);
  history_.clear();
}

Ledger& ledger(Device device) {
  // One ledger per device, never destroyed: storages freed during static destruction
  // still report to it.
  static std::mutex mutex;
  static auto* ledgers = new std::map<std::pair<int, int>, std::unique_ptr<Ledger>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(static_cast<int>(device.type), device.index);
  auto& slot = (*ledgers)[key];
  if (!slot) slot = std::make_unique<Ledger>(device);
  return *slot;
}

std::string symbolize(void* address) {
  Dl_info info;
  if (dladdr(address, &info) && info.dli_sname) {
    int status = 0;
    std::unique_ptr<char, void (*)(void*)> demangled(
        abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status), std::free);
    return status == 0 && demangled ? demangled.get() : info.dli_sname;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", address);
  return buf;
}

std::string format_bytes(int64_t bytes) {
  char buf[64];
  double b = static_cast<double>(bytes);
  double a = b < 0 ? -b : b;
  if (a >= (1LL << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1LL << 30));
  else if (a >= (1LL << 20)) std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1LL << 20));
  else if (a >= (1LL << 10)) std::snprintf(buf, sizeof buf, "%.1f KiB", b / (1LL << 10));
  else std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  return buf;
}

void write_chrome_trace(const std::string& path, const std::vector<MemoryEvent>& events,
                        int64_t instant_min_bytes) {
  using nlohmann::json;
  json trace_events = json::array();
  std::array<int64_t, kNumCategories> current{};
  for (const MemoryEvent& ev : events) {
    current[static_cast<int>(ev.category)] += ev.delta;
    json args = json::object();
    for (int c = 0; c < kNumCategories; ++c) args[category_name(static_cast<Category>(c))] = current[c];
    trace_events.push_back({{"ph", "C"}, {"name", "memory"}, {"ts", ev.time_us}, {"pid", 0}, {"tid", 0}, {"args", args}});
    if (!ev.retag && (ev.delta >= instant_min_bytes || -ev.delta >= instant_min_bytes)) {
      json iargs = {{"bytes", ev.delta}, {"owner", ev.name}, {"category", category_name(ev.category)},
                    {"step", ev.step}, {"microbatch", ev.microbatch}};
      if (!ev.stack.empty()) {
        json frames = json::array();
        for (void* f : ev.stack) frames.push_back(symbolize(f));
        iargs["stack"] = frames;
      }
      trace_events.push_back({{"ph", "i"}, {"s", "p"}, {"name", ev.delta > 0 ? "alloc" : "free"},
                              {"ts", ev.time_us}, {"pid", 0}, {"tid", 0}, {"args", iargs}});
    }
  }
  json doc = {{"traceEvents", trace_events}, {"displayTimeUnit", "ms"}};
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    TALLY_CHECK(out.good(), "cannot write memory trace '", path, "'");
    out << doc.dump();
    TALLY_CHECK(out.good(), "failed writing memory trace '", path, "'");
  }
  TALLY_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '", tmp, "' to '", path, "'");
}

void write_html_report(const std::string& path, const std::vector<MemoryEvent>& events) {
  // Sample the per-category running totals at every event, then draw one stacked polyline
  // per category (areas would need a stacking pass; lines of cumulative sums read the same).
  std::vector<double> times;
  std::vector<std::array<double, kNumCategories + 1>> cumulative;  // stacked sums, [0] = 0
  std::array<int64_t, kNumCategories> current{};
  int64_t peak = 0;
  double peak_time = 0;
  for (const MemoryEvent& ev : events) {
    current[static_cast<int>(ev.category)] += ev.delta;
    std::array<double, kNumCategories + 1> row{};
    for (int c = 0; c < kNumCategories; ++c) row[c + 1] = row[c] + static_cast<double>(current[c]);
    if (row[kNumCategories] > peak) peak = static_cast<int64_t>(row[kNumCategories]), peak_time = ev.time_us;
    times.push_back(ev.time_us);
    cumulative.push_back(row);
  }
  const double W = 1000, H = 400;
  const double t0 = times.empty() ? 0 : times.front(), t1 = times.empty() ? 1 : std::max(times.back(), t0 + 1);
  const double ymax = std::max<double>(static_cast<double>(peak), 1);
  static const char* colours[kNumCategories] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                                "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"};
  std::string html = "<!doctype html><html><head><meta charset='utf-8'><title>tally memory report</title>"
                     "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;text-align:right}</style>"
                     "</head><body><h1>tally memory report</h1>";
  html += "<p>" + std::to_string(events.size()) + " alloc/free events; peak " + format_bytes(peak) + " at " +
          std::to_string(static_cast<int64_t>((peak_time - t0) / 1000)) + " ms.</p>";
  html += "<svg width='" + std::to_string(static_cast<int>(W) + 220) + "' height='" + std::to_string(static_cast<int>(H) + 40) +
          "' xmlns='http://www.w3.org/2000/svg'><rect x='0' y='0' width='" + std::to_string(static_cast<int>(W)) +
          "' height='" + std::to_string(static_cast<int>(H)) + "' fill='#fafafa' stroke='#ccc'/>";
  for (int c = 0; c < kNumCategories; ++c) {
    std::string points;
    for (size_t i = 0; i < times.size(); i += std::max<size_t>(1, times.size() / 4000)) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.1f,%.1f ", (times[i] - t0) / (t1 - t0) * W, H - cumulative[i][c + 1] / ymax * H);
      points += buf;
    }
    html += std::string("<polyline fill='none' stroke='") + colours[c] + "' stroke-width='1.5' points='" + points + "'/>";
    html += "<text x='" + std::to_string(static_cast<int>(W) + 10) + "' y='" + std::to_string(20 + 20 * c) + "' fill='" +
            colours[c] + "'>" + category_name(static_cast<Category>(c)) + " (cumulative)</text>";
  }
  html += "<text x='4' y='" + std::to_string(static_cast<int>(H) + 20) + "'>0</text><text x='" +
          std::to_string(static_cast<int>(W) - 80) + "' y='" + std::to_string(static_cast<int>(H) + 20) + "'>" +
          std::to_string(static_cast<int64_t>((t1 - t0) / 1000)) + " ms</text></svg>";
  // The largest allocations seen, with their owners.
  std::vector<const MemoryEvent*> allocs;
  for (const MemoryEvent& ev : events)
    if (ev.delta > 0 && !ev.retag) allocs.push_back(&ev);
  std::sort(allocs.begin(), allocs.end(), [](auto* a, auto* b) { return a->delta > b->delta; });
  html += "<h2>Largest allocations</h2><table><tr><th>size</th><th>category</th><th>owner</th><th>step</th><th>microbatch</th></tr>";
  for (size_t i = 0; i < allocs.size() && i < 30; ++i) {
    std::string owner;
    for (char ch : allocs[i]->name) owner += ch == '<' ? std::string("&lt;") : ch == '&' ? std::string("&amp;") : std::string(1, ch);
    html += "<tr><td>" + format_bytes(allocs[i]->delta) + "</td><td>" + category_name(allocs[i]->category) + "</td><td>" +
            owner + "</td><td>" + std::to_string(allocs[i]->step) + "</td><td>" + std::to_string(allocs[i]->microbatch) +
            "</td></tr>";
  }
  html += "</table></body></html>\n";
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    TALLY_CHECK(out.good(), "cannot write memory report '", path, "'");
    out << html;
  }
  TALLY_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '", tmp, "' to '", path, "'");
}

}  // namespace tally::memory
