// Pieces the validators in src/core share: cat(...) builds the one-sentence messages of Status
// from strings, integers, doubles and pointers; Span is the byte range a tensor can touch.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

namespace flashcpp::detail {

inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
template <class T>
requires std::is_integral_v<T>
void put(std::string& s, T v) { s += std::to_string(v); }
inline void put(std::string& s, double v) {
  char b[48];
  std::snprintf(b, sizeof b, "%g", v);
  s += b;
}
inline void put(std::string& s, const void* p) {
  char b[32];
  std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(p)));
  s += b;
}
template <class... A>
std::string cat(const A&... a) {
  std::string s;
  (put(s, a), ...);
  return s;
}

/// A byte range [lo, hi) that a tensor can touch. Empty (lo == hi) when the tensor is unused.
struct Span {
  const char* name = "";
  std::uintptr_t lo = 0, hi = 0;
  bool used() const { return hi > lo; }
  bool overlaps(const Span& o) const { return used() && o.used() && lo < o.hi && o.lo < hi; }
  bool same(const Span& o) const { return lo == o.lo && hi == o.hi; }
};

}  // namespace flashcpp::detail
