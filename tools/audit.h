// The numerics audit behind `flashcpp audit`: stress-input families, an fp64 ground truth, per-row
// error distributions (CDFs) per (kernel, dtype, N, family, mask), the first N at which a dtype's
// tolerance is exceeded, and a documented defect bound. docs/audit.md explains every family, every
// metric and the bound; this header is the contract the CLI, the tests and the Python driver share.
//
// How the audit differs from `flashcpp check` (tools/harness/):
//   - check draws normal(0, 1) inputs and asks "is the kernel inside the dtype's tolerance?";
//   - audit draws inputs built to break an online softmax (scores hundreds of nats apart, one-hot
//     rows, ties, outlier keys, huge |q|.|k|, one far key that dominates) and asks "how is the
//     per-row error distributed, and when does it leave the tolerance?". Leaving the tolerance is a
//     finding, not a failure. A run fails only on a real defect: a NaN/Inf where the fp64 truth is
//     finite, or an error beyond the defect bound (an error model of fp32 arithmetic with 16-bit
//     rounding of P and O, times a safety factor; see DefectBound).
//
// It reuses the harness's pieces: harness::Case for names and mask descriptions, tolerance_for()
// for the dtype bands, HostTensor for outputs, describe_environment(), case_seed(), summary_line().
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "flashcpp/attention.h"
#include "harness/harness.h"

namespace flashcpp::audit {

// ---- input families ------------------------------------------------------------------------

/// A stress-input family. What each provokes: family_provokes() and docs/audit.md.
enum class Family : std::uint8_t {
  kRandom,       ///< q, k, v ~ normal(0, 1): the control
  kSubnormal,    ///< scores a*c with |a| in [150, 400], c in [-1, 1]: exp(s - m) subnormal or 0 for most keys
  kOneHot,       ///< one key per row scores >= ~24 nats above every other key
  kNearTies,     ///< n/64 keys per row share the row max to within 0.03 nats, in every key tile
  kConstant,     ///< every key identical: a row's scores are all equal, at |s| up to 300
  kOutlierKeys,  ///< key 0 and one key in every 512 have 64x the norm (attention sinks, massive activations)
  kLargeScale,   ///< shared q/k direction: |s| in [1000, 4000] with an O(1) spread within the row
  kLongRange,    ///< the farthest visible key of each row sits 14 nats above a normal background
};
inline constexpr Family kAllFamilies[] = {Family::kRandom,     Family::kSubnormal, Family::kOneHot,
                                          Family::kNearTies,   Family::kConstant,  Family::kOutlierKeys,
                                          Family::kLargeScale, Family::kLongRange};
/// "random", "subnormal", "one_hot", "near_ties", "constant", "outlier_keys", "large_scale", "long_range".
const char* family_name(Family f) noexcept;
/// One sentence: what the family provokes in an online-softmax kernel and why.
const char* family_provokes(Family f) noexcept;
bool parse_family(std::string_view s, Family* out);

/// Masks of the audit (the ones every flashcpp kernel runs).
enum class MaskKind : std::uint8_t {
  kNone,
  kCausal,
  kWindow,  ///< causal + window_left = Problem::window (a query sees itself and `window` keys before it)
};
inline constexpr MaskKind kAllMasks[] = {MaskKind::kNone, MaskKind::kCausal, MaskKind::kWindow};
const char* mask_kind_name(MaskKind m) noexcept;  // "none", "causal", "window"
bool parse_mask_kind(std::string_view s, MaskKind* out);

/// One stress problem: batch 1, seqlen_q == seqlen_k, heads_q == heads_kv, flash-attn (bshd)
/// layout, default softmax scale 1/sqrt(head_dim), LSE requested.
struct Problem {
  Family family = Family::kRandom;
  DType dtype = DType::kBF16;
  int seqlen = 128;
  int heads = 2;
  int head_dim = 64;
  MaskKind mask = MaskKind::kNone;
  int window = 64;  ///< used by MaskKind::kWindow
  /// Rotary fused into attention (neox, all head_dim dims, theta 10000, default positions): q and
  /// k of the family's inputs are rotated before the scores, so the family's score pattern is
  /// the pre-rotation one. CPU backends only (the CUDA kernels report it unsupported).
  bool rotary = false;

  /// The problem in the harness's terms (name tokens, mask description, work).
  harness::Case to_case() const;
  /// "<family>/<harness case name>", e.g. "one_hot/b1_h2_n512_d64_causal_bf16".
  std::string name() const;
  MaskParams mask_params() const;
  /// Visible keys of query row i: [key_lo(i), key_hi(i)] (every audit mask is an interval).
  int key_lo(int i) const noexcept;
  int key_hi(int i) const noexcept;
  int visible_keys(int i) const noexcept { return key_hi(i) - key_lo(i) + 1; }
  float scale() const noexcept;
};

/// Inputs of a problem, already rounded to the problem's dtype and held as float so that the
/// kernel and the fp64 reference read identical values. Layout (seqlen, heads, head_dim).
struct Inputs {
  std::vector<float> q, k, v;
};

/// Draws a family's inputs. Deterministic in (problem, seed) and independent of `threads`
/// (counter-based random numbers). 0 threads = hardware concurrency.
Inputs generate(const Problem& p, std::uint64_t seed, int threads = 0);

/// What the scores of a problem really look like, computed in fp64 from the rounded inputs.
/// O(N^2 D): for tests and small problems (the audit itself never calls it on long sequences).
struct ScoreStats {
  std::int64_t rows = 0;
  double min_top_weight = 1, mean_top_weight = 0;  ///< largest softmax weight of a row
  /// (row, visible key) pairs with exp(s - m) below FLT_MIN (subnormal or zero in fp32) ...
  double frac_pairs_underflow = 0;
  /// ... and with exp(s - m) below 2^-150 (zero even as an fp32 subnormal).
  double frac_pairs_zero = 0;
  /// Among rows with >= 64 visible keys: those where more than half of the keys underflow.
  double frac_rows_majority_underflow = 0;
  double min_top_gap = INFINITY;  ///< smallest (best - second best) score over rows with >= 2 keys
  double mean_top_gap = 0;
  /// Keys within `tie_eps` of the row max: the smallest and mean count over rows.
  double min_ties = 0, mean_ties = 0;
  double frac_rows_argmax_farthest = 0;    ///< argmax is the visible key farthest from the query
  double frac_rows_farthest_majority = 0;  ///< the farthest key carries >= half of the weight
  double mean_abs_score = 0, max_abs_score = 0;
  double max_row_score_spread = 0;  ///< largest (max - min) score within a row
  double max_row_score_std = 0;     ///< largest standard deviation of the scores of one row
};
/// Rows with fewer than `min_keys` visible keys are left out of every statistic (row 0 of a
/// causal mask sees one key and is trivially one-hot).
ScoreStats score_stats(const Problem& p, const Inputs& in, int min_keys = 1, double tie_eps = 0.05);

// ---- metrics and the defect bound ------------------------------------------------------------

/// The defect bound: per output element e of row i (r = fp64 truth, A_e = sum_j P_ij |v_je|, the
/// fp64 reference run on |V|):
///
///   |o_e - r_e| <= c * ( u_o |r_e| + (u_p + eps_exp + eta_i + gamma_i) * (A_e + |r_e|)
///                        + n_i p_floor max|v| ) + tau
///
///   u_o     unit roundoff of the output dtype (2^-8 bf16, 2^-11 fp16, 2^-24 fp32): rounding O;
///   u_p     unit roundoff of the dtype P is rounded to before P.V (the 16-bit input dtype on the
///           GPU; the CPU keeps P in fp32, but the same u_o is used for every kernel);
///   eps_exp 2^-21: exp2 approximations (PTX ex2.approx has ~2^-22 relative error);
///   eta_i   (head_dim + 8) * 2^-24 * scale * |q_i| * max_j |k_j|: fp32 rounding of a score and of
///           the exp argument (s - m) (a worst-case dot-product bound; |s|, |m| <= scale |q||k|);
///   gamma_i (256 + n_i / 64) * 2^-24: fp32 sums of l and of P.V over n_i visible keys, a tile of
///           up to 256 keys summed in any order plus a running sum over tiles of >= 64 keys;
///   p_floor 2^-25 for fp16 (2^-134 bf16, 2^-150 fp32): P below fp16's normal range is rounded on an
///           absolute grid (or flushed to 0, one-sided), up to 2^-25 per key, times max |v| of the head;
///   c       kSafety = 4;   tau: half the smallest subnormal step of the dtype, at least 1e-30.
///
/// An error in P's weights of relative size delta moves O by at most delta * (A_e + |r_e|),
/// hence the factor. The LSE gets the same terms without the P rounding:
///   |lse - lse_ref| <= c * (eta_i + eps_exp + gamma_i + 2^-24 |lse_ref|) + 2^-20.
/// The bound is loose on purpose (a factor 4 over a worst-case model): crossing it is a defect
/// (a missed rescale, a wrong max, a lost tile), never rounding.
struct DefectBound {
  static constexpr double kSafety = 4.0;
  static constexpr double kEpsExp = 1.0 / (1 << 21);
  static constexpr double kLseSlack = 1.0 / (1 << 20);
  static double unit_roundoff(DType t) noexcept;  ///< 2^-8, 2^-11, 2^-24
  static double tau(DType t) noexcept;
  static double p_floor(DType t) noexcept;  ///< 2^-25 fp16, 2^-134 bf16, 2^-150 fp32
  /// eta_i + eps_exp + gamma_i + u_p for a row (everything that multiplies A_e + |r_e|).
  static double weight_error(DType t, int head_dim, double scaled_qk_norm, int visible_keys) noexcept;
};

/// Quantiles at which every result's per-row error CDF is sampled (0, 0.01, ..., 0.99, then the
/// tail 0.995, 0.999, 0.9995, 0.9999 and 1 = max). Written once into the JSON as "cdf_quantiles".
std::vector<double> cdf_quantiles();

/// Per-row relative error: max_e |o_e - r_e| / max(max_e |r_e|, atol of the dtype).
struct Quantiles {
  double p50 = NAN, p90 = NAN, p99 = NAN, p999 = NAN, max = NAN;
};

/// One (problem, kernel) measurement.
struct Result {
  Problem problem;
  std::string kernel;       ///< run label: "cpu", "sm80", "sm90"
  std::string kernel_name;  ///< kernel_name() of the choice, e.g. "cuda_sm80_fa2"
  std::string config;       ///< tile config, "" on the CPU
  harness::CaseStatus status = harness::CaseStatus::kFail;
  std::string message;    ///< unsupported sentence, error, or the first defect found
  std::string reference;  ///< "cpu_fp64" or "cuda_fp64"
  std::uint64_t seed = 0;
  harness::Tolerance tol;   ///< the dtype band of docs/tolerances.md (base atol/rtol/lse_atol)
  std::int64_t rows = 0;    ///< (query, head) rows
  Quantiles rel_err;        ///< per-row relative error of the kernel
  std::vector<double> cdf;  ///< per-row relative error at cdf_quantiles()
  Quantiles floor_rel_err;  ///< the same for the fp64 truth merely rounded to the dtype
  double max_abs_err = NAN, mean_abs_err = NAN;
  double max_tol_ratio = NAN;      ///< max |o - r| / (atol + rtol |r|): > 1 is over the band
  std::int64_t rows_over_tol = 0;  ///< rows with an element over the dtype band
  double frac_rows_over_tol = NAN;
  double lse_max_abs_err = NAN;
  std::int64_t rows_lse_over_tol = 0;  ///< rows with |lse - lse_ref| > lse_atol
  std::int64_t nonfinite_rows = 0;     ///< rows with a NaN/Inf in O (the truth is always finite here)
  std::int64_t lse_nonfinite_rows = 0;
  std::int64_t defect_rows = 0;  ///< rows with an element beyond the defect bound
  std::int64_t lse_defect_rows = 0;
  double max_bound_ratio = NAN;  ///< max |o - r| / bound: > 1 is a defect
  double max_lse_bound_ratio = NAN;
  double ms = NAN, ref_ms = NAN;

  bool failed() const noexcept { return status == harness::CaseStatus::kFail; }
};

/// Test hook: called with the kernel's output (dtype of the problem, bshd) and LSE (fp32,
/// (heads, seqlen)) before the comparison. Tests use it to prove a perturbed output fails.
using OutputHook =
    std::function<void(const Problem&, const std::string& kernel, harness::HostTensor& out, std::vector<float>& lse)>;

/// A kernel to audit: which backend, and for CUDA which family (RunOptions::cuda_config).
struct KernelSpec {
  std::string label;  ///< "cpu", "sm80", "sm90", "cpu_decode", "decode"
  Backend backend = Backend::kCpu;
  std::string cuda_config;
  /// The decode kernels (decode.h) on the problem's last kAuditDecodeRows query rows: a
  /// contiguous cache of all seqlen keys, seqlen_q = those rows (causal bottom-right, so each
  /// row sees exactly the keys it sees in the prefill problem). Only those rows are measured.
  bool decode = false;
};

/// Query rows the decode kernels are audited on (the last rows of each problem; <= kDecodeMaxSeqlenQ).
inline constexpr int kAuditDecodeRows = 8;

struct RunSettings {
  std::vector<KernelSpec> kernels;
  int cpu_threads = 0;
  /// CUDA runs: problems with heads * seqlen^2 above this use the fp64 GPU reference
  /// (cuda::reference_attention_f64); smaller ones, and every CPU run, the CPU one.
  double gpu_reference_threshold = 4194304.0;  // 2^22: N >= 1024 at 4 heads
  OutputHook perturb_output;                   ///< tests only
};

/// Runs every kernel of `s` on one problem's inputs; one Result per kernel. Never throws.
std::vector<Result> run_problem(const Problem& p, const Inputs& in, std::uint64_t seed, const RunSettings& s);

/// For each (kernel, dtype, family, mask): the smallest N of the sweep at which some row leaves the
/// dtype band (null if none), with the fraction of rows over it and the p99 at every N.
nlohmann::json first_exceed_json(const std::vector<Result>& results);

nlohmann::json result_json(const Result& r);

// ---- the subcommand --------------------------------------------------------------------------

/// Options of `flashcpp audit`. Empty lists and zero sizes take the preset of the backend and of
/// --quick (docs/audit.md lists the presets).
struct AuditOptions {
  Backend backend = Backend::kAuto;  ///< kCpu, kCuda or kAuto (cuda when a device is present)
  bool quick = false;
  std::vector<int> seqlens;
  std::vector<DType> dtypes;
  std::vector<Family> families;
  std::vector<MaskKind> masks;
  std::vector<std::string> kernels;  ///< cuda: of {"sm80", "sm90", "decode"}; cpu: of {"cpu", "decode"}
  int heads = 0, head_dim = 0, window = 0;
  std::optional<std::uint64_t> seed;
  int cpu_threads = 0;
  std::string json_path;  ///< empty: no JSON
  /// Non-empty: write each problem's rounded inputs (raw little-endian, bshd) and a manifest.json
  /// here for python -m flashcpp.bench.audit, and run nothing.
  std::string dump_dir;
  bool list_only = false;     ///< print the problems and the families' descriptions, run nothing
  bool rotary = false;        ///< also run every problem with rotary in attention (Problem::rotary)
  OutputHook perturb_output;  ///< tests only
};

/// The largest problem run_audit accepts: N * heads * head_dim elements per tensor (2^30: 4 GiB
/// of fp32 per input, about 40 GiB of host memory with the fp64 truth; the CUDA preset's largest
/// is 2^25). Larger ones are refused with a sentence (status 2), not left to fail an allocation.
inline constexpr int kMaxProblemElementsLog2 = 30;
inline constexpr std::int64_t kMaxProblemElements = std::int64_t{1} << kMaxProblemElementsLog2;

/// The problems of a run after presets, in run order (N ascending, then dtype, family, mask).
std::vector<Problem> plan_problems(const AuditOptions& opt, Backend resolved);

/// The whole JSON document (see docs/audit.md for its keys).
nlohmann::json report_json(const harness::Environment& env, const AuditOptions& opt,
                           const std::vector<Problem>& problems, const std::vector<Result>& results);

/// `flashcpp audit`: prints a table per result, the first-N table and "N passed, M failed";
/// writes the JSON if asked. Returns 0 (no defect), 1 (a defect), 2 (usage or I/O problem).
int run_audit(const AuditOptions& opt, std::ostream& out, std::ostream& err);

namespace detail {
/// f(item) for item in [0, n) on `threads` threads pulling from a shared counter (0 = hardware
/// concurrency). Used by the generators and the per-row metrics.
template <class F>
void parallel_for(std::int64_t n, int threads, F&& f) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = static_cast<int>(std::min<std::int64_t>(threads, std::max<std::int64_t>(n, 1)));
  std::atomic<std::int64_t> next{0};
  auto worker = [&] {
    for (std::int64_t item = next.fetch_add(1); item < n; item = next.fetch_add(1)) f(item);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}
}  // namespace detail

}  // namespace flashcpp::audit
