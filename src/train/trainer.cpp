// One rank of the data-parallel MoE-LoRA fine-tuning step.
//
// Step: microbatches (forward + backward into the flat fp32 grad buffer) ->
// bucketed SUM all-reduce of the buffer -> on this rank's shard of every
// bucket (the distributed-optimizer split): [unscale +] non-finite check +
// L2 norm reduced over ranks -> skip on found_inf -> clip -> AdamW -> the
// updated shards gathered to every rank.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "leanstep/buffer.h"
#include "leanstep/comm.h"
#include "leanstep/dispatch.h"
#include "leanstep/grad.h"
#include "leanstep/layout.h"
#include "leanstep/lora.h"
#include "leanstep/ops.h"
#include "leanstep/train.h"
#include "train/internal.h"
#include "train/model.h"

namespace leanstep::train {

namespace {

using detail::Kernels;

// The fp32 model's kernels: every RMSNorm and permute/unpermute goes through
// the dispatch layer's entry points, so the active preset picks the path.
Kernels<float> dispatched_kernels() {
  Kernels<float> k;
  k.route = [](const float* logits, int64_t n, int64_t e, int64_t topk, bool normalize, uint8_t* map, float* probs) {
    moe::RoutingConfig rc;
    rc.topk = topk;
    rc.score_function = moe::ScoreFunction::kSoftmax;
    rc.pre_softmax = true;  // the softmax over every expert, gathered at the top k
    rc.normalize = normalize;
    std::vector<int64_t> per_expert(static_cast<size_t>(e));
    moe::route(Tensor(const_cast<float*>(logits), DType::kFloat32, {n, e}), rc, nullptr,
               Tensor(map, DType::kBool, {n, e}), Tensor(probs, DType::kFloat32, {n, e}),
               Tensor(per_expert.data(), DType::kInt64, {e}));
  };
  k.rmsnorm_forward = [](const float* x, const float* g, int64_t rows, int64_t h, double eps, float* y, float* rstd) {
    rmsnorm::Options opt;
    opt.eps = eps;
    rmsnorm::CallContext ctx;
    ctx.weight_requires_grad = false;  // LoRA: every norm is frozen
    ops::rmsnorm_forward(Tensor(const_cast<float*>(x), DType::kFloat32, {rows, h}),
                         Tensor(const_cast<float*>(g), DType::kFloat32, {h}), Tensor(y, DType::kFloat32, {rows, h}),
                         Tensor(rstd, DType::kFloat32, {rows}), opt, ctx);
  };
  k.rmsnorm_backward = [](const float* dy, const float* x, const float* rstd, const float* g, int64_t rows, int64_t h,
                          float* dx) {
    rmsnorm::Options opt;
    rmsnorm::CallContext ctx;
    ctx.weight_requires_grad = false;
    ops::rmsnorm_backward(Tensor(const_cast<float*>(dy), DType::kFloat32, {rows, h}),
                          Tensor(const_cast<float*>(x), DType::kFloat32, {rows, h}),
                          Tensor(const_cast<float*>(rstd), DType::kFloat32, {rows}),
                          Tensor(const_cast<float*>(g), DType::kFloat32, {h}), Tensor(dx, DType::kFloat32, {rows, h}),
                          nullptr, opt, ctx);
  };
  k.permute = [](const float* tokens, int64_t ntok, int64_t h, const uint8_t* map, const float* probs, int64_t e,
                 int64_t nout, float* out, float* out_probs, int64_t* sorted) {
    const Tensor probs_t(const_cast<float*>(probs), DType::kFloat32, {ntok, e});
    const Tensor out_probs_t(out_probs, DType::kFloat32, {nout});
    ops::moe_permute(Tensor(const_cast<float*>(tokens), DType::kFloat32, {ntok, h}),
                     Tensor(const_cast<uint8_t*>(map), DType::kBool, {ntok, e}), &probs_t, nout, false,
                     Tensor(out, DType::kFloat32, {nout, h}), &out_probs_t, Tensor(sorted, DType::kInt64, {nout}));
  };
  k.unpermute = [](const float* permuted, const int64_t* sorted, const float* probs, int64_t nout, int64_t h,
                   int64_t ntok, float* out) {
    const Tensor probs_t(const_cast<float*>(probs), DType::kFloat32, {nout});
    ops::moe_unpermute(Tensor(const_cast<float*>(permuted), DType::kFloat32, {nout, h}),
                       Tensor(const_cast<int64_t*>(sorted), DType::kInt64, {nout}), Tensor(out, DType::kFloat32, {ntok, h}),
                       probs ? &probs_t : nullptr, nullptr, false);
  };
  k.permute_backward = [](const float* dpermuted, const int64_t* sorted, int64_t nout, int64_t h, int64_t ntok,
                          float* dtokens) {
    ops::moe_permute_backward(Tensor(const_cast<float*>(dpermuted), DType::kFloat32, {nout, h}),
                              Tensor(const_cast<int64_t*>(sorted), DType::kInt64, {nout}),
                              Tensor(dtokens, DType::kFloat32, {ntok, h}));
  };
  k.unpermute_backward = [](const float* dout, const float* permuted, const int64_t* sorted, const float* probs,
                            int64_t nout, int64_t h, int64_t ntok, float* dpermuted, float* dprobs) {
    const Tensor probs_t(const_cast<float*>(probs), DType::kFloat32, {nout});
    const Tensor dprobs_t(dprobs, DType::kFloat32, {nout});
    ops::moe_unpermute_backward(Tensor(const_cast<float*>(dout), DType::kFloat32, {ntok, h}),
                                Tensor(const_cast<float*>(permuted), DType::kFloat32, {nout, h}),
                                Tensor(const_cast<int64_t*>(sorted), DType::kInt64, {nout}), &probs_t, nullptr, false,
                                Tensor(dpermuted, DType::kFloat32, {nout, h}), &dprobs_t);
  };
  return k;
}

// Dispatch presets name op groups joined by ',' ; crossover conditions use '+'
// ("rmsnorm+grad"), which a comma-separated --conditions list can carry.
std::string preset_for_dispatch(const std::string& preset) {
  std::string p = preset;
  std::replace(p.begin(), p.end(), '+', ',');
  return p;
}

// The adapters as the LoRA planner lays them out for this config (one pipeline
// stage, no TP/EP: every rank of the data-parallel group trains all of them).
std::vector<TensorInfo> planned_adapters(const Config& cfg) {
  nlohmann::json j = {
      {"model_type", cfg.model.model_type},
      {"hidden_size", cfg.model.hidden_size},
      {"num_hidden_layers", cfg.model.num_hidden_layers},
      {"num_attention_heads", cfg.model.num_attention_heads},
      {"num_key_value_heads", cfg.model.num_key_value_heads},
      {"head_dim", cfg.model.head_dim},
      {"num_experts", cfg.model.num_experts},
      {"num_experts_per_tok", cfg.model.num_experts_per_tok},
      {"moe_intermediate_size", cfg.model.moe_intermediate_size},
      {"intermediate_size", cfg.model.moe_intermediate_size},
      {"vocab_size", cfg.model.vocab_size},
      {"decoder_sparse_step", 1},
      {"mlp_only_layers", nlohmann::json::array()},
  };
  const lora::ModelConfig mc = lora::parse_model_config(j, "train config");
  lora::PlanOptions po;
  po.targets = cfg.lora.targets;
  po.lora_rank = cfg.lora.rank;
  po.dtype = DType::kFloat32;
  const lora::Plan plan = lora::plan(mc, po);
  std::vector<TensorInfo> out;
  for (const auto& t : plan.stages.at(0).layout) out.push_back({t.name, t.shape});
  return out;
}

std::vector<TensorInfo> checked_adapters(const Config& cfg) {
  std::vector<TensorInfo> planned = planned_adapters(cfg);
  // The model finds each tensor by name; the planner must describe exactly the
  // adapters the model applies (same names and shapes, any order).
  std::vector<TensorInfo> own = adapter_tensors(cfg.model, cfg.lora);
  auto key = [](const TensorInfo& t) { return t.name; };
  std::vector<TensorInfo> a = planned, b = own;
  std::sort(a.begin(), a.end(), [&](auto& x, auto& y) { return key(x) < key(y); });
  std::sort(b.begin(), b.end(), [&](auto& x, auto& y) { return key(x) < key(y); });
  bool same = a.size() == b.size();
  for (size_t i = 0; same && i < a.size(); ++i) same = a[i].name == b[i].name && a[i].shape == b[i].shape;
  if (!same)
    throw Error(fmt::format("train: the LoRA planner's layout ({} tensors) differs from the model's adapters ({} tensors)",
                            planned.size(), own.size()));
  return planned;
}

}  // namespace

// ---------------------------------------------------------------- state

struct Trainer::Impl {
  Config cfg;
  std::string preset;
  comm::Communicator* comm = nullptr;
  comm::SelfCommunicator self_comm;
  int rank = 0, world = 1;

  std::vector<TensorInfo> tensors;  // registration order
  layout::BufferLayout lay;
  std::vector<int64_t> offsets;     // per tensor, elements into the flat buffers
  Buffer params, grads, exp_avg, exp_avg_sq;
  std::vector<std::pair<int64_t, int64_t>> shard;  // this rank's element ranges (one per bucket)
  std::vector<Tensor> shard_grad_views;
  grad::Plan shard_plan;
  Buffer norm{DType::kFloat32, {1}}, found_inf{DType::kFloat32, {1}}, inv_scale{DType::kFloat32, {1}};

  detail::BaseWeights<float> base;
  std::unique_ptr<detail::Model<float>> model;
  detail::Corpus corpus;
  std::vector<int32_t> tokens;

  int64_t next_step = 0;
  int64_t adam_step = 0;   // updates applied (bias correction)
  double loss_scale = 1.0;
  int64_t good_steps = 0;  // since the last scale change

  int64_t micro_per_step() const { return cfg.train.grad_accum_steps * world; }
};

Trainer::Trainer(const Config& config, TrainerOptions options) : impl_(std::make_unique<Impl>()) {
  validate(config);
  Impl& s = *impl_;
  s.cfg = config;
  s.comm = options.comm ? options.comm : &s.self_comm;
  s.rank = s.comm->rank();
  s.world = s.comm->size();
  const auto& t = s.cfg.train;
  s.corpus = detail::Corpus(t.corpus, t.micro_batch_size * (t.seq_len + 1));
  s.tokens.resize(static_cast<size_t>(t.micro_batch_size * (t.seq_len + 1)));

  // Trainable tensors from the LoRA planner, laid out as Megatron DDP would with
  // the distributed optimizer (param starts at multiples of 64, bucket ends at
  // multiples of lcm(dp, 128)) so each bucket splits evenly into rank shards.
  s.tensors = checked_adapters(s.cfg);
  std::vector<layout::ParamSpec> specs;
  for (const auto& ti : s.tensors) specs.push_back({ti.name, ti.shape, DType::kFloat32, false, false});
  layout::LayoutOptions lo;
  lo.distributed_optimizer = true;
  lo.dp_size = s.world;
  lo.bucket_size = static_cast<int64_t>(t.bucket_size);
  lo.grad_dtype = DType::kFloat32;
  s.lay = layout::build_buffer_layout(specs, lo);
  for (const auto& slot : s.lay.params) s.offsets.push_back(slot.offset);
  s.params = Buffer(DType::kFloat32, {s.lay.numel});
  s.grads = Buffer(DType::kFloat32, {s.lay.numel});
  s.exp_avg = Buffer(DType::kFloat32, {s.lay.numel});
  s.exp_avg_sq = Buffer(DType::kFloat32, {s.lay.numel});
  detail::init_adapters(s.tensors, s.offsets, t.seed, s.params.data_as<float>());

  // This rank's shard of every bucket, and the grad views inside it (padding excluded).
  for (const auto& b : s.lay.buckets) {
    const int64_t len = b.end - b.begin;
    if (len % s.world != 0)
      throw Error(fmt::format("train: bucket of {} elements does not split over {} ranks", len, s.world));
    const int64_t per = len / s.world;
    s.shard.emplace_back(b.begin + s.rank * per, b.begin + (s.rank + 1) * per);
  }
  for (size_t i = 0; i < s.lay.params.size(); ++i) {
    const auto& slot = s.lay.params[i];
    for (const auto& [lo_e, hi_e] : s.shard) {
      const int64_t a = std::max(lo_e, slot.offset), b = std::min(hi_e, slot.offset + slot.numel);
      if (a < b) s.shard_grad_views.emplace_back(s.grads.data_as<float>() + a, DType::kFloat32, std::initializer_list<int64_t>{b - a});
    }
  }
  const Tensor declared = s.grads.view();
  s.shard_plan = grad::Plan(s.shard_grad_views, std::span<const Tensor>(&declared, 1));

  s.base = detail::make_base_weights<float>(s.cfg.model, t.seed);
  s.model = std::make_unique<detail::Model<float>>(s.cfg.model, s.cfg.lora, &s.base,
                                                   detail::make_slots(s.cfg.model, s.tensors, s.offsets),
                                                   dispatched_kernels());
  s.loss_scale = t.loss_scaling ? t.initial_loss_scale : 1.0;
  set_preset(options.preset);
}

Trainer::~Trainer() = default;

void Trainer::set_preset(const std::string& preset) {
  dispatch::registry().set_preset(preset_for_dispatch(preset));
  impl_->preset = preset;
}
const std::string& Trainer::preset() const { return impl_->preset; }
int64_t Trainer::next_step() const { return impl_->next_step; }
int Trainer::rank() const { return impl_->rank; }
int Trainer::world_size() const { return impl_->world; }
const Config& Trainer::config() const { return impl_->cfg; }
const std::vector<TensorInfo>& Trainer::trainable() const { return impl_->tensors; }
int64_t Trainer::trainable_params() const { return impl_->lay.numel_unpadded; }
Tensor Trainer::params() const { return impl_->params.view(); }
Tensor Trainer::grads() const { return impl_->grads.view(); }
std::vector<Tensor> Trainer::grad_views() const { return impl_->lay.views(impl_->grads.data()); }
std::vector<Tensor> Trainer::param_views() const { return impl_->lay.views(impl_->params.data()); }

uint64_t Trainer::microbatch_hash(int64_t step, int64_t micro) const {
  const Impl& s = *impl_;
  const auto& t = s.cfg.train;
  std::vector<int32_t> tok(s.tokens.size());
  s.corpus.sample(t.data_seed, step, s.rank * t.grad_accum_steps + micro, t.micro_batch_size, t.seq_len, tok.data());
  return detail::fnv1a(tok.data(), tok.size() * sizeof(int32_t));
}

StepRecord Trainer::step() {
  Impl& s = *impl_;
  const auto& t = s.cfg.train;
  const auto start = std::chrono::steady_clock::now();
  StepRecord rec;
  rec.step = s.next_step;
  rec.loss_scale = s.loss_scale;

  // Forward + backward of this rank's microbatches. Each microbatch's mean loss
  // is weighted 1 / (microbatches over all ranks), times the loss scale.
  std::memset(s.grads.data(), 0, s.grads.nbytes());
  const double dscale = s.loss_scale / static_cast<double>(s.micro_per_step());
  double loss_sum = 0.0;
  for (int64_t m = 0; m < t.grad_accum_steps; ++m) {
    s.corpus.sample(t.data_seed, s.next_step, s.rank * t.grad_accum_steps + m, t.micro_batch_size, t.seq_len,
                    s.tokens.data());
    loss_sum += s.model->forward_backward(s.tokens.data(), t.micro_batch_size, t.seq_len, s.params.data_as<float>(),
                                          s.grads.data_as<float>(), dscale);
  }

  // Bucketed gradient all-reduce (SUM, rank order: every rank gets the same bits).
  for (const auto& b : s.lay.buckets)
    s.comm->allreduce(Tensor(s.grads.data_as<float>() + b.begin, DType::kFloat32, {b.end - b.begin}), comm::ReduceOp::kSum);
  double loss_total = loss_sum;
  s.comm->allreduce(Tensor(&loss_total, DType::kFloat64, {1}), comm::ReduceOp::kSum);
  rec.loss = loss_total / static_cast<double>(s.micro_per_step());

  // [Unscale +] non-finite check + global norm over the shards, reduced over ranks.
  s.found_inf.data_as<float>()[0] = 0.0f;
  if (t.loss_scaling) {
    s.inv_scale.data_as<float>()[0] = static_cast<float>(1.0 / s.loss_scale);
    ops::grad_unscale_norm(s.shard_plan, s.inv_scale, s.norm, s.found_inf, 2.0, s.comm);
  } else {
    ops::grad_norm(s.shard_plan, s.norm, 2.0, &s.found_inf.view(), s.comm);
  }
  // The one host decision of the step: skip or update (as the frameworks do).
  rec.skipped = read_scalar(s.found_inf) != 0.0;
  rec.grad_norm = read_scalar(s.norm);

  if (rec.skipped) {
    if (t.loss_scaling) {
      s.loss_scale = std::max(t.min_loss_scale, s.loss_scale * 0.5);
      s.good_steps = 0;
    }
  } else {
    if (t.clip_grad > 0) ops::grad_clip(s.shard_plan, s.norm, t.clip_grad);
    // AdamW (decoupled weight decay) on this rank's shards.
    ++s.adam_step;
    const double lr = t.lr_warmup_steps > 0
                          ? t.lr * std::min(1.0, static_cast<double>(s.next_step + 1) / static_cast<double>(t.lr_warmup_steps))
                          : t.lr;
    const float b1 = static_cast<float>(t.adam_beta1), b2 = static_cast<float>(t.adam_beta2);
    const float bc1 = static_cast<float>(1.0 - std::pow(t.adam_beta1, static_cast<double>(s.adam_step)));
    const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(t.adam_beta2, static_cast<double>(s.adam_step))));
    const float step_size = static_cast<float>(lr) / bc1;
    const float decay = static_cast<float>(1.0 - lr * t.weight_decay);
    const float eps = static_cast<float>(t.adam_eps);
    float* p = s.params.data_as<float>();
    const float* g = s.grads.data_as<float>();
    float* m1 = s.exp_avg.data_as<float>();
    float* m2 = s.exp_avg_sq.data_as<float>();
    for (const auto& [lo_e, hi_e] : s.shard)
      for (int64_t i = lo_e; i < hi_e; ++i) {
        m1[i] = b1 * m1[i] + (1.0f - b1) * g[i];
        m2[i] = b2 * m2[i] + (1.0f - b2) * g[i] * g[i];
        p[i] = p[i] * decay - step_size * m1[i] / (std::sqrt(m2[i]) / bc2_sqrt + eps);
      }
    // Gather the updated shards: zero what other ranks own, then SUM (x + 0 == x exactly).
    if (s.world > 1) {
      std::vector<float> keep(p, p + s.lay.numel);
      std::memset(p, 0, s.params.nbytes());
      for (const auto& [lo_e, hi_e] : s.shard) std::memcpy(p + lo_e, keep.data() + lo_e, sizeof(float) * static_cast<size_t>(hi_e - lo_e));
      for (const auto& b : s.lay.buckets)
        s.comm->allreduce(Tensor(p + b.begin, DType::kFloat32, {b.end - b.begin}), comm::ReduceOp::kSum);
    }
    if (t.loss_scaling && ++s.good_steps >= t.loss_scale_window) {
      s.loss_scale *= 2.0;
      s.good_steps = 0;
    }
  }
  ++s.next_step;
  rec.duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return rec;
}

// ---------------------------------------------------------------- checkpoints

namespace {

constexpr const char* kFormat = "leanstep-moe-lora-v1";

// What a checkpoint must match to be loaded into this trainer.
std::string config_fingerprint(const Config& c) {
  const auto& m = c.model;
  return fmt::format("hidden={} layers={} heads={}/{} head_dim={} experts={} top_k={} ffn={} vocab={} rank={} alpha={} "
                     "targets={} seed={}",
                     m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads, m.head_dim,
                     m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.vocab_size, c.lora.rank,
                     c.lora.alpha, fmt::join(c.lora.targets, ","), c.train.seed);
}

std::string hex_double(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  return fmt::format("{:016x}", bits);
}
double from_hex_double(const std::string& s) {
  const uint64_t bits = std::stoull(s, nullptr, 16);
  double v;
  std::memcpy(&v, &bits, 8);
  return v;
}

}  // namespace

void Trainer::save(const std::string& dir) const {
  const Impl& s = *impl_;
  // Each rank updated only its shards of the Adam moments: gather them (zero
  // what others own, SUM) so rank 0 writes the whole optimizer state.
  auto gathered = [&](const Buffer& b) {
    std::vector<float> full(static_cast<size_t>(s.lay.numel), 0.0f);
    for (const auto& [lo_e, hi_e] : s.shard)
      std::memcpy(full.data() + lo_e, b.data_as<float>() + lo_e, sizeof(float) * static_cast<size_t>(hi_e - lo_e));
    if (s.world > 1)
      for (const auto& bk : s.lay.buckets)
        s.comm->allreduce(Tensor(full.data() + bk.begin, DType::kFloat32, {bk.end - bk.begin}), comm::ReduceOp::kSum);
    return full;
  };
  const std::vector<float> exp_avg = gathered(s.exp_avg), exp_avg_sq = gathered(s.exp_avg_sq);
  std::string error;
  if (s.rank == 0) {
    try {
      std::filesystem::create_directories(dir);
      std::vector<detail::TensorToWrite> out;
      for (size_t i = 0; i < s.tensors.size(); ++i) {
        const auto& ti = s.tensors[i];
        out.push_back({ti.name, ti.shape, s.params.data_as<float>() + s.offsets[i]});
        out.push_back({"optimizer.exp_avg." + ti.name, ti.shape, exp_avg.data() + s.offsets[i]});
        out.push_back({"optimizer.exp_avg_sq." + ti.name, ti.shape, exp_avg_sq.data() + s.offsets[i]});
      }
      std::map<std::string, std::string> meta = {
          {"format", kFormat},
          {"config", config_fingerprint(s.cfg)},
          {"next_step", std::to_string(s.next_step)},
          {"adam_step", std::to_string(s.adam_step)},
          {"loss_scale", hex_double(s.loss_scale)},
          {"good_steps", std::to_string(s.good_steps)},
      };
      detail::write_safetensors((std::filesystem::path(dir) / "adapters.safetensors").string(), out, meta);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Every rank learns whether rank 0 succeeded (a failure is an error everywhere).
  float failed = error.empty() ? 0.0f : 1.0f;
  s.comm->allreduce(Tensor(&failed, DType::kFloat32, {1}), comm::ReduceOp::kMax);
  if (failed != 0.0f) throw Error(error.empty() ? "train: rank 0 failed to write the checkpoint" : error);
}

void Trainer::load(const std::string& dir) {
  Impl& s = *impl_;
  const std::string path = (std::filesystem::path(dir) / "adapters.safetensors").string();
  const detail::SafetensorsFile f = detail::read_safetensors(path);
  auto meta = [&](const char* key) -> const std::string& {
    const auto it = f.metadata.find(key);
    if (it == f.metadata.end()) throw Error(fmt::format("train: checkpoint '{}' lacks metadata '{}'", path, key));
    return it->second;
  };
  if (meta("format") != kFormat)
    throw Error(fmt::format("train: checkpoint '{}' has format '{}' (expected '{}')", path, meta("format"), kFormat));
  if (meta("config") != config_fingerprint(s.cfg))
    throw Error(fmt::format("train: checkpoint '{}' is from a different config: it has [{}], this run has [{}]", path,
                            meta("config"), config_fingerprint(s.cfg)));
  const size_t expected = 3 * s.tensors.size();
  if (f.tensors.size() != expected)
    throw Error(fmt::format("train: checkpoint '{}' has {} tensors, this config has {}", path, f.tensors.size(), expected));
  // Validate everything before changing any state.
  std::vector<const detail::StoredTensor*> found;
  for (const auto& ti : s.tensors)
    for (const std::string& name : {ti.name, "optimizer.exp_avg." + ti.name, "optimizer.exp_avg_sq." + ti.name}) {
      const auto it = f.tensors.find(name);
      if (it == f.tensors.end()) throw Error(fmt::format("train: checkpoint '{}' lacks tensor '{}'", path, name));
      if (it->second.shape != ti.shape)
        throw Error(fmt::format("train: checkpoint '{}' tensor '{}' has shape [{}], this config has [{}]", path, name,
                                fmt::join(it->second.shape, ", "), fmt::join(ti.shape, ", ")));
      // A checkpoint that resumes into NaN losses is not a checkpoint: refuse non-finite
      // weights and moments (and negative second moments) before changing any state.
      const auto& d = it->second.data;
      for (size_t k = 0; k < d.size(); ++k)
        if (!std::isfinite(d[k]) || (name.rfind("optimizer.exp_avg_sq.", 0) == 0 && d[k] < 0.0f))
          throw Error(fmt::format("train: checkpoint '{}' tensor '{}' holds {} at element {}: refusing to resume from "
                                  "a corrupt state",
                                  path, name, d[k], k));
      found.push_back(&it->second);
    }
  auto count = [&](const char* key) {
    const std::string& text = meta(key);
    int64_t v = -1;
    const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || p != text.data() + text.size() || v < 0 || v > (int64_t{1} << 40))
      throw Error(fmt::format("train: checkpoint '{}' metadata '{}' must be an integer in [0, 2^40] (got '{}')", path,
                              key, text));
    return v;
  };
  const int64_t next_step = count("next_step"), adam_step = count("adam_step"), good_steps = count("good_steps");
  const std::string& scale_text = meta("loss_scale");
  if (scale_text.size() != 16 || scale_text.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw Error(fmt::format("train: checkpoint '{}' metadata 'loss_scale' must be 16 hex digits (got '{}')", path,
                            scale_text));
  const double loss_scale = from_hex_double(scale_text);
  if (!(std::isfinite(loss_scale) && loss_scale > 0))
    throw Error(fmt::format("train: checkpoint '{}' metadata 'loss_scale' must be finite and > 0 (got {})", path,
                            loss_scale));
  std::memset(s.params.data(), 0, s.params.nbytes());
  std::memset(s.exp_avg.data(), 0, s.exp_avg.nbytes());
  std::memset(s.exp_avg_sq.data(), 0, s.exp_avg_sq.nbytes());
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    float* dst[3] = {s.params.data_as<float>(), s.exp_avg.data_as<float>(), s.exp_avg_sq.data_as<float>()};
    for (int k = 0; k < 3; ++k) {
      const auto& src = found[3 * i + static_cast<size_t>(k)]->data;
      std::memcpy(dst[k] + s.offsets[i], src.data(), src.size() * sizeof(float));
    }
  }
  s.next_step = next_step;
  s.adam_step = adam_step;
  s.loss_scale = loss_scale;
  s.good_steps = good_steps;
  if (!s.cfg.train.loss_scaling) s.loss_scale = 1.0;
}

}  // namespace leanstep::train
