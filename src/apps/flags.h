// The command line's flags, declared once for every command that takes them.
//
// A training run's flags are `tally train`'s, and `tally plan` takes the same command
// line (it predicts that run's memory): both declare them with add_run_flags, which
// parses each straight into its typed field of train::TrainConfig (enums and the device
// included). The validators here answer in tally's words ("--tp: expected a positive
// integer, got 0").
#pragma once
#include <CLI/CLI.hpp>

#include <charconv>
#include <limits>
#include <string>
#include <type_traits>

#include "train/config.h"

namespace tally::apps {

// A seed: an integer in 0 .. 2^64 - 1 (CLI11 alone takes "-1" as 2^64 - 1 and clamps a
// value past 2^64 - 1 to it, so two different seeds would draw the same samples).
extern const CLI::Validator kNonNegativeInteger;
// A count of at least one (ranks, stages).
extern const CLI::Validator kPositiveInteger;

// An integer within its type's range, sign and all: CLI11 alone clamps a number out of
// range (--steps 99999999999999999999 became 2^63 - 1) without a word.
template <class T> CLI::Validator integer_in_range() {
  return CLI::Validator(
      [](std::string& value) {
        T parsed{};
        const char* end = value.data() + value.size();
        const auto [stop, error] = std::from_chars(value.data(), end, parsed);
        if (error == std::errc() && stop == end) return std::string();
        const bool range = error == std::errc::result_out_of_range;
        return std::string(range ? "out of range: expected an integer from " : "expected an integer from ") +
               std::to_string(std::numeric_limits<T>::min()) + " to " + std::to_string(std::numeric_limits<T>::max()) +
               ", got " + value;
      },
      "");
}

// An option into `field`; an integer field's value must fit it.
template <class T>
CLI::Option* add_value(CLI::App& app, const std::string& flag, T& field, const std::string& help = "") {
  CLI::Option* option = app.add_option(flag, field, help);
  if constexpr (std::is_same_v<T, uint64_t>) option->check(kNonNegativeInteger);
  else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) option->check(integer_in_range<T>());
  return option;
}

inline constexpr const char* kModelHelp =
    "Preset: gpt2, gpt2-medium, gpt2-large, gpt2-xl, dN (GPT-2 of depth N, width 64N; N in 1..64); llama3.2-1b, "
    "llama3.2-3b, llama3.1-8b, llama3-dN (N in 1..64)";
inline constexpr const char* kTokenizerHelp =
    "A directory with tokenizer.json (LLaMA-3) or encoder.json + vocab.bpe (GPT-2), or an llm.c tokenizer .bin";

// Every flag of a training run on `command`, into `config`.
void add_run_flags(CLI::App& command, train::TrainConfig& config);
// After parsing: the flags whose presence matters besides their value (--model given
// beside a resume, --bucket-mb and --val-batches named to say they would do nothing).
void note_given_flags(const CLI::App& command, train::TrainConfig& config);
// A sample setting given to a run that draws no samples would do nothing: its name and
// why ("--temperature", "--sample-every -1"), or "" when every one given is used.
std::pair<std::string, std::string> unused_sample_flag(const CLI::App& command, const train::TrainConfig& config);

}  // namespace tally::apps
