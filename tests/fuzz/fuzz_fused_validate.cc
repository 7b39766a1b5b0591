// libFuzzer target for the fused ops' validators (include/flashcpp/fused.h): validate() of
// RmsNormParams (with and without the residual), SiluMulParams, RopeParams, QkNormRopeParams and
// RopeAppendParams, one per input.
//
// Decodes random sizes, row strides, dtypes (unknown codes included), eps, head dims, rotary
// specs (styles, rotary_dim, theta, Llama-3 scaling, cos/sin tables and their row stride), q/k
// views with any strides, in-place or separate outputs, positions and a backend. The contract:
//   * validate() never crashes and never hits UB (ASan + UBSan, no recovery);
//   * it never dereferences the tensors or the rotary tables: they are fake addresses;
//   * it reads the positions array only inside its documented size (batch * seqlen int32), an
//     exact-size heap block, so ASan stops a read one element past the end; likewise
//     rope_append_kv's lengths, block table and an fp8 cache's k_scale / v_scale (heads_kv fp32
//     each: positive and finite mostly, else 0, negative, NaN or infinite; sometimes null,
//     misaligned, or set on a cache that is not fp8);
//   * every failure carries a sentence and is invalid_argument or unsupported.
//
// Build and run: tests/fuzz/run_fuzz.sh.
#include <cmath>
#include <cstdint>
#include <memory>

#include "flashcpp/fused.h"
#include "fuzz_common.h"

namespace {

using namespace flashcpp;
using fuzz::kMaxHostEntries;
using fuzz::wmul;

/// The fields of fuzz_common.h; tensors at fake addresses in one of 16 slots 4 GiB apart (so that
/// separate tensors mostly do not overlap, and sometimes share a slot).
struct Decoder : fuzz::Fields {
  void* fake() { return Fields::fake(in(0, 15)); }
  MatrixView matrix(DType dt, std::int64_t cols) { return MatrixView{fake(), dtype(dt), stride(cols)}; }
  void view(TensorView* t, DType dt, int seq, int heads, int dim) { Fields::view(t, dt, seq, heads, dim, in(0, 15)); }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  Decoder d{{fdp}};
  const Backend backend = static_cast<Backend>(d.rare(30) ? d.in(4, 255) : d.in(0, 3));
  const DType dt = static_cast<DType>(d.in(0, 2));
  switch (d.in(0, 4)) {
    case 0: {  // RMSNorm, with or without the residual
      RmsNormParams p;
      p.rows = d.size(0, 64);
      p.hidden = d.size(0, 4096);
      p.x = d.matrix(dt, p.hidden);
      p.y = d.rare(4) ? p.x : d.matrix(dt, p.hidden);
      const bool residual = d.f.ConsumeBool();
      if (residual) {
        p.residual = d.matrix(dt, p.hidden);
        p.residual_out = d.rare(4) ? p.residual : d.matrix(dt, p.hidden);
      }
      p.weight = d.fake();
      p.eps = d.real(1e-6f);
      fuzz::expect_sentence(validate(p, residual, backend), "RmsNormParams");
      break;
    }
    case 1: {  // SwiGLU
      SiluMulParams p;
      p.rows = d.size(0, 64);
      p.d = d.size(0, 4096);
      p.gate = d.matrix(dt, wmul(2, p.d));
      if (d.rare(3) && p.gate.data != nullptr) {  // up inside gate's rows ([gate | up] of one projection)
        const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(p.gate.data) + static_cast<std::uintptr_t>(d.in(0, 64));
        p.up = MatrixView{reinterpret_cast<void*>(a), p.gate.dtype, p.gate.row_stride};
      } else {
        p.up = d.matrix(dt, p.d);
      }
      p.out = d.rare(4) ? p.gate : d.matrix(dt, p.d);
      fuzz::expect_sentence(validate(p, backend), "SiluMulParams");
      break;
    }
    case 3: {  // QK-RMSNorm + rotary (tables fake: only positions are host memory)
      QkNormRopeParams p;
      p.batch = d.rare(12) ? 0 : d.size(1, 4);
      p.seqlen = d.size(0, 40);
      p.heads_q = d.size(0, 8);
      p.heads_k = d.f.ConsumeBool() ? 0 : d.size(1, 8);
      p.head_dim = d.rare(8) ? d.size(0, 600) : 2 * d.in(1, 128);
      d.view(&p.q, dt, p.seqlen, p.heads_q, p.head_dim);
      if (p.heads_k) d.view(&p.k, dt, p.seqlen, p.heads_k, p.head_dim);
      if (d.f.ConsumeBool()) d.view(&p.q_out, dt, p.seqlen, p.heads_q, p.head_dim);
      if (p.heads_k && d.f.ConsumeBool()) d.view(&p.k_out, dt, p.seqlen, p.heads_k, p.head_dim);
      p.q_weight = d.rare(10) ? nullptr : d.fake();
      p.k_weight = p.heads_k || d.rare(10) ? d.fake() : nullptr;
      p.weight_offset = d.rare(6) ? d.real(0.5f) : static_cast<float>(d.in(0, 1));
      p.eps = d.real(1e-6f);
      RotarySpec& r = p.rotary;
      r.style = static_cast<RopeStyle>(d.rare(6) ? d.in(0, 3) : d.in(1, 2));
      r.rotary_dim = d.rare(3) ? d.size(0, 300) : 0;
      r.theta = d.real(10000.f);
      if (d.rare(3)) {
        r.cos = static_cast<const float*>(d.fake());
        r.sin = static_cast<const float*>(d.fake());
        r.max_position = d.size(0, 4096);
      }
      std::unique_ptr<std::int32_t[]> pos;
      Backend be = backend;
      const __int128 n = static_cast<__int128>(p.batch > 0 ? p.batch : 0) * (p.seqlen > 0 ? p.seqlen : 0);
      if (d.f.ConsumeBool() && n <= kMaxHostEntries) {
        pos.reset(new std::int32_t[static_cast<std::size_t>(n) + (n == 0)]());
        for (__int128 i = 0; i < n; ++i) pos[static_cast<std::size_t>(i)] = d.rare(6) ? d.f.ConsumeIntegral<std::int32_t>() : d.in(0, 4200);
        p.positions = pos.get();
      }
      fuzz::expect_sentence(validate(p, be), "QkNormRopeParams");
      break;
    }
    case 4: {  // rotary + KV-cache append: lengths, block table and positions are exact-size host arrays
      RopeAppendParams p;
      p.batch = d.rare(12) ? 0 : d.size(1, 4);
      p.seqlen = d.size(0, 20);
      p.heads_q = d.f.ConsumeBool() ? 0 : d.size(1, 8);
      p.heads_kv = d.size(0, 4);
      p.head_dim = d.rare(8) ? d.size(0, 600) : 2 * d.in(1, 128);
      p.head_dim_v = d.rare(4) ? d.size(0, 300) : 0;
      const int dv = p.head_dim_v ? p.head_dim_v : p.head_dim;
      if (p.heads_q) d.view(&p.q, dt, p.seqlen, p.heads_q, p.head_dim);
      if (p.heads_q && d.f.ConsumeBool()) d.view(&p.q_out, dt, p.seqlen, p.heads_q, p.head_dim);
      d.view(&p.k_new, dt, p.seqlen, p.heads_kv, p.head_dim);
      d.view(&p.v_new, dt, p.seqlen, p.heads_kv, dv);
      KVCacheView& c = p.cache;
      const bool paged = d.f.ConsumeBool();
      c.page_size = paged ? (d.rare(6) ? d.size(-1, 300) : 1 << d.in(0, 8)) : (d.rare(10) ? d.size(-2, 4) : 0);
      c.capacity = d.size(0, 300);
      c.num_pages = d.size(0, 64);
      c.pages_per_seq = d.size(0, 8);
      c.block_table_stride = d.rare(5) ? d.size(-2, 20) : c.pages_per_seq;
      // An fp8 e4m3 cache one time in three (K or V alone fp8 sometimes), otherwise k_new's dtype.
      const bool fp8 = d.rare(3);
      d.view(&c.k, fp8 || d.rare(20) ? DType::kF8E4M3 : dt, c.paged() ? c.page_size : c.capacity, p.heads_kv, p.head_dim);
      d.view(&c.v, fp8 && !d.rare(10) ? DType::kF8E4M3 : dt, c.paged() ? c.page_size : c.capacity, p.heads_kv, dv);
      p.rotary.style = static_cast<RopeStyle>(d.in(0, 2));
      p.rotary.rotary_dim = d.rare(3) ? d.size(0, 300) : 0;
      if (d.rare(3)) {
        p.rotary.cos = static_cast<const float*>(d.fake());
        p.rotary.sin = static_cast<const float*>(d.fake());
        p.rotary.max_position = d.size(0, 4096);
      }
      std::int64_t b = p.batch > 0 ? p.batch : 0, s = p.seqlen > 0 ? p.seqlen : 0;
      const __int128 bt_wide = b > 0 ? static_cast<__int128>(b - 1) * (c.block_table_stride > 0 ? c.block_table_stride : 0) +
                                           (c.pages_per_seq > 0 ? c.pages_per_seq : 0) : 0;
      std::int64_t bt_n = bt_wide > kMaxHostEntries ? 0 : static_cast<std::int64_t>(bt_wide);
      Backend be = backend;
      std::int64_t hk = p.heads_kv > 0 ? p.heads_kv : 0;  // entries of each scale array
      if (b > kMaxHostEntries || static_cast<__int128>(b) * s > kMaxHostEntries || bt_wide > kMaxHostEntries ||
          hk > kMaxHostEntries) {
        // Too large for host arrays: fake addresses, and a backend that reads none of them.
        b = s = bt_n = hk = 0;
        if (be == Backend::kCpu || be == Backend::kCpuReference || be == Backend::kAuto) be = Backend::kCuda;
      }
      std::unique_ptr<std::int32_t[]> lens(new std::int32_t[static_cast<std::size_t>(b) + 1]()),
          table(new std::int32_t[static_cast<std::size_t>(bt_n) + 1]()), pos(new std::int32_t[static_cast<std::size_t>(b * s) + 1]());
      for (std::int64_t i = 0; i < b; ++i) lens[i] = d.rare(6) ? d.f.ConsumeIntegral<std::int32_t>() : d.in(0, 300);
      for (std::int64_t i = 0; i < bt_n; ++i) table[i] = d.rare(6) ? d.f.ConsumeIntegral<std::int32_t>() : d.in(0, 63);
      for (std::int64_t i = 0; i < b * s; ++i) pos[i] = d.rare(6) ? d.f.ConsumeIntegral<std::int32_t>() : d.in(0, 4200);
      const bool fake = be != backend;
      p.cache_seqlens = d.rare(10) ? nullptr : fake ? static_cast<const std::int32_t*>(d.fake()) : lens.get();
      if (paged && !d.rare(10)) c.block_table = fake ? static_cast<const std::int32_t*>(d.fake()) : table.get();
      if (d.f.ConsumeBool()) p.positions = fake ? static_cast<const std::int32_t*>(d.fake()) : pos.get();
      // Scales: exact-size host arrays of heads_kv floats (fake addresses where no host array is read).
      std::unique_ptr<float[]> ks(new float[static_cast<std::size_t>(hk + (hk == 0))]()),
          vs(new float[static_cast<std::size_t>(hk + (hk == 0))]());
      for (float* sc : {ks.get(), vs.get()})
        for (std::int64_t i = 0; i < hk; ++i) {
          const int kind = d.rare(12) ? d.in(0, 3) : 4;
          sc[i] = kind == 0 ? 0.f : kind == 1 ? -1.f : kind == 2 ? NAN : kind == 3 ? INFINITY : 0.01f * static_cast<float>(d.in(1, 200));
        }
      if (fp8 || d.rare(15)) {  // the scales belong to an fp8 cache; set on another they are refused
        const float* host[2] = {ks.get(), vs.get()};
        const float** field[2] = {&c.k_scale, &c.v_scale};
        for (int w = 0; w < 2; ++w) {
          *field[w] = d.rare(15) ? nullptr : fake ? static_cast<const float*>(d.fake()) : host[w];
          if (*field[w] && d.rare(20)) *field[w] = reinterpret_cast<const float*>(reinterpret_cast<const char*>(*field[w]) + 2);
        }
      }
      fuzz::expect_sentence(validate(p, be), "RopeAppendParams");
      break;
    }
    default: {  // rotary
      RopeParams p;
      p.batch = d.rare(12) ? 0 : d.size(1, 4);
      p.seqlen = d.size(0, 40);
      p.heads_q = d.size(1, 8);
      p.heads_k = d.f.ConsumeBool() ? 0 : d.size(1, 8);
      p.head_dim = d.rare(8) ? d.size(0, 1100) : 2 * d.in(1, 128);
      d.view(&p.q, dt, p.seqlen, p.heads_q, p.head_dim);
      if (p.heads_k) d.view(&p.k, dt, p.seqlen, p.heads_k, p.head_dim);
      if (d.f.ConsumeBool()) d.view(&p.q_out, dt, p.seqlen, p.heads_q, p.head_dim);
      if (p.heads_k && d.f.ConsumeBool()) d.view(&p.k_out, dt, p.seqlen, p.heads_k, p.head_dim);
      RotarySpec& r = p.rotary;
      r.style = static_cast<RopeStyle>(d.rare(10) ? d.in(0, 3) : d.in(1, 2));
      r.rotary_dim = d.rare(3) ? d.size(0, 300) : 0;
      r.theta = d.real(10000.f);
      if (d.rare(4)) r.llama3 = Llama3Scaling{d.real(8.f), d.real(1.f), d.real(4.f), d.size(0, 8192)};
      if (d.rare(3)) {  // cos/sin tables (fake: the host never reads them)
        r.cos = static_cast<const float*>(d.fake());
        r.sin = d.rare(5) ? nullptr : static_cast<const float*>(d.fake());
        r.max_position = d.size(0, 4096);
        r.table_stride = d.rare(4) ? d.size(-2, 600) : 0;
      }
      // positions: an exact-size host array when small enough (else a fake address, and a backend
      // that reads no host array)
      std::unique_ptr<std::int32_t[]> pos;
      Backend be = backend;
      if (d.f.ConsumeBool()) {
        const __int128 n = static_cast<__int128>(p.batch > 0 ? p.batch : 0) * (p.seqlen > 0 ? p.seqlen : 0);
        if (n <= kMaxHostEntries) {
          pos.reset(new std::int32_t[static_cast<std::size_t>(n) + (n == 0)]());
          for (__int128 i = 0; i < n; ++i)
            pos[static_cast<std::size_t>(i)] = d.rare(6) ? d.f.ConsumeIntegral<std::int32_t>() : d.in(0, 4200);
          p.positions = pos.get();
        } else {
          p.positions = static_cast<const std::int32_t*>(d.fake());
          if (be == Backend::kCpu || be == Backend::kCpuReference || be == Backend::kAuto) be = Backend::kCuda;
        }
      }
      fuzz::expect_sentence(validate(p, be), "RopeParams");
      break;
    }
  }
  return 0;
}
