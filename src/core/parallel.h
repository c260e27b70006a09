// Parallel loops with fixed chunking: chunk boundaries depend only on the
// problem size and a compile-time chunk size, never on the thread count, so a
// reduction that combines per-chunk partials in a fixed order is bitwise
// reproducible for any number of threads.
#pragma once

#include <cstdint>
#include <utility>

#include "leanstep/core.h"

namespace leanstep::detail {

// False in a process forked from one that loaded leanstep: there every
// parallel region runs on the calling thread (see leanstep::num_threads).
bool parallel_allowed();

inline int64_t num_chunks(int64_t n, int64_t chunk) { return n <= 0 ? 0 : (n + chunk - 1) / chunk; }

// Calls body(chunk_index, begin, end) for each chunk of [0, n). Counts one
// dispatch. `body` must not throw (validate arguments before the loop).
template <class Body>
void parallel_chunks(int64_t n, int64_t chunk, Body&& body) {
  count_dispatch();
  const int64_t chunks = num_chunks(n, chunk);
  if (chunks == 0) return;
  if (chunks == 1) {
    body(int64_t{0}, int64_t{0}, n);
    return;
  }
#pragma omp parallel for schedule(static) if (parallel_allowed())
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
    body(c, begin, end);
  }
}

// Calls body(i) for i in [0, count) in parallel (one dispatch). For work items
// that are independent (no reduction across items).
template <class Body>
void parallel_items(int64_t count, Body&& body) {
  count_dispatch();
  if (count <= 0) return;
  if (count == 1) {
    body(int64_t{0});
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) if (parallel_allowed())
  for (int64_t i = 0; i < count; ++i) body(i);
}

// Pairwise reduction of vals[0..n) in a fixed tree (depends on n only).
// Overwrites vals. Returns identity for n == 0.
template <class T, class Op>
T tree_reduce(T* vals, int64_t n, T identity, Op op) {
  if (n == 0) return identity;
  for (int64_t width = 1; width < n; width *= 2) {
    for (int64_t i = 0; i + width < n; i += 2 * width) vals[i] = op(vals[i], vals[i + width]);
  }
  return vals[0];
}

}  // namespace leanstep::detail
