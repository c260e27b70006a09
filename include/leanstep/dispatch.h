// leanstep dispatch: a registry of operations, each with a reference
// implementation and zero or more fast ones, installed safely at run time.
//
//  - Every op is a slot `Op<R(Args...)>`; callers always call through the slot
//    (see leanstep/ops.h), so no caller ever holds a stale entry point.
//  - Implementations declare their signature. In C++ the slot's type checks it
//    at compile time: installing a function of another type does not compile
//    (the install templates are constrained, so `CanInstall<Op<S>, F>` is false
//    and a call site fails with "constraints not satisfied"). Implementations
//    from a separately built backend library come as a C-style ImplDescriptor
//    carrying the ABI version and the canonical signature text; a mismatch is
//    refused at run time with an Error naming both signatures.
//  - install() of the same implementation again is a no-op reported as
//    "already installed"; uninstall() restores exactly the previous one
//    (installed implementations form a stack, the newest first).
//  - Guards: an implementation may decline a call with a reason; declined calls
//    go to the next candidate and finally to the reference. Every decision is
//    counted per implementation with its reason.
//  - Presets: "baseline" (reference everywhere), "all" (every fast path) or a
//    comma-separated subset of op names or op groups ("rmsnorm,grad.clip").
//  - Thread safety: install/uninstall/preset switches may race with calls. Each
//    op publishes an immutable snapshot of its candidates (a shared_ptr swapped
//    under a short lock, see SnapshotCell); a call works on one snapshot from
//    start to end, so it never sees a half-installed state. Mutations are
//    serialised.
#pragma once

#include <concepts>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "leanstep/core.h"

// ---------------------------------------------------------------- C-style descriptor

// Version of the binary contract between this library and a separately built
// backend: the layout of leanstep_dispatch_impl and of the types in signatures
// (leanstep::Tensor, ...). Bump it whenever either changes.
#define LEANSTEP_DISPATCH_ABI_VERSION 4u

extern "C" {
// One implementation of one op, as a backend library hands it over. Plain C
// layout so a library built separately (another compiler, a CUDA toolchain)
// can fill it in.
struct leanstep_dispatch_impl {
  uint32_t abi_version;     // LEANSTEP_DISPATCH_ABI_VERSION the backend was built with
  const char* op;           // op name, e.g. "grad.norm"
  const char* name;         // implementation name, e.g. "cuda_fused"
  const char* signature;    // canonical signature text, e.g. "void(Tensor, float)"
  uint64_t signature_hash;  // leanstep::dispatch::signature_hash(signature)
  void (*fn)(void);         // the entry point, cast from R(*)(Args...)
  void (*guard)(void);      // optional, cast from const char*(*)(Args...): NULL accepts all calls
  const char* guard_doc;    // optional, what the guard accepts (for `leanstep paths`)
  int32_t device_type;      // the leanstep::DeviceType it runs (0: cpu, 1: cuda)
  void (*workspace)(void);  // optional, cast from size_t(*)(Args...): bytes of workspace it uses
};
}

namespace leanstep::dispatch {

inline constexpr uint32_t kAbiVersion = LEANSTEP_DISPATCH_ABI_VERSION;
using ImplDescriptor = leanstep_dispatch_impl;
using GenericFn = void (*)(void);

// ---------------------------------------------------------------- the backend context

// Scratch memory the caller lends a call. Transformer Engine's protocol:
// Op::workspace_bytes(args...) says what the implementation that would run
// uses; a call given at least that much (data, bytes) works in it instead of
// allocating. Too little or none: the implementation allocates its own
// (results never depend on it).
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

// The last argument of every built-in op: where the call's tensors live (an
// op keeps its candidates per device type; one with none for the device is an
// Error naming it), the stream a device backend runs on (CPU implementations
// have none) and the workspace.
struct Context {
  Device device{};
  void* stream = nullptr;
  Workspace workspace{};
};

// ---------------------------------------------------------------- signatures

// Canonical names of the types that may appear in an op signature. The text is
// part of the run-time contract (it is compared across separately built
// libraries), so it is spelled explicitly rather than taken from the compiler.
// A type without a name does not compile as an op parameter; name new types
// with LEANSTEP_DISPATCH_TYPE_NAME at namespace scope. Only plain data is
// named: the standard library's strings, containers and optionals have no
// fixed layout across separately built libraries, so they have no name.
template <class T>
struct TypeName;  // intentionally undefined

#define LEANSTEP_DISPATCH_TYPE_NAME(Type, text)                                  \
  template <>                                                                    \
  struct leanstep::dispatch::TypeName<Type> {                                    \
    static std::string name() { return text; }                                   \
  }

template <class T>
struct TypeName<const T> {
  static std::string name() { return "const " + TypeName<T>::name(); }
};
template <class T>
struct TypeName<T*> {
  static std::string name() { return TypeName<T>::name() + "*"; }
};
template <class T>
struct TypeName<T&> {
  static std::string name() { return TypeName<T>::name() + "&"; }
};

}  // namespace leanstep::dispatch

LEANSTEP_DISPATCH_TYPE_NAME(void, "void");
LEANSTEP_DISPATCH_TYPE_NAME(bool, "bool");
LEANSTEP_DISPATCH_TYPE_NAME(char, "char");
LEANSTEP_DISPATCH_TYPE_NAME(int, "int32");
LEANSTEP_DISPATCH_TYPE_NAME(unsigned, "uint32");
LEANSTEP_DISPATCH_TYPE_NAME(long, "int64");
LEANSTEP_DISPATCH_TYPE_NAME(long long, "int64");
LEANSTEP_DISPATCH_TYPE_NAME(unsigned long, "uint64");
LEANSTEP_DISPATCH_TYPE_NAME(unsigned long long, "uint64");
LEANSTEP_DISPATCH_TYPE_NAME(float, "float32");
LEANSTEP_DISPATCH_TYPE_NAME(double, "float64");
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::Tensor, "Tensor");
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::TensorList, "TensorList");
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::OptionalInt64, "OptionalInt64");
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::DType, "DType");
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::dispatch::Context, "dispatch::Context");

namespace leanstep::dispatch {

// 64-bit FNV-1a of the canonical signature text: a stable id across builds.
uint64_t signature_hash(std::string_view signature);

template <class Sig>
struct Signature;
template <class R, class... Args>
struct Signature<R(Args...)> {
  using Fn = R (*)(Args...);
  // A guard sees the same arguments and returns nullptr to accept the call or
  // a reason (a string that lives for the whole program, e.g. a literal or
  // intern_reason(...)) to decline it.
  using Guard = const char* (*)(Args...);
  // Bytes of workspace an implementation uses for these arguments.
  using WorkspaceFn = size_t (*)(Args...);
  static std::string text() {
    std::string s = TypeName<R>::name() + "(";
    bool first = true;
    ((s += (first ? "" : ", ") + TypeName<Args>::name(), first = false), ...);
    return s + ")";
  }
};

// Returns a pointer with program lifetime to a copy of `reason`; for guards
// whose reasons are computed (e.g. taken from an area's decision function).
const char* intern_reason(std::string_view reason);

// ---------------------------------------------------------------- statistics

// What happened to the calls of one op, per implementation.
struct ImplStatsView {
  std::string name;
  uint64_t calls = 0;                       // calls this implementation ran
  std::map<std::string, uint64_t> reasons;  // fast: decline reasons; reference: why it ran
};

struct ImplInfo {
  std::string name;
  std::string origin;     // "built-in", "backend (ABI 4)", "user"
  std::string guard_doc;  // empty: accepts every call
  std::string device;     // the device type it runs: "cpu", "cuda"
  bool installed = false;
  bool active = false;  // installed and enabled by the preset
};

struct OpReport {
  std::string name;
  std::string signature;
  uint64_t signature_hash = 0;
  std::string reference;            // the reference implementation's name
  bool enabled = true;              // fast paths enabled by the preset
  std::vector<ImplInfo> impls;      // installed first (newest first), then available ones
  std::vector<ImplStatsView> stats;  // reference first, then every implementation that ran or declined
};

struct InstallResult {
  bool changed = false;  // false: "already installed"
  std::string message;   // "installed ..." / "... already installed"
};

// ---------------------------------------------------------------- ops

namespace detail {
struct ImplStats;
struct Candidate {
  GenericFn fn;
  GenericFn guard;
  GenericFn workspace;  // null: uses none
  DeviceType device;
  ImplStats* stats;  // owned by the op; never freed while the op lives
};

// The device type of a call: its Context argument's, else the CPU (ops
// without a Context, such as test ops, run host memory).
template <class... Args>
DeviceType call_device(const Args&... args) {
  DeviceType device = DeviceType::kCPU;
  auto pick = [&](const auto& arg) {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(arg)>, Context>) device = arg.device.type;
  };
  (pick(args), ...);
  return device;
}
struct Snapshot {
  std::vector<Candidate> candidates;  // in priority order
  const char* fallback_reason;        // why the reference runs when no candidate takes the call
};
void count_call(ImplStats* stats);
void count_reason(ImplStats* stats, const char* reason);

// Holds the current snapshot. A call copies the shared_ptr (one short critical
// section) and keeps the snapshot alive while it runs; a publisher swaps in a
// new one. This is what std::atomic<std::shared_ptr> does in libstdc++ 12 (an
// internal lock bit), but with a std::mutex that ThreadSanitizer understands;
// the old snapshot is released outside the lock.
class SnapshotCell {
 public:
  std::shared_ptr<const Snapshot> load() const {
    std::lock_guard lock(mutex_);
    return current_;
  }
  void store(std::shared_ptr<const Snapshot> next) {
    {
      std::lock_guard lock(mutex_);
      current_.swap(next);
    }
    // `next` now holds the previous snapshot; dropped here, after the lock.
  }

 private:
  mutable std::mutex mutex_;
  std::shared_ptr<const Snapshot> current_;
};
}  // namespace detail

// The type-independent part of an op slot: names, the installed stack, the
// preset flag, statistics and the published snapshot.
class OpBase {
 public:
  OpBase(const OpBase&) = delete;
  OpBase& operator=(const OpBase&) = delete;
  virtual ~OpBase();

  const std::string& name() const { return name_; }
  const std::string& signature() const { return signature_; }
  uint64_t signature_hash() const { return signature_hash_; }
  const std::string& reference_name() const { return reference_name_; }

  // Installs an implementation from a backend descriptor. Errors: wrong op name,
  // ABI mismatch, signature mismatch (naming both signatures), null entry point,
  // a different entry point already installed under the same name.
  InstallResult install(const ImplDescriptor& desc);
  // (Re)installs an implementation this op already knows by name (built-in ones,
  // or one uninstalled earlier). Unknown name -> Error.
  InstallResult install(std::string_view impl_name);
  // Removes an installed implementation; the one installed before it becomes
  // active again. Unknown or not installed -> Error.
  void uninstall(std::string_view impl_name);

  // Fast paths on/off (presets use this). Off: every call goes to the reference.
  void set_enabled(bool enabled, std::string_view preset_name = "");
  bool enabled() const;

  // Names of installed implementations, newest (highest priority) first.
  std::vector<std::string> installed() const;
  // The implementation a call would try first ("" if only the reference remains).
  std::string active() const;
  OpReport report() const;
  void reset_stats();

 protected:
  OpBase(std::string name, std::string signature, std::string reference_name,
         GenericFn reference);

  InstallResult install_record(std::string_view impl_name, GenericFn fn, GenericFn guard,
                               std::string guard_doc, std::string origin, DeviceType device = DeviceType::kCPU,
                               GenericFn workspace = nullptr);
  // A call on `device` that no installed implementation for it takes: the
  // reference runs host memory only.
  [[noreturn]] void throw_no_implementation(DeviceType device) const;

  std::shared_ptr<const detail::Snapshot> snapshot() const { return snapshot_.load(); }
  // The entry point and guard of a known implementation or of the reference
  // (guard null: accepts every call). Unknown name -> Error listing the known ones.
  std::pair<GenericFn, GenericFn> entry(std::string_view impl_name) const;
  GenericFn reference_fn() const { return reference_; }
  detail::ImplStats* reference_stats() const { return reference_stats_.get(); }

 private:
  struct Record {
    std::string name;
    GenericFn fn;
    GenericFn guard;
    std::string guard_doc;
    std::string origin;
    std::unique_ptr<detail::ImplStats> stats;
    DeviceType device = DeviceType::kCPU;
    GenericFn workspace = nullptr;
  };
  Record* find_record(std::string_view impl_name);
  void publish();  // rebuilds the snapshot from the stack; caller holds mutex_

  const std::string name_;
  const std::string signature_;
  const uint64_t signature_hash_;
  const std::string reference_name_;
  const GenericFn reference_;
  std::unique_ptr<detail::ImplStats> reference_stats_;

  mutable std::mutex mutex_;                     // serialises mutations and reports
  std::vector<std::unique_ptr<Record>> known_;   // every implementation ever seen, never freed
  std::vector<Record*> stack_;                   // installed, oldest first
  bool enabled_ = true;
  std::string preset_name_;
  detail::SnapshotCell snapshot_;
};

// A typed op slot. Calling it runs the first installed implementation whose
// guard accepts the call, else the reference.
template <class Sig>
class Op;

template <class R, class... Args>
class Op<R(Args...)> : public OpBase {
 public:
  using Sig = R(Args...);
  using Fn = typename Signature<Sig>::Fn;
  using Guard = typename Signature<Sig>::Guard;

  // `precondition` (optional) checks the arguments of every call (and of every
  // workspace query) before any implementation is chosen, so that all of them see consistent arguments
  // (it throws leanstep::Error; it must not depend on the implementation).
  Op(std::string name, std::string reference_name, Fn reference, Fn precondition = nullptr)
      : OpBase(std::move(name), Signature<Sig>::text(), std::move(reference_name),
               reinterpret_cast<GenericFn>(reference)),
        precondition_(precondition) {
    LEANSTEP_CHECK_ARG(reference != nullptr, "dispatch::Op", "reference", "must not be null");
  }

  using OpBase::install;

  // Typed install: the entry point (and guard) must convert to this op's exact
  // function-pointer types, so a function of another signature does not compile.
  template <class F>
    requires std::convertible_to<F, Fn>
  InstallResult install(std::string_view impl_name, F fn, std::string guard_doc = "",
                        std::string origin = "user") {
    return install_record(impl_name, reinterpret_cast<GenericFn>(static_cast<Fn>(fn)), nullptr,
                          std::move(guard_doc), std::move(origin));
  }
  template <class F, class G>
    requires std::convertible_to<F, Fn> && std::convertible_to<G, Guard>
  InstallResult install(std::string_view impl_name, F fn, G guard, std::string guard_doc,
                        std::string origin = "user") {
    return install_record(impl_name, reinterpret_cast<GenericFn>(static_cast<Fn>(fn)),
                          reinterpret_cast<GenericFn>(static_cast<Guard>(guard)),
                          std::move(guard_doc), std::move(origin));
  }

  // Runs one implementation by name (or the reference), installed or not and
  // whatever the preset: for tests and benchmarks that force a choice. Returns
  // the guard's reason without running anything when the guard declines the
  // call, else nullptr. Not counted in the statistics.
  const char* call_impl(std::string_view impl_name, Args... args) const
    requires std::is_void_v<R>
  {
    const auto [fn, guard] = entry(impl_name);
    if (precondition_) precondition_(args...);
    if (guard) {
      if (const char* reason = reinterpret_cast<Guard>(guard)(args...)) return reason;
    }
    reinterpret_cast<Fn>(fn)(args...);
    return nullptr;
  }

  // Installs an implementation for tensors on `device` (the other install
  // forms are for the CPU), with an optional workspace query.
  template <class F, class G = std::nullptr_t, class W = std::nullptr_t>
    requires std::convertible_to<F, Fn> && (std::is_null_pointer_v<G> || std::convertible_to<G, Guard>) &&
             (std::is_null_pointer_v<W> || std::convertible_to<W, typename Signature<Sig>::WorkspaceFn>)
  InstallResult install_on(DeviceType device, std::string_view impl_name, F fn, G guard = nullptr,
                           std::string guard_doc = "", W workspace = nullptr, std::string origin = "user") {
    GenericFn g = nullptr, w = nullptr;
    if constexpr (!std::is_null_pointer_v<G>) g = reinterpret_cast<GenericFn>(static_cast<Guard>(guard));
    if constexpr (!std::is_null_pointer_v<W>)
      w = reinterpret_cast<GenericFn>(static_cast<typename Signature<Sig>::WorkspaceFn>(workspace));
    return install_record(impl_name, reinterpret_cast<GenericFn>(static_cast<Fn>(fn)), g, std::move(guard_doc),
                          std::move(origin), device, w);
  }

  // Bytes of workspace the implementation a call with these arguments would
  // run uses (0 for the reference and for implementations without a query).
  size_t workspace_bytes(Args... args) const {
    if (precondition_) precondition_(args...);
    const DeviceType device = detail::call_device(args...);
    const std::shared_ptr<const detail::Snapshot> snap = snapshot();
    for (const detail::Candidate& c : snap->candidates) {
      if (c.device != device) continue;
      if (c.guard && reinterpret_cast<Guard>(c.guard)(args...)) continue;
      return c.workspace ? reinterpret_cast<typename Signature<Sig>::WorkspaceFn>(c.workspace)(args...) : 0;
    }
    return 0;
  }

  // The dispatched call. Arguments are passed on as lvalues (guards and
  // implementations take them by value or by reference).
  R operator()(Args... args) const {
    if (precondition_) precondition_(args...);
    const DeviceType device = detail::call_device(args...);
    const std::shared_ptr<const detail::Snapshot> snap = snapshot();
    for (const detail::Candidate& c : snap->candidates) {
      if (c.device != device) continue;
      if (c.guard) {
        const char* reason = reinterpret_cast<Guard>(c.guard)(args...);
        if (reason) {
          detail::count_reason(c.stats, reason);
          continue;
        }
      }
      detail::count_call(c.stats);
      return reinterpret_cast<Fn>(c.fn)(args...);
    }
    if (device != DeviceType::kCPU) throw_no_implementation(device);
    detail::count_call(reference_stats());
    detail::count_reason(reference_stats(), snap->fallback_reason);
    return reinterpret_cast<Fn>(reference_fn())(args...);
  }

 private:
  const Fn precondition_;
};

// True when `F` can be installed into op type `O` (a compile-time check; used
// by the tests to prove that a wrong signature does not compile).
template <class O, class F>
concept CanInstall = requires(O& op, F fn) { op.install(std::string_view{}, fn); };

// Fills a descriptor for an implementation of op signature `Sig`, as a backend
// library would (the strings must outlive the install call).
template <class Sig>
ImplDescriptor make_descriptor(const char* op, const char* name, const std::string& signature_text,
                               typename Signature<Sig>::Fn fn,
                               typename Signature<Sig>::Guard guard = nullptr,
                               const char* guard_doc = nullptr, DeviceType device = DeviceType::kCPU,
                               typename Signature<Sig>::WorkspaceFn workspace = nullptr) {
  return ImplDescriptor{kAbiVersion,
                        op,
                        name,
                        signature_text.c_str(),
                        signature_hash(signature_text),
                        reinterpret_cast<GenericFn>(fn),
                        reinterpret_cast<GenericFn>(guard),
                        guard_doc,
                        static_cast<int32_t>(device),
                        reinterpret_cast<GenericFn>(workspace)};
}

// ---------------------------------------------------------------- registry

// A set of ops by name with a preset. The process-wide one, `registry()`, holds
// the built-in ops of leanstep (see leanstep/ops.h); tests may build their own.
// Ops must outlive the registry they are added to.
class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Adds an op (the current preset applies to it). Duplicate name -> Error.
  void add(OpBase& op);
  OpBase& op(std::string_view name) const;  // unknown -> Error listing the known ops
  std::vector<OpBase*> ops() const;         // sorted by name

  InstallResult install(const ImplDescriptor& desc);  // op chosen by desc.op
  InstallResult install(std::string_view op_name, std::string_view impl_name);
  void uninstall(std::string_view op_name, std::string_view impl_name);

  // "baseline", "all", or a comma-separated list of op names / groups (the part
  // of an op name before the first '.'): fast paths on for those, off elsewhere.
  // Unknown names -> Error and nothing changes. Meant to be switched between
  // steps: a call already running finishes on the snapshot it started with.
  void set_preset(std::string_view preset);
  std::string preset() const;

  std::vector<OpReport> report() const;
  void reset_stats();

 private:
  mutable std::mutex mutex_;
  std::map<std::string, OpBase*, std::less<>> ops_;
  std::string preset_ = "all";
};

// The process-wide registry with every built-in op registered.
Registry& registry();

// The report behind `leanstep paths`: ops, installed implementations, guards,
// preset, call counts and reasons. Reusable by the training step.
std::string paths_text(const Registry& reg = registry());
std::string paths_json(const Registry& reg = registry());  // one JSON object

}  // namespace leanstep::dispatch
