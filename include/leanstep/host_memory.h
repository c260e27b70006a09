// Host memory that leanstep allocates for outputs: huge-page advice before the
// first write, and a pool of already-mapped blocks for fresh outputs.
//
// A fresh 100 MB output costs more in first-touch page faults than the kernel
// that writes it: glibc maps every block over 32 MiB anew and unmaps it when it
// is freed. The pool keeps such blocks once their output is gone, so a later
// output of a similar size finds its pages mapped (the caching idea of the
// frameworks' device allocators). Blocks are aligned to block_bytes (below:
// the huge page, 2 MiB on x86-64) and, when the kernel's transparent-huge-page
// mode allows it, advised as huge pages before their first write, which the
// kernels' threads then do on the pages they own. The library's ops never
// allocate outputs; the Python package and Buffer do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace leanstep {

// -- page sizes
//
// Read from the system, never assumed: the base page from sysconf(_SC_PAGESIZE)
// (4 KiB on x86-64; 4, 16 or 64 KiB on arm64) and the transparent huge page
// from /sys/kernel/mm/transparent_hugepage/hpage_pmd_size (2 MiB on x86-64 and
// 4 KiB-page arm64, 32 MiB with 16 KiB pages, 512 MiB with 64 KiB pages).
struct HostPageSizes {
  size_t page_bytes = 0;
  size_t huge_page_bytes = 0;  // 0: no transparent huge pages
  // The unit of large blocks: their threshold, alignment and size rounding, and
  // the first-touch split of their zero fill. The huge page when it is at most
  // kMaxBlockBytes, else 2 MiB (at least one page): a 512 MiB huge page would
  // make every pooled output a 512 MiB block.
  size_t block_bytes = 0;
};
inline constexpr size_t kMaxBlockBytes = size_t{32} << 20;
HostPageSizes host_page_sizes();
// For tests: behave as on a system with these sizes (page_bytes a power of two
// from 4 KiB to 1 MiB; huge_page_bytes 0 or a power-of-two multiple of it).
// (0, 0) reads the system's again. Free pool blocks are released; refused
// while any is taken. Not for use while other threads allocate.
void set_host_page_sizes_for_test(size_t page_bytes, size_t huge_page_bytes);

// -- huge pages

// Whether blocks of at least one huge page that leanstep allocates are advised
// as transparent huge pages (MADV_HUGEPAGE on their huge-page-aligned part)
// before their first write. On by default; LEANSTEP_HUGE_PAGES=0 (read once) or
// set_huge_pages(false) turns it off. Returns the previous setting.
bool set_huge_pages(bool enabled);

struct HugePageInfo {
  bool enabled = false;
  std::string thp_mode;       // "always", "madvise", "never", or "none" (no THP); read once
  size_t advised_bytes = 0;   // advised so far
  HostPageSizes sizes;
};
HugePageInfo huge_page_info();

// Advises the huge-page-aligned part of [p, p + bytes) when enabled, the block
// spans a huge page and THP is in "madvise" or "always" mode (advice only: a
// refusal changes nothing).
void advise_huge_pages(void* p, size_t bytes);

// -- the output pool

// A block of at least `bytes` (aligned to and rounded up to block_bytes), or nullptr
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

// Zeroed host memory, 64-byte aligned (from block_bytes: aligned to it and
// advised as huge pages, the zero fill on the worker threads, each first
// touching the pages of its own share). What Buffer uses. nullptr if out of
// memory; free with std::free.
void* host_alloc_zeroed(size_t bytes);

}  // namespace leanstep
