#include "train/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/json_input.h"

namespace tally::train {

void RunCurve::add_step(int64_t step, double l, double rate, int64_t t) {
  steps.push_back(step);
  loss.push_back(l);
  lr.push_back(rate);
  tokens.push_back(t);
}

RunCurve read_run_log(const std::string& path, const std::string& name) {
  std::ifstream in(path, std::ios::binary);
  TALLY_CHECK(in.good(), "plot: cannot read log '", path, "'");
  std::stringstream whole;
  whole << in.rdbuf();
  const std::string text = whole.str();
  // A last row without its newline is one a kill cut short: skipped, as resume skips it.
  const bool last_row_torn = !text.empty() && text.back() != '\n';
  RunCurve run;
  run.name = name;
  std::istringstream rows(text);
  std::string line;
  for (int64_t n = 1; std::getline(rows, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = parse_json_keeping_syntax_errors(line, "plot: log '" + path + "' line " + std::to_string(n));
    } catch (const nlohmann::json::exception& e) {
      if (last_row_torn && rows.peek() == std::char_traits<char>::eof()) break;
      TALLY_FAIL("plot: log '", path, "' line ", n, " is not JSON: ", e.what());
    }
    TALLY_CHECK(j.is_object() && j.contains("step") && j["step"].is_number() && j.contains("loss") && j["loss"].is_number(),
                "plot: log '", path, "' line ", n, " has no numeric \"step\" and \"loss\" (is it a tally --log-json file?)");
    // A whole number a double holds exactly (the axis is drawn in doubles): get<int64_t>
    // reads 1.5 as 1, and 1e300 is out of its range (undefined behaviour).
    const nlohmann::json& step_json = j["step"];
    constexpr double kLargestStep = 9007199254740992.0;  // 2^53
    TALLY_CHECK(step_json.is_number_integer() && step_json.get<double>() >= 0 && step_json.get<double>() < kLargestStep,
                "plot: log '", path, "' line ", n, ": \"step\" ", step_json.dump(),
                " is not a step number (a whole number from 0 to 2^53)");
    try {
      const int64_t step = step_json.get<int64_t>();
      run.add_step(step, j["loss"].get<double>(), j.value("lr", 0.0), j.value("tokens", int64_t{0}));
      if (j.contains("val_loss") && j["val_loss"].is_number()) run.add_val(step, j["val_loss"].get<double>());
    } catch (const nlohmann::json::exception& e) {  // "lr": "fast" and the like
      TALLY_FAIL("plot: log '", path, "' line ", n, ": ", e.what());
    }
  }
  TALLY_CHECK(!run.steps.empty(), "plot: log '", path, "' has no steps");
  return run;
}

std::string curve_to_json(const RunCurve& run) {
  nlohmann::json j = {{"steps", run.steps}, {"loss", run.loss}, {"lr", run.lr}, {"tokens", run.tokens}};
  nlohmann::json val = nlohmann::json::array();
  for (const auto& [step, loss] : run.val) val.push_back({step, loss});
  j["val"] = val;
  return j.dump() + "\n";
}

RunCurve curve_from_json(const std::string& text, const std::string& what) {
  RunCurve run;
  try {
    const nlohmann::json j = parse_json_keeping_syntax_errors(text, "run history '" + what + "'");
    run.steps = j.at("steps").get<std::vector<int64_t>>();
    run.loss = j.at("loss").get<std::vector<double>>();
    run.lr = j.at("lr").get<std::vector<double>>();
    run.tokens = j.at("tokens").get<std::vector<int64_t>>();
    // A validation loss that was not finite is written as null (JSON has no NaN): skipped,
    // as read_run_log skips a row's non-numeric val_loss.
    for (const auto& point : j.at("val"))
      if (!point.at(1).is_null()) run.add_val(point.at(0).get<int64_t>(), point.at(1).get<double>());
  } catch (const nlohmann::json::exception& e) {
    TALLY_FAIL("run history '", what, "': ", e.what());
  }
  TALLY_CHECK(run.loss.size() == run.steps.size() && run.lr.size() == run.steps.size() &&
                  run.tokens.size() == run.steps.size(),
              "run history '", what, "': ", run.steps.size(), " steps but ", run.loss.size(), " losses, ", run.lr.size(),
              " learning rates and ", run.tokens.size(), " token counts");
  return run;
}

// Whether a value can be drawn: a number not past 1e300, so that a range between two of them
// (1e308 - -1e308 overflows) and every coordinate stay finite. Others are gaps, as NaN is.
static bool plottable(double v) { return std::isfinite(v) && std::abs(v) <= 1e300; }

std::vector<double> smooth(const std::vector<double>& values, double weight) {
  std::vector<double> out;
  out.reserve(values.size());
  double average = 0, norm = 0;
  for (double v : values) {
    if (!plottable(v)) {  // a gap, which the average passes over
      out.push_back(v);
      continue;
    }
    average = weight * average + (1 - weight) * v;
    norm = weight * norm + (1 - weight);
    out.push_back(average / norm);
  }
  return out;
}

namespace {

// About `count` round tick values (1, 2 or 5 times a power of ten) covering [lo, hi];
// whole numbers only for an axis of whole numbers (steps: a 4-step run's ticks would
// otherwise be 1, 1.5, 2, ..., printed as 1, 2, 2, 2, ...).
std::vector<double> nice_ticks(double lo, double hi, int count, bool whole_numbers = false) {
  if (!(hi > lo)) hi = lo + 1;
  const double raw = (hi - lo) / count;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double unit = raw / mag < 1.5 ? 1 : raw / mag < 3 ? 2 : raw / mag < 7 ? 5 : 10;
  const double step = whole_numbers ? std::max(1.0, unit * mag) : unit * mag;
  std::vector<double> ticks;
  // (Bounded: where t + step == t a double cannot step on, and the loop would never end.)
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9 && ticks.size() < 100; t += step) {
    ticks.push_back(t);
    if (t + step == t) break;
  }
  return ticks;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '&') out += "&amp;";
    else if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string count_label(double n) {  // 1234567 -> "1.23M", 3840 -> "3.8k"
  if (n >= 1e9) return fmt(n >= 1e10 ? "%.0fG" : "%.2fG", n / 1e9);
  if (n >= 1e6) return fmt(n >= 1e8 ? "%.0fM" : n >= 1e7 ? "%.1fM" : "%.2fM", n / 1e6);
  if (n >= 1e3) return fmt(n >= 1e4 ? "%.0fk" : "%.1fk", n / 1e3);
  return fmt("%.0f", n);
}

const char* const kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};

}  // namespace

namespace {

// The plot's geometry: the page, the plotting box, and the data ranges it maps onto them.
struct Frame {
  double W = 960, H = 540, left = 80, right = 960 - 90, top = 56, bottom = 540 - 92;
  double s0 = 0, s1 = 1, l0 = 0, l1 = 1, lr1 = 1;  // steps, losses (padded), the largest learning rate
  double X(double step) const { return left + (step - s0) / (s1 - s0) * (right - left); }
  double Y(double loss) const { return bottom - (loss - l0) / (l1 - l0) * (bottom - top); }
  double YR(double lr) const { return bottom - lr / (lr1 * 1.05) * (bottom - top); }
};

Frame frame_of(const std::vector<RunCurve>& runs) {
  Frame f;
  double s0 = std::numeric_limits<double>::max(), s1 = std::numeric_limits<double>::lowest();
  double l0 = s0, l1 = s1, lr1 = 0;
  for (const RunCurve& r : runs) {
    for (size_t i = 0; i < r.steps.size(); ++i) {
      s0 = std::min(s0, static_cast<double>(r.steps[i]));
      s1 = std::max(s1, static_cast<double>(r.steps[i]));
      if (plottable(r.loss[i])) l0 = std::min(l0, r.loss[i]), l1 = std::max(l1, r.loss[i]);
      if (plottable(r.lr[i])) lr1 = std::max(lr1, r.lr[i]);
    }
    for (auto& [step, v] : r.val)
      if (plottable(v)) l0 = std::min(l0, v), l1 = std::max(l1, v);
  }
  if (s1 <= s0) s1 = s0 + 1;
  if (!(l1 > l0)) l1 = l0 + 1;
  const double pad = 0.04 * (l1 - l0);
  f.s0 = s0, f.s1 = s1, f.l0 = l0 - pad, f.l1 = l1 + pad, f.lr1 = lr1 <= 0 ? 1 : lr1;
  return f;
}

// At most ~1500 points per line: a long run is drawn from every k-th point.
std::string polyline(const std::vector<std::pair<double, double>>& pts, const std::string& attrs) {
  std::string p;
  const size_t stride = std::max<size_t>(1, pts.size() / 1500);
  for (size_t i = 0; i < pts.size(); i += stride) p += fmt("%.1f", pts[i].first) + "," + fmt("%.1f", pts[i].second) + " ";
  if (!pts.empty() && (pts.size() - 1) % stride) p += fmt("%.1f", pts.back().first) + "," + fmt("%.1f", pts.back().second);
  return "<polyline fill='none' " + attrs + " points='" + p + "'/>\n";
}

// The tokens under each step tick, read from the run that goes furthest and logged them.
const RunCurve* run_with_tokens(const std::vector<RunCurve>& runs) {
  const RunCurve* with_tokens = nullptr;
  for (const RunCurve& r : runs)
    if (!r.tokens.empty() && r.tokens.back() > 0 && (!with_tokens || r.steps.back() > with_tokens->steps.back()))
      with_tokens = &r;
  return with_tokens;
}

std::string draw_step_ticks(const Frame& f, const RunCurve* with_tokens) {
  std::string svg;
  for (double t : nice_ticks(f.s0, f.s1, 8, /*whole_numbers=*/true)) {
    const double x = f.X(t);
    svg += "<line x1='" + fmt("%.1f", x) + "' x2='" + fmt("%.1f", x) + "' y1='" + fmt("%.1f", f.top) + "' y2='" +
           fmt("%.1f", f.bottom) + "' stroke='#f0f0f0'/>\n";
    // Steps in full: rounded ("1.1k", "100k"), ticks 50 or 200 apart would print alike.
    svg += "<text class='xtick' x='" + fmt("%.1f", x) + "' y='" + fmt("%.1f", f.bottom + 18) + "' text-anchor='middle'>" +
           fmt("%.0f", t) + "</text>\n";
    if (!with_tokens) continue;
    const auto& st = with_tokens->steps;
    const size_t i = static_cast<size_t>(std::lower_bound(st.begin(), st.end(), static_cast<int64_t>(std::llround(t))) - st.begin());
    if (i < st.size())
      svg += "<text class='tokentick' x='" + fmt("%.1f", x) + "' y='" + fmt("%.1f", f.bottom + 34) +
             "' text-anchor='middle' fill='#777'>" + count_label(static_cast<double>(with_tokens->tokens[i])) + "</text>\n";
  }
  return svg;
}

// The grid, ticks and labels of both axes, the box and the axes' names.
std::string draw_axes(const Frame& f, const std::vector<RunCurve>& runs) {
  std::string svg;
  for (double t : nice_ticks(f.l0, f.l1, 6)) {
    svg += "<line x1='" + fmt("%.1f", f.left) + "' x2='" + fmt("%.1f", f.right) + "' y1='" + fmt("%.1f", f.Y(t)) + "' y2='" +
           fmt("%.1f", f.Y(t)) + "' stroke='#e6e6e6'/>\n";
    svg += "<text class='ytick' x='" + fmt("%.1f", f.left - 8) + "' y='" + fmt("%.1f", f.Y(t) + 4) + "' text-anchor='end'>" +
           fmt(f.l1 - f.l0 < 2 ? "%.2f" : "%.1f", t) + "</text>\n";
  }
  for (double t : nice_ticks(0, f.lr1 * 1.05, 5))
    svg += "<text class='lrtick' x='" + fmt("%.1f", f.right + 8) + "' y='" + fmt("%.1f", f.YR(t) + 4) + "' fill='#777'>" +
           fmt("%.2g", t) + "</text>\n";
  const RunCurve* with_tokens = run_with_tokens(runs);
  svg += draw_step_ticks(f, with_tokens);
  svg += "<rect x='" + fmt("%.1f", f.left) + "' y='" + fmt("%.1f", f.top) + "' width='" + fmt("%.1f", f.right - f.left) +
         "' height='" + fmt("%.1f", f.bottom - f.top) + "' fill='none' stroke='#999'/>\n";
  svg += "<text class='axis' x='" + fmt("%.1f", (f.left + f.right) / 2) + "' y='" + fmt("%.1f", f.H - 34) +
         "' text-anchor='middle'>step" + std::string(with_tokens ? " (tokens seen, in grey)" : "") + "</text>\n";
  svg += "<text class='axis' transform='translate(22," + fmt("%.1f", (f.top + f.bottom) / 2) +
         ") rotate(-90)' text-anchor='middle'>loss</text>\n";
  svg += "<text class='axis' transform='translate(" + fmt("%.1f", f.W - 14) + "," + fmt("%.1f", (f.top + f.bottom) / 2) +
         ") rotate(90)' text-anchor='middle' fill='#777'>learning rate</text>\n";
  return svg;
}

// Run k's curves: the learning rate, the raw and smoothed training loss, the validation.
std::string draw_run(const Frame& f, const RunCurve& r, size_t k, const std::string& colour) {
  std::vector<std::pair<double, double>> raw, smoothed, lr, val;
  const std::vector<double> s = smooth(r.loss);
  for (size_t i = 0; i < r.steps.size(); ++i) {
    const double x = f.X(static_cast<double>(r.steps[i]));
    if (plottable(r.lr[i])) lr.emplace_back(x, f.YR(r.lr[i]));
    if (!plottable(r.loss[i])) continue;
    raw.emplace_back(x, f.Y(r.loss[i]));
    if (plottable(s[i])) smoothed.emplace_back(x, f.Y(s[i]));
  }
  for (auto& [step, v] : r.val)
    if (plottable(v)) val.emplace_back(f.X(static_cast<double>(step)), f.Y(v));
  const std::string run = "run-" + std::to_string(k) + "' stroke='" + colour;
  std::string svg = polyline(lr, "class='lr " + run + "' stroke-width='1' stroke-dasharray='5 4' opacity='0.6'");
  svg += polyline(raw, "class='train-raw " + run + "' stroke-width='1' opacity='0.25'");
  svg += polyline(smoothed, "class='train " + run + "' stroke-width='2.2'");
  if (val.empty()) return svg;
  svg += polyline(val, "class='val " + run + "' stroke-width='1.6' opacity='0.9'");
  for (auto& [x, y] : val)
    svg += "<circle class='val-point run-" + std::to_string(k) + "' cx='" + fmt("%.1f", x) + "' cy='" + fmt("%.1f", y) +
           "' r='3.5' fill='#fff' stroke='" + colour + "' stroke-width='1.8'/>\n";
  return svg;
}

// Every run's curves, and a legend naming each.
std::string draw_runs(const Frame& f, const std::vector<RunCurve>& runs) {
  std::string svg, legend;
  double ly = f.top + 14;
  auto legend_row = [&](const std::string& sample, const std::string& label) {
    legend += sample + "<text class='legend' x='" + fmt("%.1f", f.right - 200) + "' y='" + fmt("%.1f", ly + 4) + "'>" +
              escape(label) + "</text>\n";
    ly += 18;
  };
  for (size_t k = 0; k < runs.size(); ++k) {
    const RunCurve& r = runs[k];
    const std::string colour = kColours[k % (sizeof kColours / sizeof *kColours)];
    svg += draw_run(f, r, k, colour);
    const std::string prefix = runs.size() > 1 || !r.name.empty() ? r.name + ": " : "";
    const double sx = f.right - 230;
    const std::string line = "<line x1='" + fmt("%.1f", sx) + "' x2='" + fmt("%.1f", sx + 22) + "' y1='" + fmt("%.1f", ly) +
                             "' y2='" + fmt("%.1f", ly) + "' stroke='" + colour + "'";
    legend_row(line + " stroke-width='2.2'/>", prefix + "train (smoothed)");
    if (!r.val.empty())
      legend_row("<circle cx='" + fmt("%.1f", sx + 11) + "' cy='" + fmt("%.1f", ly) + "' r='3.5' fill='#fff' stroke='" + colour +
                     "' stroke-width='1.8'/>",
                 prefix + "validation");
    const std::string lr_line = "<line x1='" + fmt("%.1f", sx) + "' x2='" + fmt("%.1f", sx + 22) + "' y1='" + fmt("%.1f", ly) +
                                "' y2='" + fmt("%.1f", ly) + "' stroke='" + colour + "'";
    legend_row(lr_line + " stroke-dasharray='5 4' opacity='0.6'/>", prefix + "learning rate");
  }
  return svg + "<rect class='legend-box' x='" + fmt("%.1f", f.right - 238) + "' y='" + fmt("%.1f", f.top + 4) +
         "' width='232' height='" + fmt("%.1f", ly - f.top - 8) + "' fill='#ffffff' fill-opacity='0.85' stroke='#ddd'/>\n" +
         legend;
}

}  // namespace

std::string render_loss_svg(const std::vector<RunCurve>& runs, const std::string& title) {
  TALLY_CHECK(!runs.empty(), "plot: no runs to draw");
  const Frame f = frame_of(runs);
  std::string svg = "<svg xmlns='http://www.w3.org/2000/svg' width='" + fmt("%.0f", f.W) + "' height='" + fmt("%.0f", f.H) +
                    "' viewBox='0 0 " + fmt("%.0f", f.W) + " " + fmt("%.0f", f.H) +
                    "' font-family='DejaVu Sans, Arial, sans-serif' font-size='13'>\n";
  svg += "<rect width='100%' height='100%' fill='#ffffff'/>\n";
  svg += "<text class='title' x='" + fmt("%.0f", f.left) + "' y='30' font-size='18' font-weight='bold'>" + escape(title) + "</text>\n";
  svg += draw_axes(f, runs);
  svg += draw_runs(f, runs);
  svg += "</svg>\n";
  return svg;
}

void write_loss_svg(const std::string& path, const std::vector<RunCurve>& runs, const std::string& title) {
  const std::string svg = render_loss_svg(runs, title);
  AtomicFile out(path);
  out.write(svg.data(), svg.size());
  out.commit();
}

}  // namespace tally::train
