// `leanstep paths`: the dispatch registry's ops, implementations, guards,
// preset, and (after calls in this process) who ran and why not the fast path.
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "commands.h"
#include "leanstep/buffer.h"
#include "leanstep/dispatch.h"
#include "leanstep/ops.h"

namespace leanstep::cli {
namespace {

void fill(const Tensor& t, std::mt19937_64& rng) {
  std::normal_distribution<double> dist(0.0, 1.0);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data, t.dtype, i, dist(rng));
}

// A few small calls through every entry point, chosen so that every guard
// both accepts and declines at least once; the counters then show routing.
void run_demo_calls() {
  std::mt19937_64 rng(1234);
  // RMSNorm: trainable forward, frozen backward, trainable backward, and a
  // call with a delegated feature (autocast) that goes to the reference.
  {
    const int64_t rows = 8, h = 64;
    Buffer x(DType::kBFloat16, {rows, h}), gamma(DType::kBFloat16, {h}), y(DType::kBFloat16, {rows, h}),
        rstd(DType::kFloat32, {rows}), dy(DType::kBFloat16, {rows, h}), dx(DType::kBFloat16, {rows, h}),
        dgamma(DType::kBFloat16, {h});
    fill(x, rng);
    fill(gamma, rng);
    fill(dy, rng);
    const Tensor dgamma_view = dgamma.view();
    rmsnorm::CallContext trainable, frozen, autocast;
    frozen.weight_requires_grad = false;
    autocast.weight_requires_grad = false;
    autocast.autocast = true;
    ops::rmsnorm_forward(x, gamma, y, rstd, {}, trainable);
    ops::rmsnorm_forward(x, gamma, y, rstd, {}, frozen);
    ops::rmsnorm_forward(x, gamma, y, rstd, {}, autocast);
    ops::rmsnorm_backward(dy, x, rstd, gamma, dx, nullptr, {}, frozen);
    ops::rmsnorm_backward(dy, x, rstd, gamma, dx, &dgamma_view, {}, trainable);
    ops::rmsnorm_backward(dy, x, rstd, gamma, dx, nullptr, {}, autocast);
  }
  // Gradients: a flat buffer of three params (one coalesced region) and a plan
  // of strided views (no region: the fused path declines).
  {
    Buffer flat(DType::kFloat32, {1000});
    fill(flat, rng);
    float* p = flat.data_as<float>();
    const std::vector<Tensor> views = {Tensor(p, DType::kFloat32, {600}), Tensor(p + 600, DType::kFloat32, {300}),
                                       Tensor(p + 900, DType::kFloat32, {100})};
    const grad::Plan plan(views);
    Tensor strided(p, DType::kFloat32, {500});
    strided.strides[0] = 2;
    const grad::Plan strided_plan(std::vector<Tensor>{strided});
    Buffer norm(DType::kFloat32, {1}), found_inf(DType::kFloat32, {1}), coeff(DType::kFloat32, {1}),
        zeros(DType::kInt64, {1}), one(DType::kFloat32, {1});
    one.data_as<float>()[0] = 1.0f;
    const Tensor found_view = found_inf.view(), coeff_view = coeff.view();
    ops::grad_unscale_norm(plan, one, norm, found_inf);
    ops::grad_norm_clip(plan, 1.0, norm, 2.0, &found_view, &coeff_view);
    ops::grad_norm(strided_plan, norm);
    ops::grad_clip(strided_plan, norm, 1.0);
    ops::grad_count_zeros(plan, zeros);
    ops::grad_scale(plan, one);
    ops::grad_multi_tensor_scale(views, views, one, found_inf);
  }
  // MoE: permute 16 tokens to 4 experts (top-2), unpermute, and their backward.
  {
    const int64_t T = 16, E = 4, H = 32, k = 2;
    Buffer tokens(DType::kBFloat16, {T, H}), map(DType::kBool, {T, E}), probs(DType::kFloat32, {T, E});
    fill(tokens, rng);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) {
        map.data_as<uint8_t>()[t * E + (t + j) % E] = 1;
        probs.data_as<float>()[t * E + (t + j) % E] = 0.5f;
      }
    const int64_t n = T * k;
    Buffer permuted(DType::kBFloat16, {n, H}), permuted_probs(DType::kFloat32, {n}), idx(DType::kInt64, {n}),
        out(DType::kBFloat16, {T, H}), dpermuted(DType::kBFloat16, {n, H}), dprobs(DType::kFloat32, {n});
    const Tensor probs_view = probs.view(), pp_view = permuted_probs.view(), dprobs_view = dprobs.view();
    ops::moe_permute(tokens, map, &probs_view, std::nullopt, false, permuted, &pp_view, idx);
    ops::moe_unpermute(permuted, idx, out, &pp_view);
    ops::moe_unpermute_backward(out, permuted, idx, &pp_view, nullptr, false, dpermuted, &dprobs_view);
    ops::moe_permute_backward(dpermuted, idx, out);
  }
}

}  // namespace

void add_dispatch_commands(Context& ctx) {
  struct Args {
    bool json = false;
    bool demo_calls = false;
    std::string preset;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = ctx.root.add_subcommand(
      "paths", "List dispatched ops, their implementations and guards, the preset, and call counts");
  cmd->add_flag("--json", args->json, "One JSON object instead of the readable report");
  cmd->add_flag("--demo-calls", args->demo_calls,
                "Run a few small calls through every op first, so counts and decline reasons show");
  cmd->add_option("--preset", args->preset,
                  "Select implementations first: baseline, all, or op names/groups (e.g. rmsnorm,grad.clip)");
  cmd->callback([args] {
    auto& reg = dispatch::registry();
    if (!args->preset.empty()) reg.set_preset(args->preset);
    if (args->demo_calls) run_demo_calls();
    if (args->json) std::printf("%s\n", dispatch::paths_json(reg).c_str());
    else std::fputs(dispatch::paths_text(reg).c_str(), stdout);
  });
}

}  // namespace leanstep::cli
