// Step logs: reading JSON Lines / CSV with line-numbered errors, writing JSON Lines / CSV.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "leanstep/core.h"
#include "leanstep/stats.h"
#include "core/json_integer.h"
#include "stats/util.h"

namespace leanstep::stats {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

[[noreturn]] void fail_at(const std::string& name, int64_t line, const std::string& what) {
  throw Error(fmt::format("{}:{}: {}", name, line, what));
}

std::string short_value(const std::string& text) {
  return text.size() > 40 ? text.substr(0, 37) + "..." : text;
}

// The run a file stands for when its records carry no `run`: the file's stem with a
// trailing rank suffix removed ("base.rank1.jsonl" -> "base").
std::string default_run_name(const std::string& name) {
  std::string stem = fs::path(name).stem().string();
  static const std::regex rank_suffix(R"([._-]rank[0-9]+$)");
  std::string run = std::regex_replace(stem, rank_suffix, "");
  return run.empty() ? stem : run;
}

// Python's json writes NaN / Infinity / -Infinity as bare tokens; nlohmann rejects them.
// Quote them (outside strings) so they arrive as strings the number readers accept.
std::string quote_nonfinite_tokens(const std::string& line) {
  if (line.find("NaN") == std::string::npos && line.find("Infinity") == std::string::npos) return line;
  std::string out;
  out.reserve(line.size() + 16);
  bool in_string = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < line.size()) out += line[++i];
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
      out += c;
      continue;
    }
    bool matched = false;
    for (const char* token : {"-Infinity", "Infinity", "NaN"}) {
      const size_t len = std::char_traits<char>::length(token);
      if (line.compare(i, len, token) == 0) {
        out += '"';
        out += token;
        out += '"';
        i += len - 1;
        matched = true;
        break;
      }
    }
    if (!matched) out += c;
  }
  return out;
}

std::optional<double> nonfinite_from_text(const std::string& s) {
  std::string t;
  for (char c : s) t += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t == "nan" || t == "-nan" || t == "+nan") return std::nan("");
  if (t == "inf" || t == "infinity" || t == "+inf" || t == "+infinity") return INFINITY;
  if (t == "-inf" || t == "-infinity") return -INFINITY;
  return std::nullopt;
}

bool parse_int_text(const std::string& s, int64_t& out) {
  if (s.empty()) return false;
  const char* b = s.data();
  const char* e = b + s.size();
  if (*b == '+') ++b;
  auto [p, ec] = std::from_chars(b, e, out);
  return ec == std::errc() && p == e;
}

bool parse_double_text(const std::string& s, double& out) {
  if (s.empty()) return false;
  if (auto nf = nonfinite_from_text(s)) {
    out = *nf;
    return true;
  }
  char* end = nullptr;
  errno = 0;
  out = std::strtod(s.c_str(), &end);
  // 1e400 overflows to inf: out of the double range, not a number this log meant.
  if (errno == ERANGE && std::isinf(out)) return false;
  return end == s.c_str() + s.size();
}

// Text fields must be valid UTF-8 (they are written back as JSON).
bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + static_cast<size_t>(len) > s.size()) return false;
    uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1Fu) : len == 3 ? (c & 0x0Fu) : (c & 0x07u);
    for (int k = 1; k < len; ++k) {
      const unsigned char cc = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((cc >> 6) != 0x2) return false;
      cp = (cp << 6) | (cc & 0x3Fu);
    }
    // Overlong forms, surrogates and code points beyond U+10FFFF are not UTF-8.
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += static_cast<size_t>(len);
  }
  return true;
}

constexpr const char* kKnownKeys[] = {"run", "rank", "step", "duration_s", "condition",
                                     "block", "loss", "grad_norm", "allocation"};

bool is_known_key(const std::string& key) {
  for (const char* k : kKnownKeys)
    if (key == k) return true;
  return false;
}

// The tokens Python's json writes for non-finite numbers (quoted by quote_nonfinite_tokens).
bool is_nonfinite_token(const std::string& s) { return s == "NaN" || s == "Infinity" || s == "-Infinity"; }

void add_field(StepRecord& r, const std::string& key, double value, const std::string& name, int64_t line) {
  if (!valid_utf8(key)) fail_at(name, line, "field names must be valid UTF-8 text");
  if (r.fields.size() >= kMaxStepFields)
    fail_at(name, line, fmt::format("a step record holds at most {} other numeric fields (got more, at '{}')",
                                    kMaxStepFields, short_value(key)));
  r.fields[key] = value;
}

// Validates the fields common to both formats.
void check_record(const StepRecord& r, const std::string& name, int64_t line) {
  if (r.rank < 0) fail_at(name, line, fmt::format("'rank' must be in [0, 2^31 - 1] (got {})", r.rank));
  if (r.step < 0 || r.step > kMaxStep) fail_at(name, line, fmt::format("'step' must be in [0, 2^62] (got {})", r.step));
  for (const auto& [key, text] : {std::pair<const char*, const std::string*>{"run", &r.run}, {"condition", &r.condition},
                                  {"allocation", &r.allocation}})
    if (!valid_utf8(*text)) fail_at(name, line, fmt::format("'{}' must be valid UTF-8 text", key));
  if (!(std::isfinite(r.duration_s) && r.duration_s > 0))
    fail_at(name, line, fmt::format("'duration_s' must be a finite number > 0 (got {})", r.duration_s));
  if (r.block && *r.block < 0) fail_at(name, line, fmt::format("'block' must be >= 0 (got {})", *r.block));
}

// ---------------------------------------------------------------- JSON Lines

int64_t json_int(const json& obj, const char* key, const std::string& name, int64_t line) {
  const json& v = obj.at(key);
  const std::optional<int64_t> value = json_integer<int64_t>(v);
  if (!value && !v.is_number_integer())
    fail_at(name, line, fmt::format("'{}' must be an integer (got {})", key, short_value(v.dump())));
  if (!value) fail_at(name, line, fmt::format("'{}' must be at most 2^62 (got {})", key, v.dump()));
  return *value;
}

double json_number(const json& obj, const char* key, const std::string& name, int64_t line,
                   bool null_is_nan) {
  const json& v = obj.at(key);
  if (v.is_number()) return v.get<double>();
  if (v.is_null() && null_is_nan) return std::nan("");
  if (v.is_string())
    if (auto nf = nonfinite_from_text(v.get<std::string>())) return *nf;
  fail_at(name, line, fmt::format("'{}' must be a number (got {})", key, short_value(v.dump())));
}

std::string json_text(const json& obj, const char* key, const std::string& name, int64_t line) {
  const json& v = obj.at(key);
  if (v.is_null()) return "";
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  fail_at(name, line, fmt::format("'{}' must be a string (got {})", key, short_value(v.dump())));
}

StepRecord parse_json_line(const std::string& text, const std::string& name, int64_t line,
                           const std::string& default_run) {
  json obj;
  try {
    obj = json::parse(quote_nonfinite_tokens(text));
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers such as 1e400
    std::string what = e.what();
    // nlohmann's message starts with "[json.exception.parse_error.101] parse error at ...".
    const size_t pos = what.find("] ");
    fail_at(name, line, "invalid JSON: " + (pos == std::string::npos ? what : what.substr(pos + 2)));
  }
  if (!obj.is_object()) fail_at(name, line, "a step record must be a JSON object");
  for (const char* key : {"rank", "step", "duration_s"})
    if (!obj.contains(key)) fail_at(name, line, fmt::format("missing required key '{}'", key));
  StepRecord r;
  r.origin = fmt::format("{}:{}", name, line);
  r.run = obj.contains("run") ? json_text(obj, "run", name, line) : "";
  if (r.run.empty()) r.run = default_run;
  const int64_t rank = json_int(obj, "rank", name, line);
  if (rank < 0 || rank > INT32_MAX) fail_at(name, line, fmt::format("'rank' must be in [0, 2^31 - 1] (got {})", rank));
  r.rank = static_cast<int>(rank);
  r.step = json_int(obj, "step", name, line);
  r.duration_s = json_number(obj, "duration_s", name, line, false);
  if (obj.contains("condition")) r.condition = json_text(obj, "condition", name, line);
  if (obj.contains("block") && !obj.at("block").is_null()) {
    const int64_t b = json_int(obj, "block", name, line);
    if (b < 0 || b > INT32_MAX) fail_at(name, line, fmt::format("'block' must be in [0, 2^31 - 1] (got {})", b));
    r.block = static_cast<int>(b);
  }
  // null is read as NaN: JSON encoders such as nlohmann::json write NaN as null, and a
  // non-finite loss must never disappear. Omit the key for "not recorded".
  if (obj.contains("loss")) r.loss = json_number(obj, "loss", name, line, true);
  if (obj.contains("grad_norm")) r.grad_norm = json_number(obj, "grad_norm", name, line, true);
  if (obj.contains("allocation")) r.allocation = json_text(obj, "allocation", name, line);
  // Every other number is a field (a phase duration, a counter); other values are ignored.
  for (const auto& [key, v] : obj.items()) {
    if (is_known_key(key)) continue;
    std::optional<double> value;
    if (v.is_number()) value = v.get<double>();
    else if (v.is_string() && is_nonfinite_token(v.get<std::string>())) value = nonfinite_from_text(v.get<std::string>());
    if (!value) continue;
    add_field(r, key, *value, name, line);
  }
  check_record(r, name, line);
  return r;
}

// ---------------------------------------------------------------- CSV

// Splits one CSV line (RFC 4180 quoting, no embedded newlines).
bool split_csv(const std::string& line, std::vector<std::string>& cells) {
  cells.clear();
  std::string cell;
  bool quoted = false, was_quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"') {
        if (i + 1 < line.size() && line[i + 1] == '"') {
          cell += '"';
          ++i;
        } else {
          quoted = false;
        }
      } else {
        cell += c;
      }
    } else if (c == '"' && cell.empty() && !was_quoted) {
      quoted = was_quoted = true;
    } else if (c == ',') {
      cells.push_back(cell);
      cell.clear();
      was_quoted = false;
    } else {
      if (was_quoted) return false;  // text after a closing quote
      cell += c;
    }
  }
  if (quoted) return false;
  cells.push_back(cell);
  return true;
}

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::vector<StepRecord> parse_csv(const std::string& text, const std::string& name,
                                  const std::string& default_run) {
  std::vector<StepRecord> out;
  std::istringstream in(text);
  std::string line;
  int64_t line_no = 0;
  std::vector<std::string> header, cells;
  std::map<std::string, size_t> column;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (trim(line).empty()) continue;
    if (header.empty()) {
      if (!split_csv(line, header)) fail_at(name, line_no, "malformed CSV header (unbalanced quotes)");
      for (size_t c = 0; c < header.size(); ++c) {
        header[c] = trim(header[c]);
        if (!column.emplace(header[c], c).second)
          fail_at(name, line_no, fmt::format("column '{}' appears twice in the header", header[c]));
      }
      for (const char* key : {"rank", "step", "duration_s"})
        if (!column.count(key))
          fail_at(name, line_no, fmt::format("the CSV header lacks the required column '{}'", key));
      continue;
    }
    if (!split_csv(line, cells)) fail_at(name, line_no, "malformed CSV line (unbalanced quotes)");
    if (cells.size() != header.size())
      fail_at(name, line_no, fmt::format("expected {} columns as in the header, got {}", header.size(), cells.size()));
    auto cell = [&](const char* key) -> std::optional<std::string> {
      auto it = column.find(key);
      if (it == column.end()) return std::nullopt;
      std::string v = trim(cells[it->second]);
      if (v.empty()) return std::nullopt;
      return v;
    };
    auto integer = [&](const char* key) {
      int64_t v = 0;
      auto c = cell(key);
      if (!c) fail_at(name, line_no, fmt::format("missing required value '{}'", key));
      if (!parse_int_text(*c, v)) {
        const bool digits = c->find_first_not_of("+-0123456789") == std::string::npos;
        fail_at(name, line_no, fmt::format("'{}' must be {} (got \"{}\")", key,
                                           digits ? "an integer in [0, 2^62]" : "an integer", short_value(*c)));
      }
      return v;
    };
    auto number = [&](const char* key) -> std::optional<double> {
      auto c = cell(key);
      if (!c) return std::nullopt;
      double v = 0;
      if (!parse_double_text(*c, v))
        fail_at(name, line_no,
                fmt::format("'{}' must be a number within the double range (got \"{}\")", key, short_value(*c)));
      return v;
    };
    StepRecord r;
    r.origin = fmt::format("{}:{}", name, line_no);
    r.run = cell("run").value_or(default_run);
    const int64_t rank = integer("rank");
    if (rank < 0 || rank > INT32_MAX)
      fail_at(name, line_no, fmt::format("'rank' must be in [0, 2^31 - 1] (got {})", rank));
    r.rank = static_cast<int>(rank);
    r.step = integer("step");
    auto duration = number("duration_s");
    if (!duration) fail_at(name, line_no, "missing required value 'duration_s'");
    r.duration_s = *duration;
    r.condition = cell("condition").value_or("");
    if (cell("block")) {
      const int64_t b = integer("block");
      if (b < 0 || b > INT32_MAX)
        fail_at(name, line_no, fmt::format("'block' must be in [0, 2^31 - 1] (got {})", b));
      r.block = static_cast<int>(b);
    }
    r.loss = number("loss");
    r.grad_norm = number("grad_norm");
    r.allocation = cell("allocation").value_or("");
    // Other columns: a cell that reads as a number is a field; text cells are ignored.
    for (size_t c = 0; c < header.size(); ++c) {
      if (is_known_key(header[c])) continue;
      const std::string v = trim(cells[c]);
      double value = 0;
      if (!v.empty() && parse_double_text(v, value)) add_field(r, header[c], value, name, line_no);
    }
    check_record(r, name, line_no);
    out.push_back(std::move(r));
  }
  return out;
}

bool is_csv_path(const std::string& path) {
  std::string ext = fs::path(path).extension().string();
  for (auto& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext == ".csv";
}

std::string number_json(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return fmt::format("{}", v);
}

std::string number_csv(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return fmt::format("{}", v);
}

std::string csv_text(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

constexpr const char* kCsvHeader = "run,rank,step,duration_s,condition,block,loss,grad_norm,allocation";

std::string format_csv_record(const StepRecord& r, const std::vector<std::string>& field_columns) {
  std::string line = fmt::format("{},{},{},{},{},{},{},{},{}", csv_text(r.run), r.rank, r.step,
                                 number_csv(r.duration_s), csv_text(r.condition),
                                 r.block ? std::to_string(*r.block) : "", r.loss ? number_csv(*r.loss) : "",
                                 r.grad_norm ? number_csv(*r.grad_norm) : "", csv_text(r.allocation));
  for (const auto& f : field_columns) {
    const auto it = r.fields.find(f);
    line += "," + (it == r.fields.end() ? std::string() : number_csv(it->second));
  }
  return line;
}

void write_records(const std::string& path, const std::vector<StepRecord>& records, bool append) {
  const bool csv = is_csv_path(path);
  const bool needs_header = csv && (!append || !fs::exists(path) || fs::file_size(path) == 0);
  // CSV columns are fixed by the header: the fields' columns are the union over the
  // records, written with the header; appending fields to an existing CSV is refused
  // rather than written under the wrong columns.
  std::set<std::string> field_names;
  for (const auto& r : records)
    for (const auto& [k, v] : r.fields) field_names.insert(k);
  if (csv && !needs_header && !field_names.empty())
    throw Error(fmt::format("step log: cannot append records with other fields ('{}') to the existing CSV '{}' "
                            "(its header fixes the columns); write JSON Lines or a new file",
                            *field_names.begin(), path));
  const std::vector<std::string> field_columns(field_names.begin(), field_names.end());
  std::FILE* f = std::fopen(path.c_str(), append ? "ab" : "wb");
  if (!f) throw Error(fmt::format("step log: cannot open '{}' for writing", path));
  std::string text;
  if (needs_header) {
    text += kCsvHeader;
    for (const auto& c : field_columns) text += "," + csv_text(c);
    text += "\n";
  }
  for (const auto& r : records) text += (csv ? format_csv_record(r, field_columns) : format_step_record_json(r)) + "\n";
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed) throw Error(fmt::format("step log: writing '{}' failed", path));
}

}  // namespace

void check_unique_records(const std::vector<StepRecord>& records) {
  // Runs interned to integers, then one sort of (run, rank, step, index): logs of large
  // jobs hold millions of records, so no string comparisons per record.
  std::unordered_map<std::string, uint32_t> run_id;
  struct Key {
    uint32_t run;
    int rank;
    int64_t step;
    size_t index;
  };
  std::vector<Key> keys;
  keys.reserve(records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    const auto [it, _] = run_id.emplace(records[i].run, static_cast<uint32_t>(run_id.size()));
    keys.push_back({it->second, records[i].rank, records[i].step, i});
  }
  std::sort(keys.begin(), keys.end(), [](const Key& a, const Key& b) {
    return std::tie(a.run, a.rank, a.step, a.index) < std::tie(b.run, b.rank, b.step, b.index);
  });
  for (size_t i = 1; i < keys.size(); ++i) {
    const Key &a = keys[i - 1], &b = keys[i];
    if (a.run != b.run || a.rank != b.rank || a.step != b.step) continue;
    const StepRecord &first = records[a.index], &second = records[b.index];
    throw Error(fmt::format("step log: duplicate record for run '{}' rank {} step {} ({} and {})", first.run,
                            first.rank, first.step, first.origin.empty() ? "?" : first.origin,
                            second.origin.empty() ? "?" : second.origin));
  }
}

std::vector<StepRecord> parse_step_log(const std::string& text, const std::string& name, bool csv) {
  const std::string default_run = default_run_name(name);
  if (csv) return parse_csv(text, name, default_run);
  std::vector<StepRecord> out;
  size_t begin = 0;
  int64_t line_no = 0;
  while (begin <= text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    ++line_no;
    std::string line = text.substr(begin, end - begin);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!trim(line).empty()) out.push_back(parse_json_line(line, name, line_no, default_run));
    if (end == text.size()) break;
    begin = end + 1;
  }
  return out;
}

std::vector<StepRecord> read_step_log(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("step log: cannot open '{}'", path));
  std::ostringstream text;
  text << in.rdbuf();
  auto records = parse_step_log(text.str(), path, is_csv_path(path));
  if (records.empty()) throw Error(fmt::format("step log: '{}' holds no step records", path));
  return records;
}

std::vector<StepRecord> read_step_logs(const std::vector<std::string>& paths) {
  if (paths.empty()) throw Error("step log: no log files given");
  std::vector<std::string> files;
  for (const auto& p : paths) {
    if (fs::is_directory(p)) {
      std::vector<std::string> inside;
      for (const auto& entry : fs::directory_iterator(p)) {
        const std::string ext = entry.path().extension().string();
        // Not ".json": a directory of logs often holds the plan or configs too.
        if (entry.is_regular_file() && (ext == ".jsonl" || ext == ".csv"))
          inside.push_back(entry.path().string());
      }
      if (inside.empty()) throw Error(fmt::format("step log: directory '{}' holds no .jsonl/.csv logs", p));
      std::sort(inside.begin(), inside.end());
      files.insert(files.end(), inside.begin(), inside.end());
    } else {
      files.push_back(p);
    }
  }
  std::vector<StepRecord> all;
  for (const auto& f : files) {
    auto r = read_step_log(f);
    all.insert(all.end(), std::make_move_iterator(r.begin()), std::make_move_iterator(r.end()));
  }
  check_unique_records(all);
  return all;
}

std::string format_step_record_json(const StepRecord& r) {
  std::string s = "{";
  if (!r.run.empty()) s += "\"run\":" + json(r.run).dump() + ",";
  s += fmt::format("\"rank\":{},\"step\":{},\"duration_s\":{}", r.rank, r.step, number_json(r.duration_s));
  if (!r.condition.empty()) s += ",\"condition\":" + json(r.condition).dump();
  if (r.block) s += fmt::format(",\"block\":{}", *r.block);
  if (r.loss) s += ",\"loss\":" + number_json(*r.loss);
  if (r.grad_norm) s += ",\"grad_norm\":" + number_json(*r.grad_norm);
  if (!r.allocation.empty()) s += ",\"allocation\":" + json(r.allocation).dump();
  for (const auto& [k, v] : r.fields)
    if (!is_known_key(k)) s += "," + json(k).dump() + ":" + number_json(v);
  return s + "}";
}

void write_step_log(const std::string& path, const std::vector<StepRecord>& records) {
  write_records(path, records, false);
}

void append_step_log(const std::string& path, const std::vector<StepRecord>& records) {
  write_records(path, records, true);
}

StepLogWriter::StepLogWriter(const std::string& path, bool append) : path_(path) {
  if (is_csv_path(path)) throw Error(fmt::format("StepLogWriter: argument 'path' must name a JSON Lines file, not CSV (got '{}')", path));
  file_ = std::fopen(path.c_str(), append ? "ab" : "wb");
  if (!file_) throw Error(fmt::format("StepLogWriter: cannot open '{}' for writing", path));
}

StepLogWriter::~StepLogWriter() {
  if (file_) std::fclose(file_);
}

void StepLogWriter::write(const StepRecord& record) {
  const std::string line = format_step_record_json(record) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    throw Error(fmt::format("StepLogWriter: writing '{}' failed", path_));
}

}  // namespace leanstep::stats
