// The `leanstep paths` report: text for people, JSON for machines.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "leanstep/dispatch.h"
#include "leanstep/ops.h"

namespace leanstep::dispatch {

namespace {

std::string reasons_text(const std::map<std::string, uint64_t>& reasons) {
  std::string s;
  for (const auto& [reason, count] : reasons)
    s += fmt::format("{}{} x {}", s.empty() ? "" : "; ", count, reason);
  return s;
}

// The device backends the op table declares for `op` (empty for ops that are
// not in the table, e.g. a test registry's).
std::vector<std::string> device_backends(const std::string& op) {
  std::vector<std::string> out;
  for (const ops::OpEntry& entry : ops::op_table()) {
    if (op != entry.name) continue;
    std::string_view list = entry.device_backends;
    while (!list.empty()) {
      const size_t comma = list.find(',');
      out.emplace_back(list.substr(0, comma));
      list = comma == std::string_view::npos ? std::string_view{} : list.substr(comma + 1);
    }
  }
  return out;
}

}  // namespace

std::string paths_text(const Registry& reg) {
  std::string out = fmt::format("preset: {}\n", reg.preset());
  for (const OpReport& op : reg.report()) {
    out += fmt::format("\n{}  {}  [sig {:016x}]\n", op.name, op.signature, op.signature_hash);
    out += fmt::format("  fast paths: {}\n", op.enabled ? "enabled" : "disabled by the preset");
    out += fmt::format("  reference: {}\n", op.reference);
    if (const auto devices = device_backends(op.name); !devices.empty())
      out += fmt::format("  device backends (Python package, tensors on a device): {}\n",
                         fmt::join(devices, ", "));
    for (const ImplInfo& impl : op.impls) {
      out += fmt::format("  {} {}  ({}, {}{})\n", impl.installed ? (impl.active ? "*" : "+") : "-",
                         impl.name, impl.installed ? "installed" : "not installed", impl.device,
                         impl.origin.empty() ? "" : ", " + impl.origin);
      out += fmt::format("      guard: {}\n", impl.guard_doc.empty() ? "none (takes every call)"
                                                                    : impl.guard_doc);
    }
    bool any = false;
    for (const ImplStatsView& s : op.stats) {
      if (!s.calls && s.reasons.empty()) continue;
      if (!any) out += "  calls:\n";
      any = true;
      const bool is_reference = s.name == op.reference;
      out += fmt::format("    {:<16} {:>8} calls", s.name, s.calls);
      if (!s.reasons.empty())
        out += fmt::format("   {}: {}", is_reference ? "ran because" : "declined",
                           reasons_text(s.reasons));
      out += "\n";
    }
    if (!any) out += "  calls: none yet\n";
  }
  out += "\n(* active, + installed but disabled by the preset, - known but not installed)\n";
  return out;
}

std::string paths_json(const Registry& reg) {
  nlohmann::json ops = nlohmann::json::array();
  for (const OpReport& op : reg.report()) {
    nlohmann::json impls = nlohmann::json::array();
    for (const ImplInfo& impl : op.impls)
      impls.push_back({{"name", impl.name},
                       {"device", impl.device},
                       {"origin", impl.origin},
                       {"guard", impl.guard_doc},
                       {"installed", impl.installed},
                       {"active", impl.active}});
    nlohmann::json stats = nlohmann::json::array();
    for (const ImplStatsView& s : op.stats) {
      nlohmann::json reasons = nlohmann::json::object();
      for (const auto& [reason, count] : s.reasons) reasons[reason] = count;
      stats.push_back({{"impl", s.name},
                       {"reference", s.name == op.reference},
                       {"calls", s.calls},
                       {s.name == op.reference ? "ran_because" : "declined", reasons}});
    }
    // Implementations per backend: cpu (this registry) and the device backends.
    nlohmann::json backends = nlohmann::json::object();
    backends["cpu"] = nlohmann::json::array({op.reference});
    for (const ImplInfo& impl : op.impls) backends[impl.device].push_back(impl.name);
    for (const std::string& device : device_backends(op.name)) backends[device] = {device};
    ops.push_back({{"op", op.name},
                   {"signature", op.signature},
                   {"signature_hash", fmt::format("{:016x}", op.signature_hash)},
                   {"reference", op.reference},
                   {"fast_paths_enabled", op.enabled},
                   {"implementations", impls},
                   {"backends", backends},
                   {"stats", stats}});
  }
  nlohmann::json doc = {{"preset", reg.preset()}, {"abi_version", kAbiVersion}, {"ops", ops}};
  return doc.dump();
}

}  // namespace leanstep::dispatch
