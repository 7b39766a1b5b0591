// What the validator fuzz targets share (fuzz_validate.cc, fuzz_decode_validate.cc,
// fuzz_fused_validate.cc): wrapping arithmetic for the decoders, exact-size host arrays, a decoder
// of the usual fields, and the check that a refusal carries a sentence.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>

#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp::fuzz {

// Wrapping int64 arithmetic: a decoder builds "natural" strides from fuzzed (possibly huge)
// extents and must not overflow itself (UBSan would stop the run).
inline std::int64_t wmul(std::int64_t a, std::int64_t b) {
  return static_cast<std::int64_t>(static_cast<std::uint64_t>(a) * static_cast<std::uint64_t>(b));
}
inline std::int64_t wadd(std::int64_t a, std::int64_t b) {
  return static_cast<std::int64_t>(static_cast<std::uint64_t>(a) + static_cast<std::uint64_t>(b));
}

/// Exact-size host array: a read one past the end is an ASan error. Size 0 is a valid,
/// non-null, unreadable block.
template <class T>
struct HostArray {
  std::unique_ptr<T[]> mem;
  std::int64_t n = 0;
  void alloc(std::int64_t count) {
    n = count;
    mem.reset(new T[static_cast<std::size_t>(count)]());
  }
  T* data() const { return mem.get(); }
};

/// Host arrays above this many entries are not built (the field gets a fake address and the
/// backend becomes one that does not read host arrays).
inline constexpr std::int64_t kMaxHostEntries = 1 << 14;

/// The usual fields: small values mostly, anything sometimes.
struct Fields {
  FuzzedDataProvider& f;
  int in(int lo, int hi) { return f.ConsumeIntegralInRange<int>(lo, hi); }
  bool rare(int one_in) { return in(0, one_in - 1) == 0; }
  int size(int lo, int hi) { return rare(16) ? f.ConsumeIntegral<int>() : in(lo, hi); }
  std::int64_t stride(std::int64_t natural) {
    switch (in(0, 7)) {
      case 0: return f.ConsumeIntegral<std::int64_t>();
      case 1: return wadd(natural, in(-8, 8));
      case 2: return 0;
      default: return natural;
    }
  }
  float real(float usual) {
    switch (in(0, 9)) {
      case 0: return std::numeric_limits<float>::quiet_NaN();
      case 1: return std::numeric_limits<float>::infinity();
      case 2: return -usual;
      case 3: return 0.f;
      case 4: return f.ConsumeFloatingPoint<float>();
      default: return usual;
    }
  }
  DType dtype(DType usual) { return rare(8) ? static_cast<DType>(in(0, 6)) : usual; }
  /// A fake address (never read) in slot `slot`, 4 GiB apart, 16-byte aligned unless rare; null
  /// rarely.
  void* fake(int slot) {
    if (rare(30)) return nullptr;
    const std::uintptr_t a = 0x100000000ull * static_cast<std::uintptr_t>(slot + 1) + (rare(20) ? in(1, 15) : 0);
    return reinterpret_cast<void*>(a);
  }
  /// A (seq, heads, dim) view at a fake address, natural strides mostly.
  void view(TensorView* t, DType dt, int seq, int heads, int dim, int slot) {
    t->data = fake(slot);
    t->dtype = dtype(dt);
    t->head_stride = stride(dim);
    t->seq_stride = stride(wmul(heads, dim));
    t->batch_stride = stride(wmul(wmul(seq, heads), dim));
  }
};

/// A refusal must be invalid_argument or unsupported, with a sentence; anything else aborts.
inline void expect_sentence(const Status& st, const char* what) {
  if (st.ok()) return;
  const bool known = st.code() == StatusCode::kInvalidArgument || st.code() == StatusCode::kUnsupported;
  if (!known || st.message().empty()) {
    std::fprintf(stderr, "validate(%s) failed without a sentence or with code %d: '%s'\n", what,
                 static_cast<int>(st.code()), st.message().c_str());
    std::abort();
  }
}

}  // namespace flashcpp::fuzz
