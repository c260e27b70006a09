// A plain-text table for people: first column left-aligned, the others
// right-aligned, a rule under the header. Used by the CLI and by the areas
// that format reports (e.g. the step-statistics summary).
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace leanstep {

class TextTable {
 public:
  explicit TextTable(std::vector<std::string> header) : header_(std::move(header)) {}
  void add_row(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string render() const;
  void print(std::FILE* out = stdout) const { std::fputs(render().c_str(), out); }

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace leanstep
