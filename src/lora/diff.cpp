// Reading per-rank layouts (plans or framework dumps) and comparing them.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <unordered_map>

#include "leanstep/lora.h"
#include "core/json_integer.h"

namespace leanstep::lora {
namespace {

using nlohmann::json;
using RankKey = std::tuple<int64_t, int64_t, int64_t>;

[[noreturn]] void bad(std::string_view source, const std::string& what) {
  throw Error(fmt::format("lora layout {}: {}", source, what));
}

int64_t rank_index(const json& rank, const char* key, std::string_view source, size_t i) {
  if (!rank.contains(key)) return 0;
  const json& v = rank[key];
  const std::optional<int64_t> value = json_integer<int64_t>(v);
  if (!value || *value < 0) bad(source, fmt::format("ranks[{}].{} must be an integer >= 0 (got {})", i, key, v.dump()));
  return *value;
}

std::string rank_label(const RankKey& k) {
  return fmt::format("rank (pp_stage {}, tp_rank {}, ep_rank {})", std::get<0>(k), std::get<1>(k), std::get<2>(k));
}

// "decoder.layers.12.mlp.experts.linear_fc1.lora_A.weight7" -> "decoder.layers.*.mlp.experts.linear_fc1.lora_A.weight*".
std::string name_pattern(const std::string& name) {
  std::string out;
  size_t i = 0;
  while (i < name.size()) {
    bool at_number = std::isdigit(static_cast<unsigned char>(name[i])) &&
                     (i == 0 || name[i - 1] == '.' || name.compare(i >= 6 ? i - 6 : 0, 6, "weight") == 0);
    if (!at_number) {
      out += name[i++];
      continue;
    }
    size_t j = i;
    while (j < name.size() && std::isdigit(static_cast<unsigned char>(name[j]))) ++j;
    bool whole = j == name.size() || name[j] == '.';
    out += whole ? "*" : name.substr(i, j - i);
    i = j;
  }
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

}  // namespace

std::vector<RankLayout> read_rank_layouts(const json& doc, std::string_view source) {
  const json* ranks = &doc;
  if (doc.is_object()) {
    if (!doc.contains("ranks")) bad(source, "key 'ranks' is missing (expected {\"ranks\": [{\"layout\": [...]}, ...]})");
    ranks = &doc["ranks"];
  }
  if (!ranks->is_array()) bad(source, "'ranks' must be a list of ranks");
  std::vector<RankLayout> out;
  std::set<RankKey> seen;
  for (size_t i = 0; i < ranks->size(); ++i) {
    const json& rk = (*ranks)[i];
    if (!rk.is_object()) bad(source, fmt::format("ranks[{}] must be an object", i));
    RankLayout r;
    r.pp_stage = rank_index(rk, "pp_stage", source, i);
    r.tp_rank = rank_index(rk, "tp_rank", source, i);
    r.ep_rank = rank_index(rk, "ep_rank", source, i);
    if (!seen.insert({r.pp_stage, r.tp_rank, r.ep_rank}).second)
      bad(source, fmt::format("ranks[{}] repeats {}", i, rank_label({r.pp_stage, r.tp_rank, r.ep_rank})));
    if (!rk.contains("layout") || !rk["layout"].is_array())
      bad(source, fmt::format("ranks[{}].layout is missing or not a list", i));
    std::set<std::string> names;
    for (size_t j = 0; j < rk["layout"].size(); ++j) {
      const json& t = rk["layout"][j];
      std::string where = fmt::format("ranks[{}].layout[{}]", i, j);
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string())
        bad(source, where + ".name is missing or not a string");
      TensorSpec spec;
      spec.name = t["name"].get<std::string>();
      if (!t.contains("shape") || !t["shape"].is_array()) bad(source, where + ".shape is missing or not a list");
      for (const json& d : t["shape"]) {
        const std::optional<int64_t> extent = json_integer<int64_t>(d);
        if (!extent || *extent < 0)
          bad(source, fmt::format("{}.shape must hold integers >= 0 (got {})", where, t["shape"].dump()));
        spec.shape.push_back(*extent);
      }
      if (!t.contains("dtype") || !t["dtype"].is_string()) bad(source, where + ".dtype is missing or not a string");
      std::string dtype = t["dtype"].get<std::string>();
      if (dtype.rfind("torch.", 0) == 0) dtype = dtype.substr(6);  // str(torch.bfloat16)
      try {
        spec.dtype = dtype_from_name(dtype);
      } catch (const Error&) {
        bad(source, fmt::format("{}.dtype '{}' is not a known dtype", where, t["dtype"].get<std::string>()));
      }
      if (!names.insert(spec.name).second)
        bad(source, fmt::format("{} repeats tensor name '{}'", where, spec.name));
      r.layout.push_back(std::move(spec));
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<RankLayout> load_rank_layouts(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("lora layout {}: cannot open the file", path));
  json doc;
  try {
    doc = json::parse(in);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers such as 1e400
    throw Error(fmt::format("lora layout {}: not valid JSON ({})", path, e.what()));
  }
  return read_rank_layouts(doc, path);
}

LayoutDiff diff_layouts(const std::vector<RankLayout>& a, const std::vector<RankLayout>& b, std::string_view a_label,
                        std::string_view b_label, int64_t max_lines_per_rank) {
  std::map<RankKey, const RankLayout*> ra, rb;
  for (const RankLayout& r : a) ra[{r.pp_stage, r.tp_rank, r.ep_rank}] = &r;
  for (const RankLayout& r : b) rb[{r.pp_stage, r.tp_rank, r.ep_rank}] = &r;
  std::set<RankKey> keys;
  for (auto& [k, _] : ra) keys.insert(k);
  for (auto& [k, _] : rb) keys.insert(k);

  LayoutDiff diff;
  std::vector<std::pair<std::vector<RankKey>, std::vector<std::string>>> groups;
  // Summary: (kind, name pattern) -> number of differences over all ranks.
  std::map<std::pair<std::string, std::string>, int64_t> summary;
  auto tally = [&](const std::string& kind, const std::string& name) { ++summary[{kind, name_pattern(name)}]; };
  diff.ranks_compared = static_cast<int64_t>(keys.size());
  for (const RankKey& key : keys) {
    std::vector<std::string> lines;
    auto ita = ra.find(key), itb = rb.find(key);
    if (ita == ra.end() || itb == rb.end()) {
      bool in_a = ita != ra.end();
      const RankLayout& present = in_a ? *ita->second : *itb->second;
      tally(fmt::format("rank missing in {}", in_a ? b_label : a_label), "(whole rank)");
      lines.push_back(fmt::format("missing in {} ({} has {} tensors)", in_a ? b_label : a_label,
                                  in_a ? a_label : b_label, present.layout.size()));
    } else {
      const auto& la = ita->second->layout;
      const auto& lb = itb->second->layout;
      std::unordered_map<std::string, size_t> pos_a, pos_b;
      for (size_t i = 0; i < la.size(); ++i) pos_a[la[i].name] = i;
      for (size_t i = 0; i < lb.size(); ++i) pos_b[lb[i].name] = i;
      // Walk both layouts in step: between consecutive tensors present in both, a run of
      // names only in A and a run only in B of the same length, shapes and dtypes are
      // renames; anything else is missing or extra.
      auto only_a_line = [&](const TensorSpec& t, std::string_view side) {
        tally(fmt::format("only in {}", side), t.name);
        return fmt::format("tensor {} {} {} is in {} only", t.name, shape_text(t.shape), dtype_name(t.dtype),
                           side);
      };
      size_t ia = 0, ib = 0;
      while (ia < la.size() || ib < lb.size()) {
        size_t ea = ia, eb = ib;
        while (ea < la.size() && !pos_b.count(la[ea].name)) ++ea;
        while (eb < lb.size() && !pos_a.count(lb[eb].name)) ++eb;
        bool renames = ea - ia == eb - ib;
        for (size_t k = 0; renames && k < ea - ia; ++k)
          renames = la[ia + k].shape == lb[ib + k].shape && la[ia + k].dtype == lb[ib + k].dtype;
        if (renames) {
          for (size_t k = 0; k < ea - ia; ++k) {
            tally(fmt::format("renamed ({} name)", a_label), la[ia + k].name);
            lines.push_back(fmt::format("renamed tensor {} -> {} ({} {})", la[ia + k].name, lb[ib + k].name,
                                        shape_text(la[ia + k].shape), dtype_name(la[ia + k].dtype)));
          }
        } else {
          for (size_t k = ia; k < ea; ++k) lines.push_back(only_a_line(la[k], a_label));
          for (size_t k = ib; k < eb; ++k) lines.push_back(only_a_line(lb[k], b_label));
        }
        // Now both stand at a common tensor (or at the end); step over it.
        ia = ea < la.size() ? ea + 1 : ea;
        ib = eb < lb.size() ? eb + 1 : eb;
      }
      std::vector<std::string> common_a, common_b;
      for (const TensorSpec& t : la) {
        auto it = pos_b.find(t.name);
        if (it == pos_b.end()) continue;
        common_a.push_back(t.name);
        const TensorSpec& u = lb[it->second];
        if (t.shape != u.shape) tally("changed shape", t.name);
        if (t.dtype != u.dtype) tally("changed dtype", t.name);
        if (t.shape != u.shape)
          lines.push_back(fmt::format("tensor {} changed shape {} -> {}", t.name, shape_text(t.shape),
                                      shape_text(u.shape)));
        if (t.dtype != u.dtype)
          lines.push_back(fmt::format("tensor {} changed dtype {} -> {}", t.name, dtype_name(t.dtype),
                                      dtype_name(u.dtype)));
      }
      // Registration order is the gradient buffer's order: a permutation changes the layout.
      for (const TensorSpec& t : lb)
        if (pos_a.count(t.name)) common_b.push_back(t.name);
      for (size_t i = 0; i < common_a.size(); ++i) {
        if (common_a[i] != common_b[i]) {
          tally("registration order differs", "(rank)");
          lines.push_back(fmt::format("registration order differs: {} is followed by {} in {} but by {} in {}",
                                      i ? common_a[i - 1] : "(start)", common_a[i], a_label, common_b[i],
                                      b_label));
          break;
        }
      }
    }
    if (lines.empty()) continue;
    ++diff.ranks_differing;
    diff.count += static_cast<int64_t>(lines.size());
    // Ranks with the same differences (typically every TP/EP rank of a stage) print once.
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.second == lines; });
    if (it == groups.end()) groups.push_back({{key}, std::move(lines)});
    else it->first.push_back(key);
  }
  for (auto& [group_keys, lines] : groups) {
    std::string head = rank_label(group_keys[0]);
    if (group_keys.size() > 1) {
      head += fmt::format(" and {} more rank{} with the same differences:", group_keys.size() - 1,
                          group_keys.size() > 2 ? "s" : "");
      for (size_t k = 1; k < group_keys.size() && k <= 8; ++k)
        head += fmt::format(" ({}, {}, {})", std::get<0>(group_keys[k]), std::get<1>(group_keys[k]),
                            std::get<2>(group_keys[k]));
      if (group_keys.size() > 9) head += " ...";
    }
    diff.differences.push_back(head + ":");
    int64_t shown = 0;
    for (auto& line : lines) {
      if (shown == max_lines_per_rank) {
        diff.differences.push_back(
            fmt::format("  ... and {} more differences", static_cast<int64_t>(lines.size()) - shown));
        break;
      }
      diff.differences.push_back("  " + std::move(line));
      ++shown;
    }
  }
  for (const auto& [key, n] : summary)
    diff.summary.push_back(fmt::format("{}: {} x {}", key.first, key.second, n));
  return diff;
}

}  // namespace leanstep::lora
