// Precompiled for the tools (the harness library, the CLI) and the engine's host sources
// (CMakeLists.txt, flashcpp_precompile): third-party and standard headers only.
#pragma once
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "std_headers.h"
