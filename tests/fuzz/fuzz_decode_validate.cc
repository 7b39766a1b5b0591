// libFuzzer target for flashcpp::validate(const DecodeParams&, Backend) (include/flashcpp/decode.h).
//
// Decodes random decode problems: shapes, head dims (head_dim_v included), dtypes (fp8 caches
// and unknown codes included), contiguous or paged caches with any page size, block-table
// stride and page count, host lengths and block-table entries anywhere (negative, past the
// cache), fp8 scales (null, misaligned, zero, NaN, Inf), the append, rotary and mask fields, and a
// backend. The contract it checks:
//   * validate() never crashes and never hits UB (ASan + UBSan, no recovery);
//   * it never dereferences q, o, the caches, the new K/V, lse, the rotary tables or the ALiBi
//     slopes: they are fake addresses, a read would fault;
//   * it reads the host arrays (cache_seqlens [batch], block_table [(batch - 1) * stride +
//     pages_per_seq], k_scale and v_scale [heads_kv]) only inside those documented sizes: they are
//     exact-size heap blocks, so ASan stops a read one element past the end;
//   * every failure carries a sentence and is invalid_argument or unsupported.
// What it accepts is not re-derived here (the decode tests run accepted problems against the fp64
// model); fuzz_validate.cc does that for attention.
//
// Build and run: tests/fuzz/run_fuzz.sh.
#include <cstdint>

#include "flashcpp/decode.h"
#include "fuzz_common.h"

namespace {

using namespace flashcpp;
using fuzz::HostArray;
using fuzz::kMaxHostEntries;
using fuzz::wadd;
using fuzz::wmul;
using Decoder = fuzz::Fields;

struct Case {
  DecodeParams p;
  Backend backend = Backend::kCpu;
  HostArray<std::int32_t> lens, table;
  HostArray<float> k_scale, v_scale;
};

void decode(FuzzedDataProvider& fdp, Case* c) {
  Decoder d{fdp};
  DecodeParams& p = c->p;
  c->backend = static_cast<Backend>(d.rare(30) ? d.in(4, 255) : d.in(0, 3));
  p.batch = d.rare(12) ? 0 : d.size(1, 4);
  p.seqlen_q = d.size(1, 17);
  p.heads_kv = d.size(1, 4);
  p.heads_q = d.rare(10) ? d.size(1, 16) : static_cast<int>(wmul(p.heads_kv, d.in(1, 4)));
  p.head_dim = d.rare(10) ? d.size(0, 300) : 8 * d.in(1, 32);
  p.head_dim_v = d.rare(4) ? (d.rare(5) ? d.size(0, 300) : 8 * d.in(1, 32)) : 0;
  const int dv = p.head_dim_v ? p.head_dim_v : p.head_dim;
  const DType dt = static_cast<DType>(d.in(0, 2));
  const bool fp8 = d.rare(3);
  const DType cdt = fp8 ? DType::kF8E4M3 : dt;

  KVCacheView& kv = p.cache;
  const bool paged = d.f.ConsumeBool();
  if (paged) {
    kv.page_size = d.rare(8) ? d.size(0, 300) : 1 << d.in(0, 8);
    kv.num_pages = d.size(1, 40);
    kv.pages_per_seq = d.size(1, 8);
    kv.block_table_stride = d.rare(8) ? d.stride(kv.pages_per_seq) : kv.pages_per_seq;
  } else {
    kv.capacity = d.size(1, 64);
  }
  const int rows = paged ? kv.page_size : kv.capacity;
  const int pages = paged ? kv.num_pages : p.batch;
  d.view(&kv.k, cdt, rows, p.heads_kv, p.head_dim, 0);
  d.view(&kv.v, cdt, rows, p.heads_kv, dv, 1);
  if (!paged) {
    kv.k.batch_stride = d.rare(8) ? kv.k.batch_stride : wmul(wmul(rows, p.heads_kv), p.head_dim);
    kv.v.batch_stride = d.rare(8) ? kv.v.batch_stride : wmul(wmul(rows, p.heads_kv), dv);
  }
  (void)pages;
  d.view(&p.q, dt, p.seqlen_q, p.heads_q, p.head_dim, 2);
  d.view(&p.o, dt, p.seqlen_q, p.heads_q, dv, 3);
  if (d.f.ConsumeBool()) {  // the append
    d.view(&p.k_new, dt, p.seqlen_q, p.heads_kv, p.head_dim, 4);
    d.view(&p.v_new, dt, p.seqlen_q, p.heads_kv, dv, 5);
  }
  if (d.f.ConsumeBool()) p.lse = static_cast<float*>(d.fake(6));

  // Host arrays, exact size, when small enough; else fake (and a backend that reads none).
  const std::int64_t n_lens = p.batch > 0 ? p.batch : 0;
  const __int128 n_table128 =
      paged && p.batch > 0 ? static_cast<__int128>(p.batch - 1) * kv.block_table_stride + kv.pages_per_seq : 0;
  const bool small = n_lens <= kMaxHostEntries && n_table128 >= 0 && n_table128 <= kMaxHostEntries &&
                     p.heads_kv >= 0 && p.heads_kv <= kMaxHostEntries;
  const std::int64_t n_table = small ? static_cast<std::int64_t>(n_table128) : 0;
  if (!small && (c->backend == Backend::kCpu || c->backend == Backend::kCpuReference)) c->backend = Backend::kCuda;
  if (small) {
    c->lens.alloc(n_lens);
    for (std::int64_t b = 0; b < n_lens; ++b)
      c->lens.data()[b] = d.rare(6) ? d.f.ConsumeIntegral<std::int32_t>() : d.in(0, 512);
    p.cache_seqlens = d.rare(30) ? nullptr : c->lens.data();
    if (paged) {
      c->table.alloc(n_table);
      for (std::int64_t i = 0; i < n_table; ++i)
        c->table.data()[i] = d.rare(8) ? d.f.ConsumeIntegral<std::int32_t>() : d.in(0, 40);
      kv.block_table = d.rare(30) ? nullptr : c->table.data();
    }
    if (fp8 || d.rare(10)) {  // scales: required for fp8, refused otherwise
      c->k_scale.alloc(p.heads_kv);
      c->v_scale.alloc(p.heads_kv);
      for (int h = 0; h < p.heads_kv; ++h) {
        c->k_scale.data()[h] = d.real(0.01f);
        c->v_scale.data()[h] = d.real(0.02f);
      }
      kv.k_scale = d.rare(20) ? nullptr : c->k_scale.data();
      kv.v_scale = d.rare(20) ? nullptr : c->v_scale.data();
      if (d.rare(20))  // misaligned
        kv.k_scale = reinterpret_cast<const float*>(reinterpret_cast<const char*>(c->k_scale.data()) + 1);
    }
  } else {
    p.cache_seqlens = static_cast<const std::int32_t*>(d.fake(7));
    if (paged) kv.block_table = static_cast<const std::int32_t*>(d.fake(8));
    if (fp8) kv.k_scale = kv.v_scale = static_cast<const float*>(d.fake(9));
  }

  p.softmax_scale = d.real(0.125f);
  MaskParams& m = p.mask;
  m.causal = d.f.ConsumeBool();
  m.window_left = d.f.ConsumeBool() ? -1 : d.size(-1, 40);
  m.window_right = d.f.ConsumeBool() ? -1 : d.size(-1, 40);
  m.softcap = d.rare(3) ? d.real(30.f) : 0.f;
  if (d.rare(4)) {
    m.alibi_slopes = static_cast<const float*>(d.fake(10));
    m.alibi_batch_stride = d.f.ConsumeBool() ? 0 : wadd(p.heads_q, d.rare(10) ? d.in(-1, 1) : 0);
  }
  if (d.rare(3)) {  // rotary by the formula (no tables: they would be read only on the device)
    p.rotary.style = static_cast<RopeStyle>(d.in(0, 3));
    p.rotary.rotary_dim = d.rare(4) ? d.size(0, 300) : 0;
    p.rotary.theta = d.real(10000.f);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider f(data, size);
  Case c;
  decode(f, &c);
  fuzz::expect_sentence(validate(c.p, c.backend), "DecodeParams");
  return 0;
}
