#include "memory/report.h"

#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <set>
#include <map>

#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/json_input.h"

namespace tally::memory {

namespace {
// Writes `text` whole through an AtomicFile: a full disk is an error naming the file, never
// a truncated report left behind as if complete.
void write_whole_file(const std::string& path, const std::string& text, const char* what) {
  AtomicFile out(path, what);
  out.write(text.data(), text.size());
  out.commit();
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

namespace {
// JSON text written straight to the file in 1 MiB pieces. A trace holds every alloc and free
// of the run: as one nlohmann document it would take ~4 KB of memory per event (a 9-key
// object each), tens of GB for a long run, at the very end of it.
class JsonStream {
 public:
  JsonStream(const std::string& path, const char* what) : file_(path, what) { buffer_.reserve(kFlushBytes + 4096); }
  JsonStream& raw(std::string_view text) {
    buffer_ += text;
    if (buffer_.size() >= kFlushBytes) flush();
    return *this;
  }
  // An int64, or a double as the shortest text that reads back as it (as nlohmann writes).
  template <class Number> JsonStream& number(Number v) {
    static_assert(std::is_same_v<Number, int64_t> || std::is_same_v<Number, double>);
    char text[32];
    return raw(std::string_view(text, static_cast<size_t>(std::to_chars(text, text + sizeof(text), v).ptr - text)));
  }
  JsonStream& string(const std::string& s) { return raw(nlohmann::json(s).dump()); }  // quoted and escaped
  void commit() {
    flush();
    file_.commit();
  }

 private:
  static constexpr size_t kFlushBytes = size_t{1} << 20;
  void flush() {
    file_.write(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  AtomicFile file_;
  std::string buffer_;
};
}  // namespace

void write_chrome_trace(const std::string& path, const std::vector<MemoryEvent>& events, int64_t instant_min_bytes,
                        const PlanParts& plan) {
  JsonStream out(path, "memory trace");
  std::array<std::string, kNumCategories> category_key;  // ",\"name\":" ready to write
  for (int c = 0; c < kNumCategories; ++c) {
    category_key[c].assign(c ? 1 : 0, ',');
    category_key[c] += nlohmann::json(category_name(static_cast<Category>(c))).dump();
    category_key[c] += ":";
  }
  out.raw("{\"traceEvents\":[");
  std::array<int64_t, kNumCategories> current{};
  bool first = true;
  for (const MemoryEvent& ev : events) {
    current[static_cast<int>(ev.category)] += ev.delta;
    out.raw(first ? "" : ",").raw("{\"ph\":\"C\",\"name\":\"memory\",\"ts\":").number(ev.time_us);
    out.raw(",\"pid\":0,\"tid\":0,\"args\":{");
    for (int c = 0; c < kNumCategories; ++c) out.raw(category_key[c]).number(current[c]);
    out.raw("}}");
    first = false;
    if (!ev.retag && (ev.delta >= instant_min_bytes || -ev.delta >= instant_min_bytes)) {
      out.raw(",{\"ph\":\"i\",\"s\":\"p\",\"name\":").raw(ev.delta > 0 ? "\"alloc\"" : "\"free\"");
      out.raw(",\"ts\":").number(ev.time_us).raw(",\"pid\":0,\"tid\":0,\"args\":{\"bytes\":").number(ev.delta);
      out.raw(",\"owner\":").string(name_of(ev.name)).raw(",\"category\":").string(category_name(ev.category));
      out.raw(",\"step\":").number(ev.step).raw(",\"microbatch\":").number(ev.microbatch);
      if (ev.stack && !ev.stack->empty()) {
        out.raw(",\"stack\":[");
        for (size_t f = 0; f < ev.stack->size(); ++f) out.raw(f ? "," : "").string(symbolize((*ev.stack)[f]));
        out.raw("]");
      }
      out.raw("}}");
    }
  }
  out.raw("],\"displayTimeUnit\":\"ms\",\"tally_memory\":{\"version\":1,\"categories\":[");
  for (int c = 0; c < kNumCategories; ++c) out.raw(c ? "," : "").string(category_name(static_cast<Category>(c)));
  out.raw("],\"plan\":[");  // [part, bytes] pairs, in the plan's order
  for (size_t i = 0; i < plan.size(); ++i)
    out.raw(i ? ",[" : "[").string(plan[i].first).raw(",").number(plan[i].second).raw("]");
  // Every event, compactly, for `tally memory report` and `tally memory diff` (Perfetto and
  // Chrome ignore keys they do not know): [time_us, delta, category, owner, step,
  // microbatch, id, retag], owners as indices into a name table.
  std::unordered_map<NameId, int64_t> owner_index;
  std::vector<NameId> owners;
  for (const MemoryEvent& ev : events)
    if (owner_index.emplace(ev.name, static_cast<int64_t>(owners.size())).second) owners.push_back(ev.name);
  out.raw("],\"owners\":[");
  for (size_t i = 0; i < owners.size(); ++i) out.raw(i ? "," : "").string(name_of(owners[i]));
  out.raw("],\"events\":[");
  first = true;
  for (const MemoryEvent& ev : events) {
    out.raw(first ? "[" : ",[").number(ev.time_us).raw(",").number(ev.delta).raw(",");
    out.number(static_cast<int64_t>(ev.category)).raw(",").number(owner_index.at(ev.name)).raw(",").number(ev.step);
    out.raw(",").number(ev.microbatch).raw(",").number(static_cast<int64_t>(ev.id)).raw(ev.retag ? ",1]" : ",0]");
    first = false;
  }
  out.raw("]}}");
  out.commit();
}

namespace {
// One event of a trace: [time_us, delta, category, owner, step, microbatch, id, retag].
// The owner's index goes to `owner_of` (the table may come after the events); `moved`
// sums the bytes moved, which must stay within 2^62.
MemoryEvent read_event(const nlohmann::json& e, const std::string& path, size_t index, std::vector<int64_t>* owner_of,
                       int64_t* moved) {
  TALLY_CHECK(e.is_array() && e.size() == 8, "memory trace '", path, "': event ", index, " is not an array of 8 numbers");
  // A time, then integers (get<int64_t> reads 1.7 bytes as 1).
  bool integers = e[0].is_number();
  for (size_t k = 1; k < 8; ++k) integers = integers && e[k].is_number_integer();
  TALLY_CHECK(integers, "memory trace '", path, "': event ", index, " is ", e.dump(), ", expected a time and 7 integers");
  MemoryEvent ev;
  ev.time_us = e[0].get<double>();
  ev.delta = e[1].get<int64_t>();
  // Byte counts within what an allocation can be, and all of them together within 2^62,
  // so the sums the report makes (by owner, by category, over time) cannot overflow.
  constexpr int64_t kMaxBytes = int64_t{1} << 62;
  TALLY_CHECK(ev.delta >= -kMaxBytes && ev.delta <= kMaxBytes, "memory trace '", path, "': event ", index, " moves ",
              ev.delta, " bytes, more than an allocation can hold (2^62)");
  TALLY_CHECK((ev.delta < 0 ? -ev.delta : ev.delta) <= kMaxBytes - *moved, "memory trace '", path, "': event ", index,
              " moves ", ev.delta, " bytes, which takes the bytes the trace moves past 2^62: the file is corrupt");
  *moved += ev.delta < 0 ? -ev.delta : ev.delta;
  const int64_t c = e[2].get<int64_t>();  // (read as an int, 2^32 + 3 would be 3)
  const int64_t o = e[3].get<int64_t>();
  TALLY_CHECK(c >= 0 && c < kNumCategories && o >= 0, "memory trace '", path, "': event ", index, " names category ", c,
              " or owner ", o, ", which do not exist");
  ev.category = static_cast<Category>(c);
  owner_of->push_back(o);
  ev.step = e[4].get<int64_t>();
  ev.microbatch = e[5].get<int64_t>();
  // Within what a run can reach: an edited 1e300 us or step 2^63 - 1 would draw the axis
  // as "-9223372036854775808 ms" and "step -9223372036854775808".
  constexpr double kMaxTimeUs = 1e15;  // 31 years
  constexpr int64_t kMaxStep = int64_t{1} << 40;
  TALLY_CHECK(std::isfinite(ev.time_us) && std::abs(ev.time_us) <= kMaxTimeUs, "memory trace '", path, "': event ", index,
              " is at time ", e[0].dump(), " us, expected a finite time within 1e15 us");
  TALLY_CHECK(ev.step >= -1 && ev.step <= kMaxStep && ev.microbatch >= kBetweenSteps && ev.microbatch <= kMaxStep,
              "memory trace '", path, "': event ", index, " is in step ", ev.step, ", microbatch ", ev.microbatch,
              ", expected steps from -1 (none) and microbatches from -2 (between steps) up to 2^40");
  ev.id = e[6].get<uint64_t>();
  const int64_t retag = e[7].get<int64_t>();
  TALLY_CHECK(retag == 0 || retag == 1, "memory trace '", path, "': event ", index, " has retag flag ", retag,
              ", expected 0 or 1");
  ev.retag = retag == 1;
  return ev;
}
}  // namespace

MemoryTrace read_memory_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TALLY_CHECK(in.good(), "memory trace '", path, "': cannot open");
  MemoryTrace trace;
  try {
    // Parsed from the stream, keeping only the tally_memory section: the Perfetto counters
    // beside it (a JSON object of every category an event) are for other tools, and read
    // into a document they would take ~8 bytes of memory a byte of file.
    // The events are read one at a time as the stream goes (a 3M-event trace is ~1 GB as a
    // document, ~170 MB as events); their owners are looked up once the table is read.
    std::vector<int64_t> owner_of;
    int64_t moved = 0;  // the sum of |delta|: bounded, no sum the report makes can overflow
    const std::function<void(nlohmann::json&&)> on_event = [&](nlohmann::json&& e) {
      trace.events.push_back(read_event(e, path, trace.events.size(), &owner_of, &moved));
    };
    const nlohmann::json doc = parse_json_keeping_syntax_errors(
        in, "memory trace '" + path + "'", [](const std::string& key) { return key == "tally_memory"; },
        {"tally_memory", "events"}, on_event);
    TALLY_CHECK(doc.is_object() && doc.contains("tally_memory"), "memory trace '", path,
                "': no tally_memory section (write it with `tally train --mem-trace F.json`)");
    const auto& t = doc["tally_memory"];
    TALLY_CHECK(t.value("version", 0) == 1, "memory trace '", path, "': version ", t.value("version", 0), ", expected 1");
    TALLY_CHECK(t.contains("events"), "memory trace '", path, "': no events");
    std::vector<NameId> names;
    for (const auto& o : t.at("owners")) names.push_back(intern_name(o.get<std::string>()));
    int64_t planned = 0;
    for (const auto& part : t.at("plan")) {
      const int64_t bytes = part.at(1).get<int64_t>();
      TALLY_CHECK(bytes >= 0 && bytes <= (int64_t{1} << 62) - planned, "memory trace '", path, "': plan part ",
                  part.at(0).dump(), " of ", bytes, " bytes: the parts must be sizes that sum within 2^62");
      planned += bytes;
      trace.plan.emplace_back(part.at(0).get<std::string>(), bytes);
    }
    for (size_t i = 0; i < trace.events.size(); ++i) {
      TALLY_CHECK(owner_of[i] < static_cast<int64_t>(names.size()), "memory trace '", path, "': event ", i,
                  " names owner ", owner_of[i], ", which does not exist");
      trace.events[i].name = names[static_cast<size_t>(owner_of[i])];
    }
  } catch (const nlohmann::json::parse_error& e) {
    // Say what the file is when it is one of tally's own others: a report page, a step log.
    std::ifstream again(path, std::ios::binary);
    char first = 0;
    while (again.get(first) && std::isspace(static_cast<unsigned char>(first))) {
    }
    // A document that ends inside itself was cut short (the parser ran out of input).
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    const bool cut_short = first == '{' && !ec && e.byte >= size;
    const char* what = first == '<' ? "an HTML page (a report; `--mem-trace F.json` writes the trace itself)"
                       : cut_short  ? "a trace cut short: it ends inside the document (tally writes traces whole, "
                                      "so this is a copy that did not finish)"
                                    : "a --log-json file, or not JSON at all";
    TALLY_FAIL("memory trace '", path, "' is not one JSON document (", e.what(),
               "): the memory tools read what `tally train --mem-trace F.json` writes; this looks like ", what);
  } catch (const nlohmann::json::exception& e) {
    TALLY_FAIL("memory trace '", path, "': ", e.what());
  }
  return trace;
}

namespace {

std::string escape_html(const std::string& text) {
  std::string out;
  for (char ch : text) out += ch == '<' ? std::string("&lt;") : ch == '>' ? std::string("&gt;") : ch == '&' ? std::string("&amp;") : std::string(1, ch);
  return out;
}

// The step an event happened in: allocations carry their step; frees carry the step their
// allocation was born in, so the current step is the latest seen so far.
std::vector<int64_t> current_steps(const std::vector<MemoryEvent>& events) {
  std::vector<int64_t> steps;
  int64_t now = -1;
  for (const MemoryEvent& ev : events) {
    if (ev.delta > 0 && !ev.retag) now = std::max(now, ev.step);
    steps.push_back(now);
  }
  return steps;
}

// One stacked-area chart: layer k's live bytes at each sampled event.
std::string stacked_areas(const std::vector<double>& times, const std::vector<std::vector<double>>& layers,
                          const std::vector<std::string>& names, const std::vector<int64_t>& steps, double ymax,
                          const char* id) {
  static const char* colours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                                  "#7f7f7f", "#bcbd22", "#17becf"};
  const double W = 900, H = 320, L = 70;
  const double t0 = times.empty() ? 0 : times.front(), t1 = times.empty() ? 1 : std::max(times.back(), t0 + 1);
  auto x = [&](double t) { return L + (t - t0) / (t1 - t0) * W; };
  auto y = [&](double bytes) { return 10 + H - bytes / ymax * H; };
  std::string svg = "<svg id='" + std::string(id) + "' width='" + std::to_string(static_cast<int>(L + W + 260)) +
                    "' height='" + std::to_string(static_cast<int>(H + 50)) + "' xmlns='http://www.w3.org/2000/svg'>";
  // Step bands: alternate shading, labelled.
  for (size_t i = 0; i < times.size();) {
    size_t j = i;
    while (j < times.size() && steps[j] == steps[i]) ++j;
    const double xa = x(times[i]), xb = x(j < times.size() ? times[j] : times.back());
    if (steps[i] >= 0) {
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "<rect class='stepband' x='%.1f' y='10' width='%.1f' height='%.0f' fill='%s'/>"
                    "<text x='%.1f' y='%.0f' font-size='10' fill='#888'>step %lld</text>",
                    xa, std::max(0.0, xb - xa), H, steps[i] % 2 ? "#f4f4f4" : "#fbfbfb", xa + 2, H + 24,
                    static_cast<long long>(steps[i] + 1));
      svg += buf;
    }
    i = j;
  }
  std::vector<double> below(times.size(), 0.0);
  for (size_t k = 0; k < layers.size(); ++k) {
    std::string top, bottom;
    for (size_t i = 0; i < times.size(); ++i) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.1f,%.1f ", x(times[i]), y(below[i] + layers[k][i]));
      top += buf;
    }
    for (size_t i = times.size(); i-- > 0;) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.1f,%.1f ", x(times[i]), y(below[i]));
      bottom += buf;
      below[i] += layers[k][i];
    }
    const char* colour = colours[k % (sizeof colours / sizeof colours[0])];
    svg += std::string("<polygon class='layer' fill='") + colour + "' fill-opacity='0.8' points='" + top + bottom + "'/>";
    svg += "<rect x='" + std::to_string(static_cast<int>(L + W + 10)) + "' y='" + std::to_string(12 + 18 * k) +
           "' width='10' height='10' fill='" + colour + "'/><text class='legend' x='" +
           std::to_string(static_cast<int>(L + W + 26)) + "' y='" + std::to_string(21 + 18 * k) + "' font-size='12'>" +
           escape_html(names[k]) + "</text>";
  }
  svg += "<text x='2' y='18' font-size='11'>" + format_bytes(static_cast<int64_t>(ymax)) + "</text><text x='2' y='" +
         std::to_string(static_cast<int>(H + 10)) + "' font-size='11'>0</text><text x='" + std::to_string(static_cast<int>(L + W - 60)) +
         "' y='" + std::to_string(static_cast<int>(H + 40)) + "' font-size='11'>" +
         std::to_string(static_cast<int64_t>((t1 - t0) / 1000)) + " ms</text></svg>";
  return svg;
}

}  // namespace

void write_html_report(const std::string& path, const std::vector<MemoryEvent>& events, const PlanParts& plan) {
  // Replay: live bytes per category and per owner, the peak moment, and who is alive then.
  std::array<int64_t, kNumCategories> by_category{};
  std::unordered_map<NameId, int64_t> by_owner;
  std::unordered_map<uint64_t, const MemoryEvent*> live;  // id -> its allocation
  int64_t total = 0, peak = 0;
  size_t peak_index = 0;
  // The training steps' own peak, which the plan predicts: the highest total an allocation
  // made inside a step reached (not the set-up's, nor what runs between steps: a
  // validation, the end-of-run sample).
  int64_t step_peak = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    const MemoryEvent& ev = events[i];
    by_category[static_cast<int>(ev.category)] += ev.delta;
    if (!ev.retag) {
      total += ev.delta;
      by_owner[ev.name] += ev.delta;
      if (ev.delta > 0) live[ev.id] = &ev;
      else live.erase(ev.id);
      if (ev.delta > 0 && ev.step >= 0 && ev.microbatch != kBetweenSteps) step_peak = std::max(step_peak, total);
    }
    if (total > peak) peak = total, peak_index = i;
  }
  // The owners drawn separately: the 8 holding most at the peak; the rest are "other".
  std::unordered_map<NameId, int64_t> at_peak;
  std::array<int64_t, kNumCategories> category_at_peak{};
  std::unordered_map<uint64_t, const MemoryEvent*> live_at_peak;
  std::unordered_map<uint64_t, Category> category_now;  // a live allocation's, after its retags
  {
    total = 0;
    for (size_t i = 0; i <= peak_index && i < events.size(); ++i) {
      const MemoryEvent& ev = events[i];
      category_at_peak[static_cast<int>(ev.category)] += ev.delta;
      if (ev.retag) {
        if (ev.delta > 0) category_now[ev.id] = ev.category;  // the half that enters the new category
        continue;
      }
      at_peak[ev.name] += ev.delta;
      if (ev.delta > 0) live_at_peak[ev.id] = &ev, category_now[ev.id] = ev.category;
      else live_at_peak.erase(ev.id), category_now.erase(ev.id);
    }
  }
  std::vector<std::pair<int64_t, NameId>> ranked;
  for (auto [name, bytes] : at_peak)
    if (bytes > 0) ranked.emplace_back(bytes, name);
  std::sort(ranked.rbegin(), ranked.rend());
  if (ranked.size() > 8) ranked.resize(8);
  std::unordered_map<NameId, size_t> owner_layer;
  std::vector<std::string> owner_names;
  for (auto [bytes, name] : ranked) owner_layer[name] = owner_names.size(), owner_names.push_back(name_of(name).empty() ? "(unnamed)" : name_of(name));
  owner_names.push_back("other");

  // Sample at most ~2000 moments (always the peak), replaying the running totals.
  const size_t stride = std::max<size_t>(1, events.size() / 2000);
  const std::vector<int64_t> event_steps = current_steps(events);
  std::vector<double> times;
  std::vector<int64_t> steps;
  std::vector<std::vector<double>> cat_layers(kNumCategories), owner_layers(owner_names.size());
  std::array<int64_t, kNumCategories> cat{};
  std::vector<int64_t> own(owner_names.size(), 0);
  for (size_t i = 0; i < events.size(); ++i) {
    const MemoryEvent& ev = events[i];
    cat[static_cast<int>(ev.category)] += ev.delta;
    if (!ev.retag) {
      auto it = owner_layer.find(ev.name);
      own[it == owner_layer.end() ? owner_names.size() - 1 : it->second] += ev.delta;
    }
    if (i % stride == 0 || i == peak_index || i + 1 == events.size()) {
      times.push_back(ev.time_us);
      steps.push_back(event_steps[i]);
      for (int c = 0; c < kNumCategories; ++c) cat_layers[c].push_back(static_cast<double>(cat[c]));
      for (size_t k = 0; k < own.size(); ++k) owner_layers[k].push_back(static_cast<double>(own[k]));
    }
  }
  std::vector<std::string> category_names;
  for (int c = 0; c < kNumCategories; ++c) category_names.push_back(category_name(static_cast<Category>(c)));
  const double ymax = std::max<double>(static_cast<double>(peak), 1);
  const double t0 = events.empty() ? 0 : events.front().time_us;

  std::string html = "<!doctype html><html><head><meta charset='utf-8'><title>tally memory report</title>"
                     "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;text-align:right}"
                     "td.owner{text-align:left}</style></head><body><h1>tally memory report</h1>";
  html += "<p id='summary'>" + std::to_string(events.size()) + " events; peak <b>" + format_bytes(peak) + "</b> at " +
          std::to_string(static_cast<int64_t>(((events.empty() ? 0 : events[peak_index].time_us) - t0) / 1000)) +
          " ms, in step " + std::to_string(events.empty() ? 0 : event_steps[peak_index] + 1) +
          " (steps counted from 1, as the step line does; step 0 is the set-up before training).</p>";
  html += "<h2>Live bytes by category</h2>" + stacked_areas(times, cat_layers, category_names, steps, ymax, "by-category");
  html += "<h2>Live bytes by owner</h2>" + stacked_areas(times, owner_layers, owner_names, steps, ymax, "by-owner");

  html += "<h2>At the peak, by category</h2><table id='peak-categories'><tr><th>category</th><th>measured</th></tr>";
  for (int c = 0; c < kNumCategories; ++c)
    if (category_at_peak[c] != 0)
      html += "<tr><td class='owner'>" + category_names[c] + "</td><td>" + format_bytes(category_at_peak[c]) + "</td></tr>";
  html += "</table>";
  if (!plan.empty()) {
    int64_t planned = 0;
    html += "<h2>The plan (tally plan)</h2><table id='plan'><tr><th>part</th><th>planned</th></tr>";
    for (const auto& [part, bytes] : plan) {
      planned += bytes;
      html += "<tr><td class='owner'>" + escape_html(part) + "</td><td>" + format_bytes(bytes) + "</td></tr>";
    }
    html += "<tr><td class='owner'><b>planned peak</b></td><td><b>" + format_bytes(planned) + "</b></td></tr>"
            "<tr><td class='owner'><b>measured peak in the training steps</b></td><td><b>" + format_bytes(step_peak) +
            "</b></td></tr>";
    if (peak > step_peak && !events.empty()) {
      const MemoryEvent& at = events[peak_index];
      const std::string where = at.step < 0 ? "in the set-up"
                                            : "after step " + std::to_string(at.step + 1) + " (a validation or a sample)";
      html += "<tr><td class='owner'>the run's peak, outside the training steps (" + where +
              "), which the plan does not model</td><td>" + format_bytes(peak) + "</td></tr>";
    }
    html += "</table>";
  }
  std::vector<const MemoryEvent*> holders;
  for (auto& [id, ev] : live_at_peak) holders.push_back(ev);
  std::sort(holders.begin(), holders.end(), [](auto* a, auto* b) { return a->delta != b->delta ? a->delta > b->delta : a->id < b->id; });
  html += "<h2>Who holds the peak</h2><table id='holders'><tr><th>bytes</th><th>category</th><th>owner</th>"
          "<th>born in step</th><th>microbatch</th></tr>";
  constexpr size_t kRows = 40;  // the largest; the rest are summed in one row
  int64_t rest = 0;
  for (size_t i = 0; i < holders.size(); ++i) {
    if (i >= kRows) {
      rest += holders[i]->delta;
      continue;
    }
    html += "<tr><td>" + format_bytes(holders[i]->delta) + "</td><td>" + category_name(category_now.at(holders[i]->id)) +
            "</td><td class='owner'>" + escape_html(name_of(holders[i]->name)) + "</td><td>" +
            std::to_string(holders[i]->step + 1) + "</td><td>" + std::to_string(holders[i]->microbatch) + "</td></tr>";
  }
  if (holders.size() > kRows)
    html += "<tr><td>" + format_bytes(rest) + "</td><td></td><td class='owner'>the other " +
            std::to_string(holders.size() - kRows) + " allocations</td><td></td><td></td></tr>";
  html += "</table><p>" + std::to_string(holders.size()) + " allocations were alive at the peak" +
          (holders.size() > kRows ? " (the " + std::to_string(kRows) + " largest listed)" : std::string()) +
          ".</p></body></html>\n";
  write_whole_file(path, html, "memory report");
}

std::string diff_memory_traces(const MemoryTrace& a, const MemoryTrace& b) {
  // Per owner: the most it held in each step (steps as current_steps numbers them: -1 the
  // set-up, then 0 for step 1 and on; the end of a run, its last validation, sample and
  // save, falls in its last step).
  using PerStep = std::map<int64_t, int64_t>;
  int64_t last_a = -1, last_b = -1;
  auto profile = [](const std::vector<MemoryEvent>& events, int64_t& last) {
    std::map<std::string, PerStep> out;
    std::unordered_map<NameId, int64_t> live;
    const std::vector<int64_t> steps = current_steps(events);
    for (size_t i = 0; i < events.size(); ++i) {
      const MemoryEvent& ev = events[i];
      last = std::max(last, steps[i]);
      if (ev.retag) continue;
      const int64_t now = live[ev.name] += ev.delta;
      int64_t& most = out[name_of(ev.name)][steps[i]];
      most = std::max(most, now);
    }
    return out;
  };
  const auto pa = profile(a.events, last_a), pb = profile(b.events, last_b);
  // Runs of different lengths are compared over the steps both have, and not over the
  // shorter one's last step, which also holds the end of its run: the longer one's extra
  // steps, and its end falling elsewhere, would list every owner.
  std::string out;
  int64_t compared_to = std::max(last_a, last_b);
  if (last_a != last_b) {
    compared_to = std::min(last_a, last_b) - 1;
    const bool a_shorter = last_a < last_b;
    out += "A has " + std::to_string(last_a + 1) + " steps and B " + std::to_string(last_b + 1) +
           ": compared over the set-up" +
           (compared_to >= 0 ? " and steps 1 to " + std::to_string(compared_to + 1) : std::string()) + " (step " +
           std::to_string(compared_to + 2) + " holds the end of " + (a_shorter ? "A" : "B") +
           "'s run: its last validation, sample and save)\n";
  }
  std::set<std::string> owners;
  for (auto& [o, _] : pa) owners.insert(o);
  for (auto& [o, _] : pb) owners.insert(o);
  struct Row {
    std::string owner;
    int64_t peak_a = 0, peak_b = 0, first_step = -2;
  };
  std::vector<Row> rows;
  int64_t same_most = 0;  // owners whose most held is the same, held at other moments
  for (const std::string& o : owners) {
    Row r;
    r.owner = o;
    const PerStep empty;
    const PerStep& sa = pa.count(o) ? pa.at(o) : empty;
    const PerStep& sb = pb.count(o) ? pb.at(o) : empty;
    std::set<int64_t> steps;
    for (auto& [s, v] : sa)
      if (s <= compared_to) steps.insert(s), r.peak_a = std::max(r.peak_a, v);
    for (auto& [s, v] : sb)
      if (s <= compared_to) steps.insert(s), r.peak_b = std::max(r.peak_b, v);
    for (int64_t s : steps) {
      const int64_t va = sa.count(s) ? sa.at(s) : 0, vb = sb.count(s) ? sb.at(s) : 0;
      if (va != vb) {
        r.first_step = s;
        break;
      }
    }
    if (r.first_step == -2) continue;
    if (r.peak_a == r.peak_b) ++same_most;
    else rows.push_back(r);
  }
  std::sort(rows.begin(), rows.end(), [](const Row& x, const Row& y) {
    return std::llabs(x.peak_b - x.peak_a) > std::llabs(y.peak_b - y.peak_a);
  });
  const std::string same_note =
      same_most == 0 ? std::string()
                     : std::to_string(same_most) + " owner" + (same_most == 1 ? "" : "s") +
                           " held the same most in both, at other moments (not listed)\n";
  if (rows.empty()) {
    out += same_most == 0 ? "no owner differs: every owner held the same bytes in every step compared\n"
                          : "no owner differs in the most it held; " + same_note;
    return out;
  }
  out += "owners that differ (largest change first): owner, most held in A -> in B, change, first step that differs "
         "(counted from 1; 0 is the set-up)\n";
  for (const Row& r : rows) {
    // A std::string row: a fixed buffer would cut a long owner's name, and its sizes, off.
    const std::string owner = r.owner.empty() ? std::string("(unnamed)") : r.owner;
    char sizes[160];
    std::snprintf(sizes, sizeof sizes, " %12s -> %-12s %s%s, first in step %lld\n", format_bytes(r.peak_a).c_str(),
                  format_bytes(r.peak_b).c_str(), r.peak_b >= r.peak_a ? "+" : "-",
                  format_bytes(std::llabs(r.peak_b - r.peak_a)).c_str(), static_cast<long long>(r.first_step + 1));
    out += "  " + owner + std::string(owner.size() < 40 ? 40 - owner.size() : 0, ' ') + sizes;
  }
  out += same_note;
  return out;
}

}  // namespace tally::memory
