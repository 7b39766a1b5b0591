// libFuzzer target for flashcpp::validate().
//
// Decodes random shapes, strides (negative and huge included), pointers (null, misaligned,
// overlapping, near the top of the address space), dtypes, mask fields, varlen prefix sums and
// block-sparse arrays, and a backend, then calls validate(). The contract it checks:
//   * validate() never crashes and never hits UB (ASan + UBSan, no recovery);
//   * it never dereferences q/k/v/o/lse/alibi: they are fake addresses, a read would fault;
//   * it reads host mask arrays only inside their declared sizes: they are exact-size heap
//     blocks, so ASan catches a read one past the end;
//   * every failure carries a sentence and is invalid_argument or unsupported;
//   * whatever it accepts is truly valid, re-checked here independently: brute force over the
//     rows of small tensors (injectivity, element-level overlap), closed forms in __int128 for
//     large ones. An accepted-but-invalid set prints itself and traps.
//
// Build and run: tests/fuzz/run_fuzz.sh.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flashcpp/attention.h"
#include "fuzz_common.h"

namespace {

using namespace flashcpp;
using i128 = __int128;
using u128 = unsigned __int128;

constexpr i128 kI64Max = std::numeric_limits<std::int64_t>::max();
constexpr i128 kI32Max = std::numeric_limits<std::int32_t>::max();
constexpr u128 kAddrEnd = static_cast<u128>(std::numeric_limits<std::uintptr_t>::max());
/// Tensors with at most this many rows are checked row by row.
constexpr i128 kBruteRows = 1 << 12;
using fuzz::kMaxHostEntries;  // host mask arrays are built up to it; beyond, a backend that reads none

// ---- decoding ------------------------------------------------------------------------------
//
// Two regimes, chosen per input: "tame" inputs are valid except for rare, single corruptions
// (so that validate() accepts often and the oracle has work, including at the edges: int32
// offsets at INT32_MAX, sequence lengths at the maximum, adjacent buffers), "wild" inputs
// corrupt every field freely.

using fuzz::HostArray;
using fuzz::wadd;
using fuzz::wmul;

struct Case {
  AttnParams p;
  Backend backend = Backend::kCpu;
  BlockSparseMask bs;
  HostArray<std::int32_t> cu_q, cu_k, row_ptr, col_idx, partial;
};

bool reads_host(Backend b) { return b == Backend::kCpu || b == Backend::kCpuReference; }

struct Decoder {
  FuzzedDataProvider& f;
  bool wild = false;

  /// A corruption: one in `n` when tame, one in 3 when wild. Never once the input runs out
  /// (FuzzedDataProvider then returns the minimum), so short inputs decode to valid problems.
  bool rare(int n) {
    const int hi = wild ? 2 : n - 1;
    return f.ConsumeIntegralInRange(0, hi) == hi;
  }
  int in(int lo, int hi) { return f.ConsumeIntegralInRange(lo, hi); }
  std::int64_t in64(std::int64_t lo, std::int64_t hi) { return f.ConsumeIntegralInRange(lo, hi); }

  /// A size: usually in [lo, hi], sometimes large or anything.
  int size(int lo, int hi) {
    if (!rare(12)) return in(lo, hi);
    switch (in(0, 3)) {
      case 0: return f.ConsumeIntegral<int>();
      case 1: return in(-3, 0);
      default: return in(1 << 10, 1 << 24);
    }
  }

  float real(float usual) {
    if (!rare(16)) return usual;
    switch (in(0, 3)) {
      case 0: return std::numeric_limits<float>::quiet_NaN();
      case 1: return f.ConsumeBool() ? INFINITY : -INFINITY;
      case 2: return f.ConsumeFloatingPointInRange<float>(-100.f, 100.f);
      default: return -0.f;
    }
  }

  /// A fake address. Tame: tensor `slot` lives at slot * 4 GiB plus an offset, so buffers are
  /// distinct unless an offset or a corruption says otherwise. Never dereferenced.
  std::uintptr_t pointer(int slot, const std::vector<std::uintptr_t>& earlier) {
    const std::uintptr_t base = static_cast<std::uintptr_t>(slot + 1) << 32;
    if (!rare(6)) return base + (static_cast<std::uintptr_t>(in(0, 1 << 16)) << 4);
    switch (in(0, 7)) {
      case 0: return 0;
      case 1: return f.ConsumeIntegralInRange<std::uintptr_t>(0, 4096);
      case 2: return base + f.ConsumeIntegralInRange<std::uintptr_t>(0, 1 << 20);  // misaligned
      case 3:
      case 4: {  // next to an earlier pointer: overlap, or exactly adjacent
        if (earlier.empty()) return base;
        const std::uintptr_t e = earlier[f.ConsumeIntegralInRange<std::size_t>(0, earlier.size() - 1)];
        const std::int64_t d = in64(-(1 << 22), 1 << 22);
        return e + static_cast<std::uintptr_t>(f.ConsumeBool() ? d & ~std::int64_t{15} : d);
      }
      case 5: return std::numeric_limits<std::uintptr_t>::max() - f.ConsumeIntegral<std::uint32_t>();
      case 6: return f.ConsumeIntegral<std::uintptr_t>();
      default: return (std::uintptr_t{1} << 40) + (f.ConsumeIntegral<std::uint32_t>() & ~15u);
    }
  }

  std::int64_t stride(std::int64_t natural) {
    if (!rare(10)) return natural;
    switch (in(0, 5)) {
      case 0: return f.ConsumeIntegral<std::int64_t>();
      case 1: return in64(-16, 4096);
      case 2: return wadd(natural, in64(-8, 64));
      case 3: return wmul(natural, in64(0, 3));
      case 4: return std::numeric_limits<std::int64_t>::max() / in64(1, 1 << 16);
      default: return wmul(natural, -1);
    }
  }

  /// Layout of one tensor: flash-attn, SDPA, packed qkv (three tensors per row), fuzzed strides,
  /// or strides that put the in-sequence offset right at the int32 limit.
  void layout(int kind, std::int64_t seq, std::int64_t heads, std::int64_t dim, TensorView* t) {
    switch (kind) {
      case 0:  // (batch, seq, head, dim) as bshd_view
        t->head_stride = dim;
        t->seq_stride = wmul(heads, dim);
        t->batch_stride = wmul(seq, t->seq_stride);
        break;
      case 1:  // (batch, head, seq, dim) as bhsd_view
        t->seq_stride = dim;
        t->head_stride = wmul(seq, dim);
        t->batch_stride = wmul(heads, t->head_stride);
        break;
      case 2:  // (batch, seq, 3, head, dim)
        t->head_stride = dim;
        t->seq_stride = wmul(3, wmul(heads, dim));
        t->batch_stride = wmul(seq, t->seq_stride);
        break;
      case 3: {  // (seq-1)*seq_stride + (heads-1)*head_stride + dim == INT32_MAX + delta
        const std::int64_t target = std::numeric_limits<std::int32_t>::max() + in64(-8, 8);
        t->head_stride = dim;
        t->seq_stride = wmul(heads, dim);
        if (seq > 1 && heads >= 1 && seq < (1 << 20) && heads < (1 << 20)) {
          const std::int64_t r = target - dim - (heads - 1) * dim;
          t->seq_stride = std::max<std::int64_t>(r / (seq - 1), heads * dim);
        } else if (heads > 1 && heads < (1 << 20)) {
          t->head_stride = std::max<std::int64_t>((target - dim) / (heads - 1), dim);
          t->seq_stride = wmul(heads, t->head_stride);
        }
        if (f.ConsumeBool()) t->seq_stride &= ~std::int64_t{7};
        t->batch_stride = wmul(std::max<std::int64_t>(seq, 1), t->seq_stride);
        break;
      }
      default:
        t->head_stride = stride(dim);
        t->seq_stride = stride(wmul(heads, dim));
        t->batch_stride = stride(wmul(seq, wmul(heads, dim)));
        return;
    }
    if (rare(8)) {  // perturb one stride
      std::int64_t* s[3] = {&t->batch_stride, &t->seq_stride, &t->head_stride};
      std::int64_t* which = s[in(0, 2)];
      *which = stride(*which);
      if (!wild) *which = stride(*which);
    }
  }

  /// Host prefix sums (exact size batch + 1) or, for backends that do not read them, any address.
  const std::int32_t* cu_seqlens(Case* c, HostArray<std::int32_t>& a, int max_len, bool build) {
    const AttnParams& p = c->p;
    if (rare(25)) return nullptr;
    if (build && rare(25)) {  // misaligned: validate must refuse before reading
      a.alloc(p.batch + 2);
      return reinterpret_cast<const std::int32_t*>(reinterpret_cast<const char*>(a.data()) + 2);
    }
    if (!build) return reinterpret_cast<const std::int32_t*>(pointer(5, {}) & ~std::uintptr_t{3});
    a.alloc(p.batch + 1);
    const std::int64_t mx = std::max(max_len, 0);
    std::int64_t acc = 0;
    for (int b = 0; b < p.batch; ++b) {
      std::int64_t len = in(0, 3) == 0 ? mx : in64(0, mx);  // often exactly the maximum
      if (rare(40)) len = in(0, 1) ? mx + 1 : in64(-3, mx + 3);
      acc = std::clamp<std::int64_t>(acc + len, INT32_MIN, INT32_MAX);
      a.data()[b + 1] = static_cast<std::int32_t>(acc);
    }
    if (rare(40)) a.data()[0] = in(-2, 2);
    return a.data();
  }

  void varlen(Case* c) {
    AttnParams& p = c->p;
    const bool small_batch = p.batch >= 0 && p.batch < kMaxHostEntries;
    if (reads_host(c->backend) && !small_batch) c->backend = Backend::kAuto;
    const bool build = small_batch && (reads_host(c->backend) || f.ConsumeBool());
    p.mask.cu_seqlens_q = cu_seqlens(c, c->cu_q, p.seqlen_q, build);
    p.mask.cu_seqlens_k = cu_seqlens(c, c->cu_k, p.seqlen_k, build);
    if (rare(3)) {  // the packed layouts have no batch dim: any batch_stride is ignored
      for (TensorView* t : {&p.q, &p.k, &p.v, &p.o}) t->batch_stride = f.ConsumeIntegral<std::int64_t>();
    }
  }

  int near(int usual) {
    if (!rare(20)) return usual;
    switch (in(0, 2)) {
      case 0: return f.ConsumeIntegral<int>();
      case 1: return in(-2, 3);
      default:
        return static_cast<int>(
            std::clamp<std::int64_t>(static_cast<std::int64_t>(usual) + in(-1, 1), INT32_MIN, INT32_MAX));
    }
  }

  void block_sparse(Case* c) {
    AttnParams& p = c->p;
    BlockSparseMask& m = c->bs;
    m.block_m = rare(20) ? f.PickValueInArray({0, -64, 7, 1}) : f.PickValueInArray({16, 32, 64, 128});
    m.block_n = rare(20) ? f.PickValueInArray({0, -64, 9, 1}) : f.PickValueInArray({16, 32, 64, 128});
    const auto ceil_or_0 = [](int n, int b) -> int {
      return (n >= 0 && b > 0) ? static_cast<int>((static_cast<std::int64_t>(n) + b - 1) / b) : 0;
    };
    m.num_batch = near(f.ConsumeBool() ? 1 : p.batch);
    m.num_heads = near(f.ConsumeBool() ? 1 : p.heads_q);
    m.num_q_blocks = near(ceil_or_0(p.seqlen_q, m.block_m));
    m.num_k_blocks = near(ceil_or_0(p.seqlen_k, m.block_n));
    m.num_partial = rare(20) ? -1 : in64(0, 4);
    m.element_masks = reinterpret_cast<const std::uint64_t*>(
        rare(10) ? f.PickValueInArray<std::uintptr_t>({0, 0x700000004, 0x700000001}) : 0x700000000);

    // validate() reads row_ptr[0..rows] on the host backends; build exactly that much.
    const i128 rows = static_cast<i128>(m.num_batch) * m.num_heads * m.num_q_blocks;
    if (reads_host(c->backend) && (rows < 0 || rows >= kMaxHostEntries)) c->backend = Backend::kAuto;
    if (!reads_host(c->backend) && f.ConsumeBool()) {  // "device" arrays: never read
      m.row_ptr = reinterpret_cast<const std::int32_t*>(pointer(6, {}) & ~std::uintptr_t{3});
      m.col_idx = reinterpret_cast<const std::int32_t*>(pointer(7, {}) & ~std::uintptr_t{3});
      m.partial = reinterpret_cast<const std::int32_t*>(pointer(8, {}) & ~std::uintptr_t{3});
      return;
    }
    const std::int64_t nrows = rows > 0 && rows < kMaxHostEntries ? static_cast<std::int64_t>(rows) : 0;
    c->row_ptr.alloc(nrows + 1);
    std::int32_t* rp = c->row_ptr.data();
    for (std::int64_t r = 0; r < nrows; ++r) rp[r + 1] = rp[r] + in(0, 3);
    if (rare(30)) rp[in64(0, nrows)] += in(-3, 3);
    const std::int64_t nnz = std::max<std::int32_t>(rp[nrows], 0);
    c->col_idx.alloc(nnz);
    c->partial.alloc(nnz);
    const std::int32_t np = static_cast<std::int32_t>(std::clamp<std::int64_t>(m.num_partial, 0, 4));
    for (std::int64_t r = 0; r < nrows; ++r) {  // ascending key blocks, sometimes broken
      std::int32_t col = in(0, 2);
      const std::int64_t first = std::max(rp[r], 0);  // rp may be corrupted (negative)
      for (std::int64_t i = first; i < std::min<std::int64_t>(rp[r + 1], nnz); ++i) {
        std::int32_t& ci = c->col_idx.data()[i];
        ci = col;
        if (rare(60)) ci = i > first ? c->col_idx.data()[i - 1] : -1;  // repeat, or negative
        if (rare(60)) ci = m.num_k_blocks;                             // one past the end
        col += in(1, 2);
        std::int32_t& pi = c->partial.data()[i];
        pi = np > 0 && f.ConsumeBool() ? in(0, np - 1) : -1;
        if (rare(60)) pi = f.PickValueInArray({-2, np, np + 1});
      }
    }
    m.row_ptr = rp;
    m.col_idx = c->col_idx.data();
    m.partial = c->partial.data();
    if (rare(15)) {
      switch (in(0, 3)) {
        case 0: m.row_ptr = nullptr; break;
        case 1: m.col_idx = nullptr; break;
        case 2: m.partial = nullptr; break;
        default: m.row_ptr = reinterpret_cast<const std::int32_t*>(reinterpret_cast<const char*>(rp) + 2);
      }
    }
  }

  void decode(Case* c) {
    AttnParams& p = c->p;
    wild = in(0, 4) == 4;
    c->backend = static_cast<Backend>(rare(40) ? in(4, 255) : in(0, 3));
    p.batch = rare(12) ? 0 : size(1, 4);
    p.seqlen_q = rare(12) ? 0 : size(1, 40);
    p.seqlen_k = rare(12) ? 0 : size(1, 40);
    p.heads_kv = size(1, 4);
    p.heads_q = rare(12) ? size(1, 64)
                         : static_cast<int>(std::clamp<std::int64_t>(
                               static_cast<std::int64_t>(p.heads_kv) * in(1, 3), INT32_MIN, INT32_MAX));
    // Mostly the CUDA set, else any multiple of 8 up to 256 (the CPU backends), else anything.
    auto dim = [&] {
      return rare(12) ? size(0, 300) : rare(4) ? 8 * in(1, 32) : f.PickValueInArray({64, 128, 256});
    };
    p.head_dim = dim();
    p.head_dim_v = rare(5) ? dim() : rare(20) ? p.head_dim : 0;  // 0: head_dim_v = head_dim
    const int dv = p.effective_head_dim_v();

    const DType dt = static_cast<DType>(in(0, 2));
    p.q.dtype = p.k.dtype = p.v.dtype = p.o.dtype = dt;
    if (rare(20)) {
      TensorView* ts[4] = {&p.q, &p.k, &p.v, &p.o};
      ts[in(0, 3)]->dtype = static_cast<DType>(in(0, 3));
    }

    const int kind = in(0, 4);
    auto kind_of = [&] { return rare(8) ? in(0, 4) : kind; };
    layout(kind_of(), p.seqlen_q, p.heads_q, p.head_dim, &p.q);
    layout(kind_of(), p.seqlen_k, p.heads_kv, p.head_dim, &p.k);
    layout(kind_of(), p.seqlen_k, p.heads_kv, dv, &p.v);
    const int ko = kind_of();
    layout(ko == 2 ? 0 : ko, p.seqlen_q, p.heads_q, dv, &p.o);

    std::vector<std::uintptr_t> ptrs;
    if (kind == 2 && f.ConsumeBool()) {  // one packed qkv buffer
      const std::uintptr_t base = pointer(0, {});
      const std::uintptr_t step = static_cast<std::uintptr_t>(p.heads_q) * p.head_dim * dtype_size(dt);
      ptrs = {base, base + step, base + 2 * step};
    } else {
      for (int i = 0; i < 3; ++i) ptrs.push_back(pointer(i, ptrs));
    }
    p.q.data = reinterpret_cast<void*>(ptrs[0]);
    p.k.data = reinterpret_cast<void*>(ptrs[1]);
    p.v.data = reinterpret_cast<void*>(ptrs[2]);
    ptrs.push_back(pointer(3, ptrs));
    p.o.data = reinterpret_cast<void*>(ptrs.back());
    if (f.ConsumeBool()) p.lse = reinterpret_cast<float*>(pointer(4, ptrs));

    p.softmax_scale = real(f.ConsumeBool() ? 0.f : 0.125f);
    MaskParams& m = p.mask;
    m.causal = f.ConsumeBool();
    m.window_left = f.ConsumeBool() ? -1 : size(-1, 40);
    m.window_right = f.ConsumeBool() ? -1 : size(-1, 40);
    m.global_tokens = f.ConsumeBool() ? 0 : size(0, 8);
    m.global_queries = m.global_tokens > 0 ? f.ConsumeBool() : rare(20);
    m.softcap = real(f.ConsumeBool() ? 0.f : 30.f);
    if (f.ConsumeBool()) {
      m.alibi_slopes = reinterpret_cast<const float*>(0x600000000 + (rare(15) ? in(1, 3) : 0));
      m.alibi_batch_stride = f.ConsumeBool() ? 0 : p.heads_q;
      if (rare(15)) m.alibi_batch_stride += in(-1, 1);
    }
    const int extras = in(0, 5);
    if (extras == 1 || extras == 2 || (extras == 3 && rare(10))) varlen(c);
    if (extras == 3 || extras == 4) {
      block_sparse(c);
      m.block_sparse = &c->bs;
    }
  }
};

// ---- the independent oracle ------------------------------------------------------------------

struct Verdict {
  bool ok = true;
  std::string why;
  void fail(const std::string& w) {
    if (ok) why = w;
    ok = false;
  }
};

std::string s128(i128 v) {
  if (v == 0) return "0";
  const bool neg = v < 0;
  u128 u = neg ? -static_cast<u128>(v) : static_cast<u128>(v);
  std::string s;
  while (u) s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(u % 10))), u /= 10;
  return neg ? "-" + s : s;
}

/// Byte intervals [lo, hi) that one tensor touches: one per row when small, else the hull.
struct Intervals {
  std::vector<std::pair<u128, u128>> iv;
};

/// One tensor: (outer dims with extents and strides) x (head_dim, stride 1).
struct Map {
  const char* name;
  std::uintptr_t addr;
  std::int64_t elem;
  i128 ext[3], str[3];  // outer dims (batch or 1, seq, head)
  i128 seq_max;         // rows inside one sequence (the 32-bit rule)
  i128 dim;
  bool varlen_seq;  // the packed seq stride places sequences, whatever its extent
};

void check_tensor(const Map& m, Backend b, Verdict* v, Intervals* out) {
  const std::string n = m.name;
  if (m.addr == 0) return v->fail(n + " is null");
  if (m.addr % m.elem) return v->fail(n + " is not element-aligned");
  if (b == Backend::kCuda && m.addr % 16) return v->fail(n + " is not 16-byte aligned on CUDA");
  i128 rows = 1, lo = 0, hi = m.dim - 1;
  for (int i = 0; i < 3; ++i) {
    const bool used = m.ext[i] > 1 || (i == 1 && m.varlen_seq);
    if (m.ext[i] > 1 && m.str[i] < 0) return v->fail(n + ": negative stride on a dim of extent > 1");
    if (b == Backend::kCuda && used && m.str[i] % 8) return v->fail(n + ": CUDA stride not a multiple of 8");
    rows *= std::max<i128>(m.ext[i], 0);
    const i128 reach = (std::max<i128>(m.ext[i], 1) - 1) * m.str[i];
    (reach < 0 ? lo : hi) += reach;
  }
  if (rows == 0) return;
  if (lo < 0) return v->fail(n + ": negative offsets");
  if ((hi + 1) * m.elem > kI64Max)
    return v->fail(n + ": byte span over int64 (" + s128(hi + 1) + " elements)");
  if (static_cast<u128>(m.addr) + static_cast<u128>((hi + 1) * m.elem) > kAddrEnd)
    return v->fail(n + ": span wraps the address space");
  const i128 in_seq = (std::max<i128>(m.seq_max, 1) - 1) * m.str[1] + (m.ext[2] - 1) * m.str[2] + m.dim;
  if (in_seq > kI32Max) return v->fail(n + ": in-sequence offset " + s128(in_seq) + " over int32");
  const u128 a = m.addr;
  if (rows <= kBruteRows) {
    std::vector<i128> starts;
    starts.reserve(static_cast<std::size_t>(rows));
    for (i128 x = 0; x < m.ext[0]; ++x)
      for (i128 y = 0; y < m.ext[1]; ++y)
        for (i128 z = 0; z < m.ext[2]; ++z) starts.push_back(x * m.str[0] + y * m.str[1] + z * m.str[2]);
    std::sort(starts.begin(), starts.end());
    for (std::size_t i = 1; i < starts.size(); ++i)
      if (starts[i] - starts[i - 1] < m.dim)
        return v->fail(n + ": rows at offsets " + s128(starts[i - 1]) + " and " + s128(starts[i]) +
                       " overlap (head_dim " + s128(m.dim) + ")");
    for (i128 s : starts)
      out->iv.push_back({a + static_cast<u128>(s * m.elem), a + static_cast<u128>((s + m.dim) * m.elem)});
  } else {
    // Closed form: sorted by stride, each dim must clear what the smaller ones reach.
    struct D {
      i128 s, e;
    };
    std::vector<D> ds = {{1, m.dim}};
    for (int i = 0; i < 3; ++i)
      if (m.ext[i] > 1) ds.push_back({m.str[i], m.ext[i]});
    std::sort(ds.begin(), ds.end(), [](const D& x, const D& y) { return x.s < y.s; });
    i128 reach = 0;
    for (const D& d : ds) {
      if (d.s <= reach) return v->fail(n + ": strides not injective (closed form)");
      reach += (d.e - 1) * d.s;
    }
    out->iv.push_back({a, a + static_cast<u128>((hi + 1) * m.elem)});
  }
}

/// True when some interval of `x` meets some interval of `y`; each list is sorted and disjoint.
bool meet(const Intervals& x, const Intervals& y) {
  std::size_t i = 0, j = 0;
  while (i < x.iv.size() && j < y.iv.size()) {
    if (x.iv[i].second <= y.iv[j].first)
      ++i;
    else if (y.iv[j].second <= x.iv[i].first)
      ++j;
    else
      return true;
  }
  return false;
}

Verdict oracle(const AttnParams& p, Backend b) {
  Verdict v;
  if (b != Backend::kAuto && b != Backend::kCpu && b != Backend::kCpuReference && b != Backend::kCuda)
    v.fail("unknown backend");
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.heads_q < 1 || p.heads_kv < 1) v.fail("bad sizes");
  if (!v.ok) return v;
  if (p.heads_q % p.heads_kv) v.fail("heads not divisible");
  // Head dims: a multiple of 8 in [8, 256] (head_dim_v 0 means head_dim_v = head_dim), on every
  // backend (the CUDA kernels pad to their class inside).
  const auto dim_ok = [](i128 d) { return d >= 8 && d <= 256 && d % 8 == 0; };
  const i128 dv = p.head_dim_v == 0 ? p.head_dim : p.head_dim_v;
  if (!dim_ok(p.head_dim) || !dim_ok(dv)) v.fail("unsupported head_dim or head_dim_v");
  for (DType t : {p.q.dtype, p.k.dtype, p.v.dtype, p.o.dtype})
    if (t != p.q.dtype || static_cast<int>(t) > 2) v.fail("dtype mismatch or unknown");
  if (b == Backend::kCuda && p.q.dtype == DType::kF32) v.fail("fp32 on CUDA");
  const MaskParams& m = p.mask;
  if (!std::isfinite(p.softmax_scale)) v.fail("softmax_scale not finite");
  if (!(std::isfinite(m.softcap) && m.softcap >= 0)) v.fail("bad softcap");
  if (m.window_left < -1 || m.window_right < -1 || m.global_tokens < 0) v.fail("bad window/global");
  if (m.global_queries && m.global_tokens <= 0) v.fail("global_queries without tokens");
  if (m.alibi_slopes && m.alibi_batch_stride != 0 && m.alibi_batch_stride != p.heads_q)
    v.fail("alibi stride");
  if ((m.cu_seqlens_q == nullptr) != (m.cu_seqlens_k == nullptr)) v.fail("half varlen");
  const bool varlen = m.cu_seqlens_q && m.cu_seqlens_k;
  if (varlen && m.block_sparse) v.fail("varlen + block-sparse");
  if (p.lse && !varlen && static_cast<i128>(p.batch) * p.heads_q * p.seqlen_q * 4 > kI64Max)
    v.fail("lse count");
  const BlockSparseMask* bs = m.block_sparse;
  i128 bs_rows = 0;
  if (bs) {
    if (bs->block_m <= 0 || bs->block_n <= 0) return v.fail("block size"), v;
    if (bs->num_batch != 1 && bs->num_batch != p.batch) v.fail("num_batch");
    if (bs->num_heads != 1 && bs->num_heads != p.heads_q) v.fail("num_heads");
    if (bs->num_q_blocks != (static_cast<i128>(p.seqlen_q) + bs->block_m - 1) / bs->block_m)
      v.fail("num_q_blocks");
    if (bs->num_k_blocks != (static_cast<i128>(p.seqlen_k) + bs->block_n - 1) / bs->block_n)
      v.fail("num_k_blocks");
    if (bs->num_partial < 0) v.fail("num_partial");
    bs_rows = static_cast<i128>(bs->num_batch) * bs->num_heads * bs->num_q_blocks;
    if (bs_rows > kI64Max) v.fail("block-sparse rows");
  }
  if (!v.ok || p.batch == 0 || p.seqlen_q == 0) return v;

  // Varlen: packed row counts (read on the host backends, the maxima stand in on the device).
  const bool host = b == Backend::kCpu || b == Backend::kCpuReference;
  i128 rows_q = p.seqlen_q, rows_k = p.seqlen_k;
  if (varlen) {
    for (int w = 0; w < 2; ++w) {
      const std::int32_t* cu = w ? m.cu_seqlens_k : m.cu_seqlens_q;
      const int mx = w ? p.seqlen_k : p.seqlen_q;
      if (reinterpret_cast<std::uintptr_t>(cu) % 4) return v.fail("cu_seqlens misaligned"), v;
      if (!host) continue;
      if (cu[0] != 0) return v.fail("cu_seqlens[0] != 0"), v;
      for (int i = 0; i < p.batch; ++i)
        if (cu[i + 1] < cu[i] || cu[i + 1] - static_cast<i128>(cu[i]) > mx)
          return v.fail("cu_seqlens lengths"), v;
      (w ? rows_k : rows_q) = cu[p.batch];
    }
  }
  Intervals iq, ik, iv, io, ilse;
  auto map = [&](const char* name, const TensorView& t, i128 rows, i128 mx, i128 heads, i128 dim) {
    Map mp{name,
           reinterpret_cast<std::uintptr_t>(t.data),
           static_cast<std::int64_t>(dtype_size(t.dtype)),
           {varlen ? 1 : p.batch, rows, heads},
           {varlen ? 0 : t.batch_stride, t.seq_stride, t.head_stride},
           mx,
           dim,
           varlen && !host};
    return mp;
  };
  check_tensor(map("q", p.q, rows_q, p.seqlen_q, p.heads_q, p.head_dim), b, &v, &iq);
  check_tensor(map("o", p.o, rows_q, p.seqlen_q, p.heads_q, dv), b, &v, &io);
  if (p.seqlen_k > 0) {
    check_tensor(map("k", p.k, rows_k, p.seqlen_k, p.heads_kv, p.head_dim), b, &v, &ik);
    check_tensor(map("v", p.v, rows_k, p.seqlen_k, p.heads_kv, dv), b, &v, &iv);
  }
  if (!v.ok) return v;
  if (p.lse) {
    const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(p.lse);
    const i128 bytes = static_cast<i128>(p.heads_q) * rows_q * (varlen ? 1 : p.batch) * 4;
    if (a % 4) v.fail("lse misaligned");
    if (bytes > kI64Max || static_cast<u128>(a) + static_cast<u128>(bytes) > kAddrEnd) v.fail("lse span");
    if (bytes > 0) ilse.iv.push_back({a, static_cast<u128>(a) + static_cast<u128>(bytes)});
  }
  if (m.alibi_slopes && reinterpret_cast<std::uintptr_t>(m.alibi_slopes) % 4) v.fail("alibi misaligned");
  if (meet(io, iq) || meet(io, ik) || meet(io, iv) || meet(io, ilse)) v.fail("o overlaps an input or lse");
  if (meet(ilse, iq) || meet(ilse, ik) || meet(ilse, iv)) v.fail("lse overlaps an input");
  if (!v.ok || !bs) return v;

  for (const void* a : {static_cast<const void*>(bs->row_ptr), static_cast<const void*>(bs->col_idx),
                        static_cast<const void*>(bs->partial)})
    if (!a || reinterpret_cast<std::uintptr_t>(a) % 4)
      return v.fail("block-sparse array null or misaligned"), v;
  if (bs->num_partial > 0 && !bs->element_masks) v.fail("element_masks null");
  if (reinterpret_cast<std::uintptr_t>(bs->element_masks) % 8) v.fail("element_masks misaligned");
  if (!v.ok || !host) return v;
  const std::int32_t* rp = bs->row_ptr;
  if (rp[0] != 0) return v.fail("row_ptr[0]"), v;
  for (i128 r = 0; r < bs_rows; ++r) {
    if (rp[r + 1] < rp[r]) return v.fail("row_ptr decreasing"), v;
    for (std::int32_t i = rp[r]; i < rp[r + 1]; ++i) {
      if (bs->col_idx[i] < 0 || bs->col_idx[i] >= bs->num_k_blocks) return v.fail("col_idx range"), v;
      if (i > rp[r] && bs->col_idx[i] <= bs->col_idx[i - 1]) return v.fail("col_idx order"), v;
      if (bs->partial[i] < -1 || bs->partial[i] >= bs->num_partial) return v.fail("partial range"), v;
    }
  }
  return v;
}

void dump(const Case& c, const Status& st, const std::string& why) {
  const AttnParams& p = c.p;
  std::fprintf(stderr, "validate() accepted an invalid problem: %s\n  status: %s\n  backend %s\n",
               why.c_str(), st.to_string().c_str(), backend_name(c.backend));
  std::fprintf(stderr, "  batch %d seqlen_q %d seqlen_k %d heads_q %d heads_kv %d head_dim %d head_dim_v %d\n",
               p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim, p.head_dim_v);
  const std::pair<const char*, const TensorView*> ts[] = {{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"o", &p.o}};
  for (auto [n, t] : ts)
    std::fprintf(stderr, "  %s: %p %s strides (%lld, %lld, %lld)\n", n, t->data, dtype_name(t->dtype),
                 static_cast<long long>(t->batch_stride), static_cast<long long>(t->seq_stride),
                 static_cast<long long>(t->head_stride));
  std::fprintf(stderr, "  lse %p varlen %d block_sparse %d\n", static_cast<void*>(p.lse), p.mask.is_varlen(),
               p.mask.block_sparse != nullptr);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider f(data, size);
  Case c;
  Decoder{f}.decode(&c);
  const Status st = validate(c.p, c.backend);
  if (!st.ok()) {
    if (st.message().empty() ||
        (st.code() != StatusCode::kInvalidArgument && st.code() != StatusCode::kUnsupported)) {
      std::fprintf(stderr, "validate() failed without a proper status: %s\n", st.to_string().c_str());
      __builtin_trap();
    }
    return 0;
  }
  const Verdict v = oracle(c.p, c.backend);
  if (!v.ok) {
    dump(c, st, v.why);
    __builtin_trap();
  }
  return 0;
}
