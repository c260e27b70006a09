// Host memory that leanstep allocates for outputs: huge-page advice before the
// first write, and a pool of already-mapped blocks for fresh outputs.
//
// A fresh 100 MB output costs more in first-touch page faults than the kernel
// that writes it: glibc maps every block over 32 MiB anew and unmaps it when it
// is freed. The pool keeps such blocks once their output is gone, so a later
// output of a similar size finds its pages mapped (the caching idea of the
// frameworks' device allocators). Blocks are 2 MiB-aligned and, when the
// kernel's transparent-huge-page mode allows it, advised as huge pages before
// their first write, which the kernels' threads then do on the pages they own.
// The library's ops never allocate outputs; the Python package and Buffer do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace leanstep {

inline constexpr size_t kHugePageBytes = size_t{1} << 21;  // 2 MiB (x86-64, arm64)

// -- huge pages

// Whether blocks of at least 2 MiB that leanstep allocates are advised as
// transparent huge pages (MADV_HUGEPAGE on their 2 MiB-aligned part) before
// their first write. On by default; LEANSTEP_HUGE_PAGES=0 (read once) or
// set_huge_pages(false) turns it off. Returns the previous setting.
bool set_huge_pages(bool enabled);

struct HugePageInfo {
  bool enabled = false;
  std::string thp_mode;       // "always", "madvise", "never", or "none" (no THP); read once
  size_t advised_bytes = 0;   // advised so far
};
HugePageInfo huge_page_info();

// Advises the 2 MiB-aligned part of [p, p + bytes) when enabled, the block is
// at least 2 MiB and THP is in "madvise" or "always" mode (advice only: a
// refusal changes nothing).
void advise_huge_pages(void* p, size_t bytes);

// -- the output pool

// A block of at least `bytes` (2 MiB-aligned, rounded up to 2 MiB), or nullptr
// when the pool is off or the block would take it over its cap (the caller
// then allocates as usual). Give it back with host_pool_give_back when the
// output that uses it is gone. Thread-safe.
void* host_pool_take(size_t bytes);
// Marks a block from host_pool_take free (freed at once if the pool is off).
void host_pool_give_back(void* block);

// Switches the pool and sets its cap (bytes it may hold, free and taken).
// Off by default in C++; the Python package turns it on. Lowering the cap or
// switching off releases free blocks, oldest first.
void host_pool_configure(bool enabled, size_t cap_bytes);
// Releases every free block; returns the bytes released.
size_t host_pool_release_free();

struct HostPoolInfo {
  bool enabled = false;
  size_t cap_bytes = 0;
  size_t cached_bytes = 0;  // held: free and taken
  size_t free_bytes = 0;
  int64_t blocks = 0;
  int64_t hits = 0;      // takes served by a free block
  int64_t misses = 0;    // takes that allocated a new block
  int64_t over_cap = 0;  // takes refused for the cap
};
HostPoolInfo host_pool_info();

// Zeroed host memory, 64-byte aligned (from 2 MiB: 2 MiB-aligned and advised
// as huge pages, the zero fill on the worker threads, each first touching the
// pages of its own share). What Buffer uses. nullptr if out of memory; free
// with std::free.
void* host_alloc_zeroed(size_t bytes);

}  // namespace leanstep
