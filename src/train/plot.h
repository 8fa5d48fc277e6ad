// Loss curves as a picture: a self-contained SVG (no scripts, fonts or network) of one or
// more runs. For each run, in its own colour: the training loss raw (faint) and smoothed,
// the validation loss (points joined by a line), and the learning rate on a second axis
// (thin, dashed). The x axis is the step, with the tokens seen printed under each tick.
//
// The trainer rewrites <out-dir>/loss.svg at every validation and at the end;
// `tally plot a.jsonl b.jsonl -o runs.svg` draws the logs of several runs together.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tally::train {

struct RunCurve {
  std::string name;
  std::vector<int64_t> steps;   // one per logged step
  std::vector<double> loss;     // training loss of each step
  std::vector<double> lr;       // learning rate of each step
  std::vector<int64_t> tokens;  // tokens seen by the end of each step (0 when the log lacks them)
  std::vector<std::pair<int64_t, double>> val;  // (step, validation loss)

  void add_step(int64_t step, double loss, double lr, int64_t tokens);
  void add_val(int64_t step, double loss) { val.emplace_back(step, loss); }
};

// Reads a trainer log (--log-json: one JSON object per line). Errors name the file and line.
RunCurve read_run_log(const std::string& path, const std::string& name);

// The curve as one JSON object (a checkpoint's history.json: what a resumed run draws and
// takes its best validation loss from) and back. Doubles are written to round-trip exactly.
// Errors name `what` (the file).
std::string curve_to_json(const RunCurve& run);
RunCurve curve_from_json(const std::string& text, const std::string& what);

// The training loss smoothed by an exponential moving average (bias-corrected, so the first
// points are not pulled toward zero), as TensorBoard smooths: `weight` of the past.
// Values past 1e300, infinities and NaN are gaps: passed over, and kept as they are.
std::vector<double> smooth(const std::vector<double>& values, double weight = 0.9);

std::string render_loss_svg(const std::vector<RunCurve>& runs, const std::string& title = "training loss");
// Writes the SVG atomically; errors name the path.
void write_loss_svg(const std::string& path, const std::vector<RunCurve>& runs, const std::string& title = "training loss");

}  // namespace tally::train
