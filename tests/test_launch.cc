// The `tally` program as users launch it, with and without mpirun: a rank that fails ends
// the whole job within seconds naming itself (never a hang of the others in a
// collective), and layouts that cannot work are refused naming the flags.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/random.h"
#include "data/token_shard.h"
#include "support.h"

using namespace tally;

namespace {
struct Outcome {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
};

// Runs `command` through the shell, limited to `limit` seconds, capturing stdout+stderr.
Outcome run(const std::string& command, int limit = 120) {
  // In the AddressSanitizer build the launched programs are sanitized too: OpenMPI's own
  // unfreed allocations are suppressed (tests/lsan.supp, which needs full stacks).
  const std::string sanitizer_env = std::string("ASAN_OPTIONS=detect_leaks=1:fast_unwind_on_malloc=0 ") +
                                    "LSAN_OPTIONS=suppressions=" + TALLY_SOURCE_DIR + "/tests/lsan.supp:print_suppressions=0 ";
  // -k: an mpirun whose ranks hang in MPI outlived the plain SIGTERM of `timeout`, and the
  // test with it.
  const std::string full = sanitizer_env + "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 timeout -k 10 " +
                           std::to_string(limit) + " " + command + " 2>&1";
  const auto t0 = std::chrono::steady_clock::now();
  Outcome o;
  FILE* pipe = popen(full.c_str(), "r");
  EXPECT_NE(pipe, nullptr);
  if (!pipe) return o;
  std::array<char, 4096> buf;
  while (std::fgets(buf.data(), buf.size(), pipe)) o.output += buf.data();
  const int status = pclose(pipe);
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return o;
}

std::string train_command(const std::string& launcher, const std::string& data, const std::string& extra,
                          int steps = 200) {
  return launcher + " " + TALLY_CLI + " train --model-file " + test::fixture_path("gpt2_tiny.bin") +
         " --train-data " + data + " --batch-size 2 --seq-len 16 --steps " + std::to_string(steps) +
         " --threads 1 --sample-every -1 " + extra;
}
}  // namespace

TEST(Launch, AFailingRankEndsTheWholeJobWithItsRankAndMessage) {
  // Only rank 1 fails: its own log (--log-json-all-ranks) is a directory, as on a machine
  // whose disk is laid out differently. Rank 0 goes on into its first collective, which
  // must not hang.
  const std::string data = test::write_random_shard("ok_for_all.bin", 20000, 97, 2);
  const std::string log = test::temp_path("log.jsonl");
  std::filesystem::create_directories(log + ".rank1");
  Outcome o = run(train_command("mpirun --oversubscribe -np 2", data, "--dp 2 --log-json " + log + " --log-json-all-ranks"),
                  120);
  EXPECT_NE(o.exit_code, 0) << o.output;
  EXPECT_NE(o.exit_code, 124) << "timed out: the job hung\n" << o.output;
  EXPECT_NE(o.output.find("tally: rank 1: --log-json-all-ranks '" + log + ".rank1' is a directory"), std::string::npos)
      << o.output;
  EXPECT_LT(o.seconds, 60) << "the job must end within seconds of the failure";
}

TEST(Launch, ABadTokenIsReportedBeforeTrainingNamingTheShard) {
  std::vector<int32_t> tokens(20000, 5);
  tokens[19990] = 500;  // outside the model's 97-token vocabulary, far past the steps run
  const std::string data = test::temp_path("bad_token.bin");
  data::write_token_shard(data, tokens, data::TokenWidth::U16);
  Outcome o = run(train_command("mpirun --oversubscribe -np 2", data, "--dp 2", 2), 120);
  EXPECT_NE(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("--train-data shard '" + data + "': token 500 at position 19990"), std::string::npos) << o.output;
  EXPECT_EQ(o.output.find("step     1/"), std::string::npos) << "a step ran before the bad token was found\n" << o.output;
}

TEST(Launch, TokenizeLeavesNoStaleValidationSplitBehind) {
  // A second tokenize into the same prefix that makes no validation split (a fraction of
  // one short document that is under half a token) used to leave the first run's
  // <prefix>_val.bin: its documents were now in _train.bin too, and validation measured
  // text the model trained on.
  const std::string dir = test::temp_path("tokenize_stale");
  std::filesystem::create_directories(dir);
  test::write_tiny_gpt2_tokenizer(dir, {{"a", "b"}});
  test::write_all(dir + "/two.txt", "ab ab ab\n%\nba ba\n");
  test::write_all(dir + "/one.txt", "ab ab ab ba ba\n");
  const std::string prefix = dir + "/corpus", tokenize = std::string(TALLY_CLI) + " tokenize --tokenizer " + dir;
  Outcome first = run(tokenize + " --separator % --val-fraction 0.3 --out " + prefix + " " + dir + "/two.txt");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_TRUE(std::filesystem::exists(prefix + "_val.bin")) << first.output;
  Outcome second = run(tokenize + " --val-fraction 0.01 --out " + prefix + " " + dir + "/one.txt");
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_FALSE(std::filesystem::exists(prefix + "_val.bin")) << second.output;
  EXPECT_NE(second.output.find("no validation split"), std::string::npos) << second.output;
  EXPECT_NE(second.output.find("removed the earlier " + prefix + "_val.bin"), std::string::npos) << second.output;
  for (const std::string& bad : {std::string("''"), dir + "/"}) {
    Outcome o = run(tokenize + " --out " + bad + " " + dir + "/one.txt");
    EXPECT_NE(o.exit_code, 0) << bad;
    EXPECT_NE(o.output.find("--out must be a path prefix"), std::string::npos) << o.output;
  }
  // With --val-fraction 0 no split is asked for: a _val.bin there may be the user's own
  // held-out set, kept with a warning.
  test::write_all(prefix + "_val.bin", "mine");
  Outcome none = run(tokenize + " --val-fraction 0 --out " + prefix + " " + dir + "/one.txt");
  ASSERT_EQ(none.exit_code, 0) << none.output;
  EXPECT_EQ(test::read_all(prefix + "_val.bin"), "mine");
  EXPECT_NE(none.output.find("is not from this run"), std::string::npos) << none.output;
  // An input named like an output: the stale-split removal deleted it, or the shard was
  // written over it; and a _val.bin that is a directory failed only after _train.bin was
  // written. Refused before anything is read or written, naming the input.
  test::write_all(dir + "/w_val.bin", "ab ab\n");
  Outcome own = run(tokenize + " --val-fraction 0.01 --out " + dir + "/w " + dir + "/w_val.bin");
  EXPECT_NE(own.exit_code, 0) << own.output;
  EXPECT_EQ(test::read_all(dir + "/w_val.bin"), "ab ab\n") << own.output;
  EXPECT_NE(own.output.find(dir + "/w_val.bin"), std::string::npos) << own.output;
  // A binary input (a token shard given among text files) was tokenized as garbage.
  test::write_all(dir + "/shard.bin", std::string("ab\0\x01\x02", 5));
  Outcome binary = run(tokenize + " --out " + dir + "/b " + dir + "/shard.bin");
  EXPECT_NE(binary.exit_code, 0) << binary.output;
  EXPECT_NE(binary.output.find("holds a NUL byte at offset 2"), std::string::npos) << binary.output;
  // A --separator no line of a file is: the file is one document, said.
  Outcome unseparated = run(tokenize + " --separator %% --out " + dir + "/u " + dir + "/two.txt");
  EXPECT_EQ(unseparated.exit_code, 0) << unseparated.output;
  EXPECT_NE(unseparated.output.find("is the --separator '%%': the file is one document"), std::string::npos)
      << unseparated.output;
  std::filesystem::create_directories(dir + "/d_val.bin");
  Outcome directory = run(tokenize + " --val-fraction 0.3 --separator % --out " + dir + "/d " + dir + "/two.txt");
  EXPECT_NE(directory.exit_code, 0) << directory.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/d_train.bin")) << directory.output;
}

// One large document beside a small one (each input file is a document without
// --separator) sent 99% of the tokens to validation: the split took whole documents from
// the end until it had the fraction. Now the large document is cut: validation is its
// last tenth of the tokens, and the two shards, separators aside, are the text's tokens in
// order, each once.
TEST(Launch, TokenizeCutsALargeDocumentRatherThanSendMostOfTheDataToValidation) {
  const std::string dir = test::temp_path("tokenize_cut");
  std::filesystem::create_directories(dir);
  test::write_tiny_gpt2_tokenizer(dir, {{"a", "b"}});
  test::write_all(dir + "/small.txt", "ab ab\n");
  std::string big;
  for (int i = 0; i < 300; ++i) big += i % 7 == 0 ? "ba " : "ab ";
  test::write_all(dir + "/big.txt", big + "\n");
  const std::string prefix = dir + "/corpus";
  Outcome o = run(std::string(TALLY_CLI) + " tokenize --tokenizer " + dir + " --out " + prefix + " " + dir + "/small.txt " +
                  dir + "/big.txt");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("the document is cut"), std::string::npos) << o.output;
  auto tokens = [](const std::string& path) {
    const data::TokenShard shard = data::TokenShard::open(path);
    std::vector<int32_t> t(static_cast<size_t>(shard.size()));
    shard.read(0, shard.size(), t.data());
    return t;
  };
  const std::vector<int32_t> train = tokens(prefix + "_train.bin"), val = tokens(prefix + "_val.bin");
  const double share = static_cast<double>(val.size()) / static_cast<double>(train.size() + val.size());
  EXPECT_NEAR(share, 0.1, 0.01) << o.output;
  // Separator, small document, separator, big document's head | separator, its tail.
  const int32_t sep = train.front();
  EXPECT_EQ(val.front(), sep);
  std::vector<int32_t> text;
  for (const auto* shard : {&train, &val})
    for (int32_t t : *shard)
      if (t != sep) text.push_back(t);
  Outcome whole = run(std::string(TALLY_CLI) + " tokenize --tokenizer " + dir + " --val-fraction 0 --out " + dir +
                      "/whole " + dir + "/small.txt " + dir + "/big.txt");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  std::vector<int32_t> want;
  for (int32_t t : tokens(dir + "/whole_train.bin"))
    if (t != sep) want.push_back(t);
  EXPECT_EQ(text, want);
}

// train made the directories of its --log-json and --mem-trace; tokenize --out, export -o
// (llm.c), plot -o and memory report -o failed naming their temporary file instead.
TEST(Launch, OutputsGoIntoDirectoriesThatDoNotExistYet) {
  const std::string dir = test::temp_path("new_dirs");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  test::write_tiny_gpt2_tokenizer(dir, {{"a", "b"}});
  test::write_all(dir + "/text.txt", "ab ab ab ba\n");
  const std::string cli = std::string(TALLY_CLI);
  const std::string model = test::fixture_path("gpt2_tiny.bin");
  const std::string log = dir + "/log.jsonl", trace = dir + "/trace.json";
  Outcome trained = run(train_command("", test::write_random_shard("s.bin", 2000, 97, 3),
                                      "--out-dir " + dir + "/out --log-json " + log + " --mem-trace " + trace, 1));
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  for (const auto& [command, made] : std::vector<std::pair<std::string, std::string>>{
           {cli + " tokenize --tokenizer " + dir + " --val-fraction 0 --out " + dir + "/a/b/corpus " + dir + "/text.txt",
            dir + "/a/b/corpus_train.bin"},
           {cli + " export --model-file " + model + " --format llmc -o " + dir + "/c/d/model.bin", dir + "/c/d/model.bin"},
           {cli + " plot " + log + " -o " + dir + "/e/loss.svg", dir + "/e/loss.svg"},
           {cli + " memory report " + trace + " -o " + dir + "/f/report.html", dir + "/f/report.html"}}) {
    Outcome o = run(command);
    EXPECT_EQ(o.exit_code, 0) << command << "\n" << o.output;
    EXPECT_TRUE(std::filesystem::exists(made)) << command << "\n" << o.output;
  }
}

// The summary says how much of the data the run read: 1024 of 1027 tokens is 99.7% of a
// pass (printed "1e+02%" through %g at first), and --shuffle's start-up line says the order.
TEST(Launch, TheRunSaysHowMuchOfItsDataItReadAndInWhatOrder) {
  const std::string data = test::write_random_shard("s1027.bin", 1027, 97, 3);
  Outcome o = run(train_command("", data, "--out-dir " + test::temp_path("pass_out"), 32));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("1024 tokens ("), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("99.7% of one pass over the training data"), std::string::npos) << o.output;
  Outcome twice = run(train_command("", data, "--out-dir " + test::temp_path("pass_out"), 64));
  EXPECT_NE(twice.output.find("data order: file order; --steps 64 read 1.99 passes, every pass the same text in the same order"),
            std::string::npos)
      << twice.output;
  // A warm-up longer than the run never reaches --lr: said at start-up.
  Outcome warm = run(train_command("", data, "--warmup-steps 5 --lr 1e-3 --out-dir " + test::temp_path("pass_out"), 2));
  EXPECT_NE(warm.output.find("warning: --warmup-steps 5 is longer than --steps 2: the learning rate never reaches --lr "
                             "(at most 0.0004)"),
            std::string::npos)
      << warm.output;
  Outcome shuffled = run(train_command("", data, "--shuffle --out-dir " + test::temp_path("pass_out"), 64));
  // 1027 tokens: 64 sequences of 16 (1026 / 16), 2 a step.
  EXPECT_NE(shuffled.output.find("data order: shuffled (--shuffle, seed 1337): 64 sequences of 16 tokens, in a new order "
                                 "on every pass; --steps 64 read 2.00 passes"),
            std::string::npos)
      << shuffled.output;
}

TEST(Launch, NegativeSeedsTwoModelSourcesAndAnEmptyRunAreSaidSo) {
  // --seed -1 was taken as 2^64 - 1 (an unsigned option), and --steps 0 exited silently.
  const std::string model = " --model-file " + test::fixture_path("gpt2_tiny.bin");
  for (const std::string& command :
       {std::string(TALLY_CLI) + " sample" + model + " --seed -1", train_command("", test::write_random_shard("s.bin", 2000, 97, 3), "--seed -1", 1)}) {
    Outcome o = run(command);
    EXPECT_NE(o.exit_code, 0) << command << "\n" << o.output;
    EXPECT_NE(o.output.find("--seed"), std::string::npos) << o.output;
  }
  // A preset beside a model file was ignored without a word; train and plan take one source.
  for (const std::string& command : {train_command("", "unused.bin", "--model gpt2-xl", 1),
                                     std::string(TALLY_CLI) + " plan --model-file " + test::fixture_path("gpt2_tiny.bin") +
                                         " --init-from " + test::fixture_path("llama3_tiny_hf")}) {
    Outcome o = run(command);
    EXPECT_NE(o.exit_code, 0) << command;
    EXPECT_NE(o.output.find("excludes"), std::string::npos) << o.output;
  }
  Outcome empty = run(train_command("", test::write_random_shard("s0.bin", 2000, 97, 3),
                                    "--out-dir " + test::temp_path("steps0"), 0));
  EXPECT_EQ(empty.exit_code, 0) << empty.output;
  EXPECT_NE(empty.output.find("nothing to train: the run is at step 0 of --steps 0"), std::string::npos) << empty.output;
}

// A mistyped command was answered "A subcommand is required"; a zero count of ranks or
// stages "Value 0 not in range 0.000000 to 1.79e308".
TEST(Launch, AMistypedCommandOrAZeroCountIsNamed) {
  Outcome o = run(std::string(TALLY_CLI) + " trian --model d2");
  EXPECT_NE(o.exit_code, 0);
  EXPECT_NE(o.output.find("tally: unknown command 'trian' (commands: train, sample,"), std::string::npos) << o.output;
  o = run(std::string(TALLY_CLI) + " memory reprot x.json");
  EXPECT_NE(o.exit_code, 0);
  EXPECT_NE(o.output.find("tally memory: unknown command 'reprot' (commands: report, diff;"), std::string::npos) << o.output;
  for (const char* flag : {"--pp", "--tp", "--virtual-stages"}) {
    o = run(std::string(TALLY_CLI) + " plan --model d2 " + flag + " 0");
    EXPECT_NE(o.exit_code, 0) << flag;
    EXPECT_NE(o.output.find(std::string(flag) + ": expected a positive integer, got 0"), std::string::npos) << o.output;
  }
  // A batch whose activations overflow a 64-bit byte count names the flags that made it
  // ("plan: activations: 639999999999936 x 50304 overflows" named neither).
  o = run(std::string(TALLY_CLI) + " plan --model d2 --batch-size 9999999999999");
  EXPECT_NE(o.exit_code, 0);
  EXPECT_NE(o.output.find("the activations of --batch-size 9999999999999 x --seq-len 64 tokens a microbatch: "),
            std::string::npos) << o.output;
}

// tokenize read any file that is not a directory as an llm.c tokenizer .bin ("bad magic",
// "cannot open llm.c tokenizer"), which it refuses anyway; plot -o '' failed renaming its
// temporary file to ''.
TEST(Launch, ToolsNameTheInputTheyExpected) {
  const std::string text = test::temp_path("text.txt");
  test::write_all(text, "hello\n");
  Outcome o = run(std::string(TALLY_CLI) + " tokenize --tokenizer " + text + " --out " + test::temp_path("tk") + " " + text);
  EXPECT_NE(o.exit_code, 0);
  EXPECT_NE(o.output.find("tokenize: --tokenizer '" + text + "' is not one: expected a directory with tokenizer.json"),
            std::string::npos) << o.output;
  o = run(std::string(TALLY_CLI) + " tokenize --tokenizer /nonexistent/x --out " + test::temp_path("tk") + " " + text);
  EXPECT_NE(o.output.find("--tokenizer '/nonexistent/x' does not exist: expected"), std::string::npos) << o.output;
  const std::string log = test::temp_path("l.jsonl");
  test::write_all(log, "{\"step\":1,\"loss\":9.0,\"lr\":0.001,\"tokens\":64}\n");
  o = run(std::string(TALLY_CLI) + " plot " + log + " -o ''");
  EXPECT_NE(o.exit_code, 0);
  EXPECT_NE(o.output.find("plot: -o '' must name the SVG file to write"), std::string::npos) << o.output;
  // Both ways of one switch: the last one won without a word.
  o = run(std::string(TALLY_CLI) + " sample --model-file " + test::fixture_path("gpt2_tiny.bin") +
          " --stop-at-eot --no-stop-at-eot --tokens 2");
  EXPECT_NE(o.exit_code, 0);
  EXPECT_NE(o.output.find("--stop-at-eot excludes --no-stop-at-eot"), std::string::npos) << o.output;
}

// A switch given a value: --no-stop-at-eot=false kept generating past the end of text (the
// callbacks dropped the value), and a seed past 2^64 - 1 was clamped to it, so two seeds
// drew the same samples.
TEST(Launch, SwitchValuesAreHonouredAndSeedsOutOfRangeRefused) {
  const std::string unseeded = std::string(TALLY_CLI) + " sample --model-file " + test::fixture_path("gpt2_tiny.bin") +
                               " --tokens 10 --top-k 0";
  const std::string sample = unseeded + " --seed 17";
  const Outcome stops = run(sample);
  const Outcome goes_on = run(sample + " --no-stop-at-eot");
  ASSERT_EQ(stops.exit_code, 0) << stops.output;
  ASSERT_EQ(goes_on.exit_code, 0) << goes_on.output;
  ASSERT_NE(stops.output, goes_on.output) << "this seed's sample must reach the end of text";
  for (const char* flag : {"--no-stop-at-eot=false", "--no-stop-at-eot=0", "--stop-at-eot=true", "--stop-at-eot"})
    EXPECT_EQ(run(sample + " " + flag).output, stops.output) << flag;
  for (const char* flag : {"--stop-at-eot=false", "--stop-at-eot=0", "--no-stop-at-eot=true"})
    EXPECT_EQ(run(sample + " " + flag).output, goes_on.output) << flag;
  for (const std::string seed : {"18446744073709551616", "99999999999999999999999"}) {
    const Outcome o = run(unseeded + " --seed " + seed);
    EXPECT_NE(o.exit_code, 0) << seed;
    EXPECT_NE(o.output.find("--seed: expected a non-negative integer below 2^64, got " + seed), std::string::npos)
        << o.output;
  }
  EXPECT_EQ(run(unseeded + " --seed 18446744073709551615").exit_code, 0);
  // Any integer flag: CLI11 alone clamped a number past its type to the type's largest.
  const Outcome steps = run(train_command("", test::fixture_path("gpt2_tiny.bin"), "--steps 99999999999999999999"));
  EXPECT_NE(steps.exit_code, 0);
  EXPECT_NE(steps.output.find("--steps: out of range: expected an integer from -9223372036854775808 to "
                              "9223372036854775807, got 99999999999999999999"),
            std::string::npos)
      << steps.output;
  const Outcome count = run(unseeded + " --count 9999999999999999999999");
  EXPECT_NE(count.output.find("--count: out of range"), std::string::npos) << count.output;
}

TEST(Launch, SamplingWithASmallerTokenizerWarnsAndShowsTheIdsItLacks) {
  // A model with 128,256 tokens sampled through a 257-token tokenizer failed mid-sample
  // with "token id N is out of range", naming neither the model nor the tokenizer.
  const std::string out = test::temp_path("wide_vocab");
  Outcome trained = run(std::string(TALLY_CLI) + " train --model llama3-d1 --train-data " +
                        test::write_random_shard("w.bin", 2000, 97, 5) +
                        " --batch-size 1 --seq-len 8 --steps 1 --threads 1 --sample-every -1 --save-every 1 --out-dir " + out);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const std::string tok = test::temp_path("tok257");
  std::filesystem::create_directories(tok);
  test::write_tiny_gpt2_tokenizer(tok, {});
  Outcome o = run(std::string(TALLY_CLI) + " sample --model-file " + out + " --tokenizer " + tok +
                  " --tokens 16 --temperature 1 --no-stop-at-eot --seed 3");
  EXPECT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("--tokenizer '" + tok + "' has 257 tokens and the model"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("<|id "), std::string::npos) << o.output;  // an untrained 128k model draws high ids
  // Training's own samples show them the same way (they were dropped without a trace).
  Outcome during = run(std::string(TALLY_CLI) + " train --model llama3-d1 --train-data " +
                       test::write_random_shard("w2.bin", 2000, 97, 5) + " --tokenizer " + tok +
                       " --batch-size 1 --seq-len 8 --steps 1 --threads 1 --sample-every 1 --sample-tokens 16 --out-dir " +
                       test::temp_path("wide_vocab_train"));
  EXPECT_EQ(during.exit_code, 0) << during.output;
  EXPECT_NE(during.output.find("<|id "), std::string::npos) << during.output;
}

TEST(Launch, SampleFlagsOfARunThatDrawsNoSampleAreRefused) {
  // --sample-tokens 0 drew no sample, yet --temperature and --top-k were taken without a
  // word, and with --sample-every N every Nth step printed an empty sample.
  const std::string data = test::write_random_shard("nosample.bin", 5000, 97, 3);
  const std::string base = std::string(TALLY_CLI) + " train --model-file " + test::fixture_path("gpt2_tiny.bin") +
                           " --train-data " + data + " --batch-size 2 --seq-len 16 --steps 2 --threads 1 --out-dir " +
                           test::temp_path("nosample_out") + " ";
  for (const auto& [flags, expected] : std::vector<std::pair<std::string, std::string>>{
           {"--sample-every -1 --top-k 5", "--top-k sets the samples a run prints, and --sample-every -1 draws none"},
           {"--sample-tokens 0 --temperature 0.7",
            "--temperature sets the samples a run prints, and --sample-tokens 0 draws none"},
           {"--sample-tokens 0 --sample-every 1",
            "--sample-every 1 prints a sample of --sample-tokens tokens every 1 steps, and --sample-tokens is 0"}}) {
    Outcome o = run(base + flags);
    EXPECT_EQ(o.exit_code, 1) << flags << ": " << o.output;
    EXPECT_NE(o.output.find("tally: " + expected), std::string::npos) << flags << ": " << o.output;
    EXPECT_EQ(o.output.find("sample:"), std::string::npos) << flags << ": " << o.output;
  }
  // --sample-tokens 0 alone is how a run says "no sample at the end": it trains.
  Outcome quiet = run(base + "--sample-tokens 0");
  EXPECT_EQ(quiet.exit_code, 0) << quiet.output;
  EXPECT_EQ(quiet.output.find("sample:"), std::string::npos) << quiet.output;
}

TEST(Launch, DataParallelWithoutMpirunSaysHowToLaunch) {
  const std::string data = test::write_random_shard("ok.bin", 20000, 97, 3);
  Outcome o = run(train_command("", data, "--dp 2"));
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("mpirun -np 2 tally train"), std::string::npos) << o.output;
}

TEST(Launch, ALayoutThatDoesNotFitTheWorldNamesTheFlags) {
  const std::string data = test::write_random_shard("ok.bin", 20000, 97, 3);
  Outcome o = run(train_command("mpirun --oversubscribe -np 2", data, "--dp 3"));
  EXPECT_NE(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("--dp 3 x --tp 1 x --pp 1 = 3 processes, but mpirun started 2"), std::string::npos) << o.output;
  // Ranks launched with other layouts (an mpirun app context, a per-node script): only
  // rank 1's did not fit, it exited, and rank 0 waited in set-up forever.
  const std::string one = train_command("-np 1", data, "--dp 2", 2), other = train_command("-np 1", data, "--dp 3", 2);
  o = run("mpirun --oversubscribe " + one + " : " + other, 60);
  EXPECT_NE(o.exit_code, 0) << o.output;
  EXPECT_NE(o.exit_code, 124) << "the job hung: " << o.output;
  EXPECT_NE(o.output.find("tally: rank 1: --dp 3 x --tp 1 x --pp 1 = 3 processes, but mpirun started 2"),
            std::string::npos) << o.output;
  // A rank whose data holds other tokens of the same count trained on them without a word.
  const std::string other_data = test::write_random_shard("ok_other.bin", 20000, 97, 4);
  o = run("mpirun --oversubscribe " + train_command("-np 1", data, "--dp 2", 2) + " : " +
              train_command("-np 1", other_data, "--dp 2", 2),
          60);
  EXPECT_NE(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("--train-data's tokens (a fingerprint of every token) on rank(s) 1 differs from rank 0's"),
            std::string::npos) << o.output;
  o = run(train_command("mpirun --oversubscribe -np 2", data, "--pp 2 --grad-accum 1", 2));
  EXPECT_NE(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("needs at least 2 microbatches per step (--grad-accum)"), std::string::npos) << o.output;
  o = run(train_command("mpirun --oversubscribe -np 2", data, "--tp 2 --zero 2", 2));
  EXPECT_NE(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("--zero 2 with --tp/--pp"), std::string::npos) << o.output;
}

// Mixed precision and the kernel profile from the command line: the run says which peak
// it measures against, --profile-ops prints each phase's kernels after the step line and
// adds them to the JSONL row, and bad values name the flag.
TEST(Launch, Bf16AndProfileOpsFromTheCommandLine) {
  const std::string data = test::write_random_shard("ok.bin", 20000, 97, 3);
  const std::string log = test::temp_path("profile.jsonl");
  Outcome o = run(train_command("", data, "--dtype bf16 --profile-ops --out-dir " + test::temp_path("out") +
                                              " --log-json " + log, 2));
  EXPECT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("measured bf16 GEMM peak"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("  backward "), std::string::npos) << o.output;
  std::ifstream in(log);
  std::string row;
  std::getline(in, row);
  const nlohmann::json j = nlohmann::json::parse(row);
  ASSERT_TRUE(j.contains("ops")) << row;
  EXPECT_GT(j["ops"]["forward"]["kernels"]["gemm"]["gflop"].get<double>(), 0) << row;
  // The first forward rounds the parameters into their bf16 copy (AdamW refreshes it after
  // that). Its kernel is in the row, which lists every kernel; the step line shows the six
  // slowest, where so small a copy may or may not rank (it did not under ASan once it
  // became one instruction per 16 values).
  EXPECT_TRUE(j["ops"]["forward"]["kernels"].contains("parameters_to_bf16")) << row;
  EXPECT_GE(j["ops"]["backward"]["ms"].get<double>(), j["ops"]["backward"]["kernel_ms"].get<double>()) << row;

  o = run(train_command("", data, "--dtype fp16", 1));
  EXPECT_NE(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("--dtype"), std::string::npos) << o.output;
  o = run(train_command("mpirun --oversubscribe -np 2", data, "--dtype bf16 --zero 3", 1));
  EXPECT_NE(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("--dtype bf16 with --zero 3"), std::string::npos) << o.output;
  // Where bf16 GEMMs are widened (no AVX-512), the note says so once, not once per rank.
  o = run(train_command("mpirun --oversubscribe -np 2", data, "--dtype bf16 --dp 2", 1));
  EXPECT_EQ(o.exit_code, 0) << o.output;
  size_t notes = 0;
  for (size_t at = o.output.find("no bf16 GEMM kernel"); at != std::string::npos;
       at = o.output.find("no bf16 GEMM kernel", at + 1))
    ++notes;
  EXPECT_LE(notes, 1u) << o.output;
}

// One command trains a pipeline: the step line, the pipeline's own memory line, and the
// JSONL row with the measured bubble.
TEST(Launch, APipelineRunPrintsItsLayoutAndLogsItsBubble) {
  const std::string data = test::write_random_shard("ok.bin", 20000, 97, 3);
  const std::string log = test::temp_path("pp.jsonl");
  Outcome o = run(train_command("mpirun --oversubscribe -np 2", data,
                                "--pp 2 --pp-schedule 1f1b --grad-accum 4 --recompute full --log-json " + log, 3));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("pipeline 2 stages, 1f1b"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("step     3/3"), std::string::npos) << o.output;
  const std::string rows = test::read_all(log);
  EXPECT_NE(rows.find("\"bubble_frac\""), std::string::npos) << rows;
  EXPECT_NE(rows.find("\"max_in_flight\":2"), std::string::npos) << rows;
}

TEST(Launch, OnlyRankZeroPrintsTheStepLines) {
  const std::string data = test::write_random_shard("ok.bin", 20000, 97, 3);
  Outcome o = run(train_command("mpirun --oversubscribe -np 2", data, "--dp 2 --zero 1", 3));
  EXPECT_EQ(o.exit_code, 0) << o.output;
  size_t lines = 0;
  for (size_t at = o.output.find("step "); at != std::string::npos; at = o.output.find("step ", at + 1))
    lines += o.output.compare(at, 11, "step     1/") == 0 || o.output.compare(at, 11, "step     2/") == 0 ||
             o.output.compare(at, 11, "step     3/") == 0;
  EXPECT_EQ(lines, 3u) << o.output;
}

TEST(Launch, SampleReadsATrainingOutDirAndDrawsSeveralSamples) {
  const std::string data = test::write_random_shard("sample_src.bin", 20000, 97, 4);
  const std::string out = test::temp_path("sample_run");
  Outcome trained = run(train_command("", data, "--save-every 2 --out-dir " + out, 2));
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  // The --out-dir resolves through its `latest` file to step_00000002/model.bin.
  Outcome o = run(std::string(TALLY_CLI) + " sample --model-file " + out + " --tokens 4 --count 3 --seed 7");
  EXPECT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("--- sample 1"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("--- sample 3"), std::string::npos) << o.output;
  EXPECT_EQ(o.output.find("--- sample 4"), std::string::npos) << o.output;

  const std::string empty_dir = test::temp_path("empty_dir");
  std::filesystem::create_directories(empty_dir);
  // Flags that were silently ignored or produced garbage.
  for (const auto& [flags, expected] :
       std::vector<std::pair<std::string, std::string>>{{"--prompt Hello", "--prompt needs --tokenizer"},
                                                        {"--temperature nan", "--temperature must be a finite number"},
                                                        {"--top-k -1", "--top-k must be >= 0"},
                                                        {"--threads 100000", "--threads must be in 0..1024"}}) {
    Outcome bad = run(std::string(TALLY_CLI) + " sample --model-file " + out + " " + flags);
    EXPECT_EQ(bad.exit_code, 1) << flags;
    EXPECT_NE(bad.output.find("tally: " + expected), std::string::npos) << flags << ": " << bad.output;
  }
  Outcome nothing = run(std::string(TALLY_CLI) + " sample --model-file " + empty_dir);
  EXPECT_EQ(nothing.exit_code, 1);
  EXPECT_NE(nothing.output.find("neither model.bin"), std::string::npos) << nothing.output;
}

TEST(Launch, KilledAtRandomPointsAndResumedTheRunEndsBitExactWithEveryLogRowOnce) {
  // The same 100-step run, once straight through and once killed (SIGKILL) eight times and
  // resumed from whatever it left, then run to its end. Every step is checkpointed. Kill
  // points are chosen by progress, not by the clock (a busy machine would shift them): six
  // kills come once the log has reached a random step a little past where the run
  // resumed, landing in that step's checkpoint write or the next step; two come a random
  // 10-150 ms after launch, in start-up or the resume.
  const std::string data = test::write_random_shard("kill.bin", 20000, 97, 9);
  auto command = [&](const std::string& out, bool resume) {
    return train_command("", data, "--save-every 1 --out-dir " + out + " --log-json " + out + "/log.jsonl" +
                                       (resume ? " --resume " + out : ""),
                         100);
  };
  const std::string straight = test::temp_path("straight"), killed = test::temp_path("killed");
  // A process id can repeat across runs of the suite: start from empty directories.
  std::filesystem::remove_all(straight);
  std::filesystem::remove_all(killed);
  const Outcome uninterrupted = run(command(straight, false));
  ASSERT_EQ(uninterrupted.exit_code, 0) << uninterrupted.output;

  const std::string log = killed + "/log.jsonl";
  auto rows_in_log = [&] {
    std::istringstream in(std::filesystem::exists(log) ? test::read_all(log) : std::string());
    int n = 0;
    for (std::string line; std::getline(in, line);) n += !line.empty();
    return n;
  };
  Rng rng(2026);
  int kills = 0;
  for (int k = 0; k < 8; ++k) {
    const bool resume = std::filesystem::exists(killed + "/latest");
    std::string trigger;
    if (k % 4 == 1) {
      char ms[32];
      std::snprintf(ms, sizeof ms, "%.3f", 0.01 + 0.14 * rng.uniform());
      trigger = std::string("sleep ") + ms;
    } else {
      const int target = std::min(99, rows_in_log() + 1 + static_cast<int>(rng.next_u64() % 12));
      trigger = "while kill -0 $pid 2>/dev/null && [ \"$(grep -c step " + log + " 2>/dev/null)\" -lt " +
                std::to_string(target) + " ]; do sleep 0.002; done";
    }
    // The training runs in the background; the trigger decides when it is SIGKILLed.
    const Outcome o = run("bash -c '" + command(killed, resume) + " > /dev/null 2>&1 & pid=$!; " + trigger +
                          "; kill -9 $pid 2>/dev/null; wait $pid'");
    kills += o.exit_code != 0;
  }
  const Outcome last = run(command(killed, std::filesystem::exists(killed + "/latest")));
  ASSERT_EQ(last.exit_code, 0) << last.output;
  EXPECT_GE(kills, 6) << "most runs must have been killed, or the test tests nothing";
  std::printf("killed %d times before the run finished\n", kills);
  EXPECT_EQ(test::read_all(killed + "/step_00000100/model.bin"), test::read_all(straight + "/step_00000100/model.bin"))
      << "after " << kills << " kills the weights differ";
  EXPECT_EQ(test::read_all(killed + "/step_00000100/state.bin"), test::read_all(straight + "/step_00000100/state.bin"));
  // The log: steps 1..100, each once, in order.
  std::vector<int64_t> all_steps(100);
  for (int64_t s = 0; s < 100; ++s) all_steps[s] = s + 1;
  EXPECT_EQ(test::log_steps(log), all_steps) << "after " << kills << " kills";
}

TEST(Launch, PlanPrintsEveryRanksPeakAsTextAndJson) {
  Outcome text = run(std::string(TALLY_CLI) + " plan --model d2 --batch-size 4 --seq-len 64 --world 2 --zero 1");
  EXPECT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("predicted peak"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("head:linear"), std::string::npos) << text.output;  // the logits
  Outcome json = run(std::string(TALLY_CLI) + " plan --model d2 --world 2 --json");
  EXPECT_EQ(json.exit_code, 0) << json.output;
  EXPECT_NE(json.output.find("\"rank\": 1"), std::string::npos) << json.output;
  EXPECT_NE(json.output.find("\"predicted_peak_bytes\""), std::string::npos) << json.output;
  Outcome zero3 = run(std::string(TALLY_CLI) + " plan --model d2 --world 2 --zero 3");
  EXPECT_EQ(zero3.exit_code, 0) << zero3.output;
  EXPECT_NE(zero3.output.find("zero3.gathered(embed)"), std::string::npos) << zero3.output;
  Outcome zero5 = run(std::string(TALLY_CLI) + " plan --model d2 --world 2 --zero 5");
  EXPECT_NE(zero5.exit_code, 0);
  EXPECT_NE(zero5.output.find("--zero: Value 5 not in range 0 to 3"), std::string::npos) << zero5.output;
  // Tensor parallel: --world defaults to --dp x --tp; a split the model cannot take is named.
  Outcome tp = run(std::string(TALLY_CLI) + " plan --model d2 --dp 2 --tp 2 --sp --recompute full");
  EXPECT_EQ(tp.exit_code, 0) << tp.output;
  EXPECT_NE(tp.output.find("4 rank(s) (tp 2 with sp)"), std::string::npos) << tp.output;
  EXPECT_NE(tp.output.find("full recomputation"), std::string::npos) << tp.output;
  EXPECT_NE(tp.output.find("mlp:add"), std::string::npos) << tp.output;  // the layers' outputs, kept
  Outcome stages = run(std::string(TALLY_CLI) + " plan --model d4 --pp 2 --grad-accum 4 --pp-schedule gpipe");
  EXPECT_EQ(stages.exit_code, 0) << stages.output;
  EXPECT_NE(stages.output.find("rank 1 (pipeline stage 1)"), std::string::npos) << stages.output;
  EXPECT_NE(stages.output.find("rank 1 (pipeline stage 1): predicted peak"), std::string::npos) << stages.output;
  // Pipeline flags without the pipeline they need are refused as tally train refuses them.
  for (const std::string& flags : {std::string("--virtual-stages 2"), std::string("--pp-last-stage-layers 3")}) {
    Outcome o = run(std::string(TALLY_CLI) + " plan --model d4 " + flags);
    EXPECT_EQ(o.exit_code, 1) << flags;
    EXPECT_NE(o.output.find(flags.substr(0, flags.find(' '))), std::string::npos) << o.output;
  }
  Outcome odd = run(std::string(TALLY_CLI) + " plan --model gpt2 --tp 5");
  EXPECT_EQ(odd.exit_code, 1);
  EXPECT_NE(odd.output.find("--tp 5: the model's 12 query heads and 12 key/value heads must both divide into 5 ranks"),
            std::string::npos)
      << odd.output;
}

// tally plan refuses what tally train refuses, in the same words: one check serves both
// (its messages were the plan's own, some saying only "(as tally train says)"). Those a
// single process can reach are compared with train's line for line; the others are
// train's words, printed by plan.
TEST(Launch, PlanRefusesWhatTrainRefusesInTheSameWords) {
  const std::string data = test::write_random_shard("plan_refusals.bin", 5000, 97, 5);
  auto last_line = [](const std::string& output) {  // the refusal (not CLI11's "Run with --help")
    std::string text = output;
    for (const std::string tail : {"\n", "Run with --help for more information.", "\n"})
      if (text.ends_with(tail)) text.resize(text.size() - tail.size());
    return text.substr(text.rfind('\n') + 1);
  };
  for (const std::string& flags : {std::string("--zero 5"), std::string("--sp"), std::string("--dtype bf16 --zero 3"),
                                   std::string("--device cuda --zero 1"), std::string("--device gpu0 --zero 1")}) {
    const Outcome train = run(train_command("", data, flags + " --out-dir " + test::temp_path("plan_refusals_out"), 1));
    const Outcome plan = run(std::string(TALLY_CLI) + " plan --model-file " + test::fixture_path("gpt2_tiny.bin") +
                             " --batch-size 2 --seq-len 16 " + flags);
    EXPECT_NE(train.exit_code, 0) << flags << "\n" << train.output;
    EXPECT_EQ(plan.exit_code, train.exit_code) << flags << "\n" << plan.output;
    EXPECT_EQ(last_line(plan.output), last_line(train.output)) << flags;
  }
  const std::string plan = std::string(TALLY_CLI) + " plan --model d2 ";
  EXPECT_NE(run(plan + "--pp 2 --zero 2").output.find("--zero 2 with --tp/--pp: the model is already sharded by tensor "
                                                      "and pipeline parallelism; use --zero 1"),
            std::string::npos);
  EXPECT_NE(run(plan + "--tp 2 --chunked-loss").output.find("--chunked-loss with --tp: the tensor-parallel loss is "
                                                            "vocabulary-parallel already"),
            std::string::npos);
  EXPECT_NE(run(plan + "--tp 2 --sp --seq-len 63").output.find("--sp: --seq-len 63 must divide into --tp 2 ranks"),
            std::string::npos);
  EXPECT_NE(run(plan + "--cp 3 --seq-len 64").output.find("--cp 3: each sequence is cut into 2 x 3 chunks (rank r holds "
                                                          "chunks r and 6-1-r), so --seq-len 64 must be a multiple of 6"),
            std::string::npos);
  EXPECT_NE(run(plan + "--world 6 --cp 4").output.find("--world 6 is not a multiple of --tp 1 x --cp 4 x --pp 1"),
            std::string::npos);
  // Context parallel is planned by the dry run, each rank's part of every sequence.
  EXPECT_NE(run(plan + "--cp 2 --dp 2").output.find("4 rank(s) (cp 2)"), std::string::npos);
  EXPECT_NE(run(plan + "--world 2 --device cuda").output.find("--device cuda:0 with 2 processes: multi-GPU training needs "
                                                              "the NCCL communicator"),
            std::string::npos);
}

// Several ranks: the dry run stands in for the first rank of each pipeline stage, on
// communicators that move nothing; context parallel is planned that way.
TEST(Launch, PlanRunsTheDryRunForEachPipelineStage) {
  const std::string plan = std::string(TALLY_CLI) + " plan --model d2 --world 4 --cp 2 --pp 2 --seq-len 64 --grad-accum 2";
  const Outcome text = run(plan);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("dry run (the real steps on the meta device), rank 0 (pipeline stage 0): step 1"),
            std::string::npos) << text.output;
  EXPECT_NE(text.output.find("dry run (the real steps on the meta device), rank 2 (pipeline stage 1): step 1"),
            std::string::npos) << text.output;
  const Outcome json = run(plan + " --json");
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const nlohmann::json j = nlohmann::json::parse(json.output);
  ASSERT_EQ(j.at("dry_runs").size(), 2u);
  EXPECT_EQ(j["dry_runs"][1]["rank"], 2);
  EXPECT_EQ(j["dry_runs"][1]["stage"], 1);
  EXPECT_GT(j["dry_runs"][1]["peak_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(j["dry_run"]["rank"], 0);
  // ZeRO's shards are stood in for, and so are tensor-parallel ranks (stage 1's first is
  // rank 2 of tp 2 x pp 2).
  EXPECT_NE(run(plan + " --zero 1").output.find("rank 2 (pipeline stage 1)"), std::string::npos);
  const std::string tp = std::string(TALLY_CLI) + " plan --model d2 --world 4 --tp 2 --pp 2 --seq-len 64 --grad-accum 2";
  const Outcome tp_plan = run(tp);
  EXPECT_NE(tp_plan.output.find("dry run (the real steps on the meta device), rank 2 (pipeline stage 1)"),
            std::string::npos) << tp_plan.output;
}

// A GPU run planned on any machine: cuBLASLt's 32 MiB workspace is part of its peak (the
// trainer's own plan had it, tally plan had no --device and came out 32 MiB low), and the
// validation loader's host buffers are not.
TEST(Launch, PlanForAGpuRunCountsTheLibraryWorkspace) {
  const std::string plan = std::string(TALLY_CLI) + " plan --model d2 --batch-size 2 --seq-len 32 --val --json";
  const Outcome cpu = run(plan), cuda = run(plan + " --device cuda");
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  ASSERT_EQ(cuda.exit_code, 0) << cuda.output;
  auto peak = [](const std::string& json) {
    const size_t at = json.find("\"predicted_peak_bytes\": ");
    return at == std::string::npos ? int64_t{-1} : std::stoll(json.substr(at + 24));
  };
  const Outcome cpu_no_val = run(std::string(TALLY_CLI) + " plan --model d2 --batch-size 2 --seq-len 32 --json");
  const int64_t val_buffers = peak(cpu.output) - peak(cpu_no_val.output);
  EXPECT_GT(val_buffers, 0);
  // The loaders stay on the host; at backward's peak the loss's backward has freed the
  // targets' device copy (B x T int32), and cuBLASLt's workspace is held.
  const int64_t targets_copy = 2 * 32 * 4;
  EXPECT_EQ(peak(cuda.output), peak(cpu.output) - val_buffers - targets_copy + (int64_t{32} << 20)) << cuda.output;
  // And the dry run on meta(cuda) says the same.
  const nlohmann::json j = nlohmann::json::parse(cuda.output);
  ASSERT_TRUE(j.contains("dry_run")) << cuda.output;
  EXPECT_EQ(j["dry_run"]["peak_bytes"].get<int64_t>(), peak(cuda.output)) << cuda.output;
  const Outcome bad = run(plan + " --device tpu");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("expected cpu, cuda or cuda:N, got 'tpu'"), std::string::npos) << bad.output;
}

// One process on the CPU: the plan also dry-runs the steps on the meta device, and the two
// agree (the formulas and the real step's allocations).
TEST(Launch, PlanOfOneProcessDryRunsItsStepsOnTheMetaDevice) {
  for (const std::string flags : {"--model d2 --batch-size 2 --seq-len 32 --val", "--model llama3-d1 --batch-size 1 "
                                  "--seq-len 16 --dtype bf16 --recompute full --grad-accum 2"}) {
    const Outcome json = run(std::string(TALLY_CLI) + " plan " + flags + " --json");
    ASSERT_EQ(json.exit_code, 0) << json.output;
    const nlohmann::json j = nlohmann::json::parse(json.output);
    ASSERT_TRUE(j.contains("dry_run")) << json.output;
    EXPECT_EQ(j["dry_run"]["peak_bytes"].get<int64_t>(), j["ranks"][0]["predicted_peak_bytes"].get<int64_t>()) << flags;
    EXPECT_EQ(j["dry_run"]["step_peak_bytes"].size(), 2u);
    EXPECT_TRUE(j["dry_run"]["at_peak"].contains("loader.inputs")) << json.output;
    const Outcome text = run(std::string(TALLY_CLI) + " plan " + flags);
    ASSERT_EQ(text.exit_code, 0) << text.output;
    EXPECT_NE(text.output.find("dry run (the real steps on the meta device): step 1 "), std::string::npos) << text.output;
    EXPECT_NE(text.output.find("largest owners: "), std::string::npos) << text.output;
  }
  // Data parallel: the dry run stands in for a rank (its all-reduce moves nothing) and
  // agrees with the formulas there too.
  const Outcome dp = run(std::string(TALLY_CLI) + " plan --model d2 --world 2 --json");
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  const nlohmann::json j = nlohmann::json::parse(dp.output);
  ASSERT_TRUE(j.contains("dry_run")) << dp.output;
  EXPECT_EQ(j["dry_run"]["peak_bytes"].get<int64_t>(), j["ranks"][0]["predicted_peak_bytes"].get<int64_t>());
}

TEST(Launch, AKillAtEveryCrashPointOfACheckpointLosesNothing) {
  // The narrow windows random kills rarely hit, hit on purpose (core/crash_point.h): right
  // after a step's log row, after its checkpoint files are written, after the step directory
  // is renamed in, after `latest` is replaced, and after the save returned. Each time the
  // resumed run must end bit-exact with every log row once.
  const std::string data = test::write_random_shard("crash.bin", 20000, 97, 4);
  auto command = [&](const std::string& out, const std::string& crash, const std::string& resume) {
    return train_command(crash.empty() ? "" : "env TALLY_CRASH_POINT=" + crash, data,
                         "--save-every 1 --out-dir " + out + " --log-json " + out + "/log.jsonl" +
                             (resume.empty() ? "" : " --resume " + resume),
                         8);
  };
  const std::vector<int64_t> all_steps = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::string straight = test::temp_path("straight");
  std::filesystem::remove_all(straight);  // a process id can repeat across runs of the suite
  ASSERT_EQ(run(command(straight, "", "")).exit_code, 0);
  const std::string expected_model = test::read_all(straight + "/step_00000008/model.bin");

  for (const char* point : {"row", "checkpoint-written", "checkpoint-renamed", "checkpoint-latest", "checkpoint"}) {
    const std::string out = test::temp_path(std::string("crash_") + point);
    std::filesystem::remove_all(out);
    const Outcome crashed = run(command(out, std::string(point) + ":5", ""));
    ASSERT_EQ(crashed.exit_code, 137) << point << "\n" << crashed.output;
    const Outcome resumed = run(command(out, "", out));
    ASSERT_EQ(resumed.exit_code, 0) << point << "\n" << resumed.output;
    EXPECT_EQ(test::read_all(out + "/step_00000008/model.bin"), expected_model) << point;
    EXPECT_EQ(test::log_steps(out + "/log.jsonl"), all_steps) << point;
  }

  // Re-saving the step `latest` names: the run is resumed from an older checkpoint in the
  // same directory, and killed after the old step 6 was moved aside, before the new one is
  // in place. `latest` (6) must still lead to a complete checkpoint.
  const std::string out = test::temp_path("resave");
  std::filesystem::remove_all(out);
  ASSERT_EQ(run(command(out, "checkpoint:6", "")).exit_code, 137);  // latest names step 6
  const Outcome crashed = run(command(out, "checkpoint-aside:6", out + "/step_00000004"));
  ASSERT_EQ(crashed.exit_code, 137) << crashed.output;
  EXPECT_FALSE(std::filesystem::exists(out + "/step_00000006/state.bin"));  // the window: only the .old has it
  const Outcome resumed = run(command(out, "", out));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(test::read_all(out + "/step_00000008/model.bin"), expected_model);
  EXPECT_EQ(test::log_steps(out + "/log.jsonl"), all_steps);
  EXPECT_FALSE(std::filesystem::exists(out + "/step_00000006.old"));
}

// Resuming from an older checkpoint than `latest` cut the log back to that step at once; a
// kill before the resumed run's first save left `latest` at step 8 and the log without rows
// 5-8, and `--resume out` then found the run complete: the rows were gone for good. The
// log keeps the rows `latest` vouches for until the resumed run commits its own.
TEST(Launch, AResumeFromAnOlderCheckpointKilledBeforeItsFirstSaveLosesNoLogRows) {
  const std::string data = test::write_random_shard("older_resume.bin", 20000, 97, 5);
  const std::string out = test::temp_path("older_resume");
  std::filesystem::remove_all(out);
  auto command = [&](const std::string& crash, const std::string& resume) {
    return train_command(crash.empty() ? "" : "env TALLY_CRASH_POINT=" + crash, data,
                         "--save-every 4 --out-dir " + out + " --log-json " + out + "/log.jsonl" +
                             (resume.empty() ? "" : " --resume " + resume),
                         8);
  };
  ASSERT_EQ(run(command("", "")).exit_code, 0);
  const std::vector<int64_t> all_steps = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::string rows = test::read_all(out + "/log.jsonl");
  ASSERT_EQ(test::log_steps(out + "/log.jsonl"), all_steps);
  const Outcome killed = run(command("row:6", out + "/step_00000004"));
  ASSERT_EQ(killed.exit_code, 137) << killed.output;
  EXPECT_EQ(test::read_all(out + "/log.jsonl"), rows) << "the rows `latest` (step 8) vouches for";
  const Outcome again = run(command("", out));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(test::read_all(out + "/log.jsonl"), rows);
  // Resumed from step 4 to the end, the log is that run's history: steps 5-8 once each.
  const Outcome branch = run(command("", out + "/step_00000004"));
  ASSERT_EQ(branch.exit_code, 0) << branch.output;
  EXPECT_EQ(test::log_steps(out + "/log.jsonl"), all_steps);
}

// LLaMA-3 as a user runs it: tokenize with LLaMA-3's tokenizer.json (<|begin_of_text|>
// before each document, uint32 shards), train, sample from the out-dir with a prompt,
// export to HuggingFace and sample from that directory: the same greedy text.
TEST(Launch, LlamaTokenizeTrainSampleAndExport) {
  const char* corpus_env = std::getenv("TALLY_CORPUS_DIR");
  const std::string corpus = corpus_env ? corpus_env : std::string(TALLY_SOURCE_DIR) + "/data/corpus";
  if (!std::filesystem::exists(corpus + "/llama3/tokenizer.json"))
    GTEST_SKIP() << "llama3/tokenizer.json not in " << corpus << "; run scripts/fetch_corpus.sh";
  const std::string text = test::temp_path("docs.txt"), prefix = test::temp_path("llama");
  std::string docs;
  for (int i = 0; i < 200; ++i) docs += "Fortune number " + std::to_string(i) + " says: the cat sat on the mat.\n%\n";
  test::write_all(text, docs);
  const std::string tok = corpus + "/llama3";
  Outcome t = run(std::string(TALLY_CLI) + " tokenize --tokenizer " + tok + " --separator % --out " + prefix + " " + text);
  ASSERT_EQ(t.exit_code, 0) << t.output;
  const data::TokenShard shard = data::TokenShard::open(prefix + "_train.bin");
  EXPECT_EQ(shard.width(), data::TokenWidth::U32);
  EXPECT_EQ(shard.at(0), 128000) << "each document starts with <|begin_of_text|>";
  const std::string out = test::temp_path("llama_run");
  Outcome trained = run(std::string(TALLY_CLI) + " train --model llama3-d1 --train-data " + prefix +
                        "_train.bin --batch-size 2 --seq-len 16 --steps 3 --threads 1 --sample-every -1 "
                        "--save-every 3 --quiet --out-dir " + out);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const std::string greedy = " --tokenizer " + tok + " --prompt 'The cat' --tokens 6 --temperature 0 --no-stop-at-eot";
  Outcome a = run(std::string(TALLY_CLI) + " sample --model-file " + out + greedy);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(a.output.rfind("The cat", 0), 0u) << a.output;
  const std::string hf = test::temp_path("llama_hf");
  Outcome e = run(std::string(TALLY_CLI) + " export --model-file " + out + " --format hf -o " + hf);
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_TRUE(std::filesystem::exists(hf + "/config.json") && std::filesystem::exists(hf + "/model.safetensors"));
  Outcome b = run(std::string(TALLY_CLI) + " sample --model-file " + hf + greedy);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_EQ(b.output, a.output) << "the exported model samples the same greedy text";
  // An empty -o wrote the HuggingFace files into the current directory (and removed a
  // sharded model's files there); both formats refuse it.
  for (const char* format : {"hf", "llmc"}) {
    Outcome empty = run(std::string(TALLY_CLI) + " export --model-file " + out + " --format " + format + " -o ''");
    EXPECT_NE(empty.exit_code, 0) << empty.output;
    EXPECT_NE(empty.output.find("-o is empty"), std::string::npos) << empty.output;
  }
  Outcome bad = run(std::string(TALLY_CLI) + " sample --model-file " + out + " --top-p 1.5");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.output.find("--top-p must be in (0, 1]"), std::string::npos) << bad.output;
}
