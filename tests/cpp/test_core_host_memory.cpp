// The output pool and huge-page advice (include/leanstep/host_memory.h):
// a block is handed out again only after it is given back; best fit within 2x
// of the request; the cap bounds what the pool holds; bad give-backs are
// errors; concurrent take/give-back keeps every block with one owner; Buffer's
// zeroed memory (threaded first touch) is zero; page and huge-page sizes come
// from the system, and 16 and 64 KiB pages (32 and 512 MiB huge pages) work
// when injected.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
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

// The pool's arithmetic below is written for 4 KiB pages and 2 MiB huge pages
// (x86-64, 4 KiB-page arm64): injected, so it holds on any system.
class HostPool : public ::testing::Test {
 protected:
  void SetUp() override {
    set_host_page_sizes_for_test(4096, 2 * kMiB);
    host_pool_configure(true, 64 * kMiB);
    host_pool_release_free();
  }
  void TearDown() override {
    host_pool_configure(false, 0);
    set_host_page_sizes_for_test(0, 0);
  }
};

TEST_F(HostPool, BlockIsReusedOnlyAfterItIsGivenBack) {
  void* a = host_pool_take(5 * kMiB);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % (2 * kMiB), 0u);
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
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{100}, 2 * kMiB, 5 * kMiB + 3, 33 * kMiB}) {
    Buffer b(DType::kUInt8, {static_cast<int64_t>(bytes)});
    const auto* p = b.data_as<unsigned char>();
    size_t nonzero = 0;
    for (size_t i = 0; i < bytes; ++i) nonzero += p[i] != 0;
    EXPECT_EQ(nonzero, 0u) << bytes;
    if (bytes >= host_page_sizes().block_bytes) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % host_page_sizes().block_bytes, 0u);
    }
  }
  // The advice below is counted with 2 MiB huge pages (a 512 MiB one would
  // advise nothing of a 4 MiB buffer), on the system's own base page.
  set_host_page_sizes_for_test(host_page_sizes().page_bytes, 2 * kMiB);
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
  set_host_page_sizes_for_test(0, 0);
}

TEST(HostMemory, PageSizesComeFromTheSystem) {
  const HostPageSizes s = host_page_sizes();
  EXPECT_EQ(s.page_bytes, static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  // make test-aarch64 runs this with 64 KiB pages emulated, and says so here:
  // the emulation itself is checked, not only agreement with it.
  if (const char* expect = std::getenv("LEANSTEP_EXPECT_PAGE_BYTES")) {
    EXPECT_EQ(s.page_bytes, std::stoull(expect));
  }
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
  size_t pmd = 0;
  if (f >> pmd) {
    EXPECT_EQ(s.huge_page_bytes, pmd);
  } else {
    EXPECT_EQ(s.huge_page_bytes, 0u);
    EXPECT_EQ(huge_page_info().thp_mode, "none");
  }
  EXPECT_GE(s.block_bytes, s.page_bytes);
  EXPECT_EQ(s.block_bytes % s.page_bytes, 0u);
}

// What an arm64 kernel with 16 or 64 KiB pages (or none with THP) would give:
// blocks stay small (2 MiB, not a 512 MiB huge page), aligned and rounded to
// the block size, whole pages; advice only where a block spans a huge page.
struct Sizes {
  size_t page, huge, block;
};
class InjectedPageSizes : public ::testing::TestWithParam<Sizes> {
 protected:
  void SetUp() override {
    set_host_page_sizes_for_test(GetParam().page, GetParam().huge);
    host_pool_configure(true, 256 * kMiB);
    host_pool_release_free();
  }
  void TearDown() override {
    host_pool_configure(false, 0);
    set_host_page_sizes_for_test(0, 0);
  }
};

TEST_P(InjectedPageSizes, BlocksFollowThePageSizes) {
  const Sizes want = GetParam();
  const HostPageSizes s = host_page_sizes();
  EXPECT_EQ(s.page_bytes, want.page);
  EXPECT_EQ(s.huge_page_bytes, want.huge);
  EXPECT_EQ(s.block_bytes, want.block);
  if (want.huge == 0) {
    EXPECT_EQ(huge_page_info().thp_mode, "none");
  }

  for (size_t bytes : {want.block - 1, want.block, 3 * want.block + 5}) {
    void* p = host_pool_take(bytes);
    ASSERT_NE(p, nullptr) << bytes;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % want.block, 0u) << bytes;
    std::memset(p, 7, bytes);
    host_pool_give_back(p);
  }
  // Rounded to whole blocks: (block - 1) and block share one block, 3 block + 5 takes 4.
  EXPECT_EQ(host_pool_info().cached_bytes, 5 * want.block);

  for (size_t bytes : {want.block - 1, want.block + 3}) {
    Buffer b(DType::kUInt8, {static_cast<int64_t>(bytes)});
    const auto* p = b.data_as<unsigned char>();
    if (bytes >= want.block) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % want.block, 0u);
    }
    size_t nonzero = 0;
    for (size_t i = 0; i < bytes; ++i) nonzero += p[i] != 0;
    EXPECT_EQ(nonzero, 0u) << bytes;
  }

  // A block smaller than a huge page is never advised (with 512 MiB huge
  // pages, that is every block here).
  const size_t advised = huge_page_info().advised_bytes;
  Buffer below(DType::kUInt8, {static_cast<int64_t>(want.block)});
  if (want.huge > want.block) {
    EXPECT_EQ(huge_page_info().advised_bytes, advised);
  }
}

INSTANTIATE_TEST_SUITE_P(HostMemory, InjectedPageSizes,
                         ::testing::Values(Sizes{4096, 2 * kMiB, 2 * kMiB},      // x86-64, arm64 4 KiB
                                           Sizes{16384, 32 * kMiB, 32 * kMiB},   // arm64 16 KiB pages
                                           Sizes{65536, 512 * kMiB, 2 * kMiB},   // arm64 64 KiB pages
                                           Sizes{65536, 0, 2 * kMiB},            // 64 KiB, no THP
                                           Sizes{4096, 0, 2 * kMiB}),
                         [](const auto& info) {
                           return "page" + std::to_string(info.param.page >> 10) + "k_huge" +
                                  std::to_string(info.param.huge >> 20) + "m";
                         });

TEST(HostMemory, BadInjectedSizesNameTheArgument) {
  auto message = [](size_t page, size_t huge) {
    try {
      set_host_page_sizes_for_test(page, huge);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(1000, 2 * kMiB).find("argument 'page_bytes' must be a power of two"), std::string::npos);
  EXPECT_NE(message(0, 2 * kMiB).find("argument 'page_bytes'"), std::string::npos);
  EXPECT_NE(message(65536, 4096).find("argument 'huge_page_bytes' must be 0 or a power of two"), std::string::npos);
  EXPECT_NE(message(4096, 3 * kMiB).find("(got 3145728; page_bytes is 4096)"), std::string::npos);
  EXPECT_EQ(host_page_sizes().page_bytes, static_cast<size_t>(sysconf(_SC_PAGESIZE)));  // unchanged

  // A taken block keeps the sizes it was made for: no change until it is back.
  host_pool_configure(true, 16 * kMiB);
  void* block = host_pool_take(3 * kMiB);
  ASSERT_NE(block, nullptr);
  EXPECT_NE(message(65536, 512 * kMiB).find("cannot change while pool blocks are taken (1 taken)"),
            std::string::npos);
  EXPECT_EQ(host_page_sizes().page_bytes, static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  host_pool_give_back(block);
  EXPECT_EQ(message(65536, 512 * kMiB), "no error");
  EXPECT_EQ(host_pool_info().cached_bytes, 0u);  // the free block of the old sizes is released
  set_host_page_sizes_for_test(0, 0);
  host_pool_configure(false, 0);
}

}  // namespace
}  // namespace leanstep
