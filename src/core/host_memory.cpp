// Huge-page advice and the output pool (include/leanstep/host_memory.h).
#include "leanstep/host_memory.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "leanstep/core.h"
#include "core/parallel.h"

namespace leanstep {
namespace {

bool power_of_two(size_t n) { return n != 0 && (n & (n - 1)) == 0; }

HostPageSizes derive_sizes(size_t page, size_t huge) {
  HostPageSizes s;
  s.page_bytes = page;
  s.huge_page_bytes = huge;
  s.block_bytes = (huge != 0 && huge <= kMaxBlockBytes) ? huge : std::max(page, size_t{2} << 20);
  return s;
}

HostPageSizes system_sizes() {
  size_t page = 4096;
#if defined(__linux__)
  const long sc = sysconf(_SC_PAGESIZE);
  if (sc > 0 && power_of_two(static_cast<size_t>(sc))) page = static_cast<size_t>(sc);
#endif
  size_t huge = 0;
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
  unsigned long long value = 0;
  if (f >> value && power_of_two(static_cast<size_t>(value)) && value >= page) huge = static_cast<size_t>(value);
  return derive_sizes(page, huge);
}

struct PageSizes {
  std::mutex mutex;
  HostPageSizes sizes = system_sizes();
};

PageSizes& page_sizes() {
  static auto* state = new PageSizes();
  return *state;
}

HostPageSizes current_sizes() {
  PageSizes& p = page_sizes();
  std::lock_guard<std::mutex> lock(p.mutex);
  return p.sizes;
}

struct HugePages {
  std::mutex mutex;
  bool enabled = true;
  bool mode_read = false;
  std::string mode = "none";
  size_t advised = 0;

  HugePages() {
    const char* env = std::getenv("LEANSTEP_HUGE_PAGES");
    enabled = !(env && std::string(env) == "0");
  }
  const std::string& thp_mode() {  // under mutex
    if (!mode_read) {
      mode_read = true;
      std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
      std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      const size_t open = text.find('['), close = text.find(']');
      if (open != std::string::npos && close != std::string::npos && close > open)
        mode = text.substr(open + 1, close - open - 1);
    }
    return mode;
  }
};

HugePages& huge() {
  static auto* state = new HugePages();  // never destroyed: blocks may outlive static teardown
  return *state;
}

struct Block {
  void* data;
  size_t bytes;
  bool taken;
  uint64_t last_used;
};

struct Pool {
  std::mutex mutex;
  bool enabled = false;
  size_t cap = 0;
  std::vector<Block> blocks;
  uint64_t clock = 0;
  int64_t hits = 0, misses = 0, over_cap = 0;

  size_t held() const {
    size_t n = 0;
    for (const Block& b : blocks) n += b.bytes;
    return n;
  }
  // Frees free blocks, oldest first, until at most `limit` bytes are held.
  size_t release_until(size_t limit) {
    std::vector<size_t> order;
    for (size_t i = 0; i < blocks.size(); ++i)
      if (!blocks[i].taken) order.push_back(i);
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return blocks[a].last_used < blocks[b].last_used; });
    size_t held_now = held(), released = 0;
    std::vector<bool> drop(blocks.size(), false);
    for (size_t i : order) {
      if (held_now <= limit) break;
      drop[i] = true;
      held_now -= blocks[i].bytes;
      released += blocks[i].bytes;
    }
    std::vector<Block> kept;
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (drop[i]) {
        std::free(blocks[i].data);
      } else {
        kept.push_back(blocks[i]);
      }
    }
    blocks.swap(kept);
    return released;
  }
};

Pool& pool() {
  static auto* state = new Pool();  // never destroyed: outputs may be freed after static teardown
  return *state;
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

bool set_huge_pages(bool enabled) {
  HugePages& h = huge();
  std::lock_guard<std::mutex> lock(h.mutex);
  const bool previous = h.enabled;
  h.enabled = enabled;
  return previous;
}

HugePageInfo huge_page_info() {
  const HostPageSizes sizes = current_sizes();
  HugePages& h = huge();
  std::lock_guard<std::mutex> lock(h.mutex);
  return HugePageInfo{h.enabled, sizes.huge_page_bytes ? h.thp_mode() : std::string("none"), h.advised, sizes};
}

HostPageSizes host_page_sizes() { return current_sizes(); }

void set_host_page_sizes_for_test(size_t page_bytes, size_t huge_page_bytes) {
  constexpr const char* kWhere = "set_host_page_sizes_for_test";
  HostPageSizes next;
  if (page_bytes == 0 && huge_page_bytes == 0) {
    next = system_sizes();
  } else {
    if (!power_of_two(page_bytes) || page_bytes < 4096 || page_bytes > (size_t{1} << 20))
      throw_arg_error(kWhere, "page_bytes",
                      "must be a power of two from 4096 to 1048576 (got " + std::to_string(page_bytes) + ")");
    if (huge_page_bytes != 0 && (!power_of_two(huge_page_bytes) || huge_page_bytes < page_bytes))
      throw_arg_error(kWhere, "huge_page_bytes",
                      "must be 0 or a power of two of at least page_bytes (got " + std::to_string(huge_page_bytes) +
                          "; page_bytes is " + std::to_string(page_bytes) + ")");
    next = derive_sizes(page_bytes, huge_page_bytes);
  }
  // Under the pool's lock (then the sizes' lock, the order host_pool_take
  // uses): no block of the old sizes may stay in the pool.
  Pool& pool_state = pool();
  std::lock_guard<std::mutex> pool_lock(pool_state.mutex);
  int64_t taken = 0;
  for (const Block& b : pool_state.blocks) taken += b.taken;
  if (taken != 0)
    throw_arg_error(kWhere, "page_bytes",
                    "cannot change while pool blocks are taken (" + std::to_string(taken) + " taken)");
  pool_state.release_until(0);
  PageSizes& sizes = page_sizes();
  std::lock_guard<std::mutex> lock(sizes.mutex);
  sizes.sizes = next;
}

void advise_huge_pages(void* p, size_t bytes) {
  const size_t huge_bytes = current_sizes().huge_page_bytes;
  HugePages& h = huge();
  {
    std::lock_guard<std::mutex> lock(h.mutex);
    const std::string& mode = h.thp_mode();
    if (!h.enabled || huge_bytes == 0 || bytes < huge_bytes || (mode != "madvise" && mode != "always")) return;
  }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  const uintptr_t begin = round_up(address, huge_bytes);
  const uintptr_t end = (address + bytes) / huge_bytes * huge_bytes;
  if (end <= begin) return;
  if (madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0) {
    std::lock_guard<std::mutex> lock(h.mutex);
    h.advised += end - begin;
  }
#else
  (void)p;
#endif
}

void* host_pool_take(size_t bytes) {
  if (bytes == 0) return nullptr;
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  if (!p.enabled) return nullptr;
  const size_t block_bytes = current_sizes().block_bytes;  // under the pool's lock: see set_host_page_sizes_for_test
  if (bytes > SIZE_MAX - block_bytes) return nullptr;       // would wrap; the caller's allocation reports it
  const size_t need = round_up(bytes, block_bytes);
  ++p.clock;
  Block* best = nullptr;
  for (Block& b : p.blocks) {
    // Best fit, and never more than twice the request: a small output does
    // not pin a large block.
    if (!b.taken && b.bytes >= need && b.bytes <= 2 * need && (!best || b.bytes < best->bytes))
      best = &b;
  }
  if (best) {
    ++p.hits;
    best->taken = true;
    best->last_used = p.clock;
    return best->data;
  }
  if (p.held() + need > p.cap && need <= p.cap) p.release_until(p.cap - need);
  if (p.held() + need > p.cap) {
    ++p.over_cap;
    return nullptr;
  }
  void* data = std::aligned_alloc(block_bytes, need);
  if (!data) {
    ++p.over_cap;  // the caller's own allocation reports running out of memory
    return nullptr;
  }
  advise_huge_pages(data, need);
  p.blocks.push_back(Block{data, need, true, p.clock});
  ++p.misses;
  return data;
}

void host_pool_give_back(void* block) {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  for (size_t i = 0; i < p.blocks.size(); ++i) {
    if (p.blocks[i].data != block) continue;
    if (!p.blocks[i].taken) throw Error("host_pool_give_back: argument 'block' was not taken");
    p.blocks[i].taken = false;
    if (!p.enabled || p.held() > p.cap) p.release_until(p.enabled ? p.cap : 0);
    return;
  }
  throw Error("host_pool_give_back: argument 'block' is not a pool block");
}

void host_pool_configure(bool enabled, size_t cap_bytes) {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.enabled = enabled;
  p.cap = cap_bytes;
  p.release_until(enabled ? cap_bytes : 0);
}

size_t host_pool_release_free() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  return p.release_until(0);
}

HostPoolInfo host_pool_info() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  HostPoolInfo info;
  info.enabled = p.enabled;
  info.cap_bytes = p.cap;
  info.cached_bytes = p.held();
  for (const Block& b : p.blocks)
    if (!b.taken) info.free_bytes += b.bytes;
  info.blocks = static_cast<int64_t>(p.blocks.size());
  info.hits = p.hits;
  info.misses = p.misses;
  info.over_cap = p.over_cap;
  return info;
}

void* host_alloc_zeroed(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t block_bytes = current_sizes().block_bytes;
  if (bytes > SIZE_MAX - block_bytes) return nullptr;  // out of memory, not a wrapped size
  const bool large = bytes >= block_bytes;
  const size_t alignment = large ? block_bytes : 64;
  void* p = std::aligned_alloc(alignment, round_up(bytes, alignment));
  if (!p) return nullptr;
  if (!large) {
    std::memset(p, 0, bytes);
    return p;
  }
  advise_huge_pages(p, round_up(bytes, alignment));
  // Each worker zeroes (and so first touches) whole blocks of its own, in the
  // static split the kernels' loops use. Not counted as a dispatch: allocation
  // is not an op.
  auto* base = static_cast<unsigned char*>(p);
  const int64_t pieces = static_cast<int64_t>((bytes + block_bytes - 1) / block_bytes);
#pragma omp parallel for schedule(static) if (detail::parallel_allowed())
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const size_t begin = static_cast<size_t>(piece) * block_bytes;
    std::memset(base + begin, 0, std::min(block_bytes, bytes - begin));
  }
  return p;
}

}  // namespace leanstep
