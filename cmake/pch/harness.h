// Precompiled for the correctness harness (tools/harness)
// (CMakeLists.txt, flashcpp_precompile): third-party and standard headers only.
#pragma once
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "std_headers.h"
