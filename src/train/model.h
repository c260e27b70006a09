// The MoE-LoRA decoder's forward and backward, written once for a compute type
// T (float for training, double for the whole-model finite-difference check).
//
// Per layer: input RMSNorm -> linear_qkv (+LoRA) -> per-head q/k RMSNorm ->
// RoPE -> causal GQA softmax attention -> linear_proj (+LoRA) -> residual ->
// post-attention RMSNorm -> router (softmax, top-k, optional renormalisation)
// -> permute -> per expert linear_fc1 (+LoRA) -> SwiGLU -> linear_fc2 (+LoRA)
// -> unpermute (weighted by the routing probabilities) -> residual. Then the
// final RMSNorm, the output head and the mean token cross-entropy.
//
// Base weights, embeddings and every norm are frozen: the backward computes
// activation gradients and the adapters' gradients only. GEMMs go through BLAS;
// RMSNorm and permute/unpermute go through `Kernels`, which the fp32 trainer
// points at the dispatch layer.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "leanstep/train.h"

namespace leanstep::train::detail {

// ---------------------------------------------------------------- deterministic random numbers

// splitmix64 stream with Box-Muller normals: identical on every platform and
// standard library (std::normal_distribution is not).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next_u64() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal();

 private:
  uint64_t state_;
  bool has_spare_ = false;
  double spare_ = 0.0;
};

// 64-bit FNV-1a (continue a hash by passing the previous value).
uint64_t fnv1a(const void* data, size_t bytes, uint64_t hash = 0xCBF29CE484222325ull);

// Seed of an independent stream for (seed, a, b, c).
uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0);

// ---------------------------------------------------------------- weights

template <class T>
struct BaseWeights {
  struct Layer {
    std::vector<T> input_norm;   // [H]
    std::vector<T> qkv;          // [(nq + 2 nkv) D, H]: rows q heads, then k heads, then v heads
    std::vector<T> q_norm;       // [D]
    std::vector<T> k_norm;       // [D]
    std::vector<T> proj;         // [H, nq D]
    std::vector<T> post_norm;    // [H]
    std::vector<T> router;       // [E, H]
    std::vector<T> fc1;          // [E, 2F, H]: rows gate then up (Megatron's fused GLU)
    std::vector<T> fc2;          // [E, H, F]
  };
  std::vector<T> embed;       // [V, H]
  std::vector<Layer> layers;
  std::vector<T> final_norm;  // [H]
  std::vector<T> head;        // [V, H]
};

// Frozen base weights from the seed: drawn in float64 and rounded to T, so the
// float and double models hold the same values up to one rounding.
template <class T>
BaseWeights<T> make_base_weights(const ModelConfig& model, uint64_t seed);

// Element offsets of each adapter tensor in the flat parameter/gradient arrays
// (-1 when a module has no adapter).
struct AdapterSlots {
  struct Layer {
    int64_t qkv_a = -1, qkv_b = -1, proj_a = -1, proj_b = -1;
    std::vector<int64_t> fc1_a, fc1_b, fc2_a, fc2_b;  // per expert
  };
  std::vector<Layer> layers;
};
// `offsets[i]` is the offset of tensors[i] (names as adapter_tensors(), any order).
AdapterSlots make_slots(const ModelConfig& model, const std::vector<TensorInfo>& tensors,
                        const std::vector<int64_t>& offsets);

// LoRA init as PEFT: A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0; `b_std` > 0 draws B
// from N(0, b_std) instead (gradient checks need non-zero B).
// Each tensor's stream depends on its name only (not on the layout or order).
void init_adapters(const std::vector<TensorInfo>& tensors, const std::vector<int64_t>& offsets, uint64_t seed,
                   float* flat, double b_std = 0.0);

// ---------------------------------------------------------------- kernels

template <class T>
struct Kernels {
  // Softmax router over logits[n, e]: the top k experts per token (ties to the
  // lower index) into routing_map[n, e] (bool bytes), their probabilities into
  // probs[n, e] (0 elsewhere): the softmax over all experts, or renormalised
  // over the chosen k when `normalize`.
  std::function<void(const T* logits, int64_t n, int64_t e, int64_t k, bool normalize, uint8_t* routing_map,
                     T* probs)>
      route;
  // y = x * rstd * gamma per row of h; rstd[rows].
  std::function<void(const T* x, const T* gamma, int64_t rows, int64_t h, double eps, T* y, T* rstd)>
      rmsnorm_forward;
  // Frozen gamma: dx only (overwritten).
  std::function<void(const T* dy, const T* x, const T* rstd, const T* gamma, int64_t rows, int64_t h, T* dx)>
      rmsnorm_backward;
  // Expert-major, increasing-token permutation of tokens[ntok, h] by routing_map[ntok, e]
  // (bool bytes) with probs[ntok, e]; writes out[nout, h], out_probs[nout], sorted[nout].
  std::function<void(const T* tokens, int64_t ntok, int64_t h, const uint8_t* routing_map, const T* probs,
                     int64_t e, int64_t nout, T* out, T* out_probs, int64_t* sorted)>
      permute;
  // out[ntok, h] = sum over slots of permuted[i] * probs[i] (probs may be null: weight 1).
  std::function<void(const T* permuted, const int64_t* sorted, const T* probs, int64_t nout, int64_t h,
                     int64_t ntok, T* out)>
      unpermute;
  // Backward of permute w.r.t. tokens: dtokens[t] = sum of dpermuted rows of t's slots.
  std::function<void(const T* dpermuted, const int64_t* sorted, int64_t nout, int64_t h, int64_t ntok,
                     T* dtokens)>
      permute_backward;
  // Backward of unpermute with probs: dpermuted[i] = dout[sorted[i]] * probs[i],
  // dprobs[i] = dot(dout[sorted[i]], permuted[i]).
  std::function<void(const T* dout, const T* permuted, const int64_t* sorted, const T* probs, int64_t nout,
                     int64_t h, int64_t ntok, T* dpermuted, T* dprobs)>
      unpermute_backward;
};

// The fp32 trainer fills these from the library (ops:: through the dispatch
// layer, moe::route); the tests' float64 oracle brings straightforward ones
// (tests/cpp/train_reference_kernels.h).
// ---------------------------------------------------------------- model

template <class T>
class Model {
 public:
  Model(const ModelConfig& model, const LoraConfig& lora, const BaseWeights<T>* base, AdapterSlots slots,
        Kernels<T> kernels);

  // tokens: [batch, seq + 1] byte ids; inputs are [:, :seq], targets [:, 1:].
  // Returns the mean token cross-entropy. When `grads` is not null, runs the
  // backward and ADDS dloss_scale * d(loss)/d(adapter) into grads (flat layout).
  double forward_backward(const int32_t* tokens, int64_t batch, int64_t seq, const T* params, T* grads,
                          double dloss_scale);

  void set_kernels(Kernels<T> kernels) { kernels_ = std::move(kernels); }

 private:
  // Activations a layer's backward needs.
  struct LayerCache {
    std::vector<T> x_in, h1, rstd1, qkv_mid, qkv, q_raw, k_raw, v, rstd_q, rstd_k, q_nrm, k_nrm, q, k;
    std::vector<T> attn_p, o, proj_mid, x_mid, h2, rstd2, logits, probs_dense;
    std::vector<uint8_t> routing_map;
    std::vector<T> permuted, permuted_probs, fc1_mid, gu, act, fc2_mid, ye;
    std::vector<int64_t> sorted, expert_begin;  // expert_begin[E + 1]
  };
  // One adapter pair as pointers into the flat arrays (a == nullptr: no adapter).
  struct Lora {
    const T* a = nullptr;  // [r, in]
    const T* b = nullptr;  // [out, r]
    T* da = nullptr;
    T* db = nullptr;
    int64_t rank = 0;
    T scale = 0;
    bool on() const { return a != nullptr; }
  };
  // A layer is two blocks, each a named forward/backward pair (as llm.c):
  // attention (x_in -> c.x_mid) and MoE (c.x_mid -> x_out), residuals included.
  // The sizes every block uses: tokens, hidden, head dim, heads, kv heads,
  // experts, top-k, expert FFN, LoRA rank, q / kv / qkv widths, half head dim.
  struct Dims {
    int64_t n, h, d, nq, nkv, e, k, f, r, qdim, kvdim, qkv_dim, half;
  };
  Dims dims() const;
  void layer_forward(int64_t l, LayerCache& c, const T* x_in, T* x_out);
  void layer_backward(int64_t l, LayerCache& c, T* dx);  // dx: in d(out), out d(in)
  void attention_forward(int64_t l, LayerCache& c, const T* x_in);
  void moe_forward(int64_t l, LayerCache& c, T* x_out);
  void moe_backward(int64_t l, LayerCache& c, T* dx);        // d(x_out) -> d(x_mid)
  void attention_backward(int64_t l, LayerCache& c, T* dx);  // d(x_mid) -> d(x_in)
  Lora lora_of(int64_t a, int64_t b) const;
  void rope_tables(int64_t seq);

  ModelConfig cfg_;
  LoraConfig lora_;
  const BaseWeights<T>* base_;
  AdapterSlots slots_;
  Kernels<T> kernels_;

  // per call
  int64_t batch_ = 0, seq_ = 0, ntok_ = 0;
  const T* params_ = nullptr;
  T* grads_ = nullptr;
  std::vector<LayerCache> caches_;
  std::vector<T> cos_, sin_;
  int64_t rope_seq_ = -1;
};

}  // namespace leanstep::train::detail
