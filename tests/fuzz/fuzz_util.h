// Shared by the fuzz targets: run one input, accept leanstep::Error (the answer
// to bad input), treat any other exception as a finding (an internal error that
// should have been a named one).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "leanstep/core.h"

namespace leanstep::fuzz {

template <class F>
int run_one(F&& body) {
  try {
    body();
  } catch (const leanstep::Error&) {
    // bad input, reported by name: fine
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: an exception other than leanstep::Error escaped: %s\n", e.what());
    std::abort();
  }
  return 0;
}

}  // namespace leanstep::fuzz
