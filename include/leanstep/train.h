// End-to-end MoE-LoRA training step on CPU: a small Qwen3-MoE-style decoder
// (GQA attention with RoPE and per-head q/k RMSNorm, top-k routed SwiGLU
// experts) whose base weights and norms are frozen and whose LoRA adapters
// are trained with AdamW, data parallel over a Communicator.
//
// The trainable gradients live as views in ONE flat fp32 buffer (Megatron DDP
// layout: reverse registration order, distributed-optimizer padding, buckets).
// RMSNorm, MoE permute/unpermute and the gradient norm / clip go through the
// dispatch layer, so a preset ("baseline", "all", or a subset) chooses the
// implementation between steps.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "leanstep/core.h"
#include "leanstep/stats.h"

namespace leanstep::comm {
class Communicator;
}

namespace leanstep::train {

// ---------------------------------------------------------------- configuration

// The model part of an HF-style config.json (qwen3_moe keys).
struct ModelConfig {
  std::string model_type = "qwen3_moe";
  int64_t hidden_size = 256;
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 8;
  int64_t num_key_value_heads = 2;
  int64_t head_dim = 32;
  int64_t num_experts = 16;
  int64_t num_experts_per_tok = 4;
  int64_t moe_intermediate_size = 128;
  int64_t vocab_size = 256;  // byte-level tokens
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  bool norm_topk_prob = true;
  double initializer_range = 0.02;  // std of the (random, frozen) base weights
};

// LoRA adapters: y = x W^T + (alpha / rank) * (x A^T) B^T on the target modules.
struct LoraConfig {
  int64_t rank = 8;
  double alpha = 16.0;
  // Megatron module suffixes: any of linear_qkv, linear_proj, linear_fc1, linear_fc2.
  std::vector<std::string> targets = {"linear_qkv", "linear_fc1", "linear_fc2"};
  double scale() const { return alpha / static_cast<double>(rank); }
};

struct TrainConfig {
  int64_t seq_len = 64;
  int64_t micro_batch_size = 4;   // sequences per microbatch
  int64_t grad_accum_steps = 1;   // microbatches per rank per step
  double lr = 2e-3;
  int64_t lr_warmup_steps = 0;    // linear warm-up, then constant
  double weight_decay = 0.0;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  double clip_grad = 1.0;         // max global L2 norm; 0 disables clipping
  bool loss_scaling = false;      // fp16-style dynamic loss scaling with found_inf skip
  double initial_loss_scale = 65536.0;
  int64_t loss_scale_window = 100;  // good steps before the scale doubles
  double min_loss_scale = 1.0;
  uint64_t seed = 1234;           // base weights and adapters
  uint64_t data_seed = 42;        // microbatch sampling
  std::string corpus;             // text file (path relative to the config file)
  double bucket_size = 40e6;      // elements per all-reduce bucket
};

struct Config {
  ModelConfig model;
  LoraConfig lora;
  TrainConfig train;
  std::string source;  // file it came from ("" when built in code)
};

// Reads a config file: HF model keys at the top level, plus optional "lora" and
// "train" objects. Unknown model types, missing or invalid keys: Error naming the key.
Config load_config(const std::string& path);
// Same from JSON text; `base_dir` resolves a relative corpus path.
Config parse_config(const std::string& json_text, const std::string& base_dir = ".");
// Throws Error when a value is out of range (names the key).
void validate(const Config& config);

// ---------------------------------------------------------------- trainable tensors

struct TensorInfo {
  std::string name;            // Megatron-style, e.g. decoder.layers.0.self_attention.linear_qkv.lora_A.weight
  std::vector<int64_t> shape;
  int64_t numel() const;
};

// Adapters in registration order (layer by layer; per expert tensors suffixed 0..E-1).
std::vector<TensorInfo> adapter_tensors(const ModelConfig& model, const LoraConfig& lora);

// ---------------------------------------------------------------- training

struct StepRecord {
  int64_t step = 0;          // 0-based global step index (continues across resume)
  double loss = 0.0;         // mean token cross-entropy over all ranks' microbatches
  double grad_norm = 0.0;    // global L2 norm of the unscaled gradient, before clipping
  double loss_scale = 1.0;
  bool skipped = false;      // found_inf: the update was skipped
  double duration_s = 0.0;   // this rank's wall time for the step
};

struct TrainerOptions {
  std::string preset = "all";  // dispatch preset for the fast paths
  comm::Communicator* comm = nullptr;  // nullptr: a single rank
};

// One rank of a data-parallel LoRA fine-tuning run.
class Trainer {
 public:
  Trainer(const Config& config, TrainerOptions options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Runs one optimizer step (all microbatches, all-reduce, norm, clip, AdamW).
  StepRecord step();
  // Switches the dispatch preset (between steps).
  void set_preset(const std::string& preset);
  const std::string& preset() const;

  int64_t next_step() const;
  int rank() const;
  int world_size() const;
  const Config& config() const;
  const std::vector<TensorInfo>& trainable() const;
  int64_t trainable_params() const;
  // FNV-1a hash of the token ids of this rank's first microbatch of step `step`.
  uint64_t microbatch_hash(int64_t step, int64_t micro = 0) const;

  // Views of the flat fp32 buffers (parameters, gradients) in the DDP layout.
  Tensor params() const;
  Tensor grads() const;
  // Per-tensor views into the gradient buffer, in registration order.
  std::vector<Tensor> grad_views() const;
  std::vector<Tensor> param_views() const;

  // Checkpoint: adapters + AdamW state + loss scaler + step in safetensors format,
  // written atomically (temp file + rename) to <dir>/adapters.safetensors.
  // Only rank 0 writes; all ranks must call (a collective barrier follows).
  void save(const std::string& dir) const;
  // Restores a checkpoint written by save(); a checkpoint from a different
  // config is an Error naming what differs.
  void load(const std::string& dir);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------- runs and crossovers

// What one step of a run reports to a progress callback (rank-local).
struct RunStep {
  std::string run, condition;  // the run's name, the step's dispatch preset
  int block = -1;              // the crossover block, -1 without a plan
  int64_t position = 0;        // step index within the run
  int64_t steps_per_run = 0;
  int64_t done = 0, total = 0; // steps done over all runs, of total
  bool condition_changed = false;
  StepRecord step;
};

struct RunOptions {
  // A counterbalanced crossover: every run of the plan, each condition a block
  // of steps. nullptr: one run of `steps` steps under `preset`.
  const stats::CrossoverPlan* plan = nullptr;
  int64_t steps = 0;
  std::string preset = "all";
  // This rank's step log (the caller names one file per rank), or nullptr.
  stats::StepLogWriter* log = nullptr;
  // Called after every step on this rank.
  std::function<void(const RunStep&)> on_step;
};

struct RunResult {
  // Every rank's steps (rank, step, duration, condition, block, loss, ...) on
  // rank 0, gathered with one all-reduce; empty on the other ranks. A step's
  // duration for comparisons is the max over its ranks (stats does that).
  std::vector<stats::StepRecord> records;
  StepRecord first, last;            // this rank's first and last step
  std::unique_ptr<Trainer> trainer;  // the last run's trainer (to save a checkpoint)
};

// Runs the steps of `options` on this rank. `make_trainer` builds the trainer of
// each run (every run of a crossover starts from the same state: the same init or
// checkpoint); `first`, if given, is the first run's (already built, e.g. to print
// what makes runs comparable before the first step). The preset switches between
// steps when the plan's condition changes. Collective: every rank calls it.
RunResult run_crossover(const std::function<std::unique_ptr<Trainer>()>& make_trainer, const RunOptions& options,
                        comm::Communicator* comm = nullptr, std::unique_ptr<Trainer> first = nullptr);

}  // namespace leanstep::train
