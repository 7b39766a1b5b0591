// Precompiled for the test executables (CMakeLists.txt, flashcpp_precompile): the headers that
// most test sources include, parsed once per target instead of once per source. Each source
// still includes what it uses; only third-party and standard headers belong here.
#pragma once
#include <gtest/gtest.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "std_headers.h"
