// Range checks for the numeric flags of every `flashcpp` subcommand, as CLI11 validators, and
// the parse step that turns every CLI11 error into exit status 2.
//
// CLI::Range lets NaN through (NaN < lo and NaN > hi are both false) and strtoull reads "-5" as
// 2^64 - 5, so these validators convert the text the way CLI11 does and then require the value
// to satisfy the range, which NaN never does. The message completes "--flag: ..." (CLI11 puts
// the flag's name in front), e.g. "--top-p: must be a number in (0, 1]; got 'nan'".
#pragma once

#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>

namespace flashcpp::tools {

namespace detail {

template <class T>
std::string num_str(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    std::string s = std::to_string(v);
    while (s.size() > 1 && s.back() == '0') s.pop_back();
    if (!s.empty() && s.back() == '.') s.pop_back();
    return s;
  } else {
    return std::to_string(v);
  }
}

/// The value CLI11 will store for `text`, or false when it does not convert (or is a negative
/// number for an unsigned type, which strtoull would wrap).
/// What the text must be to convert at all: "an integer that fits in 32 bits", ...
template <class T>
std::string type_words() {
  if constexpr (std::is_floating_point_v<T>) return "a number";
  else if constexpr (std::is_unsigned_v<T>) return "a non-negative integer that fits in " + std::to_string(8 * sizeof(T)) + " bits, written in decimal";
  else return "an integer that fits in " + std::to_string(8 * sizeof(T)) + " bits, written in decimal";
}

/// Integers must be written in decimal: strtoll's base 0, which CLI11 uses, reads "010" as 8
/// and "0x10" as 16, and clamps a number past the type's range to its largest value (ERANGE:
/// "--seed 99999999999999999999999" became 18446744073709551615 without a word).
inline bool is_decimal_integer(const std::string& text) {
  std::size_t i = (!text.empty() && (text[0] == '+' || text[0] == '-')) ? 1 : 0;
  if (i >= text.size()) return false;
  if (text[i] == '0' && i + 1 < text.size()) return false;  // a leading zero: octal to strtoll
  for (; i < text.size(); ++i)
    if (text[i] < '0' || text[i] > '9') return false;
  return true;
}

template <class T>
bool convert(const std::string& text, T* v) {
  if constexpr (std::is_integral_v<T>) {
    if (!is_decimal_integer(text)) return false;
    if constexpr (std::is_unsigned_v<T>) {
      if (text[0] == '-') return false;
    }
    errno = 0;
    const bool ok = CLI::detail::lexical_cast(text, *v);
    return ok && errno != ERANGE;
  } else {
    return CLI::detail::lexical_cast(text, *v);
  }
}

}  // namespace detail

/// CPU thread counts of every subcommand (--threads): 0 (all cores) up to this.
inline constexpr int kMaxThreads = 1024;

/// The value must lie in [lo, hi] (or (lo, hi] with lo_open), and be finite when T is floating.
template <class T>
CLI::Validator in_range(T lo, T hi, bool lo_open = false) {
  const char* kind = std::is_floating_point_v<T> ? "a number" : "an integer";
  std::string range;
  if (hi == std::numeric_limits<T>::max())
    range = std::string(lo_open ? "> " : ">= ") + detail::num_str(lo);
  else
    range = std::string("in ") + (lo_open ? "(" : "[") + detail::num_str(lo) + ", " + detail::num_str(hi) + "]";
  const std::string must = std::string(kind) + " " + range;
  return CLI::Validator(
      [must, lo, hi, lo_open](std::string& text) -> std::string {
        T v{};
        if (!detail::convert(text, &v))
          return "must be " + must + "; got '" + text + "', which is not " + detail::type_words<T>();
        const bool ok = (lo_open ? v > lo : v >= lo) && v <= hi;  // false for NaN
        return ok ? std::string() : "must be " + must + "; got '" + text + "'";
      },
      std::string(std::is_floating_point_v<T> ? "NUMBER " : "INT ") + range);
}

/// The value must be >= lo (and, for floating T, finite).
template <class T>
CLI::Validator at_least(T lo) {
  return in_range<T>(lo, std::numeric_limits<T>::max());
}

/// Any value of an unsigned type, but not a negative number (which strtoull would wrap).
template <class T>
CLI::Validator non_negative_integer() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        T v{};
        return detail::convert(text, &v) ? std::string() : "must be " + detail::type_words<T>() + "; got '" + text + "'";
      },
      "UINT");
}

/// The value must not be empty (a path: '' would be reported as a file named '').
inline CLI::Validator non_empty(const std::string& what) {
  return CLI::Validator(
      [what](std::string& text) -> std::string { return text.empty() ? "is empty: give " + what : std::string(); },
      "PATH");
}

/// The value must be one of `allowed` (integers: head dims).
inline CLI::Validator one_of(std::vector<int> allowed) {
  std::string list;
  for (int a : allowed) list += (list.empty() ? "" : ", ") + std::to_string(a);
  return CLI::Validator(
      [allowed, list](std::string& text) -> std::string {
        int v = 0;
        if (detail::convert(text, &v))
          for (int a : allowed)
            if (a == v) return {};
        return "must be one of " + list + "; got '" + text + "'";
      },
      "INT in {" + list + "}");
}

/// The value must be a multiple of `step` in [step, hi] (head dims on the CPU backends).
inline CLI::Validator multiple_of_upto(int step, int hi) {
  const std::string must = "a multiple of " + std::to_string(step) + " in [" + std::to_string(step) + ", " +
                           std::to_string(hi) + "]";
  return CLI::Validator(
      [must, step, hi](std::string& text) -> std::string {
        int v = 0;
        const bool ok = detail::convert(text, &v) && v >= step && v <= hi && v % step == 0;
        return ok ? std::string() : "must be " + must + "; got '" + text + "'";
      },
      "INT " + must);
}

/// The value must be a power of two in [1, hi].
inline CLI::Validator power_of_two_upto(int hi) {
  const std::string must = "a power of two in [1, " + std::to_string(hi) + "]";
  return CLI::Validator(
      [must, hi](std::string& text) -> std::string {
        int v = 0;
        const bool ok = detail::convert(text, &v) && v >= 1 && v <= hi && (v & (v - 1)) == 0;
        return ok ? std::string() : "must be " + must + "; got '" + text + "'";
      },
      "INT " + must);
}

/// "" when `path` can be written; else why not, as a sentence that starts with the flag. Checked
/// before any work, so a typo in an output path fails at once rather than after the whole run.
/// A file that did not exist is created to prove it and removed again. With `create_folder` a
/// missing folder is created first (the report writers of check and audit make theirs).
inline std::string unwritable(const std::string& flag, const std::string& path, bool create_folder = false) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (create_folder && fs::path(path).has_parent_path()) fs::create_directories(fs::path(path).parent_path(), ec);
  if (fs::is_directory(path, ec)) return flag + " " + path + " is a directory; give a file path";
  const bool existed = fs::exists(path, ec);
  {
    std::ofstream f(path, std::ios::app | std::ios::binary);
    if (!f) {
      const fs::path parent = fs::path(path).parent_path();
      if (!parent.empty() && !fs::is_directory(parent, ec))
        return flag + " " + path + " cannot be written: its folder " + parent.string() + " does not exist";
      return flag + " " + path + " cannot be written (permission denied or a read-only file system)";
    }
  }
  if (!existed) fs::remove(path, ec);
  return {};
}

/// Parses argv. Returns -1 when the program should go on; otherwise the exit status: 0 after
/// --help or --version, 2 after any parse or validation error (CLI11 prints the message; its own
/// exit codes are 100 and up, which scripts would read as a crash-like failure).
inline int parse_args(CLI::App& app, int argc, char** argv) {
  // A first word that is no subcommand: CLI11 would say only "A subcommand is required".
  const std::vector<CLI::App*> subs = app.get_subcommands({});
  if (argc >= 2 && argv[1][0] != '-' && !subs.empty()) {
    std::string names;
    bool known = false;
    for (const CLI::App* sub : subs) {
      known = known || sub->check_name(argv[1]);
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::cerr << "flashcpp: unknown subcommand '" << argv[1] << "'; the subcommands are " << names
                << " (run with --help for more information)\n";
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return -1;
}

}  // namespace flashcpp::tools
