// The memory tools over real training traces: the trace round-trips every event, the
// report (`tally memory report`) renders in a real headless browser with the expected
// owners, and `tally memory diff` names the owners that grew and the first step they did.
#include <gtest/gtest.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <map>

#include <nlohmann/json.hpp>

#include <sys/resource.h>

#include "memory/report.h"
#include "runtime/backend.h"
#include "support.h"
#include "train/memory_trace.h"
#include "train/trainer.h"

using namespace tally;
namespace fs = std::filesystem;

namespace {

// A 3-step run of the 97-token fixture writing its memory trace.
std::string traced_run(const std::string& name, int64_t batch, int64_t steps = 3) {
  train::TrainConfig c = test::tiny_train_config(test::write_random_shard(name + ".bin", 5000, 97, 1));
  c.batch.batch_size = batch;
  c.batch.grad_accum = 2;
  c.batch.steps = steps;
  c.checkpoint.out_dir = test::temp_path(name + "_out");
  c.memory.trace = test::temp_path(name + ".json");
  train::run_training(c);
  return c.memory.trace;
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

}  // namespace

// "Every live byte has a known owner": every allocation of a run, set-up, steps, validation,
// samples and saving alike, carries a name. The scalars the trainer's all-reduces carry (the
// step's memory and loss figures, even on one process) and backward's root gradient had
// none: "(unnamed)" in the report and diff.
TEST(MemoryTools, EveryAllocationOfARunHasAnOwnerName) {
  for (const char* dtype : {"fp32", "bf16"}) {
    const std::string data = test::write_random_shard(std::string("named_") + dtype + ".bin", 5000, 97, 1);
    train::TrainConfig c = test::tiny_train_config(data);
    c.compute.dtype = std::string(dtype) == "bf16" ? DType::BF16 : DType::F32;
    c.batch.grad_accum = 2;
    c.batch.steps = 3;
    c.data.val = test::write_random_shard(std::string("named_val_") + dtype + ".bin", 2000, 97, 2);
    c.validation.every = 2;
    c.sampling.every = 2;
    c.sampling.tokens = 4;
    c.checkpoint.save_every = 3;
    c.checkpoint.out_dir = test::temp_path(std::string("named_out_") + dtype);
    c.memory.trace = test::temp_path(std::string("named_") + dtype + ".json");
    train::run_training(c);
    const memory::MemoryTrace trace = memory::read_memory_trace(c.memory.trace);
    ASSERT_FALSE(trace.events.empty());
    std::map<std::string, int> unnamed;  // category -> events
    for (const memory::MemoryEvent& e : trace.events)
      if (name_of(e.name).empty()) ++unnamed[category_name(e.category)];
    for (const auto& [category, n] : unnamed) ADD_FAILURE() << dtype << ": " << n << " " << category << " events without a name";
  }
}

// A run that fails (here a loss gone non-finite; out of memory, the sanitizer's strict mode
// alike) wrote no trace: it was written after the loop, which the failure skipped, though a
// failure is when the history is wanted most.
TEST(MemoryTools, ARunThatFailsStillWritesItsTraceUpToTheFailure) {
  train::TrainConfig c = test::tiny_train_config(test::write_random_shard("failing.bin", 5000, 97, 1));
  c.batch.steps = 5;
  c.optimizer.lr = 1e30;
  c.optimizer.grad_clip = 0;
  c.memory.trace = test::temp_path("failing.json");
  EXPECT_THROW(train::run_training(c), Error);
  ASSERT_TRUE(fs::exists(c.memory.trace)) << "no trace after the failure";
  const memory::MemoryTrace trace = memory::read_memory_trace(c.memory.trace);
  EXPECT_FALSE(trace.events.empty());
  EXPECT_FALSE(trace.plan.empty()) << "the plan travels with the failed run's trace too";
  int64_t last_step = -1;
  for (const memory::MemoryEvent& e : trace.events) last_step = std::max(last_step, e.step);
  EXPECT_GE(last_step, 1) << "the trace reaches into the steps";
}

// On a full disk the end-of-run write failed, and the failure handler then wrote the trace
// again from the history the first write had taken: a valid trace of 0 events, announced
// as "the memory trace of the run up to its failure". A trace is written once.
TEST(MemoryTools, ATraceThatFailsToWriteIsNotReplacedByAnEmptyOne) {
  const std::string path = test::temp_path("full_disk.json");
  fs::remove(path);
  const std::unique_ptr<dist::World> world = dist::World::create({1, 1, 1});
  // As on a full disk: no file may grow past 4 KB (a write past it fails with EFBIG).
  std::signal(SIGXFSZ, SIG_IGN);
  rlimit unlimited{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &unlimited), 0);
  const rlimit small{4096, unlimited.rlim_max};
  std::string failure;
  testing::internal::CaptureStderr();
  try {
    train::MemoryTrace trace(path, Device::cpu(), *world);
    std::vector<Tensor> kept;
    for (int i = 0; i < 1000; ++i) kept.push_back(Tensor::zeros({16}));
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
    trace.write_at_end(true);
  } catch (const Error& e) {
    failure = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &unlimited);
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(failure.empty()) << "the write past the limit must fail";
  EXPECT_EQ(said.find("up to its failure"), std::string::npos) << said;
  EXPECT_FALSE(fs::exists(path)) << "no trace, rather than an empty one";
}

// An edited trace with a time or step no run reaches drew "-9223372036854775808 ms" and
// "step -9223372036854775808": refused, naming the event.
TEST(MemoryTools, ATraceWithATimeOrStepNoRunReachesIsRefused) {
  const std::string path = test::temp_path("edited_trace.json");
  for (const auto& [event, expected] : std::vector<std::pair<std::string, std::string>>{
           {"[1e300, 8, 0, 0, 1, 0, 1, 0]", "event 0 is at time 1e+300 us, expected a finite time"},
           {"[0.5, 8, 0, 0, 9223372036854775807, 0, 1, 0]", "event 0 is in step 9223372036854775807"},
           {"[0.5, 8, 0, 0, 1, -5, 1, 0]", "microbatch -5, expected steps from -1 (none) and microbatches from -2"}}) {
    test::write_all(path, "{\"tally_memory\": {\"version\": 1, \"owners\": [\"x\"], \"plan\": [], \"events\": [" +
                              event + "]}}");
    const std::string msg = test::message_of<Error>([&] { memory::read_memory_trace(path); });
    EXPECT_NE(msg.find(expected), std::string::npos) << event << ": " << msg;
  }
}

TEST(MemoryTools, ATraceRoundTripsEveryEventAndThePlan) {
  auto& L = runtime::ledger();
  L.clear_history();
  L.enable_history(true);
  {
    Tensor a = Tensor::empty({1000}, DType::F32, Device::cpu(), make_owner(Category::Activation, "h.0.attn"));
    Tensor b = Tensor::empty({10}, DType::F32, Device::cpu(), make_owner(Category::Workspace, "scratch"));
    // Over the 1 MiB of an instant event, with a name JSON must escape.
    Tensor c = Tensor::empty({1 << 19}, DType::F32, Device::cpu(), make_owner(Category::Other, "big \"one\" \\ here"));
  }
  const std::vector<memory::MemoryEvent> events = L.take_history();
  EXPECT_FALSE(L.history_enabled());
  { Tensor after = Tensor::empty({10}, DType::F32, Device::cpu(), make_owner(Category::Other, "after")); }
  EXPECT_TRUE(L.history().empty()) << "take_history stops the recording";
  const std::string path = test::temp_path("t.json");
  memory::write_chrome_trace(path, events, 1 << 20, {{"parameters", 123}, {"activations", 456}});
  // The Perfetto/Chrome part: a counter per event holding each category's running total,
  // and an instant event for each allocation and free of 1 MiB or more.
  const nlohmann::json doc = nlohmann::json::parse(test::read_all(path));
  std::map<std::string, int64_t> running;
  size_t counters = 0, instants = 0;
  for (const auto& e : doc.at("traceEvents")) {
    if (e.at("ph") == "i") {
      ++instants;
      EXPECT_EQ(e.at("args").at("owner"), "big \"one\" \\ here");
      EXPECT_EQ(std::abs(e.at("args").at("bytes").get<int64_t>()), int64_t{4} << 19);
      continue;
    }
    const memory::MemoryEvent& ev = events.at(counters++);
    running[category_name(ev.category)] += ev.delta;
    for (const auto& [category, bytes] : running) EXPECT_EQ(e.at("args").at(category), bytes) << category;
    EXPECT_DOUBLE_EQ(e.at("ts").get<double>(), ev.time_us);
  }
  EXPECT_EQ(counters, events.size());
  EXPECT_EQ(instants, 2u);
  const memory::MemoryTrace back = memory::read_memory_trace(path);
  ASSERT_EQ(back.events.size(), events.size());
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(back.events[i].delta, events[i].delta);
    EXPECT_EQ(back.events[i].id, events[i].id);
    EXPECT_EQ(back.events[i].category, events[i].category);
    EXPECT_EQ(name_of(back.events[i].name), name_of(events[i].name));
  }
  EXPECT_EQ(back.plan, (memory::PlanParts{{"parameters", 123}, {"activations", 456}}));  // in the plan's order

  // Hand-edited events: a fractional byte count was read as its integer part, one past 2^62
  // overflowed the report's sums, and a category or retag flag past an int's range was
  // truncated into range (category 2^32 + 3 read as 3, an activation).
  for (const auto& [event, expected] : {std::pair{"[1.0, 1.7, 0, 0, 0, 0, 1, 0]", "expected a time and 7 integers"},
                                        std::pair{"[1.0, 9223372036854775807, 0, 0, 0, 0, 1, 0]", "more than an allocation"},
                                        std::pair{"[1.0, 8, 4294967299, 0, 0, 0, 1, 0]", "names category 4294967299"},
                                        std::pair{"[1.0, 8, 3, 0, 0, 0, 1, 4294967296]", "retag flag 4294967296"}}) {
    test::write_all(path, std::string(R"({"tally_memory": {"version": 1, "owners": ["a"], "plan": [], "events": [)") +
                              event + "]}}");
    const std::string bad = test::message_of<Error>([&] { memory::read_memory_trace(path); });
    EXPECT_NE(bad.find(expected), std::string::npos) << bad;
  }
  // Each event within 2^62, but together past what the report's sums hold; a plan whose
  // parts overflow; and the owner table after the events (read as the stream goes) is fine.
  const std::string quarter = std::to_string(int64_t{1} << 61);
  for (const auto& [body, expected] :
       {std::pair{R"("owners": ["a"], "plan": [], "events": [[1.0, )" + quarter + ", 0, 0, 0, 0, 1, 0], [2.0, -" + quarter +
                      ", 0, 0, 0, 0, 1, 0], [3.0, 8, 0, 0, 0, 0, 2, 0]]",
                  std::string("past 2^62")},
        std::pair{std::string(R"("owners": ["a"], "events": [], "plan": [["x", 4611686018427387904], ["y", 1]])"),
                  std::string("plan part \"y\"")},
        std::pair{std::string(R"("plan": [], "events": [[1.0, 8, 0, 1, 0, 0, 1, 0]], "owners": ["a"])"),
                  std::string("names owner 1, which does not exist")}}) {
    test::write_all(path, R"({"tally_memory": {"version": 1, )" + body + "}}");
    const std::string bad = test::message_of<Error>([&] { memory::read_memory_trace(path); });
    EXPECT_NE(bad.find(expected), std::string::npos) << bad;
  }
  test::write_all(path, R"({"tally_memory": {"version": 1, "plan": [], "events": [[1.0, 8, 0, 0, 0, 0, 1, 0]], "owners": ["a"]}})");
  const memory::MemoryTrace later = memory::read_memory_trace(path);
  ASSERT_EQ(later.events.size(), 1u);
  EXPECT_EQ(name_of(later.events[0].name), "a");
  memory::write_chrome_trace(path, events, 1 << 20, {{"parameters", 123}, {"activations", 456}});
  // A trace cut short (a copy that did not finish): said so, not "a --log-json file".
  const std::string whole = test::read_all(path);
  test::write_all(path, whole.substr(0, whole.size() / 2));
  const std::string cut = test::message_of<Error>([&] { memory::read_memory_trace(path); });
  EXPECT_NE(cut.find("a trace cut short"), std::string::npos) << cut;

  test::write_all(path, "{\"traceEvents\": []}");
  EXPECT_NE(test::message_of<Error>([&] { memory::read_memory_trace(path); }).find("no tally_memory section"),
            std::string::npos);
  // A --log-json file (one object per line) given by mistake: said so, not a bare parser error.
  test::write_all(path, "{\"step\": 1, \"loss\": 5.0}\n{\"step\": 2, \"loss\": 4.9}\n");
  const std::string msg = test::message_of<Error>([&] { memory::read_memory_trace(path); });
  EXPECT_NE(msg.find("is not one JSON document"), std::string::npos) << msg;
  EXPECT_NE(msg.find("this looks like a --log-json file"), std::string::npos) << msg;
  // The report page given for its trace: it said "not a --log-json file".
  test::write_all(path, "<!DOCTYPE html>\n<html><body>report</body></html>\n");
  const std::string page = test::message_of<Error>([&] { memory::read_memory_trace(path); });
  EXPECT_NE(page.find("this looks like an HTML page (a report; `--mem-trace F.json` writes the trace itself)"),
            std::string::npos) << page;
}

TEST(MemoryTools, TheReportRendersInAHeadlessBrowserWithTheOwnersAtThePeak) {
  const std::string trace = traced_run("report", 2);
  const memory::MemoryTrace t = memory::read_memory_trace(trace);
  ASSERT_FALSE(t.plan.empty());
  const std::string page = test::temp_path("report.html");
  memory::write_html_report(page, t.events, t.plan);
  const std::string html = test::read_all(page);
  EXPECT_EQ(html.find("<script"), std::string::npos);  // self-contained: nothing to run, nothing fetched
  EXPECT_EQ(html.find("http://"), html.find("http://www.w3.org/2000/svg"));

  const char* browser = test::chromium();
  if (!browser) GTEST_SKIP() << "chromium is not installed (scripts/setup.sh installs it)";
  std::string dom;
  FILE* pipe = popen((std::string(browser) + " --headless --no-sandbox --disable-gpu --dump-dom file://" + page + " 2>/dev/null").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  char buf[4096];
  while (std::fgets(buf, sizeof buf, pipe)) dom += buf;
  pclose(pipe);
  // The browser parsed the whole page: both charts, the tables, and the expected owners.
  EXPECT_NE(dom.find("id=\"by-category\""), std::string::npos) << dom.substr(0, 300);
  EXPECT_NE(dom.find("id=\"by-owner\""), std::string::npos);
  EXPECT_GE(count(dom, "class=\"layer\""), 10u);  // 9 categories + at least one owner layer
  EXPECT_GE(count(dom, "class=\"stepband\""), 3u);
  const size_t holders = dom.find("id=\"holders\"");
  ASSERT_NE(holders, std::string::npos);
  const std::string table = dom.substr(holders, dom.find("</table>", holders) - holders);
  // The tiny model's peak is in the set-up (the GEMM probe's matrices outweigh its
  // activations); every holder has a name.
  for (const char* owner : {"parameters", "gradients", "adamw.m", "adamw.v", "loader.inputs"})
    EXPECT_NE(table.find(owner), std::string::npos) << owner << " is not among the holders of the peak";
  EXPECT_EQ(table.find("class=\"owner\"></td>"), std::string::npos) << "an unnamed holder:\n" << table;
  EXPECT_NE(dom.find("planned peak"), std::string::npos);
  EXPECT_NE(dom.find("measured peak"), std::string::npos);
}

TEST(MemoryTools, TheReportNamesAHoldersCategoryAsItIsAtThePeak) {
  // An activation saved for backward is retagged (two half events). The report's
  // category totals followed the retag, but its holders table printed the category the
  // allocation was born with: the same bytes were "saved_for_backward" in one table and
  // "activation" in the other.
  const NameId saved = intern_name("h.0.mlp:gelu"), other = intern_name("parameters");
  auto event = [](double time, int64_t delta, Category category, NameId name, bool retag, uint64_t id) {
    memory::MemoryEvent e;
    e.time_us = time, e.delta = delta, e.category = category, e.name = name, e.retag = retag, e.id = id;
    return e;
  };
  const std::vector<memory::MemoryEvent> events = {
      event(1, 4096, Category::Parameter, other, false, 1),
      event(2, 1 << 20, Category::Activation, saved, false, 2),
      event(3, -(1 << 20), Category::Activation, saved, true, 2),
      event(3, 1 << 20, Category::SavedForBackward, saved, true, 2),
      event(4, 4096, Category::Activation, intern_name("h.1.attn:qkv"), false, 3)};  // the peak, after the retag
  const std::string page = test::temp_path("retag.html");
  memory::write_html_report(page, events);
  const std::string html = test::read_all(page);
  const size_t holders = html.find("id='holders'");
  ASSERT_NE(holders, std::string::npos);
  const std::string table = html.substr(holders, html.find("</table>", holders) - holders);
  EXPECT_NE(table.find("<td>saved_for_backward</td><td class='owner'>h.0.mlp:gelu</td>"), std::string::npos) << table;
  EXPECT_EQ(table.find("<td>activation</td><td class='owner'>h.0.mlp:gelu"), std::string::npos) << table;
}

// The plan is of the training steps: the report set it beside the whole trace's peak, which
// can come in the set-up (the GEMM probe) or after the last step (the end-of-run sample's
// KV cache): "planned 107.14 MiB / measured 108.84 MiB" for a run whose steps matched the
// plan to the byte. The measured figure beside the plan is now the steps' own, and the
// run's peak outside them is named as such.
TEST(MemoryTools, TheReportSetsThePlanBesideTheTrainingStepsPeak) {
  auto event = [](double time, int64_t delta, int64_t step, int64_t microbatch, uint64_t id) {
    memory::MemoryEvent e;
    e.time_us = time, e.delta = delta, e.category = Category::Activation, e.name = intern_name("x"), e.id = id;
    e.step = step, e.microbatch = microbatch;
    return e;
  };
  const std::vector<memory::MemoryEvent> events = {
      event(1, 3000, -1, -1, 1), event(2, -3000, -1, -1, 1),                // set-up's probe: 3000
      event(3, 1000, 0, 0, 2), event(4, -1000, 0, 0, 2),                    // step 1: 1000
      event(5, 1500, 1, -1, 3), event(6, -1500, 1, -1, 3),                  // step 2 (its optimizer): 1500
      event(7, 2000, 1, kBetweenSteps, 4), event(8, -2000, 1, kBetweenSteps, 4)};  // the sample after it: 2000
  const std::string page = test::temp_path("step_peak.html");
  memory::write_html_report(page, events, {{"activations", 1500}});
  const std::string html = test::read_all(page);
  const size_t plan = html.find("id='plan'");
  ASSERT_NE(plan, std::string::npos) << html;
  const std::string table = html.substr(plan, html.find("</table>", plan) - plan);
  EXPECT_NE(table.find("measured peak in the training steps</b></td><td><b>1.5 KiB"), std::string::npos) << table;
  EXPECT_NE(table.find("outside the training steps (in the set-up), which the plan does not model</td><td>2.9 KiB"),
            std::string::npos)
      << table;
}

// The KV cache a sample makes is stamped with the clock, as every allocation is: born
// "in step 0" (the set-up) it read as set-up memory in a report of a run that sampled at
// its end.
TEST(MemoryTools, AKvCacheIsStampedWithTheStepItIsMadeIn) {
  const nn::Transformer model(nn::TransformerConfig::preset("d1"));
  auto& ledger = runtime::ledger();
  ledger.clear_history();
  ledger.enable_history(true);
  Clock::set(4, kBetweenSteps);
  { const nn::KvCache cache = model.make_kv_cache(1, 8); }
  Clock::set(-1, -1);
  ledger.enable_history(false);
  int kv = 0;
  for (const memory::MemoryEvent& e : ledger.history())
    if (name_of(e.name).find("kv_cache") != std::string::npos && e.delta > 0) {
      ++kv;
      EXPECT_EQ(e.step, 4);
      EXPECT_EQ(e.microbatch, kBetweenSteps);
    }
  ledger.clear_history();
  EXPECT_GT(kv, 0);
}

// Two runs alike but for --steps: every owner was listed, each "+0 B", "first in step 4" (the
// step only one of them has) or step 3 (where the end of the shorter run fell). The diff
// compares the steps both traces have, says so, and lists the owners whose most held differs.
TEST(MemoryTools, DiffOfRunsThatDifferOnlyInLengthListsNoOwner) {
  const std::string a = traced_run("three_steps", 2, 3), b = traced_run("four_steps", 2, 4);
  const std::string diff = memory::diff_memory_traces(memory::read_memory_trace(a), memory::read_memory_trace(b));
  EXPECT_NE(diff.find("A has 3 steps and B 4: compared over the set-up and steps 1 to 2 (step 3 holds the end of A's "
                      "run: its last validation, sample and save)"),
            std::string::npos) << diff;
  EXPECT_NE(diff.find("no owner differs"), std::string::npos) << diff;
  EXPECT_EQ(diff.find("+0 B"), std::string::npos) << diff;
}

TEST(MemoryTools, DiffNamesTheOwnersThatGrewAndTheFirstStep) {
  const std::string a = traced_run("small", 2), b = traced_run("large", 4);
  const memory::MemoryTrace ta = memory::read_memory_trace(a), tb = memory::read_memory_trace(b);
  const std::string same = memory::diff_memory_traces(ta, ta);
  EXPECT_NE(same.find("no owner differs"), std::string::npos) << same;
  const std::string diff = memory::diff_memory_traces(ta, tb);
  // Doubling the batch doubles the logits (head:linear), from the first training step;
  // the model states (parameters, gradients, adamw.*) do not change.
  const size_t head = diff.find("head:linear");
  ASSERT_NE(head, std::string::npos) << diff;
  const std::string line = diff.substr(head, diff.find('\n', head) - head);
  EXPECT_NE(line.find("+"), std::string::npos) << line;
  EXPECT_NE(line.find("first in step 1"), std::string::npos) << line;
  EXPECT_EQ(diff.find("adamw.m"), std::string::npos) << diff;
  EXPECT_EQ(diff.find(" parameters "), std::string::npos) << diff;
}
