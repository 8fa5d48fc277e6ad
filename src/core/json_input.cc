#include "core/json_input.h"

#include <algorithm>
#include <istream>
#include <utility>
#include <vector>

#include "core/error.h"

namespace tally {

namespace {
struct TooDeep {};

// A DOM builder over nlohmann's SAX events, linear in the input: each value is placed once
// in its parent, nothing already built is revisited. A container that would open deeper
// than kMaxJsonDepth stops the parse before anything that deep is built. A top-level key
// that `keep_key` refuses is skipped with its value, which is never built.
class BoundedBuilder {
 public:
  using json = nlohmann::json;

  explicit BoundedBuilder(const std::function<bool(const std::string&)>& keep_key) : keep_key_(keep_key) {}
  // The elements of the array at `path` (its keys from the top) go to `sink` one by one, as
  // each is complete, and are not kept.
  BoundedBuilder(const std::function<bool(const std::string&)>& keep_key, std::vector<std::string> path,
                 const std::function<void(json&&)>& sink)
      : keep_key_(keep_key), streamed_path_(std::move(path)), sink_(&sink) {}

  json take() { return std::move(root_); }

  bool null() { return scalar(json(nullptr)); }
  bool boolean(bool v) { return scalar(json(v)); }
  bool number_integer(json::number_integer_t v) { return scalar(json(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return scalar(json(v)); }
  bool number_float(json::number_float_t v, const std::string&) { return scalar(json(v)); }
  bool string(std::string& v) { return scalar(json(std::move(v))); }
  bool binary(json::binary_t& v) { return scalar(json::binary(std::move(v))); }

  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(std::string& k) {
    if (skipped_depth_ > 0) return true;
    if (keep_key_ && stack_.size() == 1 && !keep_key_(k)) {
      skipping_value_ = true;
      return true;
    }
    slot_ = &(*stack_.back())[k];
    if (sink_ && stack_.size() <= streamed_path_.size()) open_keys_.resize(stack_.size() - 1), open_keys_.push_back(k);
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    if (const auto* syntax = dynamic_cast<const json::parse_error*>(&e)) throw *syntax;
    if (const auto* range = dynamic_cast<const json::out_of_range*>(&e)) throw *range;
    TALLY_FAIL("invalid JSON: ", e.what());
  }

 private:
  size_t depth() const { return stack_.size() + static_cast<size_t>(skipped_depth_); }

  // Where the next value goes: the root, the end of the open array, or the open key's slot.
  json* place(json value) {
    if (stack_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    json& parent = *stack_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(value));
      return &parent.back();
    }
    *slot_ = std::move(value);
    return slot_;
  }

  bool scalar(json value) {
    if (skipped_depth_ > 0) return true;
    if (skipping_value_) {
      skipping_value_ = false;
      return true;
    }
    if (streamed_ && stack_.back() == streamed_) (*sink_)(std::move(value));
    else place(std::move(value));
    return true;
  }

  bool open(json empty) {
    if (depth() + 1 > static_cast<size_t>(kMaxJsonDepth)) throw TooDeep{};
    if (skipped_depth_ > 0 || skipping_value_) {
      skipping_value_ = false;
      ++skipped_depth_;
      return true;
    }
    const bool array = empty.is_array();
    stack_.push_back(place(std::move(empty)));
    if (sink_ && !streamed_ && array && stack_.size() == streamed_path_.size() + 1 &&
        std::equal(streamed_path_.begin(), streamed_path_.end(), open_keys_.begin(), open_keys_.end()))
      streamed_ = stack_.back();
    return true;
  }

  bool close() {
    if (skipped_depth_ > 0) {
      --skipped_depth_;
      return true;
    }
    stack_.pop_back();
    if (streamed_ && !stack_.empty() && stack_.back() == streamed_) {
      auto& elements = streamed_->get_ref<json::array_t&>();
      (*sink_)(std::move(elements.back()));
      elements.pop_back();
    }
    return true;
  }

  const std::function<bool(const std::string&)> keep_key_;
  json root_;
  std::vector<json*> stack_;  // the open containers, outermost first
  json* slot_ = nullptr;      // the open object's member the next value fills
  bool skipping_value_ = false;
  int skipped_depth_ = 0;  // containers open inside a skipped value
  std::vector<std::string> streamed_path_;
  const std::function<void(json&&)>* sink_ = nullptr;
  std::vector<std::string> open_keys_;  // the keys of the open objects' members, from the top
  json* streamed_ = nullptr;            // the array whose elements go to sink_, once open
};

template <class Input>
nlohmann::json parse_bounded(Input&& input, const std::string& what, BoundedBuilder&& builder) {
  try {
    nlohmann::json::sax_parse(std::forward<Input>(input), &builder);
  } catch (const TooDeep&) {
    TALLY_FAIL(what, ": JSON nested deeper than ", kMaxJsonDepth, " levels; no file tally reads nests that deep");
  }
  return builder.take();
}
}  // namespace

nlohmann::json parse_json_keeping_syntax_errors(std::string_view text, const std::string& what) {
  return parse_bounded(text, what, BoundedBuilder({}));
}

nlohmann::json parse_json_keeping_syntax_errors(std::istream& in, const std::string& what,
                                                const std::function<bool(const std::string&)>& keep_key) {
  return parse_bounded(in, what, BoundedBuilder(keep_key));
}

nlohmann::json parse_json_keeping_syntax_errors(std::istream& in, const std::string& what,
                                                const std::function<bool(const std::string&)>& keep_key,
                                                const std::vector<std::string>& streamed_array,
                                                const std::function<void(nlohmann::json&&)>& on_element) {
  return parse_bounded(in, what, BoundedBuilder(keep_key, streamed_array, on_element));
}

nlohmann::json parse_json(std::string_view text, const std::string& what) {
  try {
    return parse_json_keeping_syntax_errors(text, what);
  } catch (const nlohmann::json::exception& e) {  // syntax errors, and numbers out of range
    TALLY_FAIL(what, ": invalid JSON: ", e.what());
  }
}

}  // namespace tally
