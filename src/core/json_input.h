// JSON read from files: tokenizers, HuggingFace configs and indexes, safetensors headers,
// checkpoint recipes, step logs, memory traces. nlohmann parses any depth without
// recursing, but copying, comparing or printing a value recurses once a level: a 120 KB
// encoder.json of '[' overflows the stack (a segfault, not an error) wherever a loader
// copies the value or prints it in its message. Every such file is parsed here, its
// nesting bounded: none of them nests deeper than a handful of levels.
#pragma once
#include <functional>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace tally {

inline constexpr int kMaxJsonDepth = 64;

// `text` parsed, or tally::Error "<what>: invalid JSON: <nlohmann's reason>" or "<what>:
// JSON nested deeper than 64 levels ...". `what` names the file ("GPT-2 encoder.json 'f'").
nlohmann::json parse_json(std::string_view text, const std::string& what);

// The same bound for a caller that reads nlohmann's own syntax error (its byte offset):
// nlohmann::json::parse_error passes through; too deep is the tally::Error above.
nlohmann::json parse_json_keeping_syntax_errors(std::string_view text, const std::string& what);
// From a stream, keeping only the top-level members whose key `keep_key` accepts (a memory
// trace's tally_memory section, without the Perfetto counters beside it): the others are
// skipped as they are read, never built.
nlohmann::json parse_json_keeping_syntax_errors(std::istream& in, const std::string& what,
                                                const std::function<bool(const std::string&)>& keep_key);
// The same, with the elements of the array at `streamed_array` (its keys from the top, as
// {"tally_memory", "events"}) handed to `on_element` one at a time as each is read, and
// left out of the document: memory stays that of one element, not of the array.
nlohmann::json parse_json_keeping_syntax_errors(std::istream& in, const std::string& what,
                                                const std::function<bool(const std::string&)>& keep_key,
                                                const std::vector<std::string>& streamed_array,
                                                const std::function<void(nlohmann::json&&)>& on_element);

}  // namespace tally
