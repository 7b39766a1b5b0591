// Shared helpers for the CPU tests: a per-run random seed (printed, overridable with
// FLASHCPP_SEED=<n>) and host tensors in any dtype.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "flashcpp/half.h"
#include "flashcpp/attention.h"

namespace flashcpp::testing {

/// One seed per process, fresh each run unless FLASHCPP_SEED is set; printed once so a failure
/// can be replayed.
inline std::uint64_t run_seed() {
  static const std::uint64_t seed = [] {
    std::uint64_t s;
    if (const char* env = std::getenv("FLASHCPP_SEED")) {
      s = std::strtoull(env, nullptr, 10);
    } else {
      s = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    }
    std::fprintf(stderr, "[flashcpp tests] FLASHCPP_SEED=%llu\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

/// A generator seeded from the run seed and a per-test salt, so tests are independent.
inline std::mt19937_64 rng(std::uint64_t salt) { return std::mt19937_64(run_seed() ^ (salt * 0x9E3779B97F4A7C15ull)); }

/// Host buffer of `n` elements of dtype `dt`.
struct HostBuffer {
  DType dt = DType::kF32;
  std::vector<std::uint8_t> bytes;
  HostBuffer() = default;
  HostBuffer(DType t, std::int64_t n) : dt(t), bytes(static_cast<std::size_t>(n) * dtype_size(t)) {}
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  std::int64_t size() const { return static_cast<std::int64_t>(bytes.size() / dtype_size(dt)); }
  float get(std::int64_t i) const { return load_as_float(bytes.data(), dt, i); }
  void set(std::int64_t i, float v) { store_from_float(bytes.data(), dt, i, v); }
  /// Normal(0, stddev) values rounded to the dtype.
  void fill_normal(std::mt19937_64& g, float stddev = 1.f) {
    std::normal_distribution<float> d(0.f, stddev);
    for (std::int64_t i = 0; i < size(); ++i) set(i, d(g));
  }
  /// NaN everywhere: an element the kernel forgets to write stays NaN and fails the test.
  void poison() {
    for (std::int64_t i = 0; i < size(); ++i) set(i, NAN);
  }
};

}  // namespace flashcpp::testing
