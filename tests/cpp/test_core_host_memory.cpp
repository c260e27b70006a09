// The output pool and huge-page advice (include/leanstep/host_memory.h):
// a block is handed out again only after it is given back; best fit within 2x
// of the request; the cap bounds what the pool holds; bad give-backs are
// errors; concurrent take/give-back keeps every block with one owner; Buffer's
// zeroed memory (threaded first touch) is zero.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <cstdint>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "leanstep/buffer.h"
#include "leanstep/core.h"
#include "leanstep/host_memory.h"

namespace leanstep {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

class HostPool : public ::testing::Test {
 protected:
  void SetUp() override {
    host_pool_configure(true, 64 * kMiB);
    host_pool_release_free();
  }
  void TearDown() override { host_pool_configure(false, 0); }
};

TEST_F(HostPool, BlockIsReusedOnlyAfterItIsGivenBack) {
  void* a = host_pool_take(5 * kMiB);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % kHugePageBytes, 0u);
  std::memset(a, 1, 5 * kMiB);  // the whole request is usable
  void* b = host_pool_take(5 * kMiB);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a, b);
  const HostPoolInfo before = host_pool_info();
  host_pool_give_back(a);
  EXPECT_EQ(host_pool_info().free_bytes, 6 * kMiB);  // rounded up to 2 MiB
  void* c = host_pool_take(6 * kMiB);
  EXPECT_EQ(c, a);
  EXPECT_EQ(host_pool_info().hits, before.hits + 1);
  host_pool_give_back(b);
  host_pool_give_back(c);
}

TEST_F(HostPool, BestFitWithinTwiceTheRequest) {
  void* big = host_pool_take(20 * kMiB);
  void* small = host_pool_take(4 * kMiB);
  host_pool_give_back(big);
  host_pool_give_back(small);
  EXPECT_EQ(host_pool_take(3 * kMiB), small);   // the smallest that fits
  void* other = host_pool_take(3 * kMiB);       // 20 MiB is over 2x: a new block
  EXPECT_NE(other, big);
  EXPECT_EQ(host_pool_take(11 * kMiB), big);    // within 2x of 20 MiB
  host_pool_give_back(small);
  host_pool_give_back(other);
  host_pool_give_back(big);
}

TEST_F(HostPool, CapBoundsTheMemoryAndFreeBlocksGoFirst) {
  host_pool_configure(true, 8 * kMiB);
  void* a = host_pool_take(4 * kMiB);
  void* b = host_pool_take(4 * kMiB);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const int64_t refused = host_pool_info().over_cap;
  EXPECT_EQ(host_pool_take(2 * kMiB), nullptr);  // both taken: over the cap
  EXPECT_EQ(host_pool_info().over_cap, refused + 1);
  host_pool_give_back(a);
  void* c = host_pool_take(2 * kMiB);  // 4 MiB block is within 2x: reused
  EXPECT_EQ(c, a);
  host_pool_give_back(c);
  void* d = host_pool_take(8 * kMiB);  // frees a's block, still b is taken: refused
  EXPECT_EQ(d, nullptr);
  host_pool_give_back(b);
  d = host_pool_take(8 * kMiB);  // both free blocks released, then room
  ASSERT_NE(d, nullptr);
  EXPECT_LE(host_pool_info().cached_bytes, 8 * kMiB);
  host_pool_give_back(d);
  EXPECT_EQ(host_pool_release_free(), 8 * kMiB);
  EXPECT_EQ(host_pool_info().cached_bytes, 0u);
}

TEST_F(HostPool, OffMeansNoBlocksAndGivenBackBlocksAreFreed) {
  void* a = host_pool_take(2 * kMiB);
  host_pool_configure(false, 64 * kMiB);
  EXPECT_EQ(host_pool_take(2 * kMiB), nullptr);
  host_pool_give_back(a);
  EXPECT_EQ(host_pool_info().cached_bytes, 0u);
  EXPECT_EQ(host_pool_take(0), nullptr);
}

TEST_F(HostPool, BadGiveBacksNameTheArgument) {
  int local = 0;
  try {
    host_pool_give_back(&local);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'block' is not a pool block"), std::string::npos);
  }
  void* a = host_pool_take(2 * kMiB);
  host_pool_give_back(a);
  EXPECT_THROW(host_pool_give_back(a), Error);  // twice
}

TEST_F(HostPool, ConcurrentTakesNeverShareABlock) {
  std::atomic<bool> shared{false};
  std::vector<std::thread> threads;
  std::mutex mutex;
  std::set<void*> live;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        void* p = host_pool_take((2 + (i + t) % 3) * kMiB);
        if (!p) continue;
        {
          std::lock_guard<std::mutex> lock(mutex);
          if (!live.insert(p).second) shared = true;
        }
        static_cast<unsigned char*>(p)[0] = static_cast<unsigned char>(t);
        {
          std::lock_guard<std::mutex> lock(mutex);
          live.erase(p);
        }
        host_pool_give_back(p);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_FALSE(shared);
  EXPECT_LE(host_pool_info().cached_bytes, 64 * kMiB);
}

TEST(HostMemory, ZeroedMemoryIsZeroAndHugePageInfoIsConsistent) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{100}, 2 * kMiB, 5 * kMiB + 3}) {
    Buffer b(DType::kUInt8, {static_cast<int64_t>(bytes)});
    const auto* p = b.data_as<unsigned char>();
    size_t nonzero = 0;
    for (size_t i = 0; i < bytes; ++i) nonzero += p[i] != 0;
    EXPECT_EQ(nonzero, 0u) << bytes;
    if (bytes >= 2 * kMiB) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kHugePageBytes, 0u);
    }
  }
  const bool previous = set_huge_pages(false);
  const size_t advised = huge_page_info().advised_bytes;
  Buffer off(DType::kFloat32, {1 << 20});
  EXPECT_EQ(huge_page_info().advised_bytes, advised);
  set_huge_pages(true);
  Buffer on(DType::kFloat32, {1 << 20});
  const HugePageInfo info = huge_page_info();
  if (info.thp_mode == "madvise" || info.thp_mode == "always") {
    EXPECT_GE(info.advised_bytes, advised + 4 * kMiB);
  }
  set_huge_pages(previous);
}

}  // namespace
}  // namespace leanstep
