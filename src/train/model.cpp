// Forward and backward of the MoE-LoRA decoder (see model.h).
#include "train/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include <fmt/format.h>

#include "train/blas.h"

namespace leanstep::train::detail {

// ---------------------------------------------------------------- random numbers

double Rng::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  double u1 = 0.0;
  while (u1 <= 0.0) u1 = uniform();
  const double u2 = uniform();
  const double radius = std::sqrt(-2.0 * std::log(u1));
  const double angle = 2.0 * 3.14159265358979323846 * u2;
  spare_ = radius * std::sin(angle);
  has_spare_ = true;
  return radius * std::cos(angle);
}

uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  Rng r(seed ^ 0x243F6A8885A308D3ull);
  uint64_t h = r.next_u64();
  for (uint64_t v : {a, b, c}) {
    Rng s(h ^ (v * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull));
    h = s.next_u64();
  }
  return h;
}

// ---------------------------------------------------------------- weights

namespace {

template <class T>
std::vector<T> normal_vector(int64_t n, double mean, double stddev, uint64_t seed) {
  Rng rng(seed);
  std::vector<T> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<T>(mean + stddev * rng.normal());
  return v;
}

}  // namespace

template <class T>
BaseWeights<T> make_base_weights(const ModelConfig& m, uint64_t seed) {
  const int64_t h = m.hidden_size, d = m.head_dim, e = m.num_experts, f = m.moe_intermediate_size;
  const int64_t q_rows = (m.num_attention_heads + 2 * m.num_key_value_heads) * d;
  const double std = m.initializer_range;
  // Norm weights near 1 but not exactly, so a wrong gamma use cannot hide.
  const double norm_std = 0.1;
  BaseWeights<T> w;
  w.embed = normal_vector<T>(m.vocab_size * h, 0.0, std, mix_seed(seed, 1));
  w.final_norm = normal_vector<T>(h, 1.0, norm_std, mix_seed(seed, 2));
  w.head = normal_vector<T>(m.vocab_size * h, 0.0, std, mix_seed(seed, 3));
  w.layers.resize(static_cast<size_t>(m.num_hidden_layers));
  for (int64_t l = 0; l < m.num_hidden_layers; ++l) {
    auto& L = w.layers[static_cast<size_t>(l)];
    const uint64_t ls = static_cast<uint64_t>(l) + 100;
    L.input_norm = normal_vector<T>(h, 1.0, norm_std, mix_seed(seed, ls, 1));
    L.qkv = normal_vector<T>(q_rows * h, 0.0, std, mix_seed(seed, ls, 2));
    L.q_norm = normal_vector<T>(d, 1.0, norm_std, mix_seed(seed, ls, 3));
    L.k_norm = normal_vector<T>(d, 1.0, norm_std, mix_seed(seed, ls, 4));
    L.proj = normal_vector<T>(h * m.num_attention_heads * d, 0.0, std, mix_seed(seed, ls, 5));
    L.post_norm = normal_vector<T>(h, 1.0, norm_std, mix_seed(seed, ls, 6));
    L.router = normal_vector<T>(e * h, 0.0, std, mix_seed(seed, ls, 7));
    L.fc1 = normal_vector<T>(e * 2 * f * h, 0.0, std, mix_seed(seed, ls, 8));
    L.fc2 = normal_vector<T>(e * h * f, 0.0, std, mix_seed(seed, ls, 9));
  }
  return w;
}

AdapterSlots make_slots(const ModelConfig& m, const std::vector<TensorInfo>& tensors,
                        const std::vector<int64_t>& offsets) {
  if (offsets.size() != tensors.size())
    throw_arg_error("train", "offsets", fmt::format("must have one entry per adapter tensor ({} != {})",
                                                    offsets.size(), tensors.size()));
  AdapterSlots s;
  s.layers.resize(static_cast<size_t>(m.num_hidden_layers));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string& name = tensors[i].name;
    // decoder.layers.<l>.<module path>.lora_<A|B>.weight[<expert>]
    const size_t p = std::string("decoder.layers.").size();
    if (name.rfind("decoder.layers.", 0) != 0)
      throw_arg_error("train", "adapter tensors", fmt::format("'{}' is not a decoder layer tensor", name));
    const size_t dot = name.find('.', p);
    const int64_t l = std::stoll(name.substr(p, dot - p));
    auto& L = s.layers[static_cast<size_t>(l)];
    const bool is_a = name.find(".lora_A.weight") != std::string::npos;
    const int64_t off = offsets[i];
    if (name.find("linear_qkv") != std::string::npos) {
      (is_a ? L.qkv_a : L.qkv_b) = off;
    } else if (name.find("linear_proj") != std::string::npos) {
      (is_a ? L.proj_a : L.proj_b) = off;
    } else {
      const bool fc1 = name.find("linear_fc1") != std::string::npos;
      auto& vec = fc1 ? (is_a ? L.fc1_a : L.fc1_b) : (is_a ? L.fc2_a : L.fc2_b);
      // ".weight<expert>": any registration order of the experts is fine.
      const size_t w = name.rfind(".weight");
      const std::string idx = name.substr(w + 7);
      const int64_t ex = idx.empty() ? -1 : std::stoll(idx);
      if (ex < 0 || ex >= m.num_experts)
        throw_arg_error("train", "adapter tensors", fmt::format("expert tensor '{}' has no valid expert index", name));
      if (vec.empty()) vec.assign(static_cast<size_t>(m.num_experts), -1);
      vec[static_cast<size_t>(ex)] = off;
    }
  }
  return s;
}

void init_adapters(const std::vector<TensorInfo>& tensors, const std::vector<int64_t>& offsets, uint64_t seed,
                   float* flat, double b_std) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    float* p = flat + offsets[i];
    Rng rng(mix_seed(seed, 7777, fnv1a(t.name.data(), t.name.size())));
    const bool is_a = t.name.find(".lora_A.weight") != std::string::npos;
    const int64_t n = t.numel();
    if (is_a) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(t.shape[1]));
      for (int64_t j = 0; j < n; ++j) p[j] = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
    } else {
      for (int64_t j = 0; j < n; ++j) p[j] = b_std > 0 ? static_cast<float>(b_std * rng.normal()) : 0.0f;
    }
  }
}

// ---------------------------------------------------------------- model

template <class T>
Model<T>::Model(const ModelConfig& model, const LoraConfig& lora, const BaseWeights<T>* base, AdapterSlots slots,
                Kernels<T> kernels)
    : cfg_(model), lora_(lora), base_(base), slots_(std::move(slots)), kernels_(std::move(kernels)) {
  caches_.resize(static_cast<size_t>(cfg_.num_hidden_layers));
}

template <class T>
typename Model<T>::Lora Model<T>::lora_of(int64_t a, int64_t b) const {
  Lora l;
  if (a < 0) return l;
  l.a = params_ + a;
  l.b = params_ + b;
  if (grads_) {
    l.da = grads_ + a;
    l.db = grads_ + b;
  }
  l.rank = lora_.rank;
  l.scale = static_cast<T>(lora_.scale());
  return l;
}

namespace {

template <class T>
void resize(std::vector<T>& v, int64_t n) {
  v.resize(static_cast<size_t>(n));
}

// y[n, out] = x W^T (+ s (x A^T) B^T); mid[n, r] kept for the backward.
template <class T, class L>
void linear_forward(int64_t n, int64_t in, int64_t out, const T* x, const T* w, const L& lora, T* mid, T* y) {
  gemm(false, true, n, out, in, T(1), x, in, w, in, T(0), y, out);
  if (!lora.on()) return;
  const int64_t r = lora.rank;
  gemm(false, true, n, r, in, T(1), x, in, lora.a, in, T(0), mid, r);
  gemm(false, true, n, out, r, lora.scale, mid, r, lora.b, r, T(1), y, out);
}

// dx = dy W (+ s (dy B) A); accumulates dB += s dy^T mid, dA += s (dy B)^T x.
template <class T, class L>
void linear_backward(int64_t n, int64_t in, int64_t out, const T* x, const T* w, const L& lora, const T* mid,
                     const T* dy, T* dx, std::vector<T>& tmp) {
  gemm(false, false, n, in, out, T(1), dy, out, w, in, T(0), dx, in);
  if (!lora.on()) return;
  const int64_t r = lora.rank;
  resize(tmp, n * r);
  gemm(true, false, out, r, n, lora.scale, dy, out, mid, r, T(1), lora.db, r);
  gemm(false, false, n, r, out, lora.scale, dy, out, lora.b, r, T(0), tmp.data(), r);
  gemm(true, false, r, in, n, T(1), tmp.data(), r, x, in, T(1), lora.da, in);
  gemm(false, false, n, in, r, T(1), tmp.data(), r, lora.a, in, T(1), dx, in);
}

template <class T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

}  // namespace

template <class T>
void Model<T>::rope_tables(int64_t seq) {
  if (rope_seq_ == seq) return;
  const int64_t half = cfg_.head_dim / 2;
  cos_.assign(static_cast<size_t>(seq * half), T(0));
  sin_.assign(static_cast<size_t>(seq * half), T(0));
  for (int64_t p = 0; p < seq; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq =
          std::pow(cfg_.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(cfg_.head_dim));
      const double angle = static_cast<double>(p) * inv_freq;
      cos_[static_cast<size_t>(p * half + i)] = static_cast<T>(std::cos(angle));
      sin_[static_cast<size_t>(p * half + i)] = static_cast<T>(std::sin(angle));
    }
  rope_seq_ = seq;
}

template <class T>
double Model<T>::forward_backward(const int32_t* tokens, int64_t batch, int64_t seq, const T* params, T* grads,
                                  double dloss_scale) {
  const int64_t h = cfg_.hidden_size, vocab = cfg_.vocab_size;
  batch_ = batch;
  seq_ = seq;
  ntok_ = batch * seq;
  params_ = params;
  grads_ = grads;
  rope_tables(seq);
  const int64_t n = ntok_;

  // Embedding (frozen) and targets.
  std::vector<T> x(static_cast<size_t>(n * h));
  std::vector<int32_t> targets(static_cast<size_t>(n));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < seq; ++s) {
      const int32_t tok = tokens[b * (seq + 1) + s];
      const int32_t next = tokens[b * (seq + 1) + s + 1];
      if (tok < 0 || tok >= vocab || next < 0 || next >= vocab)
        throw_arg_error("train", "tokens", fmt::format("must be in [0, {}) (got {})", vocab,
                                                        (tok < 0 || tok >= vocab) ? tok : next));
      std::memcpy(&x[static_cast<size_t>((b * seq + s) * h)], &base_->embed[static_cast<size_t>(tok * h)],
                  sizeof(T) * static_cast<size_t>(h));
      targets[static_cast<size_t>(b * seq + s)] = next;
    }

  std::vector<T> next(static_cast<size_t>(n * h));
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    layer_forward(l, caches_[static_cast<size_t>(l)], x.data(), next.data());
    x.swap(next);
  }

  // Final norm, head, cross-entropy.
  std::vector<T> hf(static_cast<size_t>(n * h)), rstd_f(static_cast<size_t>(n));
  kernels_.rmsnorm_forward(x.data(), base_->final_norm.data(), n, h, cfg_.rms_norm_eps, hf.data(), rstd_f.data());
  std::vector<T> logits(static_cast<size_t>(n * vocab));
  gemm(false, true, n, vocab, h, T(1), hf.data(), h, base_->head.data(), h, T(0), logits.data(), vocab);
  double loss = 0.0;
  const T dscale = static_cast<T>(dloss_scale / static_cast<double>(n));
  for (int64_t t = 0; t < n; ++t) {
    T* row = &logits[static_cast<size_t>(t * vocab)];
    const T mx = *std::max_element(row, row + vocab);
    T sum = 0;
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(row[j] - mx);
    const T lse = mx + std::log(sum);
    const int32_t y = targets[static_cast<size_t>(t)];
    loss += static_cast<double>(lse - row[y]);
    if (grads) {  // dlogits = (softmax - onehot) * dscale, in place
      for (int64_t j = 0; j < vocab; ++j) row[j] = std::exp(row[j] - lse) * dscale;
      row[y] -= dscale;
    }
  }
  loss /= static_cast<double>(n);
  if (!grads) return loss;

  // Backward: head (frozen) -> final norm -> layers in reverse.
  std::vector<T> dhf(static_cast<size_t>(n * h));
  gemm(false, false, n, h, vocab, T(1), logits.data(), vocab, base_->head.data(), h, T(0), dhf.data(), h);
  std::vector<T> dx(static_cast<size_t>(n * h));
  kernels_.rmsnorm_backward(dhf.data(), x.data(), rstd_f.data(), base_->final_norm.data(), n, h, dx.data());
  for (int64_t l = cfg_.num_hidden_layers - 1; l >= 0; --l) layer_backward(l, caches_[static_cast<size_t>(l)], dx.data());
  return loss;
}

template <class T>
typename Model<T>::Dims Model<T>::dims() const {
  const int64_t d = cfg_.head_dim, nq = cfg_.num_attention_heads, nkv = cfg_.num_key_value_heads;
  return {ntok_, cfg_.hidden_size, d, nq, nkv, cfg_.num_experts, cfg_.num_experts_per_tok,
          cfg_.moe_intermediate_size, lora_.rank, nq * d, nkv * d, nq * d + 2 * nkv * d, d / 2};
}

template <class T>
void Model<T>::layer_forward(int64_t l, LayerCache& c, const T* x_in, T* x_out) {
  attention_forward(l, c, x_in);  // -> c.x_mid (residual included)
  moe_forward(l, c, x_out);
}

// The attention block: input RMSNorm, QKV (LoRA), per-head q/k norms, RoPE,
// causal softmax attention (GQA), the output projection (LoRA) and the residual.
template <class T>
void Model<T>::attention_forward(int64_t l, LayerCache& c, const T* x_in) {
  const auto& W = base_->layers[static_cast<size_t>(l)];
  const auto& S = slots_.layers[static_cast<size_t>(l)];
  [[maybe_unused]] const auto [n, h, d, nq, nkv, e, k, f, r, qdim, kvdim, qkv_dim, half] = dims();
  [[maybe_unused]] const double eps = cfg_.rms_norm_eps;
  c.x_in.assign(x_in, x_in + n * h);
  resize(c.h1, n * h);
  resize(c.rstd1, n);
  kernels_.rmsnorm_forward(x_in, W.input_norm.data(), n, h, eps, c.h1.data(), c.rstd1.data());
  resize(c.qkv, n * qkv_dim);
  resize(c.qkv_mid, n * r);
  linear_forward(n, h, qkv_dim, c.h1.data(), W.qkv.data(), lora_of(S.qkv_a, S.qkv_b), c.qkv_mid.data(), c.qkv.data());
  resize(c.q_raw, n * qdim);
  resize(c.k_raw, n * kvdim);
  resize(c.v, n * kvdim);
  for (int64_t t = 0; t < n; ++t) {
    const T* row = &c.qkv[static_cast<size_t>(t * qkv_dim)];
    std::copy(row, row + qdim, &c.q_raw[static_cast<size_t>(t * qdim)]);
    std::copy(row + qdim, row + qdim + kvdim, &c.k_raw[static_cast<size_t>(t * kvdim)]);
    std::copy(row + qdim + kvdim, row + qkv_dim, &c.v[static_cast<size_t>(t * kvdim)]);
  }
  resize(c.q_nrm, n * qdim);
  resize(c.k_nrm, n * kvdim);
  resize(c.rstd_q, n * nq);
  resize(c.rstd_k, n * nkv);
  kernels_.rmsnorm_forward(c.q_raw.data(), W.q_norm.data(), n * nq, d, eps, c.q_nrm.data(), c.rstd_q.data());
  kernels_.rmsnorm_forward(c.k_raw.data(), W.k_norm.data(), n * nkv, d, eps, c.k_nrm.data(), c.rstd_k.data());
  // RoPE (rotate-half convention, as HF Qwen3), position = index in the sequence.
  resize(c.q, n * qdim);
  resize(c.k, n * kvdim);
  auto rope = [&](const T* src, T* dst, int64_t heads) {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = t % seq_;
      const T* cs = &cos_[static_cast<size_t>(pos * half)];
      const T* sn = &sin_[static_cast<size_t>(pos * half)];
      for (int64_t hd = 0; hd < heads; ++hd) {
        const T* a = src + (t * heads + hd) * d;
        T* o = dst + (t * heads + hd) * d;
        for (int64_t i = 0; i < half; ++i) {
          o[i] = a[i] * cs[i] - a[i + half] * sn[i];
          o[i + half] = a[i + half] * cs[i] + a[i] * sn[i];
        }
      }
    }
  };
  rope(c.q_nrm.data(), c.q.data(), nq);
  rope(c.k_nrm.data(), c.k.data(), nkv);
  // Causal softmax attention per (sequence, query head); GQA: head hd reads kv head hd / group.
  const int64_t sq = seq_, group = nq / nkv;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(d)));
  resize(c.attn_p, batch_ * nq * sq * sq);
  resize(c.o, n * qdim);
  for (int64_t b = 0; b < batch_; ++b)
    for (int64_t hd = 0; hd < nq; ++hd) {
      const T* Q = &c.q[static_cast<size_t>(b * sq * qdim + hd * d)];
      const T* K = &c.k[static_cast<size_t>(b * sq * kvdim + (hd / group) * d)];
      const T* V = &c.v[static_cast<size_t>(b * sq * kvdim + (hd / group) * d)];
      T* P = &c.attn_p[static_cast<size_t>((b * nq + hd) * sq * sq)];
      gemm(false, true, sq, sq, d, scale, Q, qdim, K, kvdim, T(0), P, sq);
      for (int64_t i = 0; i < sq; ++i) {
        T* row = P + i * sq;
        T mx = row[0];
        for (int64_t j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
        T sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += (row[j] = std::exp(row[j] - mx));
        const T inv = T(1) / sum;
        for (int64_t j = 0; j <= i; ++j) row[j] *= inv;
        for (int64_t j = i + 1; j < sq; ++j) row[j] = 0;
      }
      gemm(false, false, sq, d, sq, T(1), P, sq, V, kvdim, T(0), &c.o[static_cast<size_t>(b * sq * qdim + hd * d)],
           qdim);
    }
  resize(c.proj_mid, n * r);
  resize(c.x_mid, n * h);
  linear_forward(n, qdim, h, c.o.data(), W.proj.data(), lora_of(S.proj_a, S.proj_b), c.proj_mid.data(),
                 c.x_mid.data());
  for (int64_t i = 0; i < n * h; ++i) c.x_mid[static_cast<size_t>(i)] += x_in[i];
}

// The MoE block: post-attention RMSNorm, the router (kernels_.route), permute,
// the experts' SwiGLU MLPs (LoRA on fc1/fc2), unpermute and the residual.
template <class T>
void Model<T>::moe_forward(int64_t l, LayerCache& c, T* x_out) {
  const auto& W = base_->layers[static_cast<size_t>(l)];
  const auto& S = slots_.layers[static_cast<size_t>(l)];
  [[maybe_unused]] const auto [n, h, d, nq, nkv, e, k, f, r, qdim, kvdim, qkv_dim, half] = dims();
  [[maybe_unused]] const double eps = cfg_.rms_norm_eps;
  resize(c.h2, n * h);
  resize(c.rstd2, n);
  kernels_.rmsnorm_forward(c.x_mid.data(), W.post_norm.data(), n, h, eps, c.h2.data(), c.rstd2.data());
  resize(c.logits, n * e);
  gemm(false, true, n, e, h, T(1), c.h2.data(), h, W.router.data(), h, T(0), c.logits.data(), e);
  // Router (the kernels' route: moe::route in the fp32 trainer).
  c.routing_map.assign(static_cast<size_t>(n * e), 0);
  c.probs_dense.assign(static_cast<size_t>(n * e), T(0));
  kernels_.route(c.logits.data(), n, e, k, cfg_.norm_topk_prob, c.routing_map.data(), c.probs_dense.data());
  const int64_t nout = n * k;
  resize(c.permuted, nout * h);
  resize(c.permuted_probs, nout);
  resize(c.sorted, nout);
  kernels_.permute(c.h2.data(), n, h, c.routing_map.data(), c.probs_dense.data(), e, nout, c.permuted.data(),
                   c.permuted_probs.data(), c.sorted.data());
  c.expert_begin.assign(static_cast<size_t>(e + 1), 0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t ex = 0; ex < e; ++ex) c.expert_begin[static_cast<size_t>(ex + 1)] += c.routing_map[static_cast<size_t>(t * e + ex)];
  for (int64_t ex = 0; ex < e; ++ex) c.expert_begin[static_cast<size_t>(ex + 1)] += c.expert_begin[static_cast<size_t>(ex)];
  resize(c.gu, nout * 2 * f);
  resize(c.act, nout * f);
  resize(c.fc1_mid, nout * r);
  resize(c.fc2_mid, nout * r);
  resize(c.ye, nout * h);
  for (int64_t ex = 0; ex < e; ++ex) {
    const int64_t b0 = c.expert_begin[static_cast<size_t>(ex)], ne = c.expert_begin[static_cast<size_t>(ex + 1)] - b0;
    if (ne == 0) continue;
    const bool has1 = !S.fc1_a.empty(), has2 = !S.fc2_a.empty();
    linear_forward(ne, h, 2 * f, &c.permuted[static_cast<size_t>(b0 * h)], &W.fc1[static_cast<size_t>(ex * 2 * f * h)],
                   has1 ? lora_of(S.fc1_a[static_cast<size_t>(ex)], S.fc1_b[static_cast<size_t>(ex)]) : Lora{},
                   &c.fc1_mid[static_cast<size_t>(b0 * r)], &c.gu[static_cast<size_t>(b0 * 2 * f)]);
    for (int64_t i = b0; i < b0 + ne; ++i) {  // SwiGLU: silu(gate) * up
      const T* g = &c.gu[static_cast<size_t>(i * 2 * f)];
      T* a = &c.act[static_cast<size_t>(i * f)];
      for (int64_t j = 0; j < f; ++j) a[j] = g[j] * sigmoid(g[j]) * g[f + j];
    }
    linear_forward(ne, f, h, &c.act[static_cast<size_t>(b0 * f)], &W.fc2[static_cast<size_t>(ex * h * f)],
                   has2 ? lora_of(S.fc2_a[static_cast<size_t>(ex)], S.fc2_b[static_cast<size_t>(ex)]) : Lora{},
                   &c.fc2_mid[static_cast<size_t>(b0 * r)], &c.ye[static_cast<size_t>(b0 * h)]);
  }
  kernels_.unpermute(c.ye.data(), c.sorted.data(), c.permuted_probs.data(), nout, h, n, x_out);
  for (int64_t i = 0; i < n * h; ++i) x_out[i] += c.x_mid[static_cast<size_t>(i)];
}

template <class T>
void Model<T>::layer_backward(int64_t l, LayerCache& c, T* dx) {
  moe_backward(l, c, dx);        // dx: d(x_out) -> d(x_mid)
  attention_backward(l, c, dx);  // dx: d(x_mid) -> d(x_in)
}

// Backward of moe_forward: dx is d(x_out) in, d(x_mid) out (the residual
// passes it through unchanged, the norm's gradient is added).
template <class T>
void Model<T>::moe_backward(int64_t l, LayerCache& c, T* dx) {
  const auto& W = base_->layers[static_cast<size_t>(l)];
  const auto& S = slots_.layers[static_cast<size_t>(l)];
  [[maybe_unused]] const auto [n, h, d, nq, nkv, e, k, f, r, qdim, kvdim, qkv_dim, half] = dims();
  const int64_t nout = n * k;
  std::vector<T> tmp;
  std::vector<T> dye(static_cast<size_t>(nout * h)), dprobs(static_cast<size_t>(nout));
  kernels_.unpermute_backward(dx, c.ye.data(), c.sorted.data(), c.permuted_probs.data(), nout, h, n, dye.data(),
                              dprobs.data());
  std::vector<T> dact(static_cast<size_t>(nout * f)), dgu(static_cast<size_t>(nout * 2 * f)),
      dperm(static_cast<size_t>(nout * h));
  for (int64_t ex = 0; ex < e; ++ex) {
    const int64_t b0 = c.expert_begin[static_cast<size_t>(ex)], ne = c.expert_begin[static_cast<size_t>(ex + 1)] - b0;
    if (ne == 0) continue;
    const bool has1 = !S.fc1_a.empty(), has2 = !S.fc2_a.empty();
    linear_backward(ne, f, h, &c.act[static_cast<size_t>(b0 * f)], &W.fc2[static_cast<size_t>(ex * h * f)],
                    has2 ? lora_of(S.fc2_a[static_cast<size_t>(ex)], S.fc2_b[static_cast<size_t>(ex)]) : Lora{},
                    &c.fc2_mid[static_cast<size_t>(b0 * r)], &dye[static_cast<size_t>(b0 * h)],
                    &dact[static_cast<size_t>(b0 * f)], tmp);
    for (int64_t i = b0; i < b0 + ne; ++i) {
      const T* g = &c.gu[static_cast<size_t>(i * 2 * f)];
      const T* da = &dact[static_cast<size_t>(i * f)];
      T* dg = &dgu[static_cast<size_t>(i * 2 * f)];
      for (int64_t j = 0; j < f; ++j) {
        const T sg = sigmoid(g[j]);
        const T silu = g[j] * sg;
        dg[j] = da[j] * g[f + j] * sg * (T(1) + g[j] * (T(1) - sg));
        dg[f + j] = da[j] * silu;
      }
    }
    linear_backward(ne, h, 2 * f, &c.permuted[static_cast<size_t>(b0 * h)], &W.fc1[static_cast<size_t>(ex * 2 * f * h)],
                    has1 ? lora_of(S.fc1_a[static_cast<size_t>(ex)], S.fc1_b[static_cast<size_t>(ex)]) : Lora{},
                    &c.fc1_mid[static_cast<size_t>(b0 * r)], &dgu[static_cast<size_t>(b0 * 2 * f)],
                    &dperm[static_cast<size_t>(b0 * h)], tmp);
  }
  // Backward of permute: sum each token's slots (unpermute without probs).
  std::vector<T> dh2(static_cast<size_t>(n * h));
  kernels_.permute_backward(dperm.data(), c.sorted.data(), nout, h, n, dh2.data());
  // Router: scatter the slot gradients to [n, e], then through softmax (/ top-k renormalisation).
  std::vector<T> dlogits(static_cast<size_t>(n * e), T(0));
  {
    std::vector<T> dpd(static_cast<size_t>(n * e), T(0));
    for (int64_t ex = 0; ex < e; ++ex)
      for (int64_t i = c.expert_begin[static_cast<size_t>(ex)]; i < c.expert_begin[static_cast<size_t>(ex + 1)]; ++i)
        dpd[static_cast<size_t>(c.sorted[static_cast<size_t>(i)] * e + ex)] = dprobs[static_cast<size_t>(i)];
    for (int64_t t = 0; t < n; ++t) {
      const T* dp = &dpd[static_cast<size_t>(t * e)];
      T* dl = &dlogits[static_cast<size_t>(t * e)];
      const uint8_t* map = &c.routing_map[static_cast<size_t>(t * e)];
      if (cfg_.norm_topk_prob) {  // w = softmax over the chosen logits
        const T* w = &c.probs_dense[static_cast<size_t>(t * e)];
        T dot = 0;
        for (int64_t j = 0; j < e; ++j)
          if (map[j]) dot += w[j] * dp[j];
        for (int64_t j = 0; j < e; ++j) dl[j] = map[j] ? w[j] * (dp[j] - dot) : T(0);
      } else {  // w = softmax over all experts, gathered at the chosen ones (recomputed here)
        const T* lg = &c.logits[static_cast<size_t>(t * e)];
        std::vector<T> full(static_cast<size_t>(e));
        const T mx = *std::max_element(lg, lg + e);
        T sum = 0;
        for (int64_t j = 0; j < e; ++j) sum += (full[static_cast<size_t>(j)] = std::exp(lg[j] - mx));
        for (int64_t j = 0; j < e; ++j) full[static_cast<size_t>(j)] /= sum;
        const T* p = full.data();
        T dot = 0;
        for (int64_t j = 0; j < e; ++j) dot += p[j] * dp[j];
        for (int64_t j = 0; j < e; ++j) dl[j] = p[j] * (dp[j] - dot);
      }
    }
  }
  gemm(false, false, n, h, e, T(1), dlogits.data(), e, W.router.data(), h, T(1), dh2.data(), h);
  std::vector<T> dnorm(static_cast<size_t>(n * h));
  kernels_.rmsnorm_backward(dh2.data(), c.x_mid.data(), c.rstd2.data(), W.post_norm.data(), n, h, dnorm.data());
  for (int64_t i = 0; i < n * h; ++i) dx[i] += dnorm[static_cast<size_t>(i)];  // dx is now d(x_mid)
}

// Backward of attention_forward: dx is d(x_mid) in, d(x_in) out.
template <class T>
void Model<T>::attention_backward(int64_t l, LayerCache& c, T* dx) {
  const auto& W = base_->layers[static_cast<size_t>(l)];
  const auto& S = slots_.layers[static_cast<size_t>(l)];
  [[maybe_unused]] const auto [n, h, d, nq, nkv, e, k, f, r, qdim, kvdim, qkv_dim, half] = dims();
  std::vector<T> tmp;
  std::vector<T> dnorm(static_cast<size_t>(n * h));
  std::vector<T> d_o(static_cast<size_t>(n * qdim));
  linear_backward(n, qdim, h, c.o.data(), W.proj.data(), lora_of(S.proj_a, S.proj_b), c.proj_mid.data(), dx,
                  d_o.data(), tmp);
  std::vector<T> dq(static_cast<size_t>(n * qdim), T(0)), dk(static_cast<size_t>(n * kvdim), T(0)),
      dv(static_cast<size_t>(n * kvdim), T(0));
  const int64_t sq = seq_, group = nq / nkv;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(d)));
  std::vector<T> dp(static_cast<size_t>(sq * sq));
  for (int64_t b = 0; b < batch_; ++b)
    for (int64_t hd = 0; hd < nq; ++hd) {
      const size_t qoff = static_cast<size_t>(b * sq * qdim + hd * d);
      const size_t kvoff = static_cast<size_t>(b * sq * kvdim + (hd / group) * d);
      const T* P = &c.attn_p[static_cast<size_t>((b * nq + hd) * sq * sq)];
      const T* dO = &d_o[qoff];
      gemm(false, true, sq, sq, d, T(1), dO, qdim, &c.v[kvoff], kvdim, T(0), dp.data(), sq);
      gemm(true, false, sq, d, sq, T(1), P, sq, dO, qdim, T(1), &dv[kvoff], kvdim);
      for (int64_t i = 0; i < sq; ++i) {  // softmax backward (masked entries have P = 0)
        T* row = &dp[static_cast<size_t>(i * sq)];
        const T* prow = P + i * sq;
        T dot = 0;
        for (int64_t j = 0; j <= i; ++j) dot += prow[j] * row[j];
        for (int64_t j = 0; j < sq; ++j) row[j] = j <= i ? prow[j] * (row[j] - dot) : T(0);
      }
      gemm(false, false, sq, d, sq, scale, dp.data(), sq, &c.k[kvoff], kvdim, T(0), &dq[qoff], qdim);
      gemm(true, false, sq, d, sq, scale, dp.data(), sq, &c.q[qoff], qdim, T(1), &dk[kvoff], kvdim);
    }
  // RoPE backward (the transpose rotation), in place.
  auto rope_back = [&](T* g, int64_t heads) {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = t % seq_;
      const T* cs = &cos_[static_cast<size_t>(pos * half)];
      const T* sn = &sin_[static_cast<size_t>(pos * half)];
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* a = g + (t * heads + hd) * d;
        for (int64_t i = 0; i < half; ++i) {
          const T lo = a[i], hi = a[i + half];
          a[i] = lo * cs[i] + hi * sn[i];
          a[i + half] = hi * cs[i] - lo * sn[i];
        }
      }
    }
  };
  rope_back(dq.data(), nq);
  rope_back(dk.data(), nkv);
  std::vector<T> dq_raw(static_cast<size_t>(n * qdim)), dk_raw(static_cast<size_t>(n * kvdim));
  kernels_.rmsnorm_backward(dq.data(), c.q_raw.data(), c.rstd_q.data(), W.q_norm.data(), n * nq, d, dq_raw.data());
  kernels_.rmsnorm_backward(dk.data(), c.k_raw.data(), c.rstd_k.data(), W.k_norm.data(), n * nkv, d, dk_raw.data());
  std::vector<T> dqkv(static_cast<size_t>(n * qkv_dim));
  for (int64_t t = 0; t < n; ++t) {
    T* row = &dqkv[static_cast<size_t>(t * qkv_dim)];
    std::copy_n(dq_raw.data() + t * qdim, qdim, row);
    std::copy_n(dk_raw.data() + t * kvdim, kvdim, row + qdim);
    std::copy_n(dv.data() + t * kvdim, kvdim, row + qdim + kvdim);
  }
  std::vector<T> dh1(static_cast<size_t>(n * h));
  linear_backward(n, h, qkv_dim, c.h1.data(), W.qkv.data(), lora_of(S.qkv_a, S.qkv_b), c.qkv_mid.data(),
                  dqkv.data(), dh1.data(), tmp);
  kernels_.rmsnorm_backward(dh1.data(), c.x_in.data(), c.rstd1.data(), W.input_norm.data(), n, h, dnorm.data());
  for (int64_t i = 0; i < n * h; ++i) dx[i] += dnorm[static_cast<size_t>(i)];  // dx is now d(x_in)
}

template struct BaseWeights<float>;
template struct BaseWeights<double>;
template BaseWeights<float> make_base_weights<float>(const ModelConfig&, uint64_t);
template BaseWeights<double> make_base_weights<double>(const ModelConfig&, uint64_t);
template class Model<float>;
template class Model<double>;

}  // namespace leanstep::train::detail
