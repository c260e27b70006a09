// The fused MoE paths: a counting sort instead of a comparison sort.
//
// permute: one parallel pass counts, per chunk of tokens, the routed pairs of
// every expert; prefix sums over (expert, chunk) give each chunk its first
// slot in every expert's segment, so a second parallel pass, over tokens again,
// writes sorted_indices in exactly the stable-sort order and copies each token
// row (read once) to its slots. The declared row count is checked after the
// counting pass, before anything is written.
//
// unpermute: a counting sort of sorted_indices by token gives every token its
// slots in increasing slot order (the order the reference scatter-adds them);
// tokens are then reduced in parallel, each into an fp32 row, cast once.
// Chunk boundaries depend only on the sizes, so results never depend on threads.
#include <fmt/format.h>

#include <algorithm>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <vector>

#include "core/parallel.h"
#include "moe/kernels.h"
#include "moe/common.h"

namespace leanstep::moe::detail {

using leanstep::detail::num_chunks;
using leanstep::detail::parallel_chunks;

namespace {

constexpr int64_t kTokenChunk = 256;  // tokens per counting chunk
constexpr int64_t kRowChunk = 16;     // output rows per reduce chunk
constexpr int64_t kBlock = 512;       // columns reduced at a time (2 KiB of fp32 accumulators)
// Outputs at least this large are written with non-temporal stores: they do not fit in
// the cache anyway, and streaming skips reading the destination lines first.
constexpr int64_t kStreamBytes = int64_t{16} << 20;

// Copies one row; `stream`: with non-temporal stores where the target supports them.
inline void copy_row(char* dst, const char* src, size_t bytes, bool stream) {
#if defined(__SSE2__)
  if (stream) {
    // Align the destination to 16 bytes, stream the middle, copy the tail.
    const size_t head = std::min(bytes, static_cast<size_t>((16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16));
    std::memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= bytes; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, bytes - i);
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, bytes);
}

// Prefetches the block after [src, src + bytes) of the same source row (hardware
// prefetchers stop at page boundaries; the k rows of a token live in different pages).
inline void prefetch_ahead(const char* src, size_t bytes, const char* row_end) {
#if defined(__SSE2__)
  const char* next = src + bytes;
  const char* stop = std::min(next + bytes, row_end);
  for (const char* q = next; q < stop; q += 64) _mm_prefetch(q, _MM_HINT_T0);
#endif
}

// Prefetches [begin, begin + bytes).
inline void prefetch_span(const char* begin, size_t bytes) {
#if defined(__SSE2__)
  for (size_t off = 0; off < bytes; off += 64) _mm_prefetch(begin + off, _MM_HINT_T0);
#endif
}

// Orders the streamed stores before the parallel region ends.
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace

void permute_fused(const PermuteProblem& p) {
  const int64_t T = p.T, E = p.E;
  const int64_t chunks = num_chunks(T, kTokenChunk);
  // routed_counts[c * E + e]: routed pairs of expert e among the tokens of chunk c.
  std::vector<int64_t> routed_counts(static_cast<size_t>(chunks * E), 0);
  parallel_chunks(T, kTokenChunk, [&](int64_t c, int64_t begin, int64_t end) {
    int64_t* counts = routed_counts.data() + c * E;
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* row = p.map + t * E;
      for (int64_t e = 0; e < E; ++e) counts[e] += row[e] != 0;
    }
  });

  // Expert totals and each (chunk, expert)'s first slot. With drop_and_pad, an expert's
  // unrouted tokens follow its routed ones (the stable descending sort of its 0/1 row).
  std::vector<int64_t> expert_routed(static_cast<size_t>(E), 0);
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t e = 0; e < E; ++e) expert_routed[static_cast<size_t>(e)] += routed_counts[static_cast<size_t>(c * E + e)];
  int64_t routed_total = 0;
  for (int64_t e = 0; e < E; ++e) routed_total += expert_routed[static_cast<size_t>(e)];
  if (!p.drop_and_pad && routed_total > p.N)
    throw_arg_error("permute", "num_out_tokens",
                    fmt::format("must be >= the number of routed (token, expert) pairs (got {}, routed {})",
                                p.N, routed_total));

  // routed_base / unrouted_base: slot (relative to the expert's segment start) of the chunk's
  // first routed / unrouted token for that expert; segment_start: the expert's first slot.
  std::vector<int64_t> routed_base(static_cast<size_t>(chunks * E)), unrouted_base(static_cast<size_t>(chunks * E));
  std::vector<int64_t> segment_start(static_cast<size_t>(E));
  {
    int64_t start = 0;
    for (int64_t e = 0; e < E; ++e) {
      segment_start[static_cast<size_t>(e)] = p.drop_and_pad ? e * p.capacity : start;
      start += expert_routed[static_cast<size_t>(e)];
      int64_t routed_before = 0, unrouted_before = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const size_t ce = static_cast<size_t>(c * E + e);
        routed_base[ce] = routed_before;
        unrouted_base[ce] = expert_routed[static_cast<size_t>(e)] + unrouted_before;
        const int64_t chunk_tokens = std::min(T, (c + 1) * kTokenChunk) - c * kTokenChunk;
        routed_before += routed_counts[ce];
        unrouted_before += chunk_tokens - routed_counts[ce];
      }
    }
  }

  // One pass over the tokens: each token row is read once and written to each of its
  // slots (token-major, so the k reads of a row hit the cache), with its index and prob.
  const int64_t limit = p.drop_and_pad ? p.capacity : p.N;  // slots an expert may use
  const bool stream = p.N * static_cast<int64_t>(p.row_bytes) >= kStreamBytes;
  parallel_chunks(T, kTokenChunk, [&](int64_t c, int64_t begin, int64_t end) {
    std::vector<int64_t> next_routed(routed_base.begin() + c * E, routed_base.begin() + (c + 1) * E);
    std::vector<int64_t> next_unrouted(unrouted_base.begin() + c * E, unrouted_base.begin() + (c + 1) * E);
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* row = p.map + t * E;
      const char* src = p.tokens + static_cast<size_t>(t) * p.row_bytes;
      for (int64_t e = 0; e < E; ++e) {
        int64_t rel;
        if (row[e]) rel = next_routed[static_cast<size_t>(e)]++;
        else if (p.drop_and_pad) rel = next_unrouted[static_cast<size_t>(e)]++;
        else continue;
        if (rel >= limit) continue;  // dropped beyond capacity (drop_and_pad only)
        const int64_t slot = segment_start[static_cast<size_t>(e)] + rel;
        p.indices.set(slot, t);
        copy_row(p.permuted + static_cast<size_t>(slot) * p.row_bytes, src, p.row_bytes, stream);
        if (p.permuted_probs)
          std::memcpy(p.permuted_probs + static_cast<size_t>(slot) * p.prob_bytes,
                      p.probs + static_cast<size_t>(t * E + e) * p.prob_bytes, p.prob_bytes);
      }
    }
    if (stream) stream_fence();
  });
  // Plain path with more declared rows than routed pairs: the tail has no source.
  if (!p.drop_and_pad && routed_total < p.N) {
    const int64_t tail = p.N - routed_total;
    for (int64_t i = routed_total; i < p.N; ++i) p.indices.set(i, -1);
    std::memset(p.permuted + static_cast<size_t>(routed_total) * p.row_bytes, 0, static_cast<size_t>(tail) * p.row_bytes);
    if (p.permuted_probs)
      std::memset(p.permuted_probs + static_cast<size_t>(routed_total) * p.prob_bytes, 0,
                  static_cast<size_t>(tail) * p.prob_bytes);
  }
}

void unpermute_fused(const UnpermuteProblem& p) {
  const int64_t T = p.T, H = p.H, N = p.N;
  // Counting sort of the slots by token: token_slots[token_start[t] .. token_start[t+1]) are
  // t's slots in increasing slot order.
  std::vector<int64_t> token_start(static_cast<size_t>(T + 1), 0);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = p.indices.get(i);
    if (t >= 0) ++token_start[static_cast<size_t>(t + 1)];
  }
  for (int64_t t = 0; t < T; ++t) token_start[static_cast<size_t>(t + 1)] += token_start[static_cast<size_t>(t)];
  std::vector<int64_t> token_slots(static_cast<size_t>(token_start[static_cast<size_t>(T)]));
  {
    std::vector<int64_t> next(token_start.begin(), token_start.end() - 1);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = p.indices.get(i);
      if (t >= 0) token_slots[static_cast<size_t>(next[static_cast<size_t>(t)]++)] = i;
    }
  }

  // Per token, the row is reduced in blocks of kBlock columns; within a block the token's
  // slots are added in increasing slot order (the reference's order for every element),
  // so its k source rows are read side by side, which keeps several memory streams going.
  const size_t elem = dtype_size(p.dtype);
  const bool stream = T * H * static_cast<int64_t>(elem) >= kStreamBytes;
  // fp32 and bf16 rows: each block's sums in registers (reduce_scaled), written once.
  const bool in_registers = p.dtype == DType::kFloat32 || p.dtype == DType::kBFloat16;
  parallel_chunks(T, kRowChunk, [&](int64_t, int64_t begin, int64_t end) {
    alignas(64) float acc[kBlock];
    alignas(64) char cast[kBlock * 4];
    std::vector<const void*> sources;  // the block's source rows, one per slot
    std::vector<float> probs;          // their probs (1 without slot probs)
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = token_start[static_cast<size_t>(t)], last = token_start[static_cast<size_t>(t + 1)];
      char* out_row = p.out + static_cast<size_t>(t * H) * elem;
      // Start the next token's rows (their first block) while this one is reduced.
      if (t + 1 < end)
        for (int64_t s = last; s < token_start[static_cast<size_t>(t + 2)]; ++s)
          prefetch_span(p.permuted + static_cast<size_t>(token_slots[static_cast<size_t>(s)] * H) * elem,
                        static_cast<size_t>(std::min(kBlock, H)) * elem);
      if (in_registers) {
        sources.resize(static_cast<size_t>(last - first));
        probs.resize(static_cast<size_t>(last - first));
        for (int64_t s = first; s < last; ++s) {
          const int64_t i = token_slots[static_cast<size_t>(s)];
          probs[static_cast<size_t>(s - first)] = p.slot_probs ? p.slot_probs[i] : 1.0f;
        }
      }
      for (int64_t h0 = 0; h0 < H; h0 += kBlock) {
        const int64_t width = std::min(kBlock, H - h0);
        char* out_block = out_row + static_cast<size_t>(h0) * elem;
        if (in_registers) {
          for (int64_t s = first; s < last; ++s) {
            const int64_t i = token_slots[static_cast<size_t>(s)];
            const char* src = p.permuted + static_cast<size_t>(i * H + h0) * elem;
            prefetch_ahead(src, static_cast<size_t>(width) * elem, p.permuted + static_cast<size_t>((i + 1) * H) * elem);
            sources[static_cast<size_t>(s - first)] = src;
          }
          reduce_scaled(sources.data(), probs.data(), last - first, p.dtype, stream ? cast : out_block, width);
          if (stream) copy_row(out_block, cast, static_cast<size_t>(width) * elem, true);
          continue;
        }
        // +0, as the reference's accumulators: the first slot adds to it in registers.
        if (first == last) std::fill(acc, acc + width, 0.0f);
        for (int64_t s = first; s < last; ++s) {
          const int64_t i = token_slots[static_cast<size_t>(s)];
          const char* src = p.permuted + static_cast<size_t>(i * H + h0) * elem;
          prefetch_ahead(src, static_cast<size_t>(width) * elem, p.permuted + static_cast<size_t>((i + 1) * H) * elem);
          const float prob = p.slot_probs ? p.slot_probs[i] : 1.0f;
          accumulate_scaled(acc, src, p.dtype, prob, width, s == first);
        }
        if (stream) {
          convert_from_f32(acc, cast, p.dtype, width);
          copy_row(out_block, cast, static_cast<size_t>(width) * elem, true);
        } else {
          convert_from_f32(acc, out_block, p.dtype, width);  // straight into the cache-resident output
        }
      }
    }
    if (stream) stream_fence();
  });
}

void unpermute_backward_fused(const UnpermuteBackwardProblem& p) {
  parallel_chunks(p.N, kRowChunk, [&](int64_t, int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(2 * p.H));
    for (int64_t i = begin; i < end; ++i) unpermute_backward_row(p, i, scratch.data());
  });
}

}  // namespace leanstep::moe::detail
