#include "core/json_input.h"

#include "core/error.h"

namespace tally {

namespace {
struct TooDeep {};
}  // namespace

nlohmann::json parse_json_keeping_syntax_errors(std::string_view text, const std::string& what) {
  // The callback sees each value as it starts, at its depth: deeper than the bound, the
  // parse stops there, before anything that deep is built.
  const nlohmann::json::parser_callback_t bounded = [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
    if (depth > kMaxJsonDepth) throw TooDeep{};
    return true;
  };
  try {
    return nlohmann::json::parse(text, bounded);
  } catch (const TooDeep&) {
    TALLY_FAIL(what, ": JSON nested deeper than ", kMaxJsonDepth, " levels; no file tally reads nests that deep");
  }
}

nlohmann::json parse_json(std::string_view text, const std::string& what) {
  try {
    return parse_json_keeping_syntax_errors(text, what);
  } catch (const nlohmann::json::exception& e) {  // syntax errors, and numbers out of range
    TALLY_FAIL(what, ": invalid JSON: ", e.what());
  }
}

}  // namespace tally
