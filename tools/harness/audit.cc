// `flashcpp audit`: runs the stress families (audit_inputs.cc) through every flashcpp kernel,
// compares each output row with an fp64 ground truth, and reports per-row error distributions,
// the first N at which a dtype band is crossed, and defects (docs/audit.md).
//
// One problem = (family, dtype, N, mask). Its inputs are drawn once; every kernel of the run reads
// them; the truth is computed once, lazily (an all-unsupported problem costs no reference):
//   - O and the LSE in fp64 (cpu::reference_attention, or cuda::reference_attention_f64 for long
//     CUDA problems), and
//   - A = P |V| in fp64, the same reference run on |V|: the "absolute" output that the defect bound
//     scales with (an error of delta in the weights moves O by at most delta * (A + |O|)).
// Outputs and LSEs start as NaN, so an element a kernel forgets to write is a non-finite row.
#include "audit.h"
#include "cli_checks.h"  // unwritable

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "flashcpp/half.h"
#include "flashcpp/decode.h"
#include "flashcpp/fused.h"
#include "flashcpp/reference.h"
#if FLASHCPP_WITH_CUDA
#include <cuda_runtime_api.h>

#include "flashcpp/device.h"
#include "harness/device_buffer.h"
#endif

namespace flashcpp::audit {

// ---- the defect bound ----------------------------------------------------------------------

double DefectBound::unit_roundoff(DType t) noexcept {
  switch (t) {
    case DType::kBF16:
      return 0x1p-8;
    case DType::kF16:
      return 0x1p-11;
    case DType::kF32:
      return 0x1p-24;
  }
  return 0x1p-8;
}

double DefectBound::tau(DType t) noexcept {
  // Half the smallest subnormal step of the output dtype: below the normal range the relative
  // term u_o |r| no longer bounds the rounding of O (fp16 subnormals are 2^-24 apart).
  const double half_step = t == DType::kF16 ? 0x1p-25 : t == DType::kBF16 ? 0x1p-134 : 0x1p-150;
  return std::max(half_step, 1e-30);
}

double DefectBound::p_floor(DType t) noexcept {
  // P is rounded to the input dtype before P.V on the GPU; below fp16's normal range (2^-14) the
  // grid is absolute, 2^-24 apart, so a weight is off by up to 2^-25 whatever its size, and weights
  // under 2^-25 flush to 0 (one-sided). bf16 shares fp32's exponent range: negligible there.
  return t == DType::kF16 ? 0x1p-25 : t == DType::kBF16 ? 0x1p-134 : 0x1p-150;
}

double DefectBound::weight_error(DType t, int head_dim, double scaled_qk_norm, int visible_keys) noexcept {
  const double eta = (head_dim + 8) * 0x1p-24 * scaled_qk_norm;
  const double gamma = (256.0 + visible_keys / 64.0) * 0x1p-24;
  return unit_roundoff(t) + kEpsExp + eta + gamma;
}

std::vector<double> cdf_quantiles() {
  std::vector<double> q;
  for (int i = 0; i < 100; ++i) q.push_back(i / 100.0);
  for (double t : {0.995, 0.999, 0.9995, 0.9999, 1.0}) q.push_back(t);
  return q;
}

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

/// A number, or null when it was not measured (NaN) or is infinite (JSON has no Inf).
nlohmann::json num(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }

std::string sci(double x) {
  if (std::isnan(x)) return "-";
  if (std::isinf(x)) return "inf";
  return fmt::format("{:.2e}", x);
}

/// Nearest-rank quantile of a sorted vector.
double quantile_sorted(const std::vector<double>& v, double q) {
  if (v.empty()) return NAN;
  const std::size_t k = std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5));
  return v[k];
}

/// p50 / p90 / p99 / p99.9 / max of a sorted vector.
Quantiles quantiles_of_sorted(const std::vector<double>& v) {
  Quantiles q;
  if (v.empty()) return q;
  q.p50 = quantile_sorted(v, 0.50);
  q.p90 = quantile_sorted(v, 0.90);
  q.p99 = quantile_sorted(v, 0.99);
  q.p999 = quantile_sorted(v, 0.999);
  q.max = v.back();
  return q;
}

/// A float tensor whose values are representable in `t` (the generators round them) as `t`.
harness::HostTensor to_dtype(DType t, const std::vector<float>& x, bool abs = false) {
  harness::HostTensor out(t, static_cast<std::int64_t>(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i)
    out.set(static_cast<std::int64_t>(i), abs ? std::fabs(x[i]) : x[i]);  // exact
  return out;
}

/// The problem's inputs in its dtype (what the kernels read), plus |V| for the A = P|V| reference.
struct HostProblem {
  harness::HostTensor q, k, v, vabs;
  /// scale * |q_i| * max_j |k_j| per row (i * heads + h): bounds |s| and |m| of the row.
  std::vector<double> qk_norm;
  std::vector<double> vmax;  ///< max |v| per head
};

HostProblem make_host_problem(const Problem& p, const Inputs& in) {
  HostProblem hp;
  hp.q = to_dtype(p.dtype, in.q);
  hp.k = to_dtype(p.dtype, in.k);
  hp.v = to_dtype(p.dtype, in.v);
  hp.vabs = to_dtype(p.dtype, in.v, /*abs=*/true);
  const int hc = p.heads, d = p.head_dim;
  auto norm = [&](const std::vector<float>& t, std::int64_t row, int h) {
    const float* x = t.data() + (row * hc + h) * d;
    double s = 0;
    for (int e = 0; e < d; ++e) s += static_cast<double>(x[e]) * x[e];
    return std::sqrt(s);
  };
  std::vector<double> kmax(static_cast<std::size_t>(hc), 0.0);
  for (std::int64_t j = 0; j < p.seqlen; ++j)
    for (int h = 0; h < hc; ++h) kmax[h] = std::max(kmax[h], norm(in.k, j, h));
  hp.vmax.assign(static_cast<std::size_t>(hc), 0.0);
  for (std::int64_t j = 0; j < p.seqlen; ++j)
    for (int h = 0; h < hc; ++h)
      for (int e = 0; e < d; ++e)
        hp.vmax[h] = std::max(hp.vmax[h], static_cast<double>(std::fabs(in.v[(j * hc + h) * d + e])));
  hp.qk_norm.resize(static_cast<std::size_t>(p.seqlen) * hc);
  for (std::int64_t i = 0; i < p.seqlen; ++i)
    for (int h = 0; h < hc; ++h) hp.qk_norm[i * hc + h] = p.scale() * norm(in.q, i, h) * kmax[h];
  return hp;
}

AttnParams make_params(const Problem& p, const void* q, const void* k, const void* v, void* o, float* lse) {
  AttnParams a;
  a.batch = 1;
  a.seqlen_q = a.seqlen_k = p.seqlen;
  a.heads_q = a.heads_kv = p.heads;
  a.head_dim = p.head_dim;
  a.q = bshd_view(const_cast<void*>(q), p.dtype, p.seqlen, p.heads, p.head_dim);
  a.k = bshd_view(const_cast<void*>(k), p.dtype, p.seqlen, p.heads, p.head_dim);
  a.v = bshd_view(const_cast<void*>(v), p.dtype, p.seqlen, p.heads, p.head_dim);
  a.o = bshd_view(o, p.dtype, p.seqlen, p.heads, p.head_dim);
  a.lse = lse;
  a.mask = p.mask_params();
  if (p.rotary) a.rotary.spec = RotarySpec::of_style(RopeStyle::kNeox);  // all of head_dim
  return a;
}

/// The fp64 truth of a problem, in cpu::RefOutput's packed order: o and a are (seqlen, heads, D),
/// lse is (heads, seqlen) — the same order as a batch-1 bshd output and its LSE.
struct Truth {
  std::vector<double> o, a, lse;
  std::string reference;
  double ms = NAN;
};

Status cpu_truth(const Problem& p, const HostProblem& hp, int threads, Truth* t) {
  cpu::RefOutput ref, ref_abs;  // the reference writes no O of its own: o stays null
  // With rotary: on q and k rotated exactly as the backends rotate them (attention.h).
  RunOptions ro;
  ro.cpu_threads = threads;
  FLASHCPP_RETURN_IF_ERROR(cpu::run_with_rotary(
      make_params(p, hp.q.data(), hp.k.data(), hp.v.data(), nullptr, nullptr), ro,
      [&](const AttnParams& a) { return cpu::reference_attention(a, &ref, threads); }));
  FLASHCPP_RETURN_IF_ERROR(cpu::run_with_rotary(
      make_params(p, hp.q.data(), hp.k.data(), hp.vabs.data(), nullptr, nullptr), ro,
      [&](const AttnParams& a) { return cpu::reference_attention(a, &ref_abs, threads); }));
  t->o = std::move(ref.o);
  t->lse = std::move(ref.lse);
  t->a = std::move(ref_abs.o);
  t->reference = "cpu_fp64";
  return Status::Ok();
}

#if FLASHCPP_WITH_CUDA

using harness::DeviceBuffer;

struct DeviceProblem {
  bool ready = false;
  DeviceBuffer q, k, v, vabs, o, lse;
  DeviceBuffer k_rotated;  ///< rotary: the keys the pre-pass rotates (k keeps the originals)
};

Status upload_problem(const HostProblem& hp, const Problem& p, DeviceProblem* dp) {
  if (dp->ready) return Status::Ok();
  FLASHCPP_RETURN_IF_ERROR(dp->q.upload(hp.q.data(), hp.q.bytes.size()));
  FLASHCPP_RETURN_IF_ERROR(dp->k.upload(hp.k.data(), hp.k.bytes.size()));
  FLASHCPP_RETURN_IF_ERROR(dp->v.upload(hp.v.data(), hp.v.bytes.size()));
  FLASHCPP_RETURN_IF_ERROR(dp->vabs.upload(hp.vabs.data(), hp.vabs.bytes.size()));
  FLASHCPP_RETURN_IF_ERROR(dp->o.alloc(hp.q.bytes.size()));
  FLASHCPP_RETURN_IF_ERROR(dp->lse.alloc(static_cast<std::size_t>(p.seqlen) * p.heads * sizeof(float)));
  if (p.rotary) FLASHCPP_RETURN_IF_ERROR(dp->k_rotated.alloc(hp.k.bytes.size()));
  dp->ready = true;
  return Status::Ok();
}

/// The fp64 GPU reference twice (V and |V|), for problems too long for the CPU reference. With
/// rotary it reads q and k rotated by the CUDA apply_rotary (copies, default positions: the audit's
/// problems have seqlen_q = seqlen_k), the values the fused kernels put into their scores.
Status gpu_truth(const Problem& p, const HostProblem& hp, DeviceProblem& dp, Truth* t) {
  DeviceBuffer qr, kr;
  const void* qd = dp.q.get();
  const void* kd = dp.k.get();
  if (p.rotary) {
    FLASHCPP_RETURN_IF_ERROR(qr.upload(hp.q.data(), hp.q.bytes.size()));
    FLASHCPP_RETURN_IF_ERROR(kr.upload(hp.k.data(), hp.k.bytes.size()));
    RopeParams rp;
    rp.seqlen = p.seqlen;
    rp.heads_q = rp.heads_k = p.heads;
    rp.head_dim = p.head_dim;
    rp.q = bshd_view(qr.get(), p.dtype, p.seqlen, p.heads, p.head_dim);
    rp.k = bshd_view(kr.get(), p.dtype, p.seqlen, p.heads, p.head_dim);
    RunOptions ro;
    ro.backend = Backend::kCuda;
    FLASHCPP_RETURN_IF_ERROR(apply_rotary(rp, ro));
    qd = qr.get();
    kd = kr.get();
  }
  const std::size_t rows = static_cast<std::size_t>(p.seqlen) * p.heads;
  t->o.assign(rows * p.head_dim, 0.0);
  t->a.assign(rows * p.head_dim, 0.0);
  t->lse.assign(rows, 0.0);
  std::vector<double> lse_abs(rows);
  DeviceBuffer o, lse;
  FLASHCPP_RETURN_IF_ERROR(o.alloc(t->o.size() * sizeof(double)));
  FLASHCPP_RETURN_IF_ERROR(lse.alloc(t->lse.size() * sizeof(double)));
  for (const bool abs_v : {false, true}) {
    AttnParams a =
        make_params(p, qd, kd, abs_v ? dp.vabs.get() : dp.v.get(), dp.o.get(), nullptr);
    a.rotary = AttnRotary{};  // q and k are rotated already
    FLASHCPP_RETURN_IF_ERROR(
        cuda::reference_attention_f64(a, static_cast<double*>(o.get()), static_cast<double*>(lse.get()), nullptr));
    HARNESS_CUDA_TRY(cudaDeviceSynchronize());
    FLASHCPP_RETURN_IF_ERROR(o.download(abs_v ? t->a.data() : t->o.data(), t->o.size() * sizeof(double)));
    FLASHCPP_RETURN_IF_ERROR(lse.download(abs_v ? lse_abs.data() : t->lse.data(), rows * sizeof(double)));
  }
  t->reference = "cuda_fp64";
  return Status::Ok();
}

#endif  // FLASHCPP_WITH_CUDA

/// What a kernel run leaves for the comparison.
struct RunOutcome {
  Status status;
  bool unsupported = false;
  KernelChoice choice;
  std::string kernel_name;  ///< set by the decode runners (no KernelChoice there)
  int row_begin = 0;        ///< first query row the kernel computed
  double ms = NAN;
};

/// One decode step over the problem (audit.h, KernelSpec::decode): q = the last `rows` query rows,
/// a contiguous cache holding all seqlen keys (cache_seqlens = {seqlen}, no append), o/lse of
/// those rows ((rows, heads, d) and (heads, rows)).
DecodeParams decode_params(const Problem& p, const void* q, const void* k, const void* v, void* o, float* lse,
                           const std::int32_t* cache_seqlens, int rows) {
  const std::size_t skip = static_cast<std::size_t>(p.seqlen - rows) * p.heads * p.head_dim * dtype_size(p.dtype);
  DecodeParams d;
  d.batch = 1;
  d.seqlen_q = rows;
  d.heads_q = d.heads_kv = p.heads;
  d.head_dim = p.head_dim;
  d.q = bshd_view(const_cast<char*>(static_cast<const char*>(q)) + skip, p.dtype, rows, p.heads, p.head_dim);
  d.o = bshd_view(o, p.dtype, rows, p.heads, p.head_dim);
  d.lse = lse;
  d.cache.k = bshd_view(const_cast<void*>(k), p.dtype, p.seqlen, p.heads, p.head_dim);
  d.cache.v = bshd_view(const_cast<void*>(v), p.dtype, p.seqlen, p.heads, p.head_dim);
  d.cache.capacity = p.seqlen;
  d.cache_seqlens = cache_seqlens;
  d.softmax_scale = p.scale();
  d.mask = p.mask_params();
  return d;
}

/// The decode output rows placed into a full (seqlen, heads, d) output and (heads, seqlen) LSE,
/// NaN elsewhere (those rows are not measured).
void scatter_decode(const Problem& p, int rows, const void* o_rows, const std::vector<float>& lse_rows,
                    harness::HostTensor* out, std::vector<float>* lse) {
  const std::size_t row_bytes = static_cast<std::size_t>(p.heads) * p.head_dim * dtype_size(p.dtype);
  *out = harness::HostTensor(p.dtype, static_cast<std::int64_t>(p.seqlen) * p.heads * p.head_dim);
  std::memset(out->data(), 0xFF, out->bytes.size());
  std::memcpy(static_cast<char*>(out->data()) + static_cast<std::size_t>(p.seqlen - rows) * row_bytes, o_rows,
              static_cast<std::size_t>(rows) * row_bytes);
  lse->assign(static_cast<std::size_t>(p.seqlen) * p.heads, NAN);
  for (int h = 0; h < p.heads; ++h)
    for (int r = 0; r < rows; ++r)
      (*lse)[static_cast<std::size_t>(h) * p.seqlen + (p.seqlen - rows + r)] =
          lse_rows[static_cast<std::size_t>(h) * rows + r];
}

RunOutcome run_cpu_decode(const Problem& p, const HostProblem& hp, int threads, harness::HostTensor* out,
                          std::vector<float>* lse) {
  RunOutcome r;
  const int rows = std::min(kAuditDecodeRows, p.seqlen);
  r.row_begin = p.seqlen - rows;
  r.kernel_name = "cpu_decode_split_kv";
  harness::HostTensor o(p.dtype, static_cast<std::int64_t>(rows) * p.heads * p.head_dim);
  std::memset(o.data(), 0xFF, o.bytes.size());  // NaN poison
  std::vector<float> dl(static_cast<std::size_t>(rows) * p.heads, NAN);
  const std::int32_t len = p.seqlen;
  const DecodeParams d = decode_params(p, hp.q.data(), hp.k.data(), hp.v.data(), o.data(), dl.data(), &len, rows);
  r.status = [&]() -> Status {
    DecodePlanOptions po;
    po.backend = Backend::kCpu;
    po.host_cache_seqlens = &len;
    DecodeWorkspaceSize ws;
    FLASHCPP_RETURN_IF_ERROR(decode_workspace_size(d, po, &ws));
    std::vector<std::uint64_t> iw(ws.int_bytes / 8 + 2), fw(ws.float_bytes / 8 + 2);  // 16-byte aligned
    DecodePlan plan;
    FLASHCPP_RETURN_IF_ERROR(decode_plan(d, po, iw.data(), ws.int_bytes, fw.data(), ws.float_bytes, &plan));
    r.choice.config = "splits<=" + std::to_string(plan.max_splits);
    RunOptions ro;
    ro.backend = Backend::kCpu;
    ro.cpu_threads = threads;
    const auto t0 = Clock::now();
    FLASHCPP_RETURN_IF_ERROR(decode_run(d, plan, ro));
    r.ms = ms_since(t0);
    return Status::Ok();
  }();
  r.unsupported = r.status.code() == StatusCode::kUnsupported;
  if (r.status.ok()) scatter_decode(p, rows, o.data(), dl, out, lse);
  return r;
}

RunOutcome run_cpu_kernel(const Problem& p, const KernelSpec& ks, const HostProblem& hp, int threads,
                          harness::HostTensor* out, std::vector<float>* lse) {
  RunOutcome r;
  *out = harness::HostTensor(p.dtype, hp.q.size());
  std::memset(out->data(), 0xFF, out->bytes.size());  // NaN poison
  lse->assign(static_cast<std::size_t>(p.seqlen) * p.heads, NAN);
  const AttnParams a = make_params(p, hp.q.data(), hp.k.data(), hp.v.data(), out->data(), lse->data());
  RunOptions opt;
  opt.backend = ks.backend;
  opt.cpu_threads = threads;
  r.status = select_kernel(a, opt, &r.choice);
  if (r.status.ok()) {
    const auto t0 = Clock::now();
    r.status = attention_forward(a, opt);
    r.ms = ms_since(t0);
  }
  r.unsupported = r.status.code() == StatusCode::kUnsupported;
  return r;
}

#if FLASHCPP_WITH_CUDA
RunOutcome run_cuda_kernel(const Problem& p, const KernelSpec& ks, const HostProblem& hp, DeviceProblem& dp,
                           harness::HostTensor* out, std::vector<float>* lse) {
  RunOutcome r;
  cuda::DeviceInfo dev;
  r.status = cuda::current_device(&dev);
  if (!r.status.ok()) {
    r.unsupported = true;
    return r;
  }
  r.status = [&]() -> Status {
    FLASHCPP_RETURN_IF_ERROR(upload_problem(hp, p, &dp));
    FLASHCPP_RETURN_IF_ERROR(dp.o.poison());
    FLASHCPP_RETURN_IF_ERROR(dp.lse.poison());
    AttnParams a =
        make_params(p, dp.q.get(), dp.k.get(), dp.v.get(), dp.o.get(), static_cast<float*>(dp.lse.get()));
    if (p.rotary) {  // CUDA rotates the keys once into a buffer of the caller's (attention.h)
      FLASHCPP_RETURN_IF_ERROR(dp.k_rotated.poison());
      a.rotary.k_rotated = bshd_view(dp.k_rotated.get(), p.dtype, p.seqlen, p.heads, p.head_dim);
    }
    RunOptions opt;
    opt.backend = Backend::kCuda;
    opt.cuda_config = ks.cuda_config;
    FLASHCPP_RETURN_IF_ERROR(select_kernel(a, opt, &r.choice));
    HARNESS_CUDA_TRY(cudaDeviceSynchronize());
    const auto t0 = Clock::now();
    FLASHCPP_RETURN_IF_ERROR(attention_forward(a, opt));
    HARNESS_CUDA_TRY(cudaGetLastError());
    HARNESS_CUDA_TRY(cudaDeviceSynchronize());
    r.ms = ms_since(t0);
    *out = harness::HostTensor(p.dtype, hp.q.size());
    lse->assign(static_cast<std::size_t>(p.seqlen) * p.heads, NAN);
    FLASHCPP_RETURN_IF_ERROR(dp.o.download(out->data(), out->bytes.size()));
    FLASHCPP_RETURN_IF_ERROR(dp.lse.download(lse->data(), lse->size() * sizeof(float)));
    return Status::Ok();
  }();
  r.unsupported = r.status.code() == StatusCode::kUnsupported;
  return r;
}
#endif

#if FLASHCPP_WITH_CUDA
RunOutcome run_cuda_decode(const Problem& p, const HostProblem& hp, DeviceProblem& dp, harness::HostTensor* out,
                           std::vector<float>* lse) {
  RunOutcome r;
  const int rows = std::min(kAuditDecodeRows, p.seqlen);
  r.row_begin = p.seqlen - rows;
  r.kernel_name = "cuda_decode_split_kv";
  cuda::DeviceInfo dev;
  r.status = cuda::current_device(&dev);
  if (!r.status.ok()) {
    r.unsupported = true;
    return r;
  }
  const std::int32_t len = p.seqlen;
  const std::size_t o_bytes = static_cast<std::size_t>(rows) * p.heads * p.head_dim * dtype_size(p.dtype);
  harness::HostTensor o(p.dtype, static_cast<std::int64_t>(rows) * p.heads * p.head_dim);
  std::vector<float> dl(static_cast<std::size_t>(rows) * p.heads);
  DeviceBuffer o_d, lse_d, len_d, iw_d, fw_d;
  r.status = [&]() -> Status {
    FLASHCPP_RETURN_IF_ERROR(upload_problem(hp, p, &dp));
    FLASHCPP_RETURN_IF_ERROR(o_d.alloc(o_bytes));
    FLASHCPP_RETURN_IF_ERROR(o_d.poison());
    FLASHCPP_RETURN_IF_ERROR(lse_d.alloc(dl.size() * sizeof(float)));
    FLASHCPP_RETURN_IF_ERROR(lse_d.poison());
    FLASHCPP_RETURN_IF_ERROR(len_d.upload(&len, sizeof len));
    const DecodeParams d = decode_params(p, dp.q.get(), dp.k.get(), dp.v.get(), o_d.get(),
                                         static_cast<float*>(lse_d.get()), static_cast<const std::int32_t*>(len_d.get()), rows);
    DecodePlanOptions po;
    po.backend = Backend::kCuda;
    po.host_cache_seqlens = &len;
    DecodeWorkspaceSize ws;
    FLASHCPP_RETURN_IF_ERROR(decode_workspace_size(d, po, &ws));
    FLASHCPP_RETURN_IF_ERROR(iw_d.alloc(ws.int_bytes));
    FLASHCPP_RETURN_IF_ERROR(fw_d.alloc(ws.float_bytes));
    DecodePlan plan;
    FLASHCPP_RETURN_IF_ERROR(decode_plan(d, po, iw_d.get(), ws.int_bytes, fw_d.get(), ws.float_bytes, &plan));
    r.choice.config = "splits<=" + std::to_string(plan.max_splits);
    RunOptions ro;
    ro.backend = Backend::kCuda;
    HARNESS_CUDA_TRY(cudaDeviceSynchronize());
    const auto t0 = Clock::now();
    FLASHCPP_RETURN_IF_ERROR(decode_run(d, plan, ro));
    HARNESS_CUDA_TRY(cudaGetLastError());
    HARNESS_CUDA_TRY(cudaDeviceSynchronize());
    r.ms = ms_since(t0);
    FLASHCPP_RETURN_IF_ERROR(o_d.download(o.data(), o_bytes));
    FLASHCPP_RETURN_IF_ERROR(lse_d.download(dl.data(), dl.size() * sizeof(float)));
    return Status::Ok();
  }();
  r.unsupported = r.status.code() == StatusCode::kUnsupported;
  if (r.status.ok()) scatter_decode(p, rows, o.data(), dl, out, lse);
  return r;
}
#endif

/// Per-row comparison of a kernel's output with the truth; fills the metrics of `r`.
/// Only query rows >= row_begin are measured (the decode kernels compute the last rows only).
void measure(const Problem& p, const HostProblem& hp, const Truth& t, const harness::HostTensor& out,
             const std::vector<float>& lse, int threads, int row_begin, Result* r) {
  const int hc = p.heads, d = p.head_dim;
  const std::int64_t row0 = static_cast<std::int64_t>(row_begin) * hc;  // first measured (i, h) row
  const std::int64_t rows = static_cast<std::int64_t>(p.seqlen) * hc - row0;
  const harness::Tolerance tol = r->tol;
  const double u_o = DefectBound::unit_roundoff(p.dtype), tau = DefectBound::tau(p.dtype), c = DefectBound::kSafety;
  // The defect bound of the element at `at` of row (i, h): `weight` = u_p + eps_exp + eta + gamma of the
  // row; the absolute term covers P rounded on fp16's subnormal grid for each of the row's keys.
  auto element_bound = [&](double weight, int i, int h, std::int64_t at) {
    const double want = std::fabs(t.o[static_cast<std::size_t>(at)]);
    const double p_abs = p.visible_keys(i) * DefectBound::p_floor(p.dtype) * hp.vmax[static_cast<std::size_t>(h)];
    return c * (u_o * want + weight * (t.a[static_cast<std::size_t>(at)] + want) + p_abs) + tau;
  };
  struct Row {
    double rel = 0, floor_rel = 0, err = 0, err_sum = 0, tol_ratio = 0, bound_ratio = 0, lse_err = NAN,
           lse_bound_ratio = 0;
    bool nonfinite = false, lse_nonfinite = false, over_tol = false, lse_over_tol = false, defect = false,
         lse_defect = false;
    int first_bad = -1;  // element of the first defect (or non-finite value)
  };
  std::vector<Row> rs(static_cast<std::size_t>(rows));
  detail::parallel_for((rows + 255) / 256, threads, [&](std::int64_t item) {
    const std::int64_t end = std::min(rows, (item + 1) * 256);
    for (std::int64_t local = item * 256; local < end; ++local) {
      const std::int64_t row = row0 + local;
      const int i = static_cast<int>(row / hc), h = static_cast<int>(row % hc);
      Row& w = rs[static_cast<std::size_t>(local)];
      const std::int64_t base = row * d;
      const double weight = DefectBound::weight_error(p.dtype, d, hp.qk_norm[row], p.visible_keys(i));
      double ref_inf = 0, floor_inf = 0;
      for (int e = 0; e < d; ++e) {
        const double want = t.o[base + e], got = out.get(base + e);
        ref_inf = std::max(ref_inf, std::fabs(want));
        floor_inf = std::max(floor_inf, std::fabs(round_to_dtype(p.dtype, want) - want));
        if (!std::isfinite(got)) {
          if (!w.nonfinite) w.first_bad = e;
          w.nonfinite = true;
          continue;
        }
        const double err = std::fabs(got - want);
        w.err = std::max(w.err, err);
        w.err_sum += err;
        w.tol_ratio = std::max(w.tol_ratio, err / (tol.atol + tol.rtol * std::fabs(want)));
        const double br = err / element_bound(weight, i, h, base + e);
        if (br > 1 && !w.defect && !w.nonfinite) w.first_bad = e;
        w.defect |= br > 1;
        w.bound_ratio = std::max(w.bound_ratio, br);
      }
      const double floor_den = std::max(ref_inf, tol.atol);
      w.rel = w.nonfinite ? INFINITY : w.err / floor_den;
      w.floor_rel = floor_inf / floor_den;
      w.over_tol = w.nonfinite || w.tol_ratio > 1;
      // LSE: kernel (b, h, i), truth (h, total_q): the same index for batch 1.
      const std::size_t li = static_cast<std::size_t>(h) * p.seqlen + i;
      const double want = t.lse[li], got = lse[li];
      if (!std::isfinite(got)) {
        w.lse_nonfinite = true;
      } else {
        w.lse_err = std::fabs(got - want);
        const double eta_eps_gamma = weight - DefectBound::unit_roundoff(p.dtype);
        const double bound = c * (eta_eps_gamma + 0x1p-24 * std::fabs(want)) + DefectBound::kLseSlack;
        w.lse_bound_ratio = w.lse_err / bound;
        w.lse_defect = w.lse_bound_ratio > 1;
        w.lse_over_tol = w.lse_err > tol.lse_atol;
      }
    }
  });
  // Reduce.
  std::vector<double> rel, floor_rel;
  rel.reserve(rs.size());
  floor_rel.reserve(rs.size());
  double err_sum = 0;
  r->rows = rows;
  r->max_abs_err = 0;
  r->max_tol_ratio = 0;
  r->max_bound_ratio = 0;
  r->max_lse_bound_ratio = 0;
  r->lse_max_abs_err = 0;
  std::int64_t first_defect = -1, first_lse_defect = -1;
  for (std::int64_t local = 0; local < rows; ++local) {
    const std::int64_t row = row0 + local;
    const Row& w = rs[static_cast<std::size_t>(local)];
    rel.push_back(w.rel);
    floor_rel.push_back(w.floor_rel);
    err_sum += w.err_sum;
    r->max_abs_err = std::max(r->max_abs_err, w.err);
    r->max_tol_ratio = std::max(r->max_tol_ratio, w.tol_ratio);
    r->max_bound_ratio = std::max(r->max_bound_ratio, w.bound_ratio);
    r->max_lse_bound_ratio = std::max(r->max_lse_bound_ratio, w.lse_bound_ratio);
    if (!std::isnan(w.lse_err)) r->lse_max_abs_err = std::max(r->lse_max_abs_err, w.lse_err);
    r->nonfinite_rows += w.nonfinite;
    r->lse_nonfinite_rows += w.lse_nonfinite;
    r->rows_over_tol += w.over_tol;
    r->rows_lse_over_tol += w.lse_over_tol || w.lse_nonfinite;
    r->defect_rows += w.defect;
    r->lse_defect_rows += w.lse_defect;
    if ((w.nonfinite || w.defect) && first_defect < 0) first_defect = row;
    if ((w.lse_nonfinite || w.lse_defect) && first_lse_defect < 0) first_lse_defect = row;
  }
  r->mean_abs_err = err_sum / static_cast<double>(rows * d);
  r->frac_rows_over_tol = static_cast<double>(r->rows_over_tol) / static_cast<double>(rows);
  std::sort(rel.begin(), rel.end());
  std::sort(floor_rel.begin(), floor_rel.end());
  r->rel_err = quantiles_of_sorted(rel);
  r->floor_rel_err = quantiles_of_sorted(floor_rel);
  r->cdf.clear();
  for (double q : cdf_quantiles()) r->cdf.push_back(quantile_sorted(rel, q));
  const bool defect = r->nonfinite_rows || r->lse_nonfinite_rows || r->defect_rows || r->lse_defect_rows;
  r->status = defect ? harness::CaseStatus::kFail : harness::CaseStatus::kPass;
  if (first_defect >= 0) {
    const Row& w = rs[static_cast<std::size_t>(first_defect - row0)];
    const int i = static_cast<int>(first_defect / hc), h = static_cast<int>(first_defect % hc), e = w.first_bad;
    const std::int64_t at = first_defect * d + e;
    const double got = out.get(at), want = t.o[static_cast<std::size_t>(at)];
    const double bound =
        element_bound(DefectBound::weight_error(p.dtype, d, hp.qk_norm[first_defect], p.visible_keys(i)), i, h, at);
    r->message = std::isfinite(got)
                     ? fmt::format("O[i={},h={},d={}] = {:.6g} vs fp64 {:.6g}: |err| {:.3g} > defect bound {:.3g}", i,
                                   h, e, got, want, std::fabs(got - want), bound)
                     : fmt::format("O[i={},h={},d={}] is {} (fp64 {:.6g})", i, h, e, got, want);
  } else if (first_lse_defect >= 0) {
    const int i = static_cast<int>(first_lse_defect / hc), h = static_cast<int>(first_lse_defect % hc);
    const std::size_t li = static_cast<std::size_t>(h) * p.seqlen + i;
    r->message =
        fmt::format("LSE[h={},i={}] = {:.8g} vs fp64 {:.8g}: beyond the defect bound", h, i, lse[li], t.lse[li]);
  }
}

Result base_result(const Problem& p, const KernelSpec& ks, std::uint64_t seed) {
  Result r;
  r.problem = p;
  r.kernel = ks.label;
  r.seed = seed;
  r.tol = harness::tolerance_for(p.dtype);
  return r;
}

}  // namespace

std::vector<Result> run_problem(const Problem& p, const Inputs& in, std::uint64_t seed, const RunSettings& s) {
  std::vector<Result> results;
  HostProblem hp;
  try {
    hp = make_host_problem(p, in);
  } catch (const std::exception& e) {
    for (const KernelSpec& ks : s.kernels) {
      Result r = base_result(p, ks, seed);
      r.message = std::string("exception: ") + e.what();
      results.push_back(std::move(r));
    }
    return results;
  }
  Truth truth;
  Status truth_status;
  bool truth_done = false;
#if FLASHCPP_WITH_CUDA
  DeviceProblem dp;
#endif
  for (const KernelSpec& ks : s.kernels) {
    Result r = base_result(p, ks, seed);
    try {
      harness::HostTensor out;
      std::vector<float> lse;
      RunOutcome run;
      if (ks.decode && p.rotary) {
        // The decode kernels rotate q and the keys appended in a step, not a cache filled before.
        run.unsupported = true;
        run.status = Status::Unsupported(
            "the decode kernels rotate q and the keys appended in the step, not a cache filled beforehand");
      } else if (ks.backend == Backend::kCuda) {
#if FLASHCPP_WITH_CUDA
        run = ks.decode ? run_cuda_decode(p, hp, dp, &out, &lse) : run_cuda_kernel(p, ks, hp, dp, &out, &lse);
#else
        run.unsupported = true;
        run.status =
            Status::Unsupported("this build of flashcpp has no CUDA kernels (configure with -DFLASHCPP_CUDA=ON)");
#endif
      } else {
        run = ks.decode ? run_cpu_decode(p, hp, s.cpu_threads, &out, &lse)
                        : run_cpu_kernel(p, ks, hp, s.cpu_threads, &out, &lse);
      }
      r.kernel_name = run.kernel_name.empty() ? kernel_name(run.choice.id) : run.kernel_name;
      r.config = run.choice.config;
      r.ms = run.ms;
      if (run.unsupported || !run.status.ok()) {
        r.status = run.unsupported ? harness::CaseStatus::kUnsupported : harness::CaseStatus::kFail;
        r.message = run.unsupported ? run.status.message() : run.status.to_string();
        results.push_back(std::move(r));
        continue;
      }
      if (!truth_done) {
        truth_done = true;
        const auto t0 = Clock::now();
        const double pairs = static_cast<double>(p.heads) * p.seqlen * p.seqlen;
        const bool on_gpu = ks.backend == Backend::kCuda && pairs > s.gpu_reference_threshold;
        if (on_gpu) {
#if FLASHCPP_WITH_CUDA
          truth_status = gpu_truth(p, hp, dp, &truth);
#endif
        } else {
          truth_status = cpu_truth(p, hp, s.cpu_threads, &truth);
        }
        truth.ms = ms_since(t0);
      }
      r.reference = truth.reference;
      r.ref_ms = truth.ms;
      if (!truth_status.ok()) {
        r.status = harness::CaseStatus::kFail;
        r.message = "ground truth failed: " + truth_status.to_string();
        results.push_back(std::move(r));
        continue;
      }
      if (s.perturb_output) s.perturb_output(p, ks.label, out, lse);
      measure(p, hp, truth, out, lse, s.cpu_threads, run.row_begin, &r);
    } catch (const std::exception& e) {
      r.status = harness::CaseStatus::kFail;
      r.message = std::string("exception: ") + e.what();
    }
    results.push_back(std::move(r));
  }
  return results;
}

// ---- JSON ----------------------------------------------------------------------------------

namespace {

nlohmann::json quantiles_json(const Quantiles& q) {
  return {{"p50", num(q.p50)}, {"p90", num(q.p90)}, {"p99", num(q.p99)}, {"p999", num(q.p999)}, {"max", num(q.max)}};
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}


}  // namespace

nlohmann::json result_json(const Result& r) {
  const Problem& p = r.problem;
  nlohmann::json j;
  j["name"] = p.name();
  j["case"] = p.to_case().name();
  j["family"] = family_name(p.family);
  j["dtype"] = dtype_name(p.dtype);
  j["seqlen"] = p.seqlen;
  j["heads"] = p.heads;
  j["head_dim"] = p.head_dim;
  j["mask"] = mask_kind_name(p.mask);
  j["mask_description"] = p.to_case().mask_description();
  j["window"] = p.mask == MaskKind::kWindow ? nlohmann::json(p.window) : nlohmann::json(nullptr);
  j["rotary"] = p.rotary;
  j["kernel"] = r.kernel;
  j["kernel_name"] = r.kernel_name;
  j["config"] = r.config;
  j["status"] = harness::case_status_name(r.status);
  j["pass"] = r.status == harness::CaseStatus::kPass;
  j["message"] = r.message;
  j["reference"] = r.reference;
  j["seed"] = r.seed;
  j["rows"] = r.rows;
  j["row_rel_err"] = quantiles_json(r.rel_err);
  nlohmann::json cdf = nlohmann::json::array();
  for (double x : r.cdf) cdf.push_back(num(x));
  j["cdf"] = cdf;
  j["floor_rel_err"] = quantiles_json(r.floor_rel_err);
  j["max_abs_err"] = num(r.max_abs_err);
  j["mean_abs_err"] = num(r.mean_abs_err);
  j["max_tol_ratio"] = num(r.max_tol_ratio);
  j["rows_over_tol"] = r.rows_over_tol;
  j["frac_rows_over_tol"] = num(r.frac_rows_over_tol);
  j["lse_max_abs_err"] = num(r.lse_max_abs_err);
  j["rows_lse_over_tol"] = r.rows_lse_over_tol;
  j["nonfinite_rows"] = r.nonfinite_rows;
  j["lse_nonfinite_rows"] = r.lse_nonfinite_rows;
  j["defect_rows"] = r.defect_rows;
  j["lse_defect_rows"] = r.lse_defect_rows;
  j["max_bound_ratio"] = num(r.max_bound_ratio);
  j["max_lse_bound_ratio"] = num(r.max_lse_bound_ratio);
  j["tolerance"] = {{"atol", r.tol.atol}, {"rtol", r.tol.rtol}, {"lse_atol", r.tol.lse_atol}};
  j["ms"] = num(r.ms);
  j["ref_ms"] = num(r.ref_ms);
  return j;
}

namespace {
/// The mask column of the first-N tables: the mask kind, "+rotary" for rotary problems.
std::string mask_label(MaskKind m, bool rotary) { return std::string(mask_kind_name(m)) + (rotary ? "+rotary" : ""); }
}  // namespace

nlohmann::json first_exceed_json(const std::vector<Result>& results) {
  // (kernel, dtype, family, mask, rotary) -> results sorted by N.
  using Key = std::tuple<std::string, int, int, int, bool>;
  std::map<Key, std::vector<const Result*>> groups;
  for (const Result& r : results) {
    if (r.status == harness::CaseStatus::kUnsupported) continue;
    groups[{r.kernel, static_cast<int>(r.problem.dtype), static_cast<int>(r.problem.family),
            static_cast<int>(r.problem.mask), r.problem.rotary}]
        .push_back(&r);
  }
  nlohmann::json out = nlohmann::json::array();
  for (auto& [key, rs] : groups) {
    std::sort(rs.begin(), rs.end(),
              [](const Result* a, const Result* b) { return a->problem.seqlen < b->problem.seqlen; });
    nlohmann::json j;
    j["kernel"] = std::get<0>(key);
    j["dtype"] = dtype_name(rs.front()->problem.dtype);
    j["family"] = family_name(rs.front()->problem.family);
    j["mask"] = mask_label(rs.front()->problem.mask, rs.front()->problem.rotary);
    nlohmann::json ns = nlohmann::json::array(), frac = nlohmann::json::array(), p99 = nlohmann::json::array(),
                   mx = nlohmann::json::array();
    nlohmann::json first = nullptr, first_lse = nullptr;
    for (const Result* r : rs) {
      ns.push_back(r->problem.seqlen);
      frac.push_back(num(r->frac_rows_over_tol));
      p99.push_back(num(r->rel_err.p99));
      mx.push_back(num(r->rel_err.max));
      if (first.is_null() && r->rows_over_tol > 0) first = r->problem.seqlen;
      if (first_lse.is_null() && r->rows_lse_over_tol > 0) first_lse = r->problem.seqlen;
    }
    j["seqlens"] = ns;
    j["first_n_over_tol"] = first;
    j["first_n_lse_over_tol"] = first_lse;
    // When the smallest N of the sweep already crosses the band, the true first N may be smaller.
    j["over_tol_at_smallest_n"] = !first.is_null() && first == ns.front();
    j["frac_rows_over_tol"] = frac;
    j["p99_row_rel_err"] = p99;
    j["max_row_rel_err"] = mx;
    out.push_back(j);
  }
  return out;
}

namespace {

/// For each (kernel, dtype, family): the first N per mask, so "does causal / a window move it" is one row.
nlohmann::json mask_effect_json(const nlohmann::json& first_exceed) {
  std::map<std::tuple<std::string, std::string, std::string>, nlohmann::json> rows;
  for (const auto& f : first_exceed) {
    auto& row = rows[{f["kernel"].get<std::string>(), f["dtype"].get<std::string>(), f["family"].get<std::string>()}];
    row[f["mask"].get<std::string>()] = f["first_n_over_tol"];
  }
  nlohmann::json out = nlohmann::json::array();
  for (auto& [k, v] : rows) {
    nlohmann::json j = {{"kernel", std::get<0>(k)}, {"dtype", std::get<1>(k)}, {"family", std::get<2>(k)}};
    j["first_n_over_tol"] = v;
    out.push_back(j);
  }
  return out;
}


harness::Summary summarize(const std::vector<Result>& results) {
  harness::Summary s;
  for (const Result& r : results) {
    switch (r.status) {
      case harness::CaseStatus::kPass:
        ++s.passed;
        break;
      case harness::CaseStatus::kFail:
        ++s.failed;
        break;
      case harness::CaseStatus::kUnsupported:
        ++s.unsupported;
        break;
    }
  }
  return s;
}

std::vector<std::string> dtype_names(const std::vector<DType>& v) {
  std::vector<std::string> s;
  for (DType t : v) s.push_back(dtype_name(t));
  return s;
}

}  // namespace

// ---- presets and the run -------------------------------------------------------------------

namespace {

/// Sizes and lists a run uses after the presets (docs/audit.md, "Presets").
struct Plan {
  std::vector<int> seqlens;
  std::vector<DType> dtypes;
  std::vector<Family> families;
  std::vector<MaskKind> masks;
  int heads = 0, head_dim = 0, window = 0;
};

Plan resolve_plan(const AuditOptions& opt, Backend backend) {
  Plan pl;
  const bool cuda = backend == Backend::kCuda;
  if (cuda) {
    pl.seqlens = opt.quick ? std::vector<int>{1024, 4096} : std::vector<int>{8192, 16384, 32768, 65536};
    pl.dtypes = {DType::kBF16, DType::kF16};
    pl.heads = 4;
    pl.head_dim = 128;
    pl.window = opt.quick ? 256 : 1024;
  } else {
    pl.seqlens = opt.quick ? std::vector<int>{128, 512} : std::vector<int>{256, 1024, 2048};
    pl.dtypes = {DType::kBF16, DType::kF16, DType::kF32};
    pl.heads = 2;
    pl.head_dim = opt.quick ? 64 : 128;
    pl.window = opt.quick ? 64 : 256;
  }
  if (!opt.seqlens.empty()) pl.seqlens = opt.seqlens;
  std::sort(pl.seqlens.begin(), pl.seqlens.end());
  pl.seqlens.erase(std::unique(pl.seqlens.begin(), pl.seqlens.end()), pl.seqlens.end());
  if (!opt.dtypes.empty()) pl.dtypes = opt.dtypes;
  pl.families =
      opt.families.empty() ? std::vector<Family>(std::begin(kAllFamilies), std::end(kAllFamilies)) : opt.families;
  pl.masks = opt.masks.empty() ? std::vector<MaskKind>(std::begin(kAllMasks), std::end(kAllMasks)) : opt.masks;
  if (opt.heads > 0) pl.heads = opt.heads;
  if (opt.head_dim > 0) pl.head_dim = opt.head_dim;
  if (opt.window > 0) pl.window = opt.window;
  return pl;
}

std::vector<KernelSpec> kernel_specs(const AuditOptions& opt, Backend backend) {
  auto wanted = [&](const char* k) {
    return opt.kernels.empty() || std::find(opt.kernels.begin(), opt.kernels.end(), k) != opt.kernels.end();
  };
  std::vector<KernelSpec> ks;
  if (backend != Backend::kCuda) {  // "cpu" (the tiled backend) and "decode" (run_audit refuses sm80/sm90 here)
    const bool any_cpu_name = wanted("cpu") || wanted("decode");
    if (wanted("cpu") || !any_cpu_name) ks.push_back({"cpu", Backend::kCpu, ""});
    if (wanted("decode")) ks.push_back({"cpu_decode", Backend::kCpu, "", true});
    return ks;
  }
  for (const char* fam : {"sm80", "sm90"})
    if (wanted(fam)) ks.push_back({fam, Backend::kCuda, fam});
  if (wanted("decode")) ks.push_back({"decode", Backend::kCuda, "", true});
  return ks;
}

/// A backend the user named explicitly must exist; returns the sentence when it does not.
std::string backend_unavailable(Backend requested) {
  if (requested == Backend::kCpu || requested == Backend::kAuto) return {};
  if (requested != Backend::kCuda) return "--backend: only cpu, cuda and auto are audited";
#if FLASHCPP_WITH_CUDA
  cuda::DeviceInfo dev;
  const Status st = cuda::current_device(&dev);
  return st.ok() ? std::string() : "--backend cuda: " + st.message();
#else
  return "--backend cuda: this build of flashcpp has no CUDA kernels (configure with -DFLASHCPP_CUDA=ON)";
#endif
}

/// Resolved backend for presets: kAuto becomes cuda when a device is present. A dump for a GPU
/// machine may be written anywhere, so --dump-inputs accepts --backend cuda without a device.
Backend plan_backend(const AuditOptions& opt) {
  if (opt.backend == Backend::kAuto) return harness::resolve_backend(Backend::kAuto);
  return opt.backend;
}

std::string file_stem(const std::string& name) {
  std::string s = name;
  for (char& ch : s)
    if (ch == '/') ch = '.';
  return s;
}

int dump_inputs(const AuditOptions& opt, const std::vector<Problem>& problems, std::uint64_t seed, std::ostream& out,
                std::ostream& err) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(opt.dump_dir, ec);
  nlohmann::json manifest;
  manifest["tool"] = "flashcpp audit --dump-inputs";
  manifest["seed"] = seed;
  manifest["layout"] = "bshd (batch 1): element (i, h, e) at (i * heads + h) * head_dim + e, little-endian";
  manifest["families"] = nlohmann::json::object();
  for (Family f : kAllFamilies) manifest["families"][family_name(f)] = family_provokes(f);
  manifest["problems"] = nlohmann::json::array();
  for (const Problem& p : problems) {
    const std::uint64_t ps = harness::case_seed(seed, p.name());
    const Inputs in = generate(p, ps, opt.cpu_threads);
    nlohmann::json j;
    j["name"] = p.name();
    j["family"] = family_name(p.family);
    j["dtype"] = dtype_name(p.dtype);
    j["seqlen"] = p.seqlen;
    j["heads"] = p.heads;
    j["head_dim"] = p.head_dim;
    j["mask"] = mask_kind_name(p.mask);
    j["causal"] = p.mask != MaskKind::kNone;
    j["window_left"] = p.mask == MaskKind::kWindow ? p.window : -1;
    j["softmax_scale"] = p.scale();
    j["seed"] = ps;
    const std::string stem = file_stem(p.name());
    const std::pair<const char*, const std::vector<float>*> tensors[] = {{"q", &in.q}, {"k", &in.k}, {"v", &in.v}};
    for (const auto& [tn, data] : tensors) {
      const harness::HostTensor t = to_dtype(p.dtype, *data);
      const std::string file = stem + "." + tn + ".bin";
      std::ofstream f(fs::path(opt.dump_dir) / file, std::ios::binary);
      if (!f.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(t.bytes.size())).flush()) {
        err << "flashcpp audit: cannot write " << (fs::path(opt.dump_dir) / file).string() << "\n";
        return 2;
      }
      j["files"][tn] = file;
    }
    manifest["problems"].push_back(j);
  }
  std::ofstream f(fs::path(opt.dump_dir) / "manifest.json");
  if (!(f << manifest.dump(1) << "\n" << std::flush)) {
    err << "flashcpp audit: cannot write the manifest in " << opt.dump_dir << "\n";
    return 2;
  }
  out << fmt::format("flashcpp audit: wrote {} problem(s) and manifest.json to {}\n", problems.size(), opt.dump_dir);
  return 0;
}

}  // namespace

std::vector<Problem> plan_problems(const AuditOptions& opt, Backend resolved) {
  const Plan pl = resolve_plan(opt, resolved);
  std::vector<Problem> out;
  for (int n : pl.seqlens)
    for (DType t : pl.dtypes)
      for (Family f : pl.families)
        for (MaskKind m : pl.masks)
          for (bool rot : {false, true}) {
            if (rot && !opt.rotary) continue;
            Problem p;
            p.family = f;
            p.dtype = t;
            p.seqlen = n;
            p.heads = pl.heads;
            p.head_dim = pl.head_dim;
            p.mask = m;
            p.window = pl.window;
            p.rotary = rot;
            out.push_back(p);
          }
  return out;
}

nlohmann::json report_json(const harness::Environment& env, const AuditOptions& opt,
                           const std::vector<Problem>& problems, const std::vector<Result>& results) {
  const Backend backend = plan_backend(opt);
  const Plan pl = resolve_plan(opt, backend);
  nlohmann::json j;
  j["tool"] = "flashcpp audit";
  j["environment"] = harness::environment_json(env);
  std::vector<std::string> fams, masks, kernels;
  for (Family f : pl.families) fams.push_back(family_name(f));
  for (MaskKind m : pl.masks) masks.push_back(mask_kind_name(m));
  for (const KernelSpec& k : kernel_specs(opt, backend)) kernels.push_back(k.label);
  j["config"] = {{"backend", backend_name(backend)},
                 {"quick", opt.quick},
                 {"seqlens", pl.seqlens},
                 {"dtypes", dtype_names(pl.dtypes)},
                 {"families", fams},
                 {"masks", masks},
                 {"kernels", kernels},
                 {"batch", 1},
                 {"heads", pl.heads},
                 {"head_dim", pl.head_dim},
                 {"window", pl.window},
                 {"rotary", opt.rotary},
                 {"layout", "bshd"},
                 {"softmax_scale", "1/sqrt(head_dim)"},
                 {"problems", problems.size()}};
  j["families"] = nlohmann::json::object();
  for (Family f : kAllFamilies) j["families"][family_name(f)] = family_provokes(f);
  j["tolerance_policy"] = harness::tolerance_policy_json();
  j["defect_bound"] = {
      {"formula",
       "|o - r| <= c * (u_o |r| + (u_p + eps_exp + eta_i + gamma_i) * (A + |r|) + n_i p_floor max|v|) + tau, "
       "A = P|V| (fp64)"},
      {"p_floor", "half the spacing of P's dtype below its normal range: 2^-25 fp16, 2^-134 bf16, 2^-150 fp32"},
      {"lse_formula", "|lse - lse_ref| <= c * (eta_i + eps_exp + gamma_i + 2^-24 |lse_ref|) + 2^-20"},
      {"eta_i", "(head_dim + 8) * 2^-24 * scale * |q_i| * max_j |k_j|"},
      {"gamma_i", "(256 + n_i / 64) * 2^-24, n_i = visible keys of the row"},
      {"c", DefectBound::kSafety},
      {"eps_exp", DefectBound::kEpsExp},
      {"u",
       {{"bf16", DefectBound::unit_roundoff(DType::kBF16)},
        {"fp16", DefectBound::unit_roundoff(DType::kF16)},
        {"fp32", DefectBound::unit_roundoff(DType::kF32)}}}};
  j["metrics"] = {
      {"row", "one (query, head) vector of head_dim outputs"},
      {"row_rel_err", "max_e |o_e - r_e| / max(max_e |r_e|, atol of the dtype); +inf (null) for a non-finite row"},
      {"floor_rel_err", "the same for the fp64 truth merely rounded to the dtype (what no kernel can beat)"},
      {"rows_over_tol", "rows with an element where |o - r| > atol + rtol |r| (docs/tolerances.md bands)"},
      {"max_tol_ratio", "max over elements of |o - r| / (atol + rtol |r|)"},
      {"max_bound_ratio", "max over elements of |o - r| / defect bound; > 1 fails the run"},
      {"first_n_over_tol", "smallest N of the sweep with rows_over_tol > 0, null if none"}};
  j["cdf_quantiles"] = cdf_quantiles();
  j["results"] = nlohmann::json::array();
  for (const Result& r : results) j["results"].push_back(result_json(r));
  const harness::Summary s = summarize(results);
  j["first_exceed"] = first_exceed_json(results);
  j["mask_effect"] = mask_effect_json(j["first_exceed"]);
  j["summary"] = {{"passed", s.passed}, {"failed", s.failed}, {"unsupported", s.unsupported}};
  return j;
}

int run_audit(const AuditOptions& opt, std::ostream& out, std::ostream& err) {
  if (opt.dump_dir.empty() && !opt.list_only) {
    if (const std::string why = backend_unavailable(opt.backend); !why.empty()) {
      err << "flashcpp audit: " << why << "\n";
      return 2;
    }
  }
  // 0 selects the preset; a negative size is a mistake, never a silent preset.
  for (const auto& [flag, v] : {std::pair{"--heads", opt.heads}, std::pair{"--head-dim", opt.head_dim},
                                std::pair{"--window", opt.window}, std::pair{"--threads", opt.cpu_threads}})
    if (v < 0) {
      err << fmt::format("flashcpp audit: {} {} is negative; it must be >= 1 (or left out for the preset)\n", flag, v);
      return 2;
    }
  const Backend backend = plan_backend(opt);
  // A kernel of the other backend would be dropped (kernel_specs keeps what the backend has):
  // name it instead of auditing something else than what was asked for.
  for (const std::string& k : opt.kernels) {
    const bool cuda_only = k == "sm80" || k == "sm90", cpu_only = k == "cpu";
    if (cuda_only && backend != Backend::kCuda) {
      err << "flashcpp audit: --kernels " << k << " is a CUDA kernel, but the audit runs on the CPU backend ("
          << (opt.backend == Backend::kAuto ? "--backend auto found no usable CUDA device" : "--backend cpu")
          << "); the CPU kernels are cpu and decode\n";
      return 2;
    }
    if (cpu_only && backend == Backend::kCuda) {
      err << "flashcpp audit: --kernels cpu is the CPU backend's kernel, but the audit runs on CUDA ("
          << (opt.backend == Backend::kAuto ? "--backend auto found a CUDA device" : "--backend cuda")
          << "); the CUDA kernels are sm80, sm90 and decode (add --backend cpu for cpu)\n";
      return 2;
    }
  }
  const std::vector<Problem> problems = plan_problems(opt, backend);
  const std::vector<KernelSpec> kernels = kernel_specs(opt, backend);
  if (problems.empty() || kernels.empty()) {
    err << "flashcpp audit: nothing to run (empty list of sizes, dtypes, families, masks or kernels)\n";
    return 2;
  }
  for (const Problem& p : problems) {
    if (p.seqlen < 1 || p.heads < 1 || p.window < 1) {
      err << "flashcpp audit: --n, --heads and --window must be >= 1\n";
      return 2;
    }
    if (!is_supported_head_dim(p.head_dim)) {
      err << fmt::format("flashcpp audit: head_dim {} is not supported (it must be a multiple of {} in [{}, {}])\n",
                         p.head_dim, kHeadDimStep, kHeadDimStep, kMaxHeadDim);
      return 2;
    }
    // Every tensor of a problem is held in host memory as float (and the truth in double).
    const double elems = static_cast<double>(p.seqlen) * p.heads * p.head_dim;
    if (elems > kMaxProblemElements) {
      err << fmt::format(
          "flashcpp audit: N {} with {} heads of head_dim {} is {:.3g} elements per tensor; the audit holds its "
          "inputs and the fp64 truth in host memory, so N * heads * head_dim must be at most 2^{} ({})\n",
          p.seqlen, p.heads, p.head_dim, elems, kMaxProblemElementsLog2, kMaxProblemElements);
      return 2;
    }
  }
  const std::uint64_t seed = opt.seed ? *opt.seed : harness::random_seed();
  if (opt.list_only) {
    out << "families:\n";
    for (Family f : kAllFamilies) out << fmt::format("  {:<13} {}\n", family_name(f), family_provokes(f));
    out << fmt::format("problems ({}), kernels:", problems.size());
    for (const KernelSpec& k : kernels) out << " " << k.label;
    out << "\n";
    for (const Problem& p : problems) out << "  " << p.name() << "\n";
    return 0;
  }
  if (!opt.dump_dir.empty()) return dump_inputs(opt, problems, seed, out, err);
  // The JSON is written after the whole run: a path that cannot be written fails now instead.
  if (!opt.json_path.empty()) {
    if (const std::string why = tools::unwritable("--json", opt.json_path, /*create_folder=*/true); !why.empty()) {
      err << "flashcpp audit: cannot write --json: " << why << "; nothing was run\n";
      return 2;
    }
  }

  const harness::Environment env = harness::describe_environment(backend, seed);
  RunSettings settings;
  settings.kernels = kernels;
  settings.cpu_threads = opt.cpu_threads;
  settings.perturb_output = opt.perturb_output;
  std::vector<std::string> labels;
  for (const KernelSpec& k : kernels) labels.push_back(k.label);
  out << fmt::format("flashcpp audit: backend {} on {}, kernels {}, {} problems, seed {} (replay with --seed {})\n",
                     backend_name(backend), env.device, join(labels, ","), problems.size(), seed, seed);
  std::size_t wname = 7;
  for (const Problem& p : problems) wname = std::max(wname, p.name().size());
  // The last column answers "is there a defect?", not "is the error inside the dtype band?": a
  // row can be 100% over the band and pass. Both names say so, and the legend spells it out.
  out << "columns: p50_rel .. max_rel = per-row relative error; rows_over_band = share of rows with an element\n"
         "  outside the dtype's tolerance band (docs/tolerances.md): a finding, never a failure; lse_err = max\n"
         "  |lse - truth|; err/bound = largest error over the defect bound (> 1 is a defect); defect_check: PASS =\n"
         "  no defect (no NaN/Inf where the truth is finite, every error within the bound), FAIL = a defect\n";
  const std::string header = fmt::format(
      "{:<{}}  {:<10}  {:>9}  {:>9}  {:>9}  {:>9}  {:>14}  {:>9}  {:>9}  {:>8}  {}", "problem", wname, "kernel",
      "p50_rel", "p99_rel", "p99.9", "max_rel", "rows_over_band", "lse_err", "err/bound", "ms", "defect_check");
  out << header << "\n" << std::string(header.size(), '-') << "\n" << std::flush;
  const auto t_start = Clock::now();
  std::vector<Result> results;
  std::map<std::string, int> unsupported_reasons;
  for (const Problem& p : problems) {
    const std::uint64_t ps = harness::case_seed(seed, p.name());
    std::vector<Result> rs;
    try {
      rs = run_problem(p, generate(p, ps, opt.cpu_threads), ps, settings);
    } catch (const std::exception& e) {
      for (const KernelSpec& k : kernels) {
        Result r = base_result(p, k, ps);
        r.message = std::string("exception: ") + e.what();
        rs.push_back(std::move(r));
      }
    }
    for (Result& r : rs) {
      const char* word = r.status == harness::CaseStatus::kPass   ? "PASS"
                         : r.status == harness::CaseStatus::kFail ? "FAIL"
                                                                  : "UNSUPPORTED";
      out << fmt::format(
          "{:<{}}  {:<10}  {:>9}  {:>9}  {:>9}  {:>9}  {:>14}  {:>9}  {:>9}  {:>8}  {}\n", p.name(), wname, r.kernel,
          sci(r.rel_err.p50), sci(r.rel_err.p99), sci(r.rel_err.p999), sci(r.rel_err.max),
          std::isnan(r.frac_rows_over_tol) ? std::string("-") : fmt::format("{:.2f}%", 100 * r.frac_rows_over_tol),
          sci(r.lse_max_abs_err),
          std::isnan(r.max_bound_ratio) ? std::string("-") : fmt::format("{:.3f}", r.max_bound_ratio),
          std::isnan(r.ms) ? std::string("-") : fmt::format("{:.1f}", r.ms), word);
      if (r.status == harness::CaseStatus::kFail) out << "    -> " << r.message << "\n";
      if (r.status == harness::CaseStatus::kUnsupported) ++unsupported_reasons[r.kernel + ": " + r.message];
      results.push_back(std::move(r));
    }
    out << std::flush;
  }
  for (const auto& [why, n] : unsupported_reasons)
    out << fmt::format("unsupported ({} result{}): {}\n", n, n == 1 ? "" : "s", why);

  // First N over the dtype band, per mask, in the order of the plan.
  const nlohmann::json first = first_exceed_json(results);
  {
    std::map<std::string, std::string> first_n;  // "kernel/dtype/family/mask" -> N or "-"
    for (const auto& f : first)
      first_n[fmt::format("{}/{}/{}/{}", f["kernel"].get<std::string>(), f["dtype"].get<std::string>(),
                          f["family"].get<std::string>(), f["mask"].get<std::string>())] =
          f["first_n_over_tol"].is_null() ? "-" : std::to_string(f["first_n_over_tol"].get<int>());
    const Plan pl = resolve_plan(opt, backend);
    std::vector<std::string> ns;
    for (int n : pl.seqlens) ns.push_back(std::to_string(n));
    out << fmt::format(
        "\nfirst N (of {}) at which some row leaves the dtype band of docs/tolerances.md ('-': never, "
        "'n/a': unsupported):\n",
        join(ns, ", "));
    std::vector<std::string> cols;
    for (bool rot : {false, true})
      if (!rot || opt.rotary)
        for (MaskKind m : pl.masks) cols.push_back(mask_label(m, rot));
    const int cw = opt.rotary ? 13 : 7;  // "window+rotary"
    out << fmt::format("  {:<10}  {:<5}  {:<13}", "kernel", "dtype", "family");
    for (const std::string& col : cols) out << fmt::format("  {:>{}}", col, cw);
    out << "\n";
    for (const KernelSpec& k : kernels)
      for (DType t : pl.dtypes)
        for (Family f : pl.families) {
          out << fmt::format("  {:<10}  {:<5}  {:<13}", k.label, dtype_name(t), family_name(f));
          for (const std::string& col : cols) {
            const auto it = first_n.find(fmt::format("{}/{}/{}/{}", k.label, dtype_name(t), family_name(f), col));
            out << fmt::format("  {:>{}}", it == first_n.end() ? "n/a" : it->second, cw);
          }
          out << "\n";
        }
  }

  int rc = 0;
  if (!opt.json_path.empty()) {
    std::error_code ec;
    const std::filesystem::path path(opt.json_path);
    if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
    std::ofstream f(path);
    if (f << report_json(env, opt, problems, results).dump(1) << "\n" << std::flush) {  // a full disk shows at the flush
      out << "report: " << opt.json_path << "\n";
    } else {
      err << "flashcpp audit: cannot write " << opt.json_path << "\n";
      rc = 2;
    }
  }
  const harness::Summary s = summarize(results);
  out << fmt::format("audit took {:.1f} s\n", ms_since(t_start) / 1000.0);
  out << harness::summary_line(s) << "\n" << std::flush;
  if (s.failed > 0) return 1;
  return rc;
}

}  // namespace flashcpp::audit
