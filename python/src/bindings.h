// One bind_<area>(module) per area; module.cpp calls those compiled in.
#pragma once

#include <nanobind/nanobind.h>

namespace leanstep::py {

namespace nb = nanobind;

void bind_comm(nb::module_& m);
void bind_grad(nb::module_& m);
void bind_rmsnorm(nb::module_& m);
void bind_moe(nb::module_& m);
void bind_lora(nb::module_& m);
void bind_stats(nb::module_& m);
void bind_dispatch(nb::module_& m);
void bind_train(nb::module_& m);

}  // namespace leanstep::py
