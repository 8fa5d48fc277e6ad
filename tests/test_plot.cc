// Loss plots: the SVG the trainer writes and `tally plot` draws, checked as text and, when
// Debian's chromium is installed (scripts/setup.sh installs it), rendered by a real
// headless browser: the browser lays the SVG out and reports what it drew.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include "support.h"
#include "train/plot.h"
#include "train/trainer.h"

using namespace tally;
namespace fs = std::filesystem;

namespace {
train::RunCurve fake_run(const std::string& name, double start, double floor, int steps, int val_every) {
  train::RunCurve r;
  r.name = name;
  for (int s = 1; s <= steps; ++s) {
    const double loss = floor + (start - floor) * std::exp(-s / 40.0) + 0.15 * std::sin(s * 1.7);
    const double lr = 1e-3 * std::min(1.0, s / 20.0) * (0.55 + 0.45 * std::cos(M_PI * s / steps));
    r.add_step(s, loss, lr, static_cast<int64_t>(s) * 512);
    if (s % val_every == 0) r.add_val(s, floor + (start - floor) * std::exp(-s / 40.0) + 0.1);
  }
  return r;
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

int run_command(const std::string& command, std::string* output) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return -1;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, pipe)) *output += buf;
  return pclose(pipe);
}

}  // namespace

TEST(Plot, SmoothingIsBiasCorrected) {
  EXPECT_EQ(train::smooth({4, 4, 4}), (std::vector<double>{4, 4, 4}));
  const auto s = train::smooth({0, 10}, 0.5);
  EXPECT_DOUBLE_EQ(s[0], 0);
  EXPECT_DOUBLE_EQ(s[1], (0.5 * 0.5 * 0 + 0.5 * 10) / (0.5 * 0.5 + 0.5));
}

TEST(Plot, DrawsEverySeriesOfEveryRunWithALegend) {
  const std::string svg = train::render_loss_svg({fake_run("small", 10.8, 5, 300, 50), fake_run("wide", 10.8, 4.6, 200, 40)});
  EXPECT_EQ(svg.rfind("<svg xmlns='http://www.w3.org/2000/svg'", 0), 0u);
  EXPECT_EQ(svg.find("<script"), std::string::npos) << "self-contained: no scripts";
  EXPECT_EQ(svg.find("http://", svg.find('>')), std::string::npos) << "self-contained: no external references";
  for (int k = 0; k < 2; ++k) {
    const std::string run = "run-" + std::to_string(k) + "'";
    EXPECT_EQ(count(svg, "class='train " + run), 1u);
    EXPECT_EQ(count(svg, "class='train-raw " + run), 1u);
    EXPECT_EQ(count(svg, "class='val " + run), 1u);
    EXPECT_EQ(count(svg, "class='lr " + run), 1u);
  }
  EXPECT_EQ(count(svg, "class='val-point run-0'"), 6u);  // steps 50..300
  EXPECT_EQ(count(svg, "class='val-point run-1'"), 5u);  // steps 40..200
  for (const char* label : {"small: train (smoothed)", "small: validation", "wide: learning rate", ">learning rate<"})
    EXPECT_NE(svg.find(label), std::string::npos) << label;
  // Tokens are printed under the step ticks: step 300 is 153,600 tokens, step 10 5,120.
  EXPECT_NE(svg.find(">154k<"), std::string::npos);
  EXPECT_EQ(count(svg, "class='tokentick'"), count(svg, "class='xtick'"));
  // Tick labels are distinct (no two rounded to the same text).
  // (Plain string scanning: GCC 12 warns inside std::regex under AddressSanitizer.)
  auto texts_after = [&](const std::string& marker, char open, char close) {
    std::vector<std::string> found;
    for (size_t at = svg.find(marker); at != std::string::npos; at = svg.find(marker, at + 1)) {
      const size_t begin = svg.find(open, at + marker.size());
      const size_t end = begin == std::string::npos ? begin : svg.find(close, begin + 1);
      if (end != std::string::npos) found.push_back(svg.substr(begin + 1, end - begin - 1));
    }
    return found;
  };
  const std::vector<std::string> lr_labels = texts_after("class='lrtick'", '>', '<');
  const std::set<std::string> seen(lr_labels.begin(), lr_labels.end());
  EXPECT_GT(lr_labels.size(), 1u);
  EXPECT_EQ(seen.size(), lr_labels.size());
  // Every point of every line lies inside the 960 x 540 picture.
  for (const std::string& list : texts_after("points=", '\'', '\'')) {
    std::istringstream in(list);
    double x, y;
    char comma;
    while (in >> x >> comma >> y) {
      EXPECT_GE(x, 0);
      EXPECT_LE(x, 960);
      EXPECT_GE(y, 0);
      EXPECT_LE(y, 540);
    }
  }
}

// A 4-step run's step ticks read 1, 2, 2, 2, 3, 4, 4 (ticks half a step apart, rounded),
// and its token ticks put 192 tokens under a "2"; steps 1000 to 1400 printed as "1.1k"
// three times, 100000 to 102000 as "100k". Step ticks are now whole, distinct, and
// printed in full.
TEST(Plot, StepTicksAreDistinctWholeSteps) {
  for (const auto& [first, last] : {std::pair<int, int>{1, 4}, {1000, 1400}, {1, 2}, {100000, 102000}}) {
    train::RunCurve r;
    r.name = "short";
    for (int s = first; s <= last; ++s) r.add_step(s, 5.0 - 0.001 * s, 1e-3, int64_t{64} * s);
    const std::string svg = train::render_loss_svg({r});
    std::vector<std::string> labels;
    for (size_t at = svg.find("class='xtick'"); at != std::string::npos; at = svg.find("class='xtick'", at + 1)) {
      const size_t begin = svg.find('>', at) + 1;
      labels.push_back(svg.substr(begin, svg.find('<', begin) - begin));
    }
    SCOPED_TRACE("steps " + std::to_string(first) + " to " + std::to_string(last));
    ASSERT_GE(labels.size(), 2u);
    EXPECT_EQ(std::set<std::string>(labels.begin(), labels.end()).size(), labels.size());
    std::vector<std::string> token_labels;
    for (size_t at = svg.find("class='tokentick'"); at != std::string::npos; at = svg.find("class='tokentick'", at + 1)) {
      const size_t begin = svg.find('>', at) + 1;
      token_labels.push_back(svg.substr(begin, svg.find('<', begin) - begin));
    }
    ASSERT_EQ(token_labels.size(), labels.size());
    for (size_t i = 0; i < labels.size(); ++i) {
      EXPECT_EQ(labels[i].find_first_not_of("0123456789"), std::string::npos) << labels[i];
      // The tokens under a tick are that step's (64 a step; under 1000 printed in full).
      if (last <= 4) {
        EXPECT_EQ(token_labels[i], std::to_string(64 * std::stoll(labels[i])));
      }
    }
  }
}

// A checkpoint's history.json round-trips the curve exactly. A validation loss that was not
// finite is written as null (JSON has no NaN), and reading it back failed, so the
// checkpoint could not be resumed: it is skipped, as a log's non-numeric val_loss is.
TEST(Plot, ARunHistoryRoundTripsAndSkipsAValidationLossThatWasNotFinite) {
  train::RunCurve r = fake_run("r", 10.8, 5, 30, 10);
  r.add_val(31, std::nan(""));
  const train::RunCurve back = train::curve_from_json(train::curve_to_json(r), "history.json");
  EXPECT_EQ(back.steps, r.steps);
  EXPECT_EQ(back.loss, r.loss);  // bit for bit
  EXPECT_EQ(back.lr, r.lr);
  EXPECT_EQ(back.tokens, r.tokens);
  ASSERT_EQ(back.val.size(), 3u);
  EXPECT_EQ(back.val, (std::vector<std::pair<int64_t, double>>(r.val.begin(), r.val.begin() + 3)));
  try {
    train::curve_from_json("{\"steps\": [1, 2], \"loss\": [1.0], \"lr\": [0, 0], \"tokens\": [1, 2], \"val\": []}",
                           "h.json");
    ADD_FAILURE() << "a history with fewer losses than steps was read";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("run history 'h.json': 2 steps but 1 losses"), std::string::npos) << e.what();
  }
}

TEST(Plot, ReadingALogNamesTheFileAndLineOfABadRow) {
  const std::string path = test::temp_path("log.jsonl");
  test::write_all(path, "{\"step\": 1, \"loss\": 10.5, \"lr\": 0.001}\n{\"step\": 2, \"loss\"\n");
  std::string m = test::message_of<Error>([&] { train::read_run_log(path, "x"); });
  EXPECT_NE(m.find(path), std::string::npos) << m;
  EXPECT_NE(m.find("line 2"), std::string::npos) << m;
  test::write_all(path, "{\"step\": 1, \"lr\": 0.001}\n");
  m = test::message_of<Error>([&] { train::read_run_log(path, "x"); });
  EXPECT_NE(m.find("\"loss\""), std::string::npos) << m;
  // A last row without its newline is a write a kill cut short (resume drops it too): the
  // rows before it are drawn. It used to be refused, so a killed run's log could not be.
  test::write_all(path, "{\"step\": 1, \"loss\": 10.5}\n{\"step\": 2, \"loss\": 9.5}\n{\"step\": 3, \"lo");
  const train::RunCurve run = train::read_run_log(path, "x");
  EXPECT_EQ(run.steps, (std::vector<int64_t>{1, 2}));
  // A step that is not a whole number a double holds exactly: 1.5 was read as 1, 1e300 was
  // undefined, and 2^53 + 1 made the axis's tick loop stand still (plot hung, eating memory).
  for (const char* step : {"1.5", "1e300", "9007199254740993", "-1"}) {
    test::write_all(path, std::string("{\"step\": ") + step + ", \"loss\": 2}\n");
    m = test::message_of<Error>([&] { train::read_run_log(path, "x"); });
    EXPECT_NE(m.find("line 1: \"step\" "), std::string::npos) << m;
    EXPECT_NE(m.find(" is not a step number"), std::string::npos) << m;
  }
}

// Ticks over a range whose values a double cannot step through (2^60 apart by 1000) stop
// instead of looping forever.
// Losses of +-1e308 (a run that diverged, or an edited log) made the range between them
// overflow, and every coordinate of the page was written as "nan". Values past 1e300 are
// gaps, as NaN is; the rest of the curve is drawn in a finite frame.
TEST(Plot, LossesAtTheEdgeOfADoubleLeaveGapsNotNanCoordinates) {
  train::RunCurve r = fake_run("diverged", 10.8, 5, 30, 10);
  r.loss[3] = 1e308, r.loss[4] = -1e308, r.loss[5] = std::numeric_limits<double>::infinity();
  r.lr[6] = 1e308;
  r.add_val(31, -1e308);
  const std::string svg = train::render_loss_svg({r});
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  EXPECT_EQ(svg.find("inf"), std::string::npos);
  EXPECT_EQ(count(svg, "class='val-point"), 3u) << "the three finite validation losses";
  const std::vector<double> smoothed = train::smooth(r.loss);
  EXPECT_TRUE(std::isfinite(smoothed.back()) && smoothed.back() < 20) << "a gap does not poison the average";
}

TEST(Plot, StepsFarApartAtTheEdgeOfADoubleStillDrawAFewTicks) {
  train::RunCurve run;
  run.add_step(int64_t{1} << 52, 2.0, 0.0, 0);
  run.add_step((int64_t{1} << 52) + 1000, 1.5, 0.0, 0);
  const std::string path = test::temp_path("edge.svg");
  train::write_loss_svg(path, {run}, "edge");
  EXPECT_NE(test::read_all(path).find("</svg>"), std::string::npos);
}

TEST(Plot, TheTrainerDrawsLossSvgInItsOutDirAndLogsTokens) {
  train::TrainConfig c;
  c.model.file = test::fixture_path("gpt2_tiny.bin");
  c.data.train = test::write_random_shard("train.bin", 5000, 97, 1);
  c.data.val = test::write_random_shard("val.bin", 2000, 97, 2);
  c.batch.batch_size = 2;
  c.batch.seq_len = 16;
  c.batch.steps = 6;
  c.validation.every = 3;
  c.validation.batches = 2;
  c.sampling.every = -1;
  c.sampling.tokens = 0;
  c.metrics.quiet = true;
  c.checkpoint.out_dir = test::temp_path("out");
  c.metrics.log_json = c.checkpoint.out_dir + "/log.jsonl";
  train::run_training(c);
  const std::string svg = slurp(c.checkpoint.out_dir + "/loss.svg");
  EXPECT_EQ(count(svg, "class='val-point run-0'"), 2u) << "validation at steps 3 and 6";
  train::RunCurve run = train::read_run_log(c.metrics.log_json, "run");
  ASSERT_EQ(run.steps.size(), 6u);
  EXPECT_EQ(run.tokens.back(), 6 * 2 * 16);
  EXPECT_EQ(run.val.size(), 2u);
  // A run that saves nothing, in an out-dir holding another run's checkpoints, replaced
  // that run's plot with its own; it now leaves it, and says so.
  train::TrainConfig saver = c;
  saver.checkpoint.save_every = 6;
  saver.checkpoint.overwrite = true;
  train::run_training(saver);
  const std::string saved_plot = slurp(c.checkpoint.out_dir + "/loss.svg");
  train::TrainConfig other = c;
  other.metrics.log_json.clear();
  other.batch.steps = 2;
  other.validation.every = 1;
  train::run_training(other);
  EXPECT_EQ(slurp(c.checkpoint.out_dir + "/loss.svg"), saved_plot);
}

// The picture as a browser draws it. The page inlines the SVG and uses the browser's own
// layout to check it: each curve has a drawn length, every text fits inside the picture,
// the legend does not cover the end of the curves, and a canvas rendering of the SVG has
// the first run's colour where its smoothed curve ends.
TEST(Plot, RendersInAHeadlessBrowser) {
  const char* browser = test::chromium();
  if (!browser) GTEST_SKIP() << "chromium is not installed (scripts/setup.sh installs it)";
  const std::string svg = train::render_loss_svg({fake_run("small", 10.8, 5, 300, 50), fake_run("wide", 10.8, 4.6, 200, 40)});
  std::string encoded;
  for (char ch : svg) {
    if (std::isalnum(static_cast<unsigned char>(ch))) encoded += ch;
    else {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", static_cast<unsigned char>(ch));
      encoded += buf;
    }
  }
  const std::string page = test::temp_path("plot.html");
  test::write_all(page, R"(<!doctype html><html><body style='margin:0'>)" + svg + R"(
<pre id='result'>PENDING</pre>
<script>
const svg = document.querySelector('svg');
const box = svg.getBoundingClientRect();
const problems = [];
for (const line of svg.querySelectorAll('polyline')) {
  if (!(line.getTotalLength() > 10)) problems.push('empty line ' + line.getAttribute('class'));
}
for (const t of svg.querySelectorAll('text')) {
  const b = t.getBoundingClientRect();
  if (b.width <= 0 || b.left < box.left - 1 || b.right > box.right + 1 || b.top < box.top - 1 || b.bottom > box.bottom + 1)
    problems.push('text outside: ' + t.textContent);
}
const legend = svg.querySelector('.legend-box').getBoundingClientRect();
for (const line of svg.querySelectorAll('polyline.train')) {
  const end = line.getPointAtLength(line.getTotalLength());
  if (end.x >= legend.left && end.x <= legend.right && end.y >= legend.top && end.y <= legend.bottom)
    problems.push('legend covers the end of ' + line.getAttribute('class'));
}
const img = new Image();
img.onload = () => {
  const c = document.createElement('canvas');
  c.width = 960; c.height = 540;
  const g = c.getContext('2d');
  g.drawImage(img, 0, 0);
  const line = svg.querySelector('polyline.train.run-0');
  const end = line.getPointAtLength(line.getTotalLength() * 0.5);
  let found = false;
  for (let dx = -2; dx <= 2 && !found; dx++) for (let dy = -2; dy <= 2 && !found; dy++) {
    const [r, gr, b] = g.getImageData(Math.round(end.x) + dx, Math.round(end.y) + dy, 1, 1).data;
    if (Math.abs(r - 0x1f) < 40 && Math.abs(gr - 0x77) < 40 && Math.abs(b - 0xb4) < 40) found = true;
  }
  if (!found) problems.push('run 0 colour not drawn on its curve');
  document.getElementById('result').textContent =
      problems.length ? 'PLOT PROBLEMS: ' + problems.join('; ') : 'PLOT OK ' + svg.querySelectorAll('polyline').length + ' lines';
};
img.src = 'data:image/svg+xml,)" + encoded + R"(';
</script></body></html>)");
  const std::string flags = std::string(browser) +
                            " --headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
                            "--disable-background-networking --disable-component-update --disable-sync "
                            "--user-data-dir=" + test::temp_path("chromium-profile") + " --virtual-time-budget=5000 ";
  std::string dom;
  run_command(flags + "--dump-dom file://" + page, &dom);
  EXPECT_NE(dom.find("PLOT OK 8 lines"), std::string::npos) << dom.substr(dom.find("id=\"result\"") == std::string::npos ? 0 : dom.find("id=\"result\""), 600);
  // And a screenshot of it, as a person would see it.
  const std::string png = test::temp_path("plot.png");
  std::string out;
  run_command(flags + "--window-size=960,540 --screenshot=" + png + " file://" + page, &out);
  const std::string bytes = slurp(png);
  ASSERT_GT(bytes.size(), 24u) << out;
  EXPECT_EQ(bytes.substr(1, 3), "PNG");
  auto be32 = [&](size_t at) {
    return (static_cast<uint32_t>(static_cast<unsigned char>(bytes[at])) << 24) |
           (static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + 1])) << 16) |
           (static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + 2])) << 8) |
           static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + 3]));
  };
  EXPECT_EQ(be32(16), 960u);  // IHDR width
  EXPECT_EQ(be32(20), 540u);  // IHDR height
  EXPECT_GT(bytes.size(), 20000u) << "a blank page compresses to far less";
}
