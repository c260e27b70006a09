// Installs, uninstalls and preset switches racing with calls from other
// threads. Run under ThreadSanitizer by `make test-tsan` (label "tsan"); in the
// other builds it still checks that no call ever sees a half-installed state
// and that no call goes uncounted.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <thread>
#include <vector>

#include "leanstep/dispatch.h"
#include "test_util.h"

namespace ld = leanstep::dispatch;

namespace {

// Each implementation adds its own tag, so the result says who ran. A guard
// leaves its tag in a thread-local; the implementation it admitted checks the
// tag, so a guard of one implementation paired with the entry point of another
// (a torn, half-installed candidate) is detected.
constexpr int64_t kTagA = 1000, kTagB = 2000, kTagC = 3000;
thread_local int64_t last_guard_tag = 0;
std::atomic<int64_t> torn_candidates{0};

int64_t reference(int64_t x) { return x; }
int64_t impl_a(int64_t x) { return x + kTagA; }
int64_t impl_b(int64_t x) {
  if (last_guard_tag != kTagB) torn_candidates.fetch_add(1);
  return x + kTagB;
}
int64_t impl_c(int64_t x) {
  if (last_guard_tag != kTagC) torn_candidates.fetch_add(1);
  return x + kTagC;
}
const char* guard_b(int64_t x) {
  last_guard_tag = kTagB;
  return x % 3 == 0 ? "multiple of 3" : nullptr;
}
const char* guard_c(int64_t x) {
  last_guard_tag = kTagC;
  return x % 2 ? "odd" : nullptr;
}

// True when `result` is a legal outcome of a call with input x.
bool legal(int64_t x, int64_t result) {
  const int64_t tag = result - x;
  if (tag == 0 || tag == kTagA) return true;
  if (tag == kTagB) return x % 3 != 0;
  if (tag == kTagC) return x % 2 == 0;
  return false;
}

}  // namespace

TEST(DispatchThreads, InstallsAndPresetSwitchesRaceWithCalls) {
  leanstep::set_num_threads(1);  // libgomp is not TSan-instrumented; these ops do not use it anyway
  ld::Op<int64_t(int64_t)> op("stress.op", "reference", &reference);
  ld::Op<int64_t(int64_t)> other("stress.other", "reference", &reference);
  ld::Registry reg;
  reg.add(op);
  reg.add(other);
  const std::string sig = op.signature();
  const ld::ImplDescriptor desc_c =
      ld::make_descriptor<int64_t(int64_t)>("stress.op", "c", sig, &impl_c, &guard_c, "even inputs");

  // The callers run until the mutator has done all its rounds AND each caller
  // has made a minimum of calls, so the two really overlap on any machine.
  constexpr int kCallers = 3;
  constexpr int64_t kMinCallsPerThread = 5000;
  // At least kRounds rounds, then more until every implementation has run at least once
  // (a short-lived one can be missed by chance on a loaded machine), never past kMaxRounds:
  // an implementation that cannot run at all still fails the check below.
  constexpr int kRounds = 100;
  constexpr int kMaxRounds = 200000;
  std::atomic<bool> mutator_done{false};
  std::atomic<bool> stop_reader{false};
  std::atomic<int64_t> illegal{0}, total_calls{0};
  std::atomic<int64_t> seen[4] = {0, 0, 0, 0};  // reference, a, b, c
  auto every_implementation_ran = [&] {
    return std::all_of(std::begin(seen), std::end(seen), [](const auto& s) { return s.load() > 0; });
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kCallers; ++t) {
    threads.emplace_back([&, t] {
      int64_t i = 0;
      for (; i < kMinCallsPerThread || !mutator_done.load(); ++i) {
        const int64_t x = i * kCallers + t;
        const int64_t result = op(x);
        if (!legal(x, result)) illegal.fetch_add(1);
        else seen[(result - x) / 1000].fetch_add(1, std::memory_order_relaxed);
        const int64_t tag = other(x) - x;
        if (tag != 0 && tag != kTagA) illegal.fetch_add(1);
      }
      total_calls.fetch_add(i);
    });
  }
  // The mutator: every kind of change, over and over.
  threads.emplace_back([&] {
    for (int round = 0; round < kRounds || (round < kMaxRounds && !every_implementation_ran()); ++round) {
      op.install("a", &impl_a);
      op.install("b", &impl_b, &guard_b, "not a multiple of 3");
      reg.install(desc_c);
      other.install("a", &impl_a);
      std::this_thread::yield();
      EXPECT_FALSE(op.install("b", &impl_b, &guard_b, "not a multiple of 3").changed);
      reg.set_preset(round % 3 == 0 ? "baseline" : round % 3 == 1 ? "stress.op" : "all");
      op.uninstall("b");
      std::this_thread::yield();
      reg.uninstall("stress.op", "c");
      op.install("b");
      op.uninstall("a");
      std::this_thread::yield();
      op.uninstall("b");
      other.uninstall("a");
    }
    mutator_done.store(true);
  });
  // A reader of the reports (what `leanstep paths` does) at the same time.
  threads.emplace_back([&] {
    while (!stop_reader.load()) {
      const auto reports = reg.report();
      EXPECT_EQ(reports.size(), 2u);
      (void)ld::paths_json(reg);
    }
  });
  for (int t = 0; t <= kCallers; ++t) threads[t].join();
  stop_reader.store(true);
  threads.back().join();

  EXPECT_EQ(illegal.load(), 0);
  EXPECT_EQ(torn_candidates.load(), 0);
  // Every call was counted exactly once, by the implementation that ran it.
  uint64_t counted = 0;
  for (const auto& s : op.report().stats) counted += s.calls;
  EXPECT_EQ(counted, static_cast<uint64_t>(total_calls.load()));
  counted = 0;
  for (const auto& s : other.report().stats) counted += s.calls;
  EXPECT_EQ(counted, static_cast<uint64_t>(total_calls.load()));
  // The calls really were spread over every implementation (the race happened).
  for (int k = 0; k < 4; ++k) EXPECT_GT(seen[k].load(), 0) << "implementation " << k << " never ran";
}
