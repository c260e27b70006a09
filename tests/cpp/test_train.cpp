// The training step end to end: it trains, data parallel equals one rank on
// the combined batch, presets agree, checkpoints resume bit-identically, and
// bad input is refused with clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "leanstep/comm.h"
#include "leanstep/dispatch.h"
#include "leanstep/train.h"
#include "test_util.h"

namespace {

using namespace leanstep;
using namespace leanstep::train;

const std::string kSource = LEANSTEP_SOURCE_DIR;

// The micro config of the gradient check with a longer context: small enough
// for the sanitizer build, big enough to learn byte statistics.
Config small_config() {
  Config c = load_config(kSource + "/examples/tiny-moe/micro.json");
  c.train.seq_len = 16;
  c.train.micro_batch_size = 2;
  return c;
}

std::vector<float> copy_of(const Tensor& t) {
  const float* p = static_cast<const float*>(t.data);
  return std::vector<float>(p, p + t.numel());
}

std::string temp_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("leanstep_train_" + name + "_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
                    "_" + std::to_string(reinterpret_cast<uintptr_t>(&name) & 0xffff));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(Train, LossDecreasesOverFiftySteps) {
  Config c = small_config();
  Trainer trainer(c);
  std::vector<double> losses;
  for (int i = 0; i < 50; ++i) {
    const StepRecord r = trainer.step();
    ASSERT_TRUE(std::isfinite(r.loss) && std::isfinite(r.grad_norm)) << "step " << i;
    EXPECT_FALSE(r.skipped);
    losses.push_back(r.loss);
  }
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) {
    first += losses[static_cast<size_t>(i)] / 10;
    last += losses[static_cast<size_t>(40 + i)] / 10;
  }
  std::printf("[ info     ] mean loss steps 0-9: %.4f, steps 40-49: %.4f\n", first, last);
  // Uniform guessing over 256 bytes is ln 256 = 5.55; a model that learns the
  // byte frequencies of English text gets well below. Demand 0.5 nats of progress:
  // the first-10 mean is ~5.5, so an update that did nothing cannot pass.
  EXPECT_LT(last, first - 0.5);
}

TEST(Train, TrainableLayoutIsTheFlatBuffer) {
  Config c = small_config();
  Trainer trainer(c);
  const auto views = trainer.grad_views();
  ASSERT_EQ(views.size(), trainer.trainable().size());
  const Tensor buf = trainer.grads();
  int64_t total = 0;
  for (size_t i = 0; i < views.size(); ++i) {
    EXPECT_GE(views[i].byte_begin(), buf.byte_begin());
    EXPECT_LE(views[i].byte_end(), buf.byte_end());
    EXPECT_EQ(views[i].dtype, DType::kFloat32);
    EXPECT_EQ((static_cast<float*>(views[i].data) - static_cast<float*>(buf.data)) % 64, 0)
        << "distributed-optimizer padding puts each param start at a multiple of 64";
    total += views[i].numel();
  }
  EXPECT_EQ(total, trainer.trainable_params());
  // Megatron's reverse order: the first registered tensor sits last in the buffer.
  EXPECT_GT(views.front().data, views.back().data);
}

// Two ranks with one microbatch each == one rank with the two microbatches
// accumulated. Only the order of fp32 additions differs (the accumulation of the
// second microbatch into the first vs the rank-order SUM), so loss and grad norm
// agree to a few ulps per step: 1e-5 relative on 4 steps leaves room for the
// divergence that Adam's normalisation can add, while a wrong weighting of the
// microbatches (a factor of 2) or a missing all-reduce is off by >= 1e-2.
TEST(Train, DataParallelEqualsOneRankOnTheCombinedBatch) {
  Config one = small_config();
  one.train.grad_accum_steps = 2;
  Config two = small_config();
  two.train.grad_accum_steps = 1;
  const int steps = 4;

  Trainer single(one);
  std::vector<StepRecord> ref;
  for (int i = 0; i < steps; ++i) ref.push_back(single.step());
  const auto ref_params = copy_of(single.params());

  comm::InProcessGroup group(2, 30.0);
  std::vector<std::vector<StepRecord>> got(2);
  std::vector<std::vector<float>> params(2);
  std::vector<uint64_t> hashes(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        TrainerOptions o;
        o.comm = &group.communicator(r);
        Trainer t(two, o);
        hashes[static_cast<size_t>(r)] = t.microbatch_hash(0);
        for (int i = 0; i < steps; ++i) got[static_cast<size_t>(r)].push_back(t.step());
        params[static_cast<size_t>(r)] = copy_of(t.params());
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  // Rank r's first microbatch is microbatch r of the single rank's step.
  EXPECT_EQ(hashes[0], single.microbatch_hash(0, 0));
  EXPECT_EQ(hashes[1], single.microbatch_hash(0, 1));
  for (int i = 0; i < steps; ++i) {
    for (int r = 0; r < 2; ++r) {
      const StepRecord& g = got[static_cast<size_t>(r)][static_cast<size_t>(i)];
      EXPECT_NEAR(g.loss, ref[static_cast<size_t>(i)].loss, 1e-5 * ref[static_cast<size_t>(i)].loss) << "step " << i;
      EXPECT_NEAR(g.grad_norm, ref[static_cast<size_t>(i)].grad_norm, 1e-5 * ref[static_cast<size_t>(i)].grad_norm)
          << "step " << i;
    }
    // Both ranks report the same reduced values bit for bit.
    EXPECT_EQ(got[0][static_cast<size_t>(i)].loss, got[1][static_cast<size_t>(i)].loss);
    EXPECT_EQ(got[0][static_cast<size_t>(i)].grad_norm, got[1][static_cast<size_t>(i)].grad_norm);
  }
  // Parameters: identical on both ranks (the gathered shards), and within
  // 1e-4 of the single rank (lr = 1e-2 per step; a sign flip of an update would be 2e-2).
  ASSERT_EQ(params[0].size(), params[1].size());
  EXPECT_EQ(std::memcmp(params[0].data(), params[1].data(), params[0].size() * sizeof(float)), 0);
  ASSERT_EQ(params[0].size(), ref_params.size());
  double worst = 0;
  for (size_t i = 0; i < ref_params.size(); ++i) worst = std::max(worst, std::abs(double(params[0][i]) - ref_params[i]));
  EXPECT_LT(worst, 1e-4);
}

// Baseline (reference implementations everywhere) against "all" (every fast
// path): permute/unpermute are bit-identical, RMSNorm and the norm differ in the
// last bits (fp32 rounding order), so per step the loss agrees to 1e-5 relative
// and the grad norm to 1e-4 relative over 6 steps; all values finite.
TEST(Train, BaselineAndAllPresetsAgree) {
  Config c = small_config();
  std::vector<StepRecord> base, all;
  {
    TrainerOptions o;
    o.preset = "baseline";
    Trainer t(c, o);
    for (int i = 0; i < 6; ++i) base.push_back(t.step());
  }
  {
    TrainerOptions o;
    o.preset = "all";
    Trainer t(c, o);
    for (int i = 0; i < 6; ++i) all.push_back(t.step());
  }
  for (size_t i = 0; i < base.size(); ++i) {
    ASSERT_TRUE(std::isfinite(base[i].loss) && std::isfinite(all[i].loss));
    ASSERT_TRUE(std::isfinite(base[i].grad_norm) && std::isfinite(all[i].grad_norm));
    EXPECT_NEAR(all[i].loss, base[i].loss, 1e-5 * base[i].loss) << "step " << i;
    EXPECT_NEAR(all[i].grad_norm, base[i].grad_norm, 1e-4 * base[i].grad_norm) << "step " << i;
  }
}

// Subsets switch between steps (the crossover does this) and stay valid presets.
TEST(Train, PresetsSwitchBetweenSteps) {
  Config c = small_config();
  Trainer t(c);
  for (const char* p : {"baseline", "rmsnorm", "grad", "moe", "rmsnorm+grad", "all"}) {
    t.set_preset(p);
    EXPECT_EQ(t.preset(), p);
    EXPECT_TRUE(std::isfinite(t.step().loss));
  }
  EXPECT_THROW(t.set_preset("no_such_op"), Error);
}

// The step really goes through the dispatch layer: under "baseline" every op
// the step uses runs its reference, under "all" its fast implementation.
TEST(Train, PresetChoosesTheImplementations) {
  Config c = small_config();
  const std::vector<std::string> used = {"rmsnorm.forward", "rmsnorm.backward", "moe.permute",
                                         "moe.unpermute",   "moe.permute_backward", "moe.unpermute_backward",
                                         "grad.norm",       "grad.clip"};
  auto calls = [&](const std::string& op_name, bool reference) {
    uint64_t n = 0;
    for (const auto& op : dispatch::registry().report())
      if (op.name == op_name)
        for (const auto& st : op.stats)
          if ((st.name == op.reference) == reference) n += st.calls;
    return n;
  };
  for (const char* preset : {"baseline", "all"}) {
    TrainerOptions o;
    o.preset = preset;
    Trainer t(c, o);
    dispatch::registry().reset_stats();
    t.step();
    const bool base = std::string(preset) == "baseline";
    for (const auto& op : used) {
      EXPECT_GT(calls(op, base), 0u) << op << " under " << preset;
      EXPECT_EQ(calls(op, !base), 0u) << op << " under " << preset;
    }
  }
}

// A power-of-two loss scale is exact in fp32: the scaled backward and the
// unscale give the same bits as no scaling (barring underflow, which these
// gradient magnitudes never reach).
TEST(Train, PowerOfTwoLossScaleIsExact) {
  Config plain = small_config();
  Config scaled = small_config();
  scaled.train.loss_scaling = true;
  scaled.train.initial_loss_scale = 65536.0;
  Trainer a(plain), b(scaled);
  for (int i = 0; i < 3; ++i) {
    const StepRecord ra = a.step(), rb = b.step();
    EXPECT_EQ(ra.loss, rb.loss);
    EXPECT_EQ(ra.grad_norm, rb.grad_norm);
    EXPECT_FALSE(rb.skipped);
  }
  const auto pa = copy_of(a.params()), pb = copy_of(b.params());
  EXPECT_EQ(std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(float)), 0);
}

// An overflowing loss scale: found_inf skips the update and halves the scale.
TEST(Train, FoundInfSkipsTheStepAndBacksOff) {
  Config c = small_config();
  c.train.loss_scaling = true;
  c.train.initial_loss_scale = 1e300;  // inf in fp32: every gradient overflows
  c.train.loss_scale_window = 2;
  Trainer t(c);
  const auto before = copy_of(t.params());
  const StepRecord r = t.step();
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.loss_scale, 1e300);
  EXPECT_TRUE(std::isfinite(r.loss));
  const auto after = copy_of(t.params());
  EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)), 0);
  EXPECT_EQ(t.step().loss_scale, 0.5e300);
}

TEST(Train, CheckpointRoundTripAndBitIdenticalResume) {
  Config c = small_config();
  c.train.loss_scaling = true;
  c.train.initial_loss_scale = 1024.0;
  c.train.loss_scale_window = 2;  // the scaler state changes inside the run
  c.train.weight_decay = 0.01;
  const std::string dir = temp_dir("resume");

  Trainer a(c);
  for (int i = 0; i < 3; ++i) a.step();
  a.save(dir);
  ASSERT_TRUE(std::filesystem::exists(dir + "/adapters.safetensors"));
  std::vector<StepRecord> continued;
  for (int i = 0; i < 3; ++i) continued.push_back(a.step());

  Trainer b(c);
  b.load(dir);
  EXPECT_EQ(b.next_step(), 3);
  std::vector<StepRecord> resumed;
  for (int i = 0; i < 3; ++i) resumed.push_back(b.step());
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed[i].step, continued[i].step);
    EXPECT_EQ(resumed[i].loss, continued[i].loss);
    EXPECT_EQ(resumed[i].grad_norm, continued[i].grad_norm);
    EXPECT_EQ(resumed[i].loss_scale, continued[i].loss_scale);
  }
  const auto pa = copy_of(a.params()), pb = copy_of(b.params());
  EXPECT_EQ(std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(float)), 0);

  // Round trip: save again and load into a fresh trainer -> the same bits.
  b.save(dir);
  Trainer d(c);
  d.load(dir);
  const auto pd = copy_of(d.params());
  EXPECT_EQ(std::memcmp(pb.data(), pd.data(), pb.size() * sizeof(float)), 0);
  // No temporary file is left behind.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
  std::filesystem::remove_all(dir);
}

TEST(Train, CheckpointFromAnotherConfigIsRefused) {
  const std::string dir = temp_dir("otherconfig");
  Config c = small_config();
  Trainer a(c);
  a.save(dir);
  Config other = small_config();
  other.lora.rank = 3;
  Trainer b(other);
  EXPECT_LEANSTEP_ERROR(b.load(dir), "different config");
  // A truncated file is not a checkpoint.
  const std::string path = dir + "/adapters.safetensors";
  std::filesystem::resize_file(path, std::filesystem::file_size(path) / 2);
  Trainer e(c);
  EXPECT_LEANSTEP_ERROR(e.load(dir), "not valid safetensors");
  EXPECT_LEANSTEP_ERROR(e.load(dir + "/missing"), "cannot read checkpoint");
  std::filesystem::remove_all(dir);
}

TEST(Train, BadConfigsAreRefused) {
  const std::string good = R"({"model_type": "qwen3_moe", "hidden_size": 16, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 8, "vocab_size": 256,
    "lora": {"rank": 2, "alpha": 4}})";
  EXPECT_NO_THROW(parse_config(good));
  auto with = [&](const std::string& key, const std::string& value) {
    nlohmann::json j = nlohmann::json::parse(good);
    j[key] = nlohmann::json::parse(value);
    return j.dump();
  };
  EXPECT_LEANSTEP_ERROR(parse_config("{"), "not valid JSON");
  EXPECT_LEANSTEP_ERROR(parse_config(R"({"model_type": "qwen3_moe"})"), "missing key 'hidden_size'");
  EXPECT_LEANSTEP_ERROR(parse_config(with("model_type", "\"llama\"")), "model_type");
  EXPECT_LEANSTEP_ERROR(parse_config(with("num_experts_per_tok", "5")), "num_experts_per_tok");
  EXPECT_LEANSTEP_ERROR(parse_config(with("num_key_value_heads", "3")), "num_key_value_heads");
  EXPECT_LEANSTEP_ERROR(parse_config(with("head_dim", "5")), "head_dim");
  EXPECT_LEANSTEP_ERROR(parse_config(with("hidden_size", "\"big\"")), "wrong type");
  EXPECT_LEANSTEP_ERROR(parse_config(with("hidden_size", "0")), "hidden_size");
  EXPECT_LEANSTEP_ERROR(parse_config(with("lora", R"({"rank": 2, "alpha": 4, "targets": ["linear_qkvz"]})")),
                        "unknown module");
  EXPECT_LEANSTEP_ERROR(parse_config(with("lora", R"({"rank": 0, "alpha": 4})")),
                        "key 'lora.rank' must be in [1, 4096] (got 0)");
  EXPECT_LEANSTEP_ERROR(parse_config(with("train", R"({"lr": -1})")), "train.lr");
  EXPECT_LEANSTEP_ERROR(parse_config(with("train", R"({"adam_beta2": 1.0})")), "train.adam_beta2");
  EXPECT_LEANSTEP_ERROR(load_config(kSource + "/examples/tiny-moe/no-such-file.json"), "cannot read");
}

TEST(Train, CorpusShorterThanOneMicrobatchIsRefused) {
  const std::string dir = temp_dir("corpus");
  const std::string path = dir + "/short.txt";
  std::ofstream(path) << "too short";
  Config c = small_config();
  c.train.corpus = path;
  EXPECT_LEANSTEP_ERROR(Trainer t(c), "shorter than one microbatch");
  c.train.corpus = dir + "/missing.txt";
  EXPECT_LEANSTEP_ERROR(Trainer t(c), "cannot read corpus");
  std::filesystem::remove_all(dir);
}

// A rank that never joins the step's collectives: the other rank's step fails
// with a clear error after the communicator's timeout instead of hanging.
TEST(Train, MissingRankFailsWithinTheTimeout) {
  Config c = small_config();
  comm::InProcessGroup group(2, 1.0);
  TrainerOptions o;
  o.comm = &group.communicator(0);
  Trainer t(c, o);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_LEANSTEP_ERROR(t.step(), "comm: allreduce did not complete within 1 s (a rank of the in-process group did not join)");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
}

}  // namespace

// The crossover runner: every run of the plan from the same state (a fresh
// trainer each, the first one given), the plan's condition at every position,
// every step recorded once with this rank's duration, and the same losses at
// the same step of every run (the conditions agree within fp32, and equal
// starts give equal data).
TEST(Train, RunCrossoverRunsEveryPlannedStepFromTheSameState) {
  const Config c = small_config();
  const stats::CrossoverPlan plan = stats::plan_crossover({"baseline", "all"}, 2, 2, 1, {}, 1);
  int made = 0;
  auto make = [&] {
    ++made;
    return std::make_unique<Trainer>(c);
  };
  std::vector<RunStep> seen;
  RunOptions o;
  o.plan = &plan;
  o.on_step = [&](const RunStep& s) { seen.push_back(s); };
  RunResult r = run_crossover(make, o, nullptr, std::make_unique<Trainer>(c));
  const int64_t per_run = plan.steps_per_run();
  EXPECT_EQ(made, 1);  // the first run used the given trainer
  ASSERT_EQ(r.records.size(), static_cast<size_t>(2 * per_run));
  ASSERT_EQ(seen.size(), r.records.size());
  for (size_t i = 0; i < r.records.size(); ++i) {
    const int run = static_cast<int>(i / static_cast<size_t>(per_run));
    const int64_t pos = static_cast<int64_t>(i % static_cast<size_t>(per_run));
    EXPECT_EQ(r.records[i].run, plan.runs[static_cast<size_t>(run)].name);
    EXPECT_EQ(r.records[i].condition, plan.at(run, pos).condition);
    EXPECT_EQ(r.records[i].step, pos);  // every run starts at step 0
    EXPECT_GT(r.records[i].duration_s, 0.0);
    EXPECT_EQ(seen[i].done, static_cast<int64_t>(i) + 1);
  }
  for (int64_t pos = 0; pos < per_run; ++pos)
    EXPECT_NEAR(*r.records[static_cast<size_t>(pos)].loss, *r.records[static_cast<size_t>(per_run + pos)].loss, 1e-4);
  ASSERT_NE(r.trainer, nullptr);
  EXPECT_EQ(r.trainer->next_step(), per_run);
  EXPECT_EQ(r.last.step, per_run - 1);

  RunOptions plain;
  plain.steps = 0;
  EXPECT_THROW(run_crossover(make, plain), Error);  // no steps and no plan
}
