// The correctness harness behind `flashcpp check`: case tables, fresh random inputs, poisoned
// outputs, comparison against an fp64 ground truth, per-row error statistics, the tolerance
// policy of docs/tolerances.md and the correctness_report.json writer.
//
// A run of one case:
//   1. inputs  : q, k, v ~ normal(0, 1) rounded to the dtype, from a per-case seed derived from
//                the run seed and the case name (so --filter does not change a case's inputs);
//   2. poison  : O (and the LSE) start as NaN, with NaN guard zones before and after each buffer;
//   3. run     : flashcpp::attention_forward on the chosen backend (select_kernel first: an
//                Unsupported answer is recorded as "unsupported" with its sentence, never a pass);
//   4. truth   : cpu::reference_attention (fp64), or cuda::reference_attention_f64 for CUDA
//                problems with batch*heads_q*seqlen_q*seqlen_k > gpu_reference_threshold;
//   5. compare : per element |out - ref| <= atol + rtol*|ref|, no NaN/Inf, guards intact, LSE
//                within lse_atol; also the "floor": the error of the fp64 result merely rounded
//                to the output dtype, which no kernel can beat. NaN fails everywhere except where
//                the truth itself is NaN (the NaN-input cases, MaskSpec::nan_inputs): there NaN is
//                the only passing value (attention.h's NaN rule), in O and in the LSE.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <cstdio>
#include <functional>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "flashcpp/half.h"
#include "flashcpp/attention.h"

namespace flashcpp::harness {

/// Memory layout of q/k/v/o (varlen cases are always packed (total_tokens, heads, dim)).
enum class Layout : std::uint8_t {
  kBshd,  ///< flash-attn (batch, seqlen, heads, dim)
  kBhsd,  ///< PyTorch SDPA (batch, heads, seqlen, dim), through strides alone
};
const char* layout_name(Layout l) noexcept;  // "bshd", "bhsd"

/// Host-side description of a mask; the harness turns it into MaskParams (building the ALiBi
/// slopes, cu_seqlens and the block-sparse CSR arrays) in the backend's memory space.
struct MaskSpec {
  bool causal = false;
  int window_left = -1;   ///< -1 = unbounded
  int window_right = -1;  ///< -1 = unbounded
  int global_tokens = 0;
  bool global_queries = false;
  float softcap = 0.f;
  bool alibi = false;            ///< BLOOM slopes 2^(-8(h+1)/heads_q)
  bool alibi_per_batch = false;  ///< slopes differ per sequence (alibi_batch_stride = heads_q)
  /// Varlen: per-sequence query lengths (non-empty = packed varlen; batch = its size).
  std::vector<int> varlen_q;
  /// Per-sequence key lengths; empty = same as varlen_q.
  std::vector<int> varlen_k;
  /// > 0: block-sparse with blocks of sparse_block_m x sparse_block_n, a random pattern of
  /// absent, full and partial (random element bits) blocks drawn from the case seed.
  int sparse_block_m = 0, sparse_block_n = 0;
  bool sparse_per_head = false;  ///< one pattern per (batch, head) instead of one for all
  /// > 0: rotary fused into attention (AttnParams::rotary, theta 10000, default positions) on
  /// the leading rotary_dim dims; the references run on q and k rotated the same way.
  int rotary_dim = 0;
  bool rotary_interleaved = false;
  /// NaN inputs (attention.h's rule: a NaN score at a visible key makes the row NaN): q gets a NaN
  /// in one row of every sequence, k in one key of sequence 0, and with ALiBi the last head's
  /// slope is NaN. The truth's NaN rows must come out NaN, every other row as usual.
  bool nan_inputs = false;

  bool is_varlen() const noexcept { return !varlen_q.empty(); }
  bool is_block_sparse() const noexcept { return sparse_block_m > 0 && sparse_block_n > 0; }
};

/// Mask kinds a case can exercise, used to prove table coverage.
inline constexpr const char* kMaskKinds[] = {"none",   "causal", "window", "softcap",
                                             "alibi",  "varlen", "global", "block_sparse"};

struct Case {
  int batch = 1;
  int seqlen_q = 1, seqlen_k = 1;  ///< maxima of varlen_q / varlen_k for varlen cases
  int heads_q = 1, heads_kv = 1;
  int head_dim = 64;
  DType dtype = DType::kBF16;
  Layout layout = Layout::kBshd;
  MaskSpec mask;
  float softmax_scale = 0.f;  ///< 0 = 1/sqrt(head_dim)
  bool return_lse = true;

  /// Readable unique id, e.g. "b2_h16_n4096_d64_causal_bf16", "b1_h32kv8_q1000_k4097_d128_fp16",
  /// "b4_h2_n1000_d64_wl64_wr0_sink4_bhsd_fp32" (tokens documented in docs/tolerances.md).
  std::string name() const;
  /// "none" or a comma-separated description, e.g. "causal, window_left=64, window_right=0".
  std::string mask_description() const;
  /// The kinds of kMaskKinds this case exercises ("none" when no mask at all).
  std::vector<std::string> mask_kinds() const;
  /// Multiply-adds of QK^T and PV over the dense (unmasked) problem: the cost bound of a case.
  double work() const;
  /// Query rows in the packed order (batch*seqlen_q, or the sum of varlen_q).
  std::int64_t total_q() const;
  std::int64_t total_k() const;
};

enum class TableKind : std::uint8_t { kQuick, kFull };
const char* table_name(TableKind t) noexcept;

/// Dense multiply-adds allowed per case in a CPU table, so a CPU `full` run stays within a few
/// minutes on 2 cores (the reference and the tiled backend both run every case).
inline constexpr double kCpuMaxWorkPerCase = 6.0e9;

/// The case table for a backend. `quick` is CPU-cheap and covers every mask kind, head dim, dtype
/// and both layouts; `full` adds larger problems, and for Backend::kCuda the course's shapes.
std::vector<Case> make_table(TableKind kind, Backend backend);

/// Tolerance policy, per output dtype (docs/tolerances.md gives the reasoning).
struct Tolerance {
  double atol = 0, rtol = 0;  ///< per element: |out - ref| <= atol + rtol * |ref|
  double lse_atol = 0;        ///< per row: |lse - lse_ref| <= lse_atol (both -inf is exact)
  /// fp32 only (0 otherwise): atol and lse_atol of a case grow by plain_factor times the error
  /// of a plain fp32 implementation on that case (the flash-attn rule), because fp32 scores of
  /// magnitude S carry an absolute error ~S * 2^-24 that no algorithm avoids.
  double plain_factor = 0;
};
/// A plain fp32 implementation disagreeing with the fp64 reference by more than this (in O or
/// the LSE) is a mask or harness bug, not rounding: the case fails. It also caps the fp32 band.
inline constexpr double kPlainSanityBound = 1e-4;
/// One fp32 ulp at |x| (the step to the next float up), as a double: the bands' rounding unit.
inline double fp32_ulp(float x) {
  const float a = std::fabs(x);
  return static_cast<double>(std::nextafter(a, INFINITY) - a);
}
Tolerance tolerance_for(DType t) noexcept;
/// The policy as JSON (the "tolerance_policy" object of the report).
nlohmann::json tolerance_policy_json();

/// Host copy of a kernel output as the harness sees it after the run (strided layout of the case).
struct HostTensor {
  DType dtype = DType::kF32;
  std::vector<std::uint8_t> bytes;
  HostTensor() = default;
  HostTensor(DType t, std::int64_t n);
  std::int64_t size() const;
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  float get(std::int64_t i) const;
  void set(std::int64_t i, float v);
};

/// Test hook: called with the host copies of the output (dtype of the case, the case's layout)
/// and the LSE (fp32, empty when not requested) after the run and before the comparison.
/// Used by tests to prove that a wrong or NaN output fails; never set by the CLI.
using OutputHook = std::function<void(const Case&, HostTensor& out, std::vector<float>& lse)>;

enum class CaseStatus : std::uint8_t { kPass, kFail, kUnsupported };
const char* case_status_name(CaseStatus s) noexcept;  // "pass", "fail", "unsupported"

struct CaseResult {
  Case c;
  std::string name;
  CaseStatus status = CaseStatus::kFail;
  std::string message;  ///< unsupported sentence, error sentence, or the first violation found
  std::uint64_t seed = 0;  ///< the per-case seed the inputs were drawn from
  std::string kernel, config, kernel_reason;
  std::string reference;  ///< "cpu_fp64" or "cuda_fp64"
  Tolerance tol;
  // Output errors against the fp64 reference (NaN when not measured, e.g. unsupported).
  double max_abs_err = NAN, mean_abs_err = NAN;
  double p50_row_err = NAN, p99_row_err = NAN, max_row_err = NAN;  ///< row = (b, i, h)
  /// max |out - ref| / max(|ref|, atol): the relative error, floored so near-zero outputs do
  /// not turn rounding noise into huge ratios.
  double max_rel_err = NAN;
  /// max over elements of |out - ref| / (atol + rtol*|ref|): <= 1 passes; the margin.
  double tol_ratio = NAN;
  /// Error of the fp64 reference rounded to the output dtype (the floor any kernel has).
  double floor_max_abs_err = NAN, floor_mean_abs_err = NAN;
  double lse_max_abs_err = NAN;  ///< NaN when the LSE was not requested
  /// fp32 cases: error of plain_attention_fp32 against the reference (NaN for 16-bit cases).
  double plain_max_abs_err = NAN, plain_lse_max_abs_err = NAN;
  /// The bounds actually applied: atol (+ plain_factor * plain error for fp32) and rtol.
  double effective_atol = NAN, effective_lse_atol = NAN;
  std::int64_t nan_count = 0;      ///< NaN or Inf elements in O (where the truth is finite), or finite where it is NaN
  /// NaN-input cases: O elements whose truth is NaN and that came out NaN (as they must); a
  /// NaN-input case whose truth has none fails (it would test nothing).
  std::int64_t nan_expected = 0;
  /// LSE values that are NaN or +Inf, -inf where the row sees keys, or finite where it sees none.
  std::int64_t lse_nan_count = 0;
  std::int64_t guard_violations = 0;  ///< elements written outside O or the LSE
  std::int64_t violations = 0;        ///< elements of O outside the tolerance
  std::int64_t lse_violations = 0;    ///< finite LSE values further than lse_atol from the truth
  double ms = NAN;      ///< wall time of attention_forward (CUDA: launch to synchronize)
  double ref_ms = NAN;  ///< wall time of the ground truth
  /// "attention" (the prefill table), "decode" or "fused". Non-attention cases also carry
  /// `area`, `page_size` (decode; 0 = contiguous, -1 = n/a) and `num_splits` in their JSON.
  std::string area = "attention";
  int page_size = -1;   ///< decode: 0 contiguous, else the page size; -1 = not a decode case
  int num_splits = -1;  ///< decode: the forced split count; -1 = not a decode case

  bool pass() const noexcept { return status == CaseStatus::kPass; }
};

struct RunConfig {
  Backend backend = Backend::kCpu;  ///< kCpu, kCpuReference or kCuda (resolve kAuto first)
  std::uint64_t seed = 0;
  int cpu_threads = 0;  ///< threads of the CPU backends and the CPU reference; 0 = all
  std::string cuda_config;  ///< RunOptions::cuda_config ("" auto, "sm80", "sm90" or a config name)
  /// CUDA problems above this many (batch*heads_q*seqlen_q*seqlen_k) use the GPU fp64 reference.
  double gpu_reference_threshold = 268435456.0;  // 2^28
  OutputHook perturb_output;  ///< tests only
};

/// Calls fn(); an exception becomes a failed case carrying its message, never an abort of the
/// whole check.
template <class Fn>
void run_guarded(CaseResult* r, Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    r->status = CaseStatus::kFail;
    r->message = std::string("exception: ") + e.what();
  }
}

/// Runs one case. Never throws for a failing kernel: the result says what went wrong.
CaseResult run_case(const Case& c, const RunConfig& cfg);

/// Plain fp32 attention of an fp32 problem with host pointers, in the packed order of
/// cpu::RefOutput: o (total_q, heads_q, head_dim), lse (heads_q, total_q); max_abs_score, if
/// given, gets the largest |score| of a visible key (scaled, after softcap and ALiBi). See plain.cc.
Status plain_attention_fp32(const AttnParams& p, std::vector<float>* o, std::vector<float>* lse, int threads = 0,
                            float* max_abs_score = nullptr);

/// The per-case seed: a mix of the run seed and the case name.
std::uint64_t case_seed(std::uint64_t run_seed, const std::string& name);

struct Environment {
  std::string device, backend, git_commit, timestamp;
  std::uint64_t seed = 0;
  bool cuda_build = false;
  int cuda_driver = 0, cuda_runtime = 0;  ///< 0 when unknown or no CUDA build
};
/// The "environment" object of the JSON reports (device, backend, commit, seed, CUDA versions).
nlohmann::json environment_json(const Environment& env);
/// Describes the machine and build a run happens on (device = CPU model or GPU name).
Environment describe_environment(Backend backend, std::uint64_t seed);

struct Summary {
  int passed = 0, failed = 0, unsupported = 0;
};
Summary summarize(const std::vector<CaseResult>& results);
/// "N passed, M failed" with ", K unsupported" when K > 0.
std::string summary_line(const Summary& s);

nlohmann::json case_json(const CaseResult& r);
/// The correctness_report.json document.
nlohmann::json report_json(const Environment& env, const std::vector<CaseResult>& results);

/// Resolves Backend::kAuto: kCuda when this build has CUDA and a device is present, else kCpu.
Backend resolve_backend(Backend b);
/// Fresh random seed (std::random_device).
std::uint64_t random_seed();

// ---- decode and fused areas (check_decode.cc, check_fused.cc) ------------------------------

/// What `flashcpp check --area` covers: prefill attention (the default and the original table),
/// decode against a contiguous or paged KV cache, the fused LLM kernels, the attention backward,
/// or all of them in that order.
enum class CheckArea : std::uint8_t { kAttention, kDecode, kFused, kAll, kBackward };
const char* check_area_name(CheckArea a) noexcept;  // "attention", "decode", "fused", "all", "backward"
/// Parses "attention", "decode", "fused", "backward" or "all"; false for anything else.
bool parse_check_area(const std::string& s, CheckArea* out);

/// One case of the decode or fused area: its name and how to run it. The runner fills a
/// CaseResult with the same metrics as run_case (area, page_size and num_splits too).
struct AreaCase {
  std::string name;
  std::function<CaseResult(const RunConfig&)> run;
};
/// decode: contiguous and paged caches (page sizes 1..256, shuffled pages), ragged lengths,
/// GQA and MHA, q_len 1 and 4 causal, append with rotary, forced split counts; fp64 truth.
std::vector<AreaCase> make_decode_table(TableKind kind, Backend backend);
/// fused: rms_norm, fused_add_rms_norm, silu_and_mul (both forms), apply_rotary; fp64 truth.
std::vector<AreaCase> make_fused_table(TableKind kind, Backend backend);
/// backward: attention_backward against the fp64 reference backward (check_backward.cc): odd sizes,
/// every mask, GQA, every dtype, dL/dLSE, deterministic, NaN; the band is 2x a plain same-dtype
/// implementation's error plus a small atol.
std::vector<AreaCase> make_backward_table(TableKind kind, Backend backend);

/// Host (and, for Backend::kCuda, device) copies of the buffers of one decode or fused case.
/// Every buffer has `guard` bytes of 0xFF (NaN) before and after it; outputs are poisoned with
/// 0xFF too. materialize() uploads for kCuda; fetch() downloads the buffers marked as outputs.
class BufferSpace {
 public:
  BufferSpace() = default;
  BufferSpace(const BufferSpace&) = delete;
  BufferSpace& operator=(const BufferSpace&) = delete;
  ~BufferSpace();
  /// A buffer of `bytes` bytes, every byte 0xFF; returns its id. output: fetched after the run.
  int add(std::size_t bytes, bool output, std::size_t guard = 1024);
  /// Host payload (what the harness fills before materialize and reads after fetch).
  std::uint8_t* host(int id) { return bufs_[id].bytes.data() + bufs_[id].guard; }
  std::size_t bytes(int id) const { return bufs_[id].bytes.size() - 2 * bufs_[id].guard; }
  /// The pointer the backend gets: host payload (CPU) or device payload (CUDA).
  void* ptr(int id);
  Status materialize(Backend b);
  Status fetch();
  /// Guard bytes of buffer id that are no longer 0xFF (host copy, after fetch()).
  std::int64_t guard_violations(int id) const;

 private:
  struct Buf {
    std::vector<std::uint8_t> bytes;
    std::size_t guard = 0;
    bool output = false;
    void* dev = nullptr;
  };
  std::vector<Buf> bufs_;
  bool device_ = false;
};

/// Element errors against an fp64 truth with a per-element bound atol + rtol*|ref|: fills the
/// CaseResult metrics of the decode and fused areas exactly as compare() does for attention.
struct ErrorStats {
  DType dtype = DType::kF32;
  double atol = 0, rtol = 0;
  double sum = 0, max_err = 0, max_rel = 0, ratio = 0, floor_max = 0, floor_sum = 0, row_max = 0;
  std::int64_t count = 0;
  std::vector<double> rows;
  /// One element; `where` (called only for the first problem) names it, e.g. "O[b=0,t=1,h=3,d=7]".
  template <class Where>
  void add(CaseResult* r, double got, double want, Where&& where);
  void end_row() {
    rows.push_back(row_max);
    row_max = 0;
  }
  /// Writes max/mean/percentiles/ratio/floor into r.
  void finish(CaseResult* r);
};

/// Options of `flashcpp check`.
struct CheckOptions {
  Backend backend = Backend::kAuto;
  CheckArea area = CheckArea::kAttention;
  TableKind table = TableKind::kQuick;
  std::string json_path;  ///< empty: no JSON written
  std::string filter;     ///< substring of the case name; empty: all
  std::optional<std::uint64_t> seed;
  int cpu_threads = 0;
  std::string cuda_config;  ///< kernel family or config for the cuda backend ("" = automatic)
  bool list_only = false;  ///< print the selected case names and exit 0
  OutputHook perturb_output;  ///< tests only
};

/// `flashcpp check`: runs the table, prints the aligned table and the closing summary line to
/// `out` (diagnostics to `err`), writes the JSON if asked. Returns the process exit status:
/// 0 all supported cases passed, 1 a case failed, 2 a usage or I/O problem.
int run_check(const CheckOptions& opt, std::ostream& out, std::ostream& err);

template <class Where>
void ErrorStats::add(CaseResult* r, double got, double want, Where&& where) {
  if (std::isnan(want)) {  // NaN inputs: NaN is the one right answer, and it carries no error
    if (std::isnan(got)) {
      ++r->nan_expected;
    } else if (r->nan_count++ == 0 && r->message.empty()) {
      r->message = where() + " is " + std::to_string(got) + " where the truth is NaN";
    }
    return;
  }
  ++count;
  const double fl = std::fabs(round_to_dtype(dtype, static_cast<float>(want)) - want);
  floor_max = std::max(floor_max, fl);
  floor_sum += fl;
  if (!std::isfinite(got)) {
    if (r->nan_count++ == 0 && r->message.empty())
      r->message = where() + " is " + std::to_string(got) + " (ref " + std::to_string(want) + ")";
    return;
  }
  const double err = std::fabs(got - want), allowed = atol + rtol * std::fabs(want);
  sum += err;
  max_err = std::max(max_err, err);
  row_max = std::max(row_max, err);
  max_rel = std::max(max_rel, err / std::max(std::fabs(want), atol));
  ratio = std::max(ratio, err / allowed);
  if (err > allowed && r->violations++ == 0 && r->message.empty()) {
    char buf[160];
    std::snprintf(buf, sizeof buf, " = %.6g vs ref %.6g: |err| %.3g > tol %.3g", got, want, err, allowed);
    r->message = where() + buf;
  }
}

}  // namespace flashcpp::harness
