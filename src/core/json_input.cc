#include "core/json_input.h"

#include <istream>

#include "core/error.h"

namespace tally {

namespace {
struct TooDeep {};

// The callback sees each value as it starts, at its depth: deeper than the bound, the parse
// stops there, before anything that deep is built. A top-level key `keep_key` refuses is
// skipped with its value.
nlohmann::json::parser_callback_t bounded(const std::function<bool(const std::string&)>& keep_key) {
  return [&keep_key](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (depth > kMaxJsonDepth) throw TooDeep{};
    return !(keep_key && depth == 1 && event == nlohmann::json::parse_event_t::key &&
             !keep_key(parsed.get<std::string>()));
  };
}

template <class Input>
nlohmann::json parse_bounded(Input&& input, const std::string& what, const std::function<bool(const std::string&)>& keep_key) {
  try {
    return nlohmann::json::parse(std::forward<Input>(input), bounded(keep_key));
  } catch (const TooDeep&) {
    TALLY_FAIL(what, ": JSON nested deeper than ", kMaxJsonDepth, " levels; no file tally reads nests that deep");
  }
}
}  // namespace

nlohmann::json parse_json_keeping_syntax_errors(std::string_view text, const std::string& what) {
  return parse_bounded(text, what, {});
}

nlohmann::json parse_json_keeping_syntax_errors(std::istream& in, const std::string& what,
                                                const std::function<bool(const std::string&)>& keep_key) {
  return parse_bounded(in, what, keep_key);
}

nlohmann::json parse_json(std::string_view text, const std::string& what) {
  try {
    return parse_json_keeping_syntax_errors(text, what);
  } catch (const nlohmann::json::exception& e) {  // syntax errors, and numbers out of range
    TALLY_FAIL(what, ": invalid JSON: ", e.what());
  }
}

}  // namespace tally
