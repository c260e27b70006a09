// The LoRA coverage planner: a Hugging Face config.json, targets and a
// parallel layout in; the plan's JSON (per-rank trainable tensors) out.
#include <cstdint>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <leanstep/lora.h>

#include "bindings.h"

namespace leanstep::py {

void bind_lora(nb::module_& m) {
  m.def(
      "lora_plan_json",
      [](const std::string& config_path, const std::vector<std::string>& targets, int64_t lora_rank,
         int64_t tp, int64_t pp, int64_t ep, const std::string& scope, const std::string& dtype,
         const std::string& numbering) {
        lora::PlanOptions o;
        o.targets = targets;
        o.lora_rank = lora_rank;
        o.parallel.tp = tp;
        o.parallel.pp = pp;
        o.parallel.ep = ep;
        if (scope == "language") o.scope = lora::Scope::kLanguage;
        else if (scope == "all") o.scope = lora::Scope::kAll;
        else throw_arg_error("lora_plan", "scope", "must be 'language' or 'all' (got '" + scope + "')");
        if (numbering == "global") o.numbering = lora::LayerNumbering::kGlobal;
        else if (numbering == "local") o.numbering = lora::LayerNumbering::kLocal;
        else throw_arg_error("lora_plan", "numbering", "must be 'global' or 'local' (got '" + numbering + "')");
        o.dtype = dtype_from_name(dtype);
        const lora::ModelConfig config = lora::load_model_config(config_path);
        return lora::plan_to_json(lora::plan(config, o));
      },
      nb::arg("config_path"), nb::arg("targets"), nb::arg("lora_rank") = 32, nb::arg("tp") = 1,
      nb::arg("pp") = 1, nb::arg("ep") = 1, nb::arg("scope") = "language",
      nb::arg("dtype") = "bfloat16", nb::arg("numbering") = "global");
}

}  // namespace leanstep::py
