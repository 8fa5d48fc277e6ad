// Rules of the code's shape that a reader relies on, checked on the sources themselves:
// no function in the top floors (src/train, src/apps, src/dist) is longer than a screen
// and a half (120 lines, its signature included).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

// The text with comments, string and character literals and preprocessor lines blanked
// out (newlines kept), so that braces are only the code's own.
std::string code_only(const std::string& text) {
  std::string out = text;
  const size_t n = text.size();
  size_t i = 0;
  auto blank = [&](size_t from, size_t to) {
    for (size_t k = from; k < to && k < n; ++k)
      if (out[k] != '\n') out[k] = ' ';
  };
  bool line_start = true;
  while (i < n) {
    if (line_start && text[i] == '#') {
      size_t end = i;
      while (end < n && (text[end] != '\n' || (end > 0 && text[end - 1] == '\\'))) ++end;
      blank(i, end);
      i = end;
      continue;
    }
    if (text[i] == '\n') line_start = true;
    else if (text[i] != ' ' && text[i] != '\t') line_start = false;
    if (text.compare(i, 2, "//") == 0) {
      const size_t end = text.find('\n', i);
      blank(i, end == std::string::npos ? n : end);
      i = end == std::string::npos ? n : end;
    } else if (text.compare(i, 2, "/*") == 0) {
      const size_t end = text.find("*/", i + 2);
      const size_t stop = end == std::string::npos ? n : end + 2;
      blank(i, stop);
      i = stop;
    } else if (text.compare(i, 3, "R\"(") == 0 || (text[i] == 'R' && i + 1 < n && text[i + 1] == '"')) {
      // A raw string R"delim( ... )delim".
      const size_t open = std::min(text.find('(', i), n);
      std::string delim = ")";
      delim.append(text, i + 2, open > i + 2 ? open - i - 2 : 0);
      delim.push_back('"');
      const size_t end = text.find(delim, open);
      const size_t stop = end == std::string::npos ? n : end + delim.size();
      blank(i, stop);
      i = stop;
    } else if (text[i] == '"' || text[i] == '\'') {
      const char quote = text[i];
      size_t k = i + 1;
      while (k < n && text[k] != quote) k += text[k] == '\\' ? 2 : 1;
      blank(i, k + 1);
      i = k + 1;
    } else {
      ++i;
    }
  }
  return out;
}

std::string trimmed(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\n");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t\n") - a + 1);
}

// The declaration before a '{' without a leading template<...> clause.
std::string without_template(std::string header) {
  header = trimmed(header);
  while (header.rfind("template", 0) == 0) {
    const size_t open = header.find('<');
    if (open == std::string::npos) break;
    int depth = 0;
    size_t k = open;
    for (; k < header.size(); ++k) {
      if (header[k] == '<') ++depth;
      if (header[k] == '>' && --depth == 0) break;
    }
    header = trimmed(header.substr(k + 1));
  }
  return header;
}

struct LongFunction {
  std::string where;
  int lines;
};

// Functions (bodies at namespace or class scope) of `path` longer than `limit` lines.
std::vector<LongFunction> long_functions(const fs::path& path, int limit) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string code = code_only(ss.str());
  enum class Kind { Namespace, Class, Function, Block };
  struct Open {
    Kind kind;
    int first_line;
    std::string header;
  };
  std::vector<Open> stack;
  std::vector<LongFunction> out;
  int line = 1;
  size_t header_start = 0;
  int header_line = 1;
  bool header_has_text = false;
  for (size_t i = 0; i < code.size(); ++i) {
    const char ch = code[i];
    if (ch == '\n') ++line;
    if (!header_has_text && ch != ' ' && ch != '\t' && ch != '\n' && ch != ';' && ch != '{' && ch != '}') {
      header_has_text = true;
      header_start = i;
      header_line = line;
    }
    if (ch == '{') {
      const std::string header = header_has_text ? without_template(code.substr(header_start, i - header_start)) : "";
      const bool outside = stack.empty() || stack.back().kind == Kind::Namespace || stack.back().kind == Kind::Class;
      Kind kind = Kind::Block;
      if (header.rfind("namespace", 0) == 0 || header.rfind("extern", 0) == 0) kind = Kind::Namespace;
      else if (header.rfind("class", 0) == 0 || header.rfind("struct", 0) == 0 || header.rfind("union", 0) == 0 ||
               header.rfind("enum", 0) == 0)
        kind = Kind::Class;
      else if (outside && header.find(')') != std::string::npos && header.find('=') == std::string::npos)
        kind = Kind::Function;
      else if (outside && header.find(')') != std::string::npos && header.find("operator") != std::string::npos)
        kind = Kind::Function;
      stack.push_back({kind, header_line, header.substr(0, header.find('('))});
      header_has_text = false;
    } else if (ch == '}') {
      if (!stack.empty()) {
        const Open open = stack.back();
        stack.pop_back();
        const int lines = line - open.first_line + 1;
        if (open.kind == Kind::Function && lines > limit)
          out.push_back({path.string() + ":" + std::to_string(open.first_line) + " " + trimmed(open.header), lines});
      }
      header_has_text = false;
    } else if (ch == ';') {
      header_has_text = false;
    } else if (ch == ':' && header_has_text && (i + 1 >= code.size() || code[i + 1] != ':')) {
      // An access label ends what came before it, as ';' does.
      const std::string label = trimmed(code.substr(header_start, i - header_start));
      if (label == "public" || label == "private" || label == "protected") header_has_text = false;
    }
  }
  return out;
}

}  // namespace

TEST(CodeShape, NoFunctionOfTheTopFloorsIsLongerThan120Lines) {
  constexpr int kLimit = 120;
  const fs::path root = fs::path(TALLY_SOURCE_DIR) / "src";
  std::string report;
  int files = 0;
  for (const char* layer : {"train", "apps", "dist"}) {
    for (const auto& entry : fs::recursive_directory_iterator(root / layer)) {
      const std::string ext = entry.path().extension().string();
      if (ext != ".cc" && ext != ".h") continue;
      ++files;
      for (const LongFunction& f : long_functions(entry.path(), kLimit)) {
        report += "  " + f.where + ": " + std::to_string(f.lines) + " lines\n";
      }
    }
  }
  EXPECT_GT(files, 10) << "the top floors' sources were not found under " << root;
  EXPECT_TRUE(report.empty()) << "functions over " << kLimit << " lines (split them into parts with one job each):\n"
                              << report;
}

// The checker itself: it must see a long function, and not count what is not one.
TEST(CodeShape, TheCheckerCountsFunctionBodiesAndNothingElse) {
  const fs::path file = fs::temp_directory_path() / "tally_code_shape_probe.cc";
  {
    std::ofstream out(file);
    out << "#include \"a.h\"\nnamespace a {\nstruct S {\n public:\n  int f() const {\n";
    for (int i = 0; i < 130; ++i) out << "    x(\"{\"); // }\n";
    out << "  }\n};\nconst int table[] = {\n";
    for (int i = 0; i < 130; ++i) out << "  1,\n";
    out << "};\ntemplate <class T> void g(T t) {\n  if (t) {\n  }\n}\n}  // namespace a\n";
  }
  const std::vector<LongFunction> found = long_functions(file, 120);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_NE(found[0].where.find(":5 int f"), std::string::npos) << found[0].where;
  EXPECT_EQ(found[0].lines, 132);
  fs::remove(file);
}
