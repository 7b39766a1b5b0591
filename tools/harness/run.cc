// Running one case: inputs, poisoned outputs with NaN guard zones, the backend run, the fp64
// ground truth and the comparison.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "flashcpp/half.h"
#include "flashcpp/reference.h"
#include "harness/harness.h"
#if FLASHCPP_WITH_CUDA
#include <cuda_runtime_api.h>

#include "flashcpp/device.h"
#include "harness/device_buffer.h"
#endif

namespace flashcpp::harness {

// ---- small pieces --------------------------------------------------------------------------

HostTensor::HostTensor(DType t, std::int64_t n) : dtype(t), bytes(static_cast<std::size_t>(n) * dtype_size(t)) {}
std::int64_t HostTensor::size() const { return static_cast<std::int64_t>(bytes.size() / dtype_size(dtype)); }
float HostTensor::get(std::int64_t i) const { return load_as_float(bytes.data(), dtype, i); }
void HostTensor::set(std::int64_t i, float v) { store_from_float(bytes.data(), dtype, i, v); }

const char* case_status_name(CaseStatus s) noexcept {
  switch (s) {
    case CaseStatus::kPass: return "pass";
    case CaseStatus::kFail: return "fail";
    case CaseStatus::kUnsupported: return "unsupported";
  }
  return "unknown";
}

namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

/// Elements of NaN padding before and after every buffer. Poisoned output guards catch writes just
/// past either end; NaN input guards turn reads just past either end into NaN outputs (a masked
/// score times a NaN V row is still NaN). 256 elements keep every buffer 512-byte aligned.
constexpr std::int64_t kGuard = 256;

/// A host buffer of `n` elements of `dt` inside NaN guard zones; every byte starts as 0xFF, which
/// is a NaN in fp16, bf16 and fp32 alike.
struct Guarded {
  DType dt = DType::kF32;
  std::int64_t n = 0;
  std::vector<std::uint8_t> bytes;
  Guarded() = default;
  Guarded(DType t, std::int64_t count)
      : dt(t), n(count), bytes(static_cast<std::size_t>(count + 2 * kGuard) * dtype_size(t), 0xFF) {}
  std::size_t esize() const { return dtype_size(dt); }
  void* payload() { return bytes.data() + kGuard * esize(); }
  std::size_t total_bytes() const { return bytes.size(); }
  /// Guard elements whose bytes are no longer the poison pattern.
  std::int64_t guard_violations() const {
    std::int64_t bad = 0;
    const std::size_t es = esize();
    auto scan = [&](std::size_t from) {
      for (std::int64_t e = 0; e < kGuard; ++e) {
        const std::uint8_t* p = bytes.data() + from + e * es;
        for (std::size_t b = 0; b < es; ++b)
          if (p[b] != 0xFF) {
            ++bad;
            break;
          }
      }
    };
    scan(0);
    scan((kGuard + n) * es);
    return bad;
  }
};

/// normal(0, 1) rounded to the dtype, in independent chunks so the values do not depend on the
/// number of threads.
void fill_normal(Guarded& g, std::uint64_t seed) {
  constexpr std::int64_t kChunk = 1 << 20;
  const std::int64_t chunks = (g.n + kChunk - 1) / kChunk;
  auto work = [&](std::int64_t c) {
    std::mt19937_64 rng(splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(c))));
    std::normal_distribution<float> dist(0.f, 1.f);
    const std::int64_t end = std::min(g.n, (c + 1) * kChunk);
    for (std::int64_t i = c * kChunk; i < end; ++i) store_from_float(g.payload(), g.dt, i, dist(rng));
  };
  const int threads = static_cast<int>(std::min<std::int64_t>(chunks, std::max(1u, std::thread::hardware_concurrency())));
  if (threads <= 1) {
    for (std::int64_t c = 0; c < chunks; ++c) work(c);
    return;
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (std::int64_t c = t; c < chunks; c += threads) work(c);
    });
  for (auto& th : pool) th.join();
}

/// Everything a case needs on the host: inputs, poisoned outputs and the mask arrays.
struct HostProblem {
  Guarded q, k, v, o, lse;
  std::vector<float> alibi;
  std::vector<std::int32_t> cu_q, cu_k;
  std::vector<std::int32_t> bs_row_ptr, bs_col_idx, bs_partial;
  std::vector<std::uint64_t> bs_masks;
  BlockSparseMask bs;
};

void build_block_sparse(const Case& c, std::uint64_t seed, HostProblem* hp) {
  const MaskSpec& m = c.mask;
  BlockSparseMask& bs = hp->bs;
  bs.block_m = m.sparse_block_m;
  bs.block_n = m.sparse_block_n;
  bs.num_batch = m.sparse_per_head ? c.batch : 1;
  bs.num_heads = m.sparse_per_head ? c.heads_q : 1;
  bs.num_q_blocks = (c.seqlen_q + bs.block_m - 1) / bs.block_m;
  bs.num_k_blocks = (c.seqlen_k + bs.block_n - 1) / bs.block_n;
  const int words = (bs.block_n + 63) / 64;
  std::mt19937_64 rng(splitmix64(seed ^ 0x5BA55E5ull));
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const int rows = bs.num_batch * bs.num_heads * bs.num_q_blocks;
  hp->bs_row_ptr.assign(1, 0);
  for (int r = 0; r < rows; ++r) {
    for (int kb = 0; kb < bs.num_k_blocks; ++kb) {
      const double x = u(rng);
      if (x < 0.35) continue;  // absent block
      hp->bs_col_idx.push_back(kb);
      if (x < 0.7) {
        hp->bs_partial.push_back(-1);  // every element visible
      } else {
        // Partial block: random element bits, including bits for keys past seqlen_k in the last
        // block, which every kernel must ignore.
        hp->bs_partial.push_back(static_cast<std::int32_t>(hp->bs_masks.size() / (bs.block_m * words)));
        for (int e = 0; e < bs.block_m * words; ++e) hp->bs_masks.push_back(rng());
      }
    }
    hp->bs_row_ptr.push_back(static_cast<std::int32_t>(hp->bs_col_idx.size()));
  }
  bs.num_partial = static_cast<std::int64_t>(hp->bs_masks.size() / (bs.block_m * words));
  bs.row_ptr = hp->bs_row_ptr.data();
  bs.col_idx = hp->bs_col_idx.data();
  bs.partial = hp->bs_partial.data();
  bs.element_masks = hp->bs_masks.data();
}

void build_host_problem(const Case& c, std::uint64_t seed, HostProblem* hp) {
  const std::int64_t d = c.head_dim;
  hp->q = Guarded(c.dtype, c.total_q() * c.heads_q * d);
  hp->k = Guarded(c.dtype, c.total_k() * c.heads_kv * d);
  hp->v = Guarded(c.dtype, c.total_k() * c.heads_kv * d);
  hp->o = Guarded(c.dtype, c.total_q() * c.heads_q * d);
  hp->lse = Guarded(DType::kF32, c.return_lse ? c.total_q() * c.heads_q : 0);
  fill_normal(hp->q, splitmix64(seed ^ 1));
  fill_normal(hp->k, splitmix64(seed ^ 2));
  fill_normal(hp->v, splitmix64(seed ^ 3));
  if (c.mask.alibi) {
    const int nb = c.mask.alibi_per_batch ? c.batch : 1;
    hp->alibi.resize(static_cast<std::size_t>(nb) * c.heads_q);
    for (int b = 0; b < nb; ++b)
      for (int h = 0; h < c.heads_q; ++h)
        hp->alibi[static_cast<std::size_t>(b) * c.heads_q + h] =
            std::exp2(-8.f * (h + 1) / c.heads_q) * (1.f + 0.25f * b);
  }
  if (c.mask.is_varlen()) {
    const auto& lk = c.mask.varlen_k.empty() ? c.mask.varlen_q : c.mask.varlen_k;
    hp->cu_q.assign(1, 0);
    hp->cu_k.assign(1, 0);
    for (std::size_t b = 0; b < c.mask.varlen_q.size(); ++b) {
      hp->cu_q.push_back(hp->cu_q.back() + c.mask.varlen_q[b]);
      hp->cu_k.push_back(hp->cu_k.back() + lk[b]);
    }
  }
  if (c.mask.is_block_sparse()) build_block_sparse(c, seed, hp);
}

/// Pointers of one memory space (host or device) for make_params.
struct Pointers {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  void* k_rotated = nullptr;  ///< rotary: where the keys are rotated to (CUDA needs one; null on the host)
  float* lse = nullptr;
  const float* alibi = nullptr;
  const std::int32_t *cu_q = nullptr, *cu_k = nullptr;
  const BlockSparseMask* bs = nullptr;
};

AttnParams make_params(const Case& c, const Pointers& ptr) {
  AttnParams p;
  p.batch = c.batch;
  p.seqlen_q = c.seqlen_q;
  p.seqlen_k = c.seqlen_k;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim = c.head_dim;
  const std::int64_t d = c.head_dim;
  auto view = [&](void* data, int heads, int seqlen) {
    if (c.mask.is_varlen()) return TensorView{data, c.dtype, 0, heads * d, d};
    return c.layout == Layout::kBhsd ? bhsd_view(data, c.dtype, seqlen, heads, d)
                                     : bshd_view(data, c.dtype, seqlen, heads, d);
  };
  p.q = view(ptr.q, c.heads_q, c.seqlen_q);
  p.k = view(ptr.k, c.heads_kv, c.seqlen_k);
  p.v = view(ptr.v, c.heads_kv, c.seqlen_k);
  p.o = view(ptr.o, c.heads_q, c.seqlen_q);
  p.lse = c.return_lse ? ptr.lse : nullptr;
  p.softmax_scale = c.softmax_scale;
  MaskParams& m = p.mask;
  m.causal = c.mask.causal;
  m.window_left = c.mask.window_left;
  m.window_right = c.mask.window_right;
  m.global_tokens = c.mask.global_tokens;
  m.global_queries = c.mask.global_queries;
  m.softcap = c.mask.softcap;
  if (c.mask.alibi) {
    m.alibi_slopes = ptr.alibi;
    m.alibi_batch_stride = c.mask.alibi_per_batch ? c.heads_q : 0;
  }
  if (c.mask.is_varlen()) {
    m.cu_seqlens_q = ptr.cu_q;
    m.cu_seqlens_k = ptr.cu_k;
  }
  if (c.mask.is_block_sparse()) m.block_sparse = ptr.bs;
  if (c.mask.rotary_dim > 0) {
    p.rotary.spec.rotary_dim = c.mask.rotary_dim;
    p.rotary.spec.style = c.mask.rotary_interleaved ? RopeStyle::kInterleaved : RopeStyle::kNeox;
    if (ptr.k_rotated) p.rotary.k_rotated = view(ptr.k_rotated, c.heads_kv, c.seqlen_k);
  }
  return p;
}

Pointers host_pointers(HostProblem& hp) {
  Pointers p;
  p.q = hp.q.payload();
  p.k = hp.k.payload();
  p.v = hp.v.payload();
  p.o = hp.o.payload();
  p.lse = static_cast<float*>(hp.lse.payload());
  p.alibi = hp.alibi.empty() ? nullptr : hp.alibi.data();
  p.cu_q = hp.cu_q.empty() ? nullptr : hp.cu_q.data();
  p.cu_k = hp.cu_k.empty() ? nullptr : hp.cu_k.data();
  p.bs = &hp.bs;
  return p;
}

/// MaskSpec::nan_inputs: a NaN in q at the middle row of every sequence (head b % heads_q), in k
/// at the key 3/4 into sequence 0 (KV head 0), and with ALiBi in the last head's slope. The
/// references read the same NaNs, so the truth has NaN exactly in the rows the rule names.
void plant_nans(const Case& c, HostProblem* hp) {
  if (!c.mask.nan_inputs) return;
  const AttnParams p = make_params(c, host_pointers(*hp));  // strides of the case's layout
  const bool vl = c.mask.is_varlen();
  const int nseq = vl ? static_cast<int>(c.mask.varlen_q.size()) : c.batch;
  auto at = [&](const TensorView& t, int b, std::int64_t first, int i, int h, int e) {
    return (vl ? (first + i) * t.seq_stride : b * t.batch_stride + i * t.seq_stride) + h * t.head_stride + e;
  };
  for (int b = 0; b < nseq; ++b) {
    const int lq = vl ? c.mask.varlen_q[b] : c.seqlen_q;
    if (lq == 0) continue;
    store_from_float(hp->q.payload(), c.dtype, at(p.q, b, vl ? hp->cu_q[b] : 0, lq / 2, b % c.heads_q, b % c.head_dim),
                     NAN);
  }
  const int lk0 = vl ? hp->cu_k[1] : c.seqlen_k;
  if (lk0 > 0) store_from_float(hp->k.payload(), c.dtype, at(p.k, 0, 0, lk0 * 3 / 4, 0, 1), NAN);
  if (c.mask.alibi)
    for (std::size_t x = c.heads_q - 1; x < hp->alibi.size(); x += c.heads_q) hp->alibi[x] = NAN;
}

/// What a backend run leaves for the comparison.
struct RunOutcome {
  Status status;           ///< of select_kernel / attention_forward / a CUDA call
  bool unsupported = false;
  KernelChoice choice;
  double ms = NAN;
};

RunOutcome run_cpu(const Case& c, const RunConfig& cfg, HostProblem& hp) {
  RunOutcome r;
  const AttnParams p = make_params(c, host_pointers(hp));
  RunOptions opt;
  opt.backend = cfg.backend;
  opt.cpu_threads = cfg.cpu_threads;
  r.status = select_kernel(p, opt, &r.choice);
  if (r.status.code() == StatusCode::kUnsupported) r.unsupported = true;
  if (!r.status.ok()) return r;
  const auto t0 = Clock::now();
  r.status = attention_forward(p, opt);
  r.ms = ms_since(t0);
  if (r.status.code() == StatusCode::kUnsupported) r.unsupported = true;
  return r;
}

#if FLASHCPP_WITH_CUDA

template <class T>
Status upload_vec(DeviceBuffer& d, const std::vector<T>& v) {
  return d.upload(v.data(), v.size() * sizeof(T));
}

struct DeviceProblem {
  DeviceBuffer q, k, v, o, lse, alibi, cu_q, cu_k, bs_row_ptr, bs_col_idx, bs_partial, bs_masks;
  DeviceBuffer k_rotated;  ///< rotary: the keys rotated by the pre-pass (k keeps the originals)
  BlockSparseMask bs;  ///< host struct whose arrays live on the device
};

Status upload_problem(const Case& c, HostProblem& hp, DeviceProblem* dp, Pointers* ptr) {
  FLASHCPP_RETURN_IF_ERROR(dp->q.upload(hp.q.bytes.data(), hp.q.total_bytes()));
  FLASHCPP_RETURN_IF_ERROR(dp->k.upload(hp.k.bytes.data(), hp.k.total_bytes()));
  FLASHCPP_RETURN_IF_ERROR(dp->v.upload(hp.v.bytes.data(), hp.v.total_bytes()));
  FLASHCPP_RETURN_IF_ERROR(dp->o.alloc(hp.o.total_bytes()));
  HARNESS_CUDA_TRY(cudaMemset(dp->o.get(), 0xFF, hp.o.total_bytes()));  // NaN poison + guards
  FLASHCPP_RETURN_IF_ERROR(dp->lse.alloc(hp.lse.total_bytes()));
  HARNESS_CUDA_TRY(cudaMemset(dp->lse.get(), 0xFF, hp.lse.total_bytes()));
  FLASHCPP_RETURN_IF_ERROR(upload_vec(dp->alibi, hp.alibi));
  FLASHCPP_RETURN_IF_ERROR(upload_vec(dp->cu_q, hp.cu_q));
  FLASHCPP_RETURN_IF_ERROR(upload_vec(dp->cu_k, hp.cu_k));
  const std::size_t es = dtype_size(c.dtype);
  ptr->q = dp->q.as<void>(kGuard * es);
  ptr->k = dp->k.as<void>(kGuard * es);
  ptr->v = dp->v.as<void>(kGuard * es);
  ptr->o = dp->o.as<void>(kGuard * es);
  ptr->lse = dp->lse.as<float>(kGuard * sizeof(float));
  if (c.mask.rotary_dim > 0) {
    // Shaped like k, guards included (poisoned); out of place, so k keeps the original keys for
    // anything that reads p_dev after the run.
    FLASHCPP_RETURN_IF_ERROR(dp->k_rotated.alloc(hp.k.total_bytes()));
    FLASHCPP_RETURN_IF_ERROR(dp->k_rotated.poison());
    ptr->k_rotated = dp->k_rotated.as<void>(kGuard * es);
  }
  ptr->alibi = dp->alibi.as<const float>();
  ptr->cu_q = dp->cu_q.as<const std::int32_t>();
  ptr->cu_k = dp->cu_k.as<const std::int32_t>();
  if (c.mask.is_block_sparse()) {
    FLASHCPP_RETURN_IF_ERROR(upload_vec(dp->bs_row_ptr, hp.bs_row_ptr));
    FLASHCPP_RETURN_IF_ERROR(upload_vec(dp->bs_col_idx, hp.bs_col_idx));
    FLASHCPP_RETURN_IF_ERROR(upload_vec(dp->bs_partial, hp.bs_partial));
    FLASHCPP_RETURN_IF_ERROR(upload_vec(dp->bs_masks, hp.bs_masks));
    dp->bs = hp.bs;
    dp->bs.row_ptr = dp->bs_row_ptr.as<const std::int32_t>();
    dp->bs.col_idx = dp->bs_col_idx.as<const std::int32_t>();
    dp->bs.partial = dp->bs_partial.as<const std::int32_t>();
    dp->bs.element_masks = dp->bs_masks.as<const std::uint64_t>();
    ptr->bs = &dp->bs;
  }
  return Status::Ok();
}

RunOutcome run_cuda(const Case& c, const RunConfig& cfg, HostProblem& hp, DeviceProblem& dp, AttnParams* p_dev) {
  RunOutcome r;
  cuda::DeviceInfo dev;
  r.status = cuda::current_device(&dev);
  if (!r.status.ok()) {
    r.unsupported = true;  // no device: nothing on this machine can run the case
    return r;
  }
  Pointers ptr;
  r.status = upload_problem(c, hp, &dp, &ptr);
  if (!r.status.ok()) return r;
  *p_dev = make_params(c, ptr);
  RunOptions opt;
  opt.backend = Backend::kCuda;
  opt.cuda_config = cfg.cuda_config;
  r.status = select_kernel(*p_dev, opt, &r.choice);
  if (r.status.code() == StatusCode::kUnsupported) r.unsupported = true;
  if (!r.status.ok()) return r;
  r.status = [&]() -> Status {
    HARNESS_CUDA_TRY(cudaDeviceSynchronize());
    const auto t0 = Clock::now();
    FLASHCPP_RETURN_IF_ERROR(attention_forward(*p_dev, opt));
    HARNESS_CUDA_TRY(cudaGetLastError());
    HARNESS_CUDA_TRY(cudaDeviceSynchronize());
    r.ms = ms_since(t0);
    FLASHCPP_RETURN_IF_ERROR(dp.o.download(hp.o.bytes.data(), hp.o.total_bytes()));
    FLASHCPP_RETURN_IF_ERROR(dp.lse.download(hp.lse.bytes.data(), hp.lse.total_bytes()));
    return Status::Ok();
  }();
  if (r.status.code() == StatusCode::kUnsupported) r.unsupported = true;
  return r;
}

Status gpu_reference(const Case& c, const AttnParams& p_dev, cpu::RefOutput* ref) {
  const std::int64_t tq = c.total_q();
  ref->total_q = tq;
  ref->o.assign(static_cast<std::size_t>(tq * c.heads_q * c.head_dim), 0.0);
  ref->lse.assign(static_cast<std::size_t>(tq * c.heads_q), 0.0);
  DeviceBuffer o, lse;
  FLASHCPP_RETURN_IF_ERROR(o.alloc(ref->o.size() * sizeof(double)));
  FLASHCPP_RETURN_IF_ERROR(lse.alloc(ref->lse.size() * sizeof(double)));
  FLASHCPP_RETURN_IF_ERROR(cuda::reference_attention_f64(p_dev, o.as<double>(), lse.as<double>(), nullptr));
  HARNESS_CUDA_TRY(cudaGetLastError());
  HARNESS_CUDA_TRY(cudaDeviceSynchronize());
  FLASHCPP_RETURN_IF_ERROR(o.download(ref->o.data(), ref->o.size() * sizeof(double)));
  FLASHCPP_RETURN_IF_ERROR(lse.download(ref->lse.data(), ref->lse.size() * sizeof(double)));
  return Status::Ok();
}

#endif  // FLASHCPP_WITH_CUDA

double percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0.0;
  const std::size_t k = std::min(v.size() - 1, static_cast<std::size_t>(q * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

/// Compares the kernel output (packed payload copies) against the fp64 truth; fills the metrics.
/// Where the truth is NaN (NaN inputs) the output must be NaN (counted in nan_expected); a NaN
/// anywhere else, or a number where the truth is NaN, counts in nan_count / lse_nan_count.
void compare(const Case& c, const HostProblem& hp, const HostTensor& out, const std::vector<float>& lse,
             const cpu::RefOutput& ref, CaseResult* r) {
  Tolerance tol = r->tol;
  tol.atol = r->effective_atol;
  tol.lse_atol = r->effective_lse_atol;
  const int hq = c.heads_q, d = c.head_dim;
  const std::int64_t tq = c.total_q();
  const AttnParams p = make_params(c, Pointers{});  // strides only
  double sum_err = 0, max_err = 0, max_rel = 0, ratio = 0, floor_max = 0, floor_sum = 0, lse_max = 0;
  std::int64_t count = 0;
  std::vector<double> row_err;
  row_err.reserve(static_cast<std::size_t>(tq * hq));
  const int nseq = c.mask.is_varlen() ? static_cast<int>(c.mask.varlen_q.size()) : c.batch;
  for (int b = 0; b < nseq; ++b) {
    const int lq = c.mask.is_varlen() ? c.mask.varlen_q[b] : c.seqlen_q;
    const std::int64_t row0 = c.mask.is_varlen() ? hp.cu_q[b] : static_cast<std::int64_t>(b) * c.seqlen_q;
    for (int i = 0; i < lq; ++i) {
      const std::int64_t r_packed = row0 + i;
      for (int h = 0; h < hq; ++h) {
        const std::int64_t base = c.mask.is_varlen()
                                      ? r_packed * p.o.seq_stride + h * p.o.head_stride
                                      : b * p.o.batch_stride + i * p.o.seq_stride + h * p.o.head_stride;
        const double* rf = ref.o.data() + (r_packed * hq + h) * d;
        double rmax = 0;
        for (int e = 0; e < d; ++e) {
          const double o = out.get(base + e), want = rf[e];
          if (std::isnan(want)) {  // NaN inputs: NaN is the one right answer
            if (std::isnan(o)) {
              ++r->nan_expected;
            } else if (r->nan_count++ == 0 && r->message.empty()) {
              r->message = fmt::format("O[b={},i={},h={},d={}] is {} where the truth is NaN", b, i, h, e, o);
            }
            continue;
          }
          const double fl = std::fabs(round_to_dtype(c.dtype, want) - want);
          floor_max = std::max(floor_max, fl);
          floor_sum += fl;
          ++count;
          if (!std::isfinite(o)) {
            if (r->nan_count++ == 0 && r->message.empty())
              r->message = fmt::format("O[b={},i={},h={},d={}] is {} (ref {:.6g})", b, i, h, e, o, want);
            continue;
          }
          const double err = std::fabs(o - want), allowed = tol.atol + tol.rtol * std::fabs(want);
          sum_err += err;
          max_err = std::max(max_err, err);
          rmax = std::max(rmax, err);
          max_rel = std::max(max_rel, err / std::max(std::fabs(want), tol.atol));
          ratio = std::max(ratio, err / allowed);
          if (err > allowed && r->violations++ == 0 && r->message.empty())
            r->message = fmt::format("O[b={},i={},h={},d={}] = {:.6g} vs ref {:.6g}: |err| {:.3g} > tol {:.3g}",
                                     b, i, h, e, o, want, err, allowed);
        }
        row_err.push_back(rmax);
        if (c.return_lse) {
          const std::int64_t li = c.mask.is_varlen() ? h * tq + r_packed
                                                     : (static_cast<std::int64_t>(b) * hq + h) * c.seqlen_q + i;
          const double got = lse[static_cast<std::size_t>(li)], want = ref.lse[static_cast<std::size_t>(h * tq + r_packed)];
          const bool want_empty = std::isinf(want) && want < 0;
          bool bad = false;
          if (std::isnan(want)) {
            bad = !std::isnan(got);
          } else if (want_empty) {
            bad = !(std::isinf(got) && got < 0);
          } else if (!std::isfinite(got)) {
            bad = true;
          } else {
            const double err = std::fabs(got - want);
            lse_max = std::max(lse_max, err);
            if (err > tol.lse_atol && r->lse_violations++ == 0 && r->message.empty())
              r->message = fmt::format("LSE[b={},h={},i={}] = {:.8g} vs ref {:.8g}: |err| {:.3g} > {:.3g}", b, h,
                                       i, got, want, err, tol.lse_atol);
          }
          if (bad && r->lse_nan_count++ == 0 && r->message.empty())
            r->message = fmt::format("LSE[b={},h={},i={}] is {} (ref {:.8g})", b, h, i, got, want);
        }
      }
    }
  }
  r->max_abs_err = max_err;
  r->mean_abs_err = count > r->nan_count ? sum_err / static_cast<double>(count - r->nan_count) : 0.0;
  r->max_rel_err = max_rel;
  r->tol_ratio = ratio;
  r->floor_max_abs_err = floor_max;
  r->floor_mean_abs_err = count ? floor_sum / static_cast<double>(count) : 0.0;
  r->max_row_err = row_err.empty() ? 0.0 : *std::max_element(row_err.begin(), row_err.end());
  r->p99_row_err = percentile(row_err, 0.99);
  r->p50_row_err = percentile(row_err, 0.50);
  if (c.return_lse) r->lse_max_abs_err = lse_max;
}

void run_case_impl(const Case& c, const RunConfig& cfg, CaseResult* r) {
  HostProblem hp;
  build_host_problem(c, r->seed, &hp);
  plant_nans(c, &hp);
  cpu::RefOutput ref;
  RunOutcome run;
  bool gpu_truth = false;
#if FLASHCPP_WITH_CUDA
  DeviceProblem dp;
  AttnParams p_dev;
#endif
  if (cfg.backend == Backend::kCuda) {
#if FLASHCPP_WITH_CUDA
    run = run_cuda(c, cfg, hp, dp, &p_dev);
    const double pairs = static_cast<double>(c.batch) * c.heads_q * c.seqlen_q * c.seqlen_k;
    gpu_truth = pairs > cfg.gpu_reference_threshold && !c.mask.is_block_sparse();
#else
    run.unsupported = true;
    run.status = Status::Unsupported("this build of flashcpp has no CUDA kernels (configure with -DFLASHCPP_CUDA=ON)");
#endif
  } else {
    run = run_cpu(c, cfg, hp);
  }
  r->kernel = kernel_name(run.choice.id);
  r->config = run.choice.config;
  r->kernel_reason = run.choice.reason;
  r->ms = run.ms;
  if (run.unsupported) {
    r->status = CaseStatus::kUnsupported;
    r->message = run.status.message();
    return;
  }
  if (!run.status.ok()) {
    r->status = CaseStatus::kFail;
    r->message = run.status.to_string();
    return;
  }
  // Ground truth.
  const auto t0 = Clock::now();
  Status st;
  if (gpu_truth) {
#if FLASHCPP_WITH_CUDA
    r->reference = "cuda_fp64";
    st = gpu_reference(c, p_dev, &ref);
#endif
  } else {
    r->reference = "cpu_fp64";
    // With rotary, on q and k rotated exactly as the backends rotate them (attention.h).
    RunOptions ro;
    ro.cpu_threads = cfg.cpu_threads;
    st = cpu::run_with_rotary(make_params(c, host_pointers(hp)), ro, [&](const AttnParams& a) {
      return cpu::reference_attention(a, &ref, cfg.cpu_threads);
    });
  }
  r->ref_ms = ms_since(t0);
  if (!st.ok()) {
    r->status = CaseStatus::kFail;
    r->message = "ground truth failed: " + st.to_string();
    return;
  }
  // fp32: the error of a plain fp32 implementation widens the band (see plain.cc).
  r->effective_atol = r->tol.atol;
  r->effective_lse_atol = r->tol.lse_atol;
  if (c.dtype == DType::kF32 && r->tol.plain_factor > 0) {
    std::vector<float> po, pl;
    float top_score = 0.f;
    RunOptions ro;
    ro.cpu_threads = cfg.cpu_threads;
    const AttnParams host_params = make_params(c, host_pointers(hp));
    st = cpu::run_with_rotary(host_params, ro, [&](const AttnParams& a) {
      return plain_attention_fp32(a, &po, &pl, cfg.cpu_threads, &top_score);
    });
    if (!st.ok()) {
      r->status = CaseStatus::kFail;
      r->message = "plain fp32 implementation failed: " + st.to_string();
      return;
    }
    // NaN against NaN agrees (NaN inputs); NaN against a number is a disagreement (infinite).
    auto gap = [](double got, double want) {
      if (std::isnan(want) || std::isnan(got)) return std::isnan(want) && std::isnan(got) ? 0.0 : INFINITY;
      return std::fabs(got - want);
    };
    double e_o = 0, e_l = 0;
    for (std::size_t i = 0; i < po.size(); ++i) e_o = std::max(e_o, gap(po[i], ref.o[i]));
    for (std::size_t i = 0; i < pl.size(); ++i) {
      const double want = ref.lse[i];
      if (std::isinf(want) && std::isinf(pl[i]) && want < 0 && pl[i] < 0) continue;
      e_l = std::max(e_l, std::isfinite(pl[i]) || std::isnan(pl[i]) ? gap(pl[i], want) : INFINITY);
    }
    r->plain_max_abs_err = e_o;
    r->plain_lse_max_abs_err = e_l;
    if (!(e_o <= kPlainSanityBound && e_l <= kPlainSanityBound)) {
      r->status = CaseStatus::kFail;
      r->message = fmt::format(
          "the harness's plain fp32 implementation and the fp64 reference disagree (O {:.3g}, LSE {:.3g} > {:g}): "
          "a mask bug in one of them",
          e_o, e_l, kPlainSanityBound);
      return;
    }
    // The binade. The plain implementation holds a score scaled (torch's order); the kernels'
    // algebra holds it in q.k's units and scales inside the exponent (flash-attn's order), where
    // the same score is |s| / scale and rounds to half an ulp of that. With large scores (ALiBi:
    // |s| ~ 250, ~2800 in q.k's units at head_dim 128) this rounding is the error of both. Which
    // binade each order lands in moves its cost by up to 2x, so the plain error is scaled by the
    // ratio of the two ulps when the kernels' is the coarser (1.41x on the d128 ALiBi case, whose
    // tol_ratio averaged 0.63 and reached 0.98 over 301 seeds without it). Only with ALiBi: without
    // it scores stay ~10 and the sums, not the score's rounding, set both errors.
    const float scale = std::fabs(host_params.effective_scale());
    double binade = 1.0;
    if (c.mask.alibi && top_score > 0.f && std::isfinite(top_score) && scale > 0.f)
      binade = std::clamp(fp32_ulp(top_score / scale) * scale / fp32_ulp(top_score), 1.0, 2.0);
    r->effective_atol += r->tol.plain_factor * binade * e_o;
    r->effective_lse_atol += r->tol.plain_factor * binade * e_l;
  }
  // Guards, then the payload copies the test hook may perturb.
  r->guard_violations = hp.o.guard_violations() + hp.lse.guard_violations();
  HostTensor out(c.dtype, hp.o.n);
  std::memcpy(out.data(), hp.o.payload(), out.bytes.size());
  std::vector<float> lse(static_cast<std::size_t>(hp.lse.n));
  if (!lse.empty()) std::memcpy(lse.data(), hp.lse.payload(), lse.size() * sizeof(float));
  if (cfg.perturb_output) cfg.perturb_output(c, out, lse);
  if (r->guard_violations)
    r->message = fmt::format("{} element(s) written outside the output buffers", r->guard_violations);
  compare(c, hp, out, lse, ref, r);
  if (c.mask.nan_inputs && r->nan_expected == 0 && r->message.empty())
    r->message = "a NaN-input case whose truth has no NaN row tests nothing (the planted NaNs reached no row)";
  const bool ok = r->nan_count == 0 && r->lse_nan_count == 0 && r->guard_violations == 0 && r->violations == 0 &&
                  r->lse_violations == 0 && (!c.mask.nan_inputs || r->nan_expected > 0);
  r->status = ok ? CaseStatus::kPass : CaseStatus::kFail;
}

}  // namespace

std::uint64_t case_seed(std::uint64_t run_seed, const std::string& name) {
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  return splitmix64(run_seed ^ h);
}

CaseResult run_case(const Case& c, const RunConfig& cfg) {
  CaseResult r;
  r.c = c;
  r.name = c.name();
  r.seed = case_seed(cfg.seed, r.name);
  r.tol = tolerance_for(c.dtype);
  run_guarded(&r, [&] { run_case_impl(c, cfg, &r); });
  return r;
}

Backend resolve_backend(Backend b) {
  if (b != Backend::kAuto) return b;
#if FLASHCPP_WITH_CUDA
  cuda::DeviceInfo dev;
  if (cuda::current_device(&dev).ok()) return Backend::kCuda;
#endif
  return Backend::kCpu;
}

std::uint64_t random_seed() {
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

}  // namespace flashcpp::harness
