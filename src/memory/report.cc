#include "memory/report.h"

#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace tally::memory {

namespace {
// Writes `text` to "<path>.tmp" and renames it over `path`, checking every step: a full disk
// is an error naming the file, never a truncated report left behind as if complete. (The
// memory layer sits below io's AtomicFile, hence this small copy of its steps.)
void write_whole_file(const std::string& path, const std::string& text, const char* what) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  TALLY_CHECK(f, "cannot write ", what, " '", path, "': ", std::strerror(errno));
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0;
  const int saved_errno = errno;
  if (std::fclose(f) != 0 || !written) {
    std::remove(tmp.c_str());
    TALLY_FAIL("failed writing ", what, " '", path, "': ", std::strerror(written ? errno : saved_errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = std::strerror(errno);
    std::remove(tmp.c_str());
    TALLY_FAIL("cannot rename '", tmp, "' to '", path, "': ", err);
  }
}
}  // namespace

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
      json iargs = {{"bytes", ev.delta}, {"owner", name_of(ev.name)}, {"category", category_name(ev.category)},
                    {"step", ev.step}, {"microbatch", ev.microbatch}};
      if (ev.stack && !ev.stack->empty()) {
        json frames = json::array();
        for (void* f : *ev.stack) frames.push_back(symbolize(f));
        iargs["stack"] = frames;
      }
      trace_events.push_back({{"ph", "i"}, {"s", "p"}, {"name", ev.delta > 0 ? "alloc" : "free"},
                              {"ts", ev.time_us}, {"pid", 0}, {"tid", 0}, {"args", iargs}});
    }
  }
  json doc = {{"traceEvents", trace_events}, {"displayTimeUnit", "ms"}};
  write_whole_file(path, doc.dump(), "memory trace");
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
    for (char ch : name_of(allocs[i]->name)) owner += ch == '<' ? std::string("&lt;") : ch == '&' ? std::string("&amp;") : std::string(1, ch);
    html += "<tr><td>" + format_bytes(allocs[i]->delta) + "</td><td>" + category_name(allocs[i]->category) + "</td><td>" +
            owner + "</td><td>" + std::to_string(allocs[i]->step) + "</td><td>" + std::to_string(allocs[i]->microbatch) +
            "</td></tr>";
  }
  html += "</table></body></html>\n";
  write_whole_file(path, html, "memory report");
}

}  // namespace tally::memory
