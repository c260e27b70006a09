// The dispatch mechanism on synthetic ops: signatures, install/uninstall,
// guards and their counters, presets, reports, bad input.
#include <gtest/gtest.h>

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "leanstep/dispatch.h"
#include "test_util.h"

namespace ld = leanstep::dispatch;
using leanstep::Tensor;

namespace {

// Synthetic implementations: each returns a value that says who ran.
int square_reference(int x) { return x * x; }
int square_fast(int x) { return x * x + 1000; }
int square_faster(int x) { return x * x + 2000; }
const char* decline_odd(int x) { return x % 2 ? "odd input" : nullptr; }
const char* decline_negative(int x) { return x < 0 ? "negative input" : nullptr; }
const char* decline_all(int) { return "never applies"; }

using SquareOp = ld::Op<int(int)>;

uint64_t calls_of(const ld::OpBase& op, const std::string& impl) {
  for (const auto& s : op.report().stats)
    if (s.name == impl) return s.calls;
  return 0;
}

std::map<std::string, uint64_t> reasons_of(const ld::OpBase& op, const std::string& impl) {
  for (const auto& s : op.report().stats)
    if (s.name == impl) return s.reasons;
  return {};
}

}  // namespace

// ---------------------------------------------------------------- signatures

// The compile-time case: installing a function of another signature into a
// typed slot does not compile. These assertions are the test (they run when
// this file compiles); a call site like `op.install("x", &wrong)` fails with
// "constraints not satisfied".
static_assert(ld::CanInstall<SquareOp, int (*)(int)>);
static_assert(ld::CanInstall<SquareOp, decltype([](int x) { return x; })>);  // captureless lambda
static_assert(!ld::CanInstall<SquareOp, int (*)(double)>);                  // other parameter
static_assert(!ld::CanInstall<SquareOp, long (*)(int)>);                    // other result
static_assert(!ld::CanInstall<SquareOp, int (*)(int, int)>);                // other arity
static_assert(!ld::CanInstall<ld::Op<void(Tensor)>, void (*)(const Tensor&)>);
static_assert(!ld::CanInstall<SquareOp, decltype([y = 1](int x) { return x + y; })>);  // captures state

// Op signatures carry plain data only: the standard library's strings,
// containers and optionals have no signature name, so an op using one does not compile.
template <class T>
concept Nameable = requires { ld::TypeName<T>::name(); };
static_assert(Nameable<leanstep::TensorList> && Nameable<leanstep::OptionalInt64> && Nameable<const Tensor&>);
static_assert(!Nameable<std::span<const Tensor>> && !Nameable<std::optional<int64_t>> &&
              !Nameable<std::vector<Tensor>> && !Nameable<std::string> && !Nameable<std::string_view>);

TEST(DispatchSignature, CanonicalTextAndStableHash) {
  EXPECT_EQ(ld::Signature<int(int)>::text(), "int32(int32)");
  EXPECT_EQ((ld::Signature<void(const Tensor&, Tensor, float, int64_t, const double*)>::text()),
            "void(const Tensor&, Tensor, float32, int64, const float64*)");
  EXPECT_EQ((ld::Signature<bool(leanstep::TensorList, leanstep::OptionalInt64)>::text()),
            "bool(TensorList, OptionalInt64)");
  EXPECT_EQ(ld::Signature<void()>::text(), "void()");
  // FNV-1a 64 published test vectors: the id must not change between builds.
  EXPECT_EQ(ld::signature_hash(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(ld::signature_hash("a"), 0xaf63dc4c8601ec8cull);
  SquareOp op("test.square", "reference", &square_reference);
  EXPECT_EQ(op.signature(), "int32(int32)");
  EXPECT_EQ(op.signature_hash(), ld::signature_hash("int32(int32)"));
}

TEST(DispatchSignature, DescriptorWithOtherSignatureIsRefusedNamingBoth) {
  SquareOp op("test.square", "reference", &square_reference);
  const std::string other = ld::Signature<double(double)>::text();
  auto fn = +[](double x) { return x; };
  ld::ImplDescriptor desc = ld::make_descriptor<double(double)>("test.square", "wrong", other, fn);
  try {
    op.install(desc);
    FAIL() << "a signature mismatch was accepted";
  } catch (const leanstep::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("signature mismatch"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'float64(float64)'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'int32(int32)'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'wrong'"), std::string::npos) << msg;
  }
  EXPECT_TRUE(op.installed().empty());
  EXPECT_EQ(op(3), 9);
}

TEST(DispatchSignature, DescriptorAbiAndConsistencyChecks) {
  SquareOp op("test.square", "reference", &square_reference);
  const std::string sig = ld::Signature<int(int)>::text();
  ld::ImplDescriptor good = ld::make_descriptor<int(int)>("test.square", "backend", sig, &square_fast,
                                                          &decline_odd, "even inputs only");

  ld::ImplDescriptor abi = good;
  abi.abi_version = ld::kAbiVersion + 1;
  EXPECT_LEANSTEP_ERROR(op.install(abi), "ABI");
  EXPECT_LEANSTEP_ERROR(op.install(abi), "built for ABI " + std::to_string(ld::kAbiVersion + 1));

  ld::ImplDescriptor corrupt = good;
  corrupt.signature_hash ^= 1;
  EXPECT_LEANSTEP_ERROR(op.install(corrupt), "signature_hash");

  ld::ImplDescriptor other_op = good;
  other_op.op = "test.cube";
  EXPECT_LEANSTEP_ERROR(op.install(other_op), "must name op 'test.square'");

  ld::ImplDescriptor null_fn = good;
  null_fn.fn = nullptr;
  EXPECT_LEANSTEP_ERROR(op.install(null_fn), "must not be null");

  ld::ImplDescriptor bad_device = good;
  bad_device.device_type = 7;
  EXPECT_LEANSTEP_ERROR(op.install(bad_device), "descriptor.device_type");

  ld::ImplDescriptor no_name = good;
  no_name.name = "";
  EXPECT_LEANSTEP_ERROR(op.install(no_name), "descriptor.name");
  EXPECT_TRUE(op.installed().empty());

  // The well-formed descriptor installs and runs, guard included.
  EXPECT_TRUE(op.install(good).changed);
  EXPECT_EQ(op(4), 1016);
  EXPECT_EQ(op(3), 9);
  const auto report = op.report();
  ASSERT_EQ(report.impls.size(), 1u);
  EXPECT_EQ(report.impls[0].origin, "backend (ABI " + std::to_string(ld::kAbiVersion) + ")");
  EXPECT_EQ(report.impls[0].device, "cpu");
  EXPECT_EQ(report.impls[0].guard_doc, "even inputs only");
}

// ---------------------------------------------------------------- install / uninstall

TEST(DispatchInstall, SameImplementationTwiceIsReportedNoOp) {
  SquareOp op("test.square", "reference", &square_reference);
  const auto first = op.install("fast", &square_fast);
  EXPECT_TRUE(first.changed);
  EXPECT_NE(first.message.find("installed 'fast'"), std::string::npos);
  const auto second = op.install("fast", &square_fast);
  EXPECT_FALSE(second.changed);
  EXPECT_NE(second.message.find("already installed"), std::string::npos) << second.message;
  EXPECT_EQ(op.installed(), std::vector<std::string>{"fast"});
  // Also through a descriptor and by name.
  const std::string sig = op.signature();
  EXPECT_FALSE(op.install(ld::make_descriptor<int(int)>("test.square", "fast", sig, &square_fast)).changed);
  EXPECT_FALSE(op.install("fast").changed);
  EXPECT_EQ(op.installed(), std::vector<std::string>{"fast"});
  // The same name with another entry point is not "the same implementation".
  EXPECT_LEANSTEP_ERROR(op.install("fast", &square_faster), "different entry point");
  EXPECT_LEANSTEP_ERROR(op.install("fast", &square_fast, &decline_odd, "even"), "different entry point");
  EXPECT_LEANSTEP_ERROR(op.install("reference", &square_fast), "must differ from the reference");
  EXPECT_LEANSTEP_ERROR(op.install("", &square_fast), "'name' must not be empty");
  EXPECT_EQ(op(5), 1025);
}

TEST(DispatchInstall, UninstallRestoresExactlyThePreviousImplementation) {
  SquareOp op("test.square", "reference", &square_reference);
  EXPECT_EQ(op(3), 9);
  EXPECT_EQ(op.active(), "");
  op.install("fast", &square_fast);
  EXPECT_EQ(op(3), 1009);
  op.install("faster", &square_faster);
  EXPECT_EQ(op.active(), "faster");
  EXPECT_EQ(op(3), 2009);
  EXPECT_EQ(op.installed(), (std::vector<std::string>{"faster", "fast"}));

  op.uninstall("faster");
  EXPECT_EQ(op.active(), "fast");
  EXPECT_EQ(op(3), 1009);
  op.uninstall("fast");
  EXPECT_EQ(op.active(), "");
  EXPECT_EQ(op(3), 9);

  // Uninstalling what is not installed, or was never known: Error.
  EXPECT_LEANSTEP_ERROR(op.uninstall("fast"), "installed: none");
  EXPECT_LEANSTEP_ERROR(op.uninstall("nonexistent"), "got 'nonexistent'");

  // Uninstalling from the middle keeps the order of the others.
  op.install("fast", &square_fast);
  op.install("faster", &square_faster);
  op.uninstall("fast");
  EXPECT_EQ(op.installed(), std::vector<std::string>{"faster"});
  op.uninstall("faster");

  // Re-install by name (the op remembers implementations it has seen).
  EXPECT_TRUE(op.install("faster").changed);
  EXPECT_EQ(op(2), 2004);
  EXPECT_LEANSTEP_ERROR(op.install("unknown_impl"), "must name an implementation known to op 'test.square'");
}

TEST(DispatchInstall, CallersThatKeptTheSlotSeeTheNewImplementation) {
  SquareOp op("test.square", "reference", &square_reference);
  const SquareOp& held = op;  // a caller that cached "the entry point" holds the slot
  EXPECT_EQ(held(2), 4);
  op.install("fast", &square_fast);
  EXPECT_EQ(held(2), 1004);
  op.uninstall("fast");
  EXPECT_EQ(held(2), 4);
}

// ---------------------------------------------------------------- guards

TEST(DispatchGuards, DeclinedCallsGoToTheNextCandidateThenTheReference) {
  SquareOp op("test.square", "reference", &square_reference);
  op.install("fast", &square_fast, &decline_negative, "non-negative inputs");
  op.install("faster", &square_faster, &decline_odd, "even inputs");

  EXPECT_EQ(op(4), 2016);   // faster accepts
  EXPECT_EQ(op(3), 1009);   // faster declines (odd), fast accepts
  EXPECT_EQ(op(-3), 9);     // both decline: reference
  EXPECT_EQ(op(-2), 2004);  // faster accepts
  EXPECT_EQ(op(5), 1025);

  EXPECT_EQ(calls_of(op, "faster"), 2u);
  EXPECT_EQ(calls_of(op, "fast"), 2u);
  EXPECT_EQ(calls_of(op, "reference"), 1u);
  EXPECT_EQ(reasons_of(op, "faster"), (std::map<std::string, uint64_t>{{"odd input", 3}}));
  EXPECT_EQ(reasons_of(op, "fast"), (std::map<std::string, uint64_t>{{"negative input", 1}}));
  EXPECT_EQ(reasons_of(op, "reference"),
            (std::map<std::string, uint64_t>{{"every installed implementation declined", 1}}));

  op.reset_stats();
  EXPECT_EQ(calls_of(op, "faster"), 0u);
  EXPECT_EQ(calls_of(op, "reference"), 0u);
  EXPECT_TRUE(reasons_of(op, "faster").empty());
}

TEST(DispatchGuards, ReasonsForTheReferenceSayWhyTheFastPathDidNotRun) {
  SquareOp op("test.square", "reference", &square_reference);
  op(1);
  EXPECT_EQ(reasons_of(op, "reference"),
            (std::map<std::string, uint64_t>{{"no fast implementation installed", 1}}));
  op.install("never", &square_fast, &decline_all, "nothing");
  op(1);
  op(2);
  EXPECT_EQ(reasons_of(op, "never"), (std::map<std::string, uint64_t>{{"never applies", 2}}));
  EXPECT_EQ(calls_of(op, "never"), 0u);
  op.set_enabled(false, "baseline");
  op(1);
  const auto reasons = reasons_of(op, "reference");
  EXPECT_EQ(reasons.at("preset 'baseline' disables this op's fast paths"), 1u);
  EXPECT_EQ(reasons.at("every installed implementation declined"), 2u);
  EXPECT_EQ(calls_of(op, "reference"), 4u);
}

TEST(DispatchGuards, InternedReasonsAreStableAndShared) {
  const char* a = ld::intern_reason(std::string("computed ") + "reason");
  const char* b = ld::intern_reason("computed reason");
  EXPECT_EQ(a, b);
  EXPECT_STREQ(a, "computed reason");
}

TEST(DispatchGuards, TensorArgumentsReachGuardAndImplementation) {
  // A view-taking op with a guard on the dtype, like the real ones.
  using ScaleOp = ld::Op<void(Tensor, float)>;
  static auto reference = +[](Tensor x, float s) {
    for (int64_t i = 0; i < x.numel(); ++i) x.data_as<float>()[i] *= s;
  };
  static auto fast = +[](Tensor x, float s) {
    float* p = x.data_as<float>();
    for (int64_t i = 0; i < x.numel(); ++i) p[i] = p[i] * s;
  };
  static auto fp32_only = +[](Tensor x, float) -> const char* {
    return x.dtype == leanstep::DType::kFloat32 ? nullptr : "dtype is not float32";
  };
  ScaleOp op("test.scale", "reference", reference);
  op.install("fast", fast, fp32_only, "float32 views");
  std::vector<float> v = {1, 2, 3};
  op(Tensor(v.data(), leanstep::DType::kFloat32, {3}), 2.0f);
  EXPECT_EQ(v, (std::vector<float>{2, 4, 6}));
  std::vector<double> d = {1, 2};
  // Only the guard looks at this call (no implementation is run on float64 data).
  const Tensor t(d.data(), leanstep::DType::kFloat64, {0});
  op(t, 2.0f);
  EXPECT_EQ(calls_of(op, "fast"), 1u);
  EXPECT_EQ(reasons_of(op, "fast").at("dtype is not float32"), 1u);
}

// ---------------------------------------------------------------- presets

namespace {
struct ThreeOps {
  SquareOp a{"grp.a", "reference", &square_reference};
  SquareOp b{"grp.b", "reference", &square_reference};
  SquareOp c{"other.c", "reference", &square_reference};
  ld::Registry reg;
  ThreeOps() {
    for (SquareOp* op : {&a, &b, &c}) {
      op->install("fast", &square_fast);
      reg.add(*op);
    }
  }
  // Which ops ran their fast path for input 1 (1001) versus the reference (1).
  std::string fast_set() {
    std::string s;
    if (a(1) == 1001) s += "a";
    if (b(1) == 1001) s += "b";
    if (c(1) == 1001) s += "c";
    return s;
  }
};
}  // namespace

TEST(DispatchPresets, SwitchBetweenSteps) {
  ThreeOps t;
  EXPECT_EQ(t.reg.preset(), "all");
  EXPECT_EQ(t.fast_set(), "abc");
  t.reg.set_preset("baseline");
  EXPECT_EQ(t.fast_set(), "");
  EXPECT_EQ(t.a.active(), "");
  EXPECT_EQ(t.a.installed(), std::vector<std::string>{"fast"});  // still installed, just off
  t.reg.set_preset("grp");
  EXPECT_EQ(t.fast_set(), "ab");
  t.reg.set_preset("other.c, grp.a");
  EXPECT_EQ(t.reg.preset(), "other.c, grp.a");
  EXPECT_EQ(t.fast_set(), "ac");
  t.reg.set_preset("other");
  EXPECT_EQ(t.fast_set(), "c");
  t.reg.set_preset("all");
  EXPECT_EQ(t.fast_set(), "abc");
  // The reasons recorded for the reference name the preset.
  t.reg.set_preset("grp.b");
  t.a(2);
  EXPECT_EQ(reasons_of(t.a, "reference").at("preset 'grp.b' disables this op's fast paths"), 1u);
}

TEST(DispatchPresets, BadPresetChangesNothing) {
  ThreeOps t;
  t.reg.set_preset("grp.a");
  EXPECT_LEANSTEP_ERROR(t.reg.set_preset("grp.a,nonsense"), "'nonsense' names none");
  EXPECT_LEANSTEP_ERROR(t.reg.set_preset("grp.a,nonsense"), "known ops: grp.a, grp.b, other.c");
  EXPECT_LEANSTEP_ERROR(t.reg.set_preset(""), "must be 'baseline', 'all'");
  EXPECT_LEANSTEP_ERROR(t.reg.set_preset("grp.a,,grp.b"), "'' names none");
  EXPECT_LEANSTEP_ERROR(t.reg.set_preset("gr"), "'gr' names none");  // no prefix matching
  EXPECT_EQ(t.reg.preset(), "grp.a");
  EXPECT_EQ(t.fast_set(), "a");
}

TEST(DispatchPresets, OpsAddedLaterFollowThePreset) {
  ThreeOps t;
  t.reg.set_preset("grp");
  SquareOp d("grp.d", "reference", &square_reference);
  SquareOp e("late.e", "reference", &square_reference);
  d.install("fast", &square_fast);
  e.install("fast", &square_fast);
  t.reg.add(d);
  t.reg.add(e);
  EXPECT_EQ(d(1), 1001);
  EXPECT_EQ(e(1), 1);
  t.reg.set_preset("baseline");
  SquareOp f("late.f", "reference", &square_reference);
  f.install("fast", &square_fast);
  t.reg.add(f);
  EXPECT_EQ(f(1), 1);
}

// ---------------------------------------------------------------- registry

TEST(DispatchRegistry, NamesAndErrors) {
  ThreeOps t;
  EXPECT_EQ(&t.reg.op("grp.b"), &t.b);
  ASSERT_EQ(t.reg.ops().size(), 3u);
  EXPECT_EQ(t.reg.ops()[2]->name(), "other.c");
  EXPECT_LEANSTEP_ERROR(t.reg.op("grp.z"), "must name a registered op (grp.a, grp.b, other.c); got 'grp.z'");
  SquareOp dup("grp.a", "reference", &square_reference);
  EXPECT_LEANSTEP_ERROR(t.reg.add(dup), "'grp.a' is already registered");
  EXPECT_LEANSTEP_ERROR(t.reg.install("grp.z", "fast"), "got 'grp.z'");
  EXPECT_LEANSTEP_ERROR(t.reg.uninstall("grp.a", "slow"), "got 'slow'");
  t.reg.uninstall("grp.a", "fast");
  EXPECT_EQ(t.fast_set(), "bc");
  EXPECT_TRUE(t.reg.install("grp.a", "fast").changed);
  EXPECT_FALSE(t.reg.install("grp.a", "fast").changed);
  EXPECT_EQ(t.fast_set(), "abc");
  const std::string sig = t.a.signature();
  ld::ImplDescriptor desc = ld::make_descriptor<int(int)>("grp.b", "faster", sig, &square_faster);
  EXPECT_TRUE(t.reg.install(desc).changed);
  EXPECT_EQ(t.b(1), 2001);
  desc.op = "grp.z";
  EXPECT_LEANSTEP_ERROR(t.reg.install(desc), "got 'grp.z'");
  EXPECT_LEANSTEP_ERROR(SquareOp("", "reference", &square_reference), "'name' must not be empty");
  EXPECT_LEANSTEP_ERROR(SquareOp("x", "reference", nullptr), "'reference' must not be null");
}

TEST(DispatchRegistry, ReportTextAndJson) {
  ThreeOps t;
  t.b.install("picky", &square_faster, &decline_odd, "even inputs only");
  t.b(1);
  t.b(2);
  t.reg.set_preset("grp.b");
  t.a(1);
  const std::string text = ld::paths_text(t.reg);
  EXPECT_NE(text.find("preset: grp.b"), std::string::npos) << text;
  EXPECT_NE(text.find("grp.b  int32(int32)"), std::string::npos) << text;
  EXPECT_NE(text.find("guard: even inputs only"), std::string::npos) << text;
  EXPECT_NE(text.find("declined: 1 x odd input"), std::string::npos) << text;
  EXPECT_NE(text.find("ran because: 1 x preset 'grp.b' disables"), std::string::npos) << text;

  const auto doc = nlohmann::json::parse(ld::paths_json(t.reg));
  EXPECT_EQ(doc["preset"], "grp.b");
  EXPECT_EQ(doc["abi_version"], ld::kAbiVersion);
  ASSERT_EQ(doc["ops"].size(), 3u);
  const auto& b = doc["ops"][1];
  EXPECT_EQ(b["op"], "grp.b");
  EXPECT_EQ(b["signature"], "int32(int32)");
  EXPECT_EQ(b["fast_paths_enabled"], true);
  ASSERT_EQ(b["implementations"].size(), 2u);
  EXPECT_EQ(b["implementations"][0]["name"], "picky");  // newest first
  EXPECT_EQ(b["implementations"][0]["guard"], "even inputs only");
  uint64_t picky_calls = 0, fast_calls = 0, declines = 0;
  for (const auto& s : b["stats"]) {
    if (s["impl"] == "picky") {
      picky_calls = s["calls"];
      declines = s["declined"]["odd input"];
    }
    if (s["impl"] == "fast") fast_calls = s["calls"];
  }
  EXPECT_EQ(picky_calls, 1u);
  EXPECT_EQ(fast_calls, 1u);
  EXPECT_EQ(declines, 1u);
  EXPECT_EQ(doc["ops"][0]["fast_paths_enabled"], false);
  EXPECT_EQ(doc["ops"][0]["stats"][0]["ran_because"]["preset 'grp.b' disables this op's fast paths"], 1);
}
