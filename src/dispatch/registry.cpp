// The op slots and the registry: installs, uninstalls, presets, statistics.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <set>

#include "leanstep/dispatch.h"

namespace leanstep::dispatch {

uint64_t signature_hash(std::string_view signature) {
  uint64_t h = 14695981039346656037ull;  // FNV-1a 64 offset basis
  for (unsigned char c : signature) {
    h ^= c;
    h *= 1099511628211ull;  // FNV prime
  }
  return h;
}

const char* intern_reason(std::string_view reason) {
  // std::set nodes never move, so the c_str() pointers live as long as the program.
  static std::mutex mutex;
  static std::set<std::string, std::less<>>* strings = new std::set<std::string, std::less<>>();
  std::lock_guard lock(mutex);
  auto it = strings->find(reason);
  if (it == strings->end()) it = strings->emplace(reason).first;
  return it->c_str();
}

namespace detail {

struct ImplStats {
  std::atomic<uint64_t> calls{0};
  std::mutex mutex;  // guards reasons (declines only: the accepted path is one atomic add)
  std::map<std::string, uint64_t, std::less<>> reasons;
};

void count_call(ImplStats* stats) { stats->calls.fetch_add(1, std::memory_order_relaxed); }

void count_reason(ImplStats* stats, const char* reason) {
  std::lock_guard lock(stats->mutex);
  auto it = stats->reasons.find(std::string_view(reason));
  if (it == stats->reasons.end()) stats->reasons.emplace(reason, 1);
  else ++it->second;
}

static ImplStatsView view_of(const std::string& name, ImplStats& stats) {
  ImplStatsView v;
  v.name = name;
  v.calls = stats.calls.load(std::memory_order_relaxed);
  std::lock_guard lock(stats.mutex);
  for (const auto& [reason, count] : stats.reasons) v.reasons.emplace(reason, count);
  return v;
}

static void reset(ImplStats& stats) {
  stats.calls.store(0, std::memory_order_relaxed);
  std::lock_guard lock(stats.mutex);
  stats.reasons.clear();
}

}  // namespace detail

// ---------------------------------------------------------------- OpBase

OpBase::OpBase(std::string name, std::string signature, std::string reference_name,
               GenericFn reference)
    : name_(std::move(name)),
      signature_(std::move(signature)),
      signature_hash_(dispatch::signature_hash(signature_)),
      reference_name_(std::move(reference_name)),
      reference_(reference),
      reference_stats_(std::make_unique<detail::ImplStats>()) {
  LEANSTEP_CHECK_ARG(!name_.empty(), "dispatch::Op", "name", "must not be empty");
  LEANSTEP_CHECK_ARG(!reference_name_.empty(), "dispatch::Op", "reference_name",
                     "must not be empty");
  std::lock_guard lock(mutex_);
  publish();
}

OpBase::~OpBase() = default;

OpBase::Record* OpBase::find_record(std::string_view impl_name) {
  for (auto& r : known_)
    if (r->name == impl_name) return r.get();
  return nullptr;
}

void OpBase::publish() {
  auto snap = std::make_shared<detail::Snapshot>();
  if (!enabled_) {
    snap->fallback_reason = intern_reason(
        preset_name_.empty() ? std::string("fast paths disabled")
                             : fmt::format("preset '{}' disables this op's fast paths", preset_name_));
  } else if (stack_.empty()) {
    snap->fallback_reason = "no fast implementation installed";
  } else {
    snap->fallback_reason = "every installed implementation declined";
    for (auto it = stack_.rbegin(); it != stack_.rend(); ++it)
      snap->candidates.push_back({(*it)->fn, (*it)->guard, (*it)->workspace, (*it)->device, (*it)->stats.get()});
  }
  snapshot_.store(std::move(snap));
}

void OpBase::throw_no_implementation(DeviceType device) const {
  std::string installed;
  {
    std::lock_guard lock(mutex_);
    for (Record* r : stack_)
      installed += fmt::format("{}{} ({})", installed.empty() ? "" : ", ", r->name, device_name(r->device));
  }
  throw Error(fmt::format("{}: no implementation for {} tensors (the reference '{}' runs cpu memory; installed: {}); "
                          "device tensors go through the Python package's device backends",
                          name_, device_name(device), reference_name_, installed.empty() ? "none" : installed));
}

InstallResult OpBase::install_record(std::string_view impl_name, GenericFn fn, GenericFn guard,
                                     std::string guard_doc, std::string origin, DeviceType device,
                                     GenericFn workspace) {
  constexpr std::string_view where = "dispatch::install";
  LEANSTEP_CHECK_ARG(!impl_name.empty(), where, "name", "must not be empty");
  LEANSTEP_CHECK_ARG(fn != nullptr, where, "fn",
                     fmt::format("must not be null (implementation '{}' of op '{}')", impl_name, name_));
  LEANSTEP_CHECK_ARG(impl_name != reference_name_, where, "name",
                     fmt::format("must differ from the reference's name '{}' of op '{}'",
                                 reference_name_, name_));
  std::lock_guard lock(mutex_);
  Record* rec = find_record(impl_name);
  if (rec) {
    if (rec->fn != fn || rec->guard != guard || rec->device != device || rec->workspace != workspace)
      throw_arg_error(where, "name",
                      fmt::format("'{}' of op '{}' is already known with a different entry point "
                                  "or guard; uninstall it and install under another name",
                                  impl_name, name_));
    if (std::find(stack_.begin(), stack_.end(), rec) != stack_.end())
      return {false, fmt::format("{}: '{}' already installed", name_, impl_name)};
  } else {
    known_.push_back(std::unique_ptr<Record>(new Record{std::string(impl_name), fn, guard,
                                                        std::move(guard_doc), std::move(origin),
                                                        std::make_unique<detail::ImplStats>(), device, workspace}));
    rec = known_.back().get();
  }
  stack_.push_back(rec);
  publish();
  return {true, fmt::format("{}: installed '{}'", name_, impl_name)};
}

InstallResult OpBase::install(const ImplDescriptor& desc) {
  constexpr std::string_view where = "dispatch::install";
  const std::string impl = desc.name ? desc.name : "";
  LEANSTEP_CHECK_ARG(desc.name && *desc.name, where, "descriptor.name", "must not be empty");
  LEANSTEP_CHECK_ARG(desc.op && name_ == desc.op, where, "descriptor.op",
                     fmt::format("must name op '{}' (got '{}')", name_, desc.op ? desc.op : "(null)"));
  if (desc.abi_version != kAbiVersion)
    throw_arg_error(where, "descriptor.abi_version",
                    fmt::format("must match the dispatch ABI version {} of this library (implementation "
                                "'{}' of op '{}' was built for ABI {})",
                                kAbiVersion, impl, name_, desc.abi_version));
  const std::string_view sig = desc.signature ? desc.signature : "";
  if (dispatch::signature_hash(sig) != desc.signature_hash)
    throw_arg_error(where, "descriptor.signature_hash",
                    fmt::format("must be the hash of the signature text '{}' (implementation '{}': "
                                "got {:#018x}, expected {:#018x}); the descriptor is corrupt",
                                sig, impl, desc.signature_hash, dispatch::signature_hash(sig)));
  if (sig != signature_)
    throw Error(fmt::format("dispatch::install: signature mismatch for implementation '{}' of op "
                            "'{}': it has signature '{}' but the op requires '{}'",
                            impl, name_, sig, signature_));
  LEANSTEP_CHECK_ARG(desc.device_type == static_cast<int32_t>(DeviceType::kCPU) ||
                         desc.device_type == static_cast<int32_t>(DeviceType::kCUDA),
                     where, "descriptor.device_type",
                     fmt::format("must be 0 (cpu) or 1 (cuda) (implementation '{}' of op '{}': got {})", impl, name_,
                                 desc.device_type));
  return install_record(impl, desc.fn, desc.guard, desc.guard_doc ? desc.guard_doc : "",
                        fmt::format("backend (ABI {})", desc.abi_version),
                        static_cast<DeviceType>(desc.device_type), desc.workspace);
}

InstallResult OpBase::install(std::string_view impl_name) {
  GenericFn fn, guard, workspace;
  DeviceType device;
  {
    std::lock_guard lock(mutex_);
    Record* rec = find_record(impl_name);
    if (!rec) {
      std::string known;
      for (auto& r : known_) known += (known.empty() ? "" : ", ") + r->name;
      throw_arg_error("dispatch::install", "name",
                      fmt::format("must name an implementation known to op '{}' ({}); got '{}'", name_,
                                  known.empty() ? "none known" : known, impl_name));
    }
    fn = rec->fn;
    guard = rec->guard;
    workspace = rec->workspace;
    device = rec->device;
  }
  return install_record(impl_name, fn, guard, "", "", device, workspace);
}

void OpBase::uninstall(std::string_view impl_name) {
  std::lock_guard lock(mutex_);
  auto it = std::find_if(stack_.begin(), stack_.end(), [&](Record* r) { return r->name == impl_name; });
  if (it == stack_.end()) {
    std::string installed;
    for (Record* r : stack_) installed += (installed.empty() ? "" : ", ") + r->name;
    throw_arg_error("dispatch::uninstall", "name",
                    fmt::format("must name an installed implementation of op '{}' (installed: {}); "
                                "got '{}'",
                                name_, installed.empty() ? "none" : installed, impl_name));
  }
  stack_.erase(it);
  publish();
}

void OpBase::set_enabled(bool enabled, std::string_view preset_name) {
  std::lock_guard lock(mutex_);
  enabled_ = enabled;
  preset_name_ = preset_name;
  publish();
}

bool OpBase::enabled() const {
  std::lock_guard lock(mutex_);
  return enabled_;
}

std::vector<std::string> OpBase::installed() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> names;
  for (auto it = stack_.rbegin(); it != stack_.rend(); ++it) names.push_back((*it)->name);
  return names;
}

std::pair<GenericFn, GenericFn> OpBase::entry(std::string_view impl_name) const {
  if (impl_name == reference_name_) return {reference_, nullptr};
  std::lock_guard lock(mutex_);
  std::string names = reference_name_;
  for (const auto& r : known_) {
    if (r->name == impl_name) return {r->fn, r->guard};
    names += ", " + r->name;
  }
  throw_arg_error("dispatch::call_impl", "impl_name",
                  fmt::format("must name the reference or an implementation known to op '{}' ({}); got '{}'",
                              name_, names, impl_name));
}

std::string OpBase::active() const {
  std::lock_guard lock(mutex_);
  return enabled_ && !stack_.empty() ? stack_.back()->name : std::string();
}

OpReport OpBase::report() const {
  std::lock_guard lock(mutex_);
  OpReport r;
  r.name = name_;
  r.signature = signature_;
  r.signature_hash = signature_hash_;
  r.reference = reference_name_;
  r.enabled = enabled_;
  for (auto it = stack_.rbegin(); it != stack_.rend(); ++it)
    r.impls.push_back({(*it)->name, (*it)->origin, (*it)->guard_doc, device_name((*it)->device), true, enabled_});
  for (auto& rec : known_)
    if (std::find(stack_.begin(), stack_.end(), rec.get()) == stack_.end())
      r.impls.push_back({rec->name, rec->origin, rec->guard_doc, device_name(rec->device), false, false});
  r.stats.push_back(detail::view_of(reference_name_, *reference_stats_));
  for (auto& rec : known_) {
    ImplStatsView v = detail::view_of(rec->name, *rec->stats);
    if (v.calls || !v.reasons.empty()) r.stats.push_back(std::move(v));
  }
  return r;
}

void OpBase::reset_stats() {
  std::lock_guard lock(mutex_);
  detail::reset(*reference_stats_);
  for (auto& rec : known_) detail::reset(*rec->stats);
}

// ---------------------------------------------------------------- Registry

namespace {

// Which ops a preset enables; throws on unknown names without changing anything.
std::set<std::string> ops_enabled_by(std::string_view preset,
                                     const std::map<std::string, OpBase*, std::less<>>& ops) {
  std::set<std::string> enabled;
  if (preset == "baseline") return enabled;
  if (preset == "all") {
    for (const auto& [name, op] : ops) enabled.insert(name);
    return enabled;
  }
  LEANSTEP_CHECK_ARG(!preset.empty(), "dispatch::set_preset", "preset",
                     "must be 'baseline', 'all' or a comma-separated list of op names or groups");
  size_t pos = 0;
  while (pos <= preset.size()) {
    size_t comma = preset.find(',', pos);
    if (comma == std::string_view::npos) comma = preset.size();
    std::string_view token = preset.substr(pos, comma - pos);
    while (!token.empty() && token.front() == ' ') token.remove_prefix(1);
    while (!token.empty() && token.back() == ' ') token.remove_suffix(1);
    bool matched = false;
    for (const auto& [name, op] : ops) {
      const std::string_view group = std::string_view(name).substr(0, name.find('.'));
      if (!token.empty() && (name == token || group == token)) {
        enabled.insert(name);
        matched = true;
      }
    }
    if (!matched) {
      std::string known;
      for (const auto& [name, op] : ops) known += (known.empty() ? "" : ", ") + name;
      throw_arg_error("dispatch::set_preset", "preset",
                      fmt::format("must be 'baseline', 'all' or a comma-separated list of op names "
                                  "or groups (known ops: {}); '{}' names none",
                                  known.empty() ? "none" : known, token));
    }
    pos = comma + 1;
  }
  return enabled;
}

}  // namespace

void Registry::add(OpBase& op) {
  std::lock_guard lock(mutex_);
  LEANSTEP_CHECK_ARG(ops_.find(op.name()) == ops_.end(), "dispatch::Registry::add", "op",
                     fmt::format("must have a unique name ('{}' is already registered)", op.name()));
  ops_.emplace(op.name(), &op);
  // Apply the current preset to the newcomer.
  if (preset_ == "all") op.set_enabled(true, preset_);
  else if (preset_ == "baseline") op.set_enabled(false, preset_);
  else op.set_enabled(ops_enabled_by(preset_, ops_).count(op.name()) > 0, preset_);
}

OpBase& Registry::op(std::string_view name) const {
  std::lock_guard lock(mutex_);
  auto it = ops_.find(name);
  if (it == ops_.end()) {
    std::string known;
    for (const auto& [n, op] : ops_) known += (known.empty() ? "" : ", ") + n;
    throw_arg_error("dispatch", "op",
                    fmt::format("must name a registered op ({}); got '{}'",
                                known.empty() ? "none registered" : known, name));
  }
  return *it->second;
}

std::vector<OpBase*> Registry::ops() const {
  std::lock_guard lock(mutex_);
  std::vector<OpBase*> v;
  for (const auto& [name, op] : ops_) v.push_back(op);
  return v;
}

InstallResult Registry::install(const ImplDescriptor& desc) {
  LEANSTEP_CHECK_ARG(desc.op != nullptr, "dispatch::install", "descriptor.op", "must not be null");
  return op(desc.op).install(desc);
}

InstallResult Registry::install(std::string_view op_name, std::string_view impl_name) {
  return op(op_name).install(impl_name);
}

void Registry::uninstall(std::string_view op_name, std::string_view impl_name) {
  op(op_name).uninstall(impl_name);
}

void Registry::set_preset(std::string_view preset) {
  std::lock_guard lock(mutex_);
  const std::set<std::string> enabled = ops_enabled_by(preset, ops_);
  for (const auto& [name, op] : ops_) op->set_enabled(enabled.count(name) > 0, preset);
  preset_ = preset;
}

std::string Registry::preset() const {
  std::lock_guard lock(mutex_);
  return preset_;
}

std::vector<OpReport> Registry::report() const {
  std::vector<OpReport> reports;
  for (OpBase* op : ops()) reports.push_back(op->report());
  return reports;
}

void Registry::reset_stats() {
  for (OpBase* op : ops()) op->reset_stats();
}

}  // namespace leanstep::dispatch
