// The selector (selector.h): every rule that turns a problem into a kernel choice.
#include "core/selector.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <tuple>

#include <nlohmann/json.hpp>

#include "common/decode_common.h"
#include "common/tile_order.h"
#include "core/families.h"
#include "flashcpp/tune.h"
#if FLASHCPP_HAS_SM80
#include "cuda/backward/bwd_registry.h"
#include "cuda/prefill/fa2_registry.h"
#endif
#if FLASHCPP_HAS_SM90
#include "cuda/prefill/fa3_registry.h"
#endif

namespace flashcpp::select {

// ---- names and fits -------------------------------------------------------------------------------
std::string sm80_config_name(const TileConfig& t) {
  // Appends, not a chain of operator+ (GCC 12 warns falsely about -Wrestrict on the chain).
  std::string s = "m";
  s += std::to_string(t.block_m);
  s += 'n';
  s += std::to_string(t.block_n);
  s += 'w';
  s += std::to_string(t.warps);
  s += 's';
  s += std::to_string(t.stages);
  s += t.q_in_regs ? 'r' : 'q';
  if (t.min_blocks > 1) {
    s += 'b';
    s += std::to_string(t.min_blocks);
  }
  return s;
}

std::string sm90_config_name(const TileConfig& t) {
  return "sm90_m" + std::to_string(t.block_m) + "n" + std::to_string(t.block_n) + "s" + std::to_string(t.stages) +
         (t.ping_pong ? (t.sched ? "p" : "o") : "") + (t.lean_mask ? "_lean" : "") +
         (t.qk_dims > 0 ? "_k" + std::to_string(t.qk_dims) : "") + (t.persistent ? "_persist" : "");
}

bool tiles_fit_block_sparse(const BlockSparseMask& bs, int block_m, int block_n) {
  return bs.block_m % block_m == 0 && bs.block_n % block_n == 0 && (block_n % 64 == 0 || 64 % block_n == 0);
}

bool persistent_units_fill_waves(std::int64_t units, int sms) {
  if (units <= 0 || sms <= 0) return false;
  const std::int64_t waves = (units + sms - 1) / sms;
  return 4 * units >= 3 * waves * sms;
}

bool sm90_persistent_pays(std::int64_t units, int sms, bool causal, int key_blocks, int q_bufs) {
  if (!persistent_units_fill_waves(units, sms) || key_blocks <= 0) return false;
  const int mean_blocks = causal ? (key_blocks + 1) / 2 : key_blocks;  // key tiles a tile walks, on average
  if (q_bufs > 1) return mean_blocks <= (causal ? 32 : 4);
  return causal && mean_blocks >= 16;
}

bool sm90_short_for_wide_tile(int seqlen_k, bool causal) { return seqlen_k < (causal ? 8192 : 2048); }

bool wide_tile_pays(std::int64_t seqlen_q, std::int64_t heads_batch, bool causal, int wide_rows, int sms) {
  if (seqlen_q <= 0 || heads_batch <= 0 || sms <= 0) return false;
  auto tiles = [&](int rows) { return (seqlen_q + rows - 1) / rows * heads_batch; };
  auto waves = [&](int rows) { return static_cast<double>((tiles(rows) + sms - 1) / sms); };
  if (causal) return tiles(wide_rows) >= std::int64_t{10} * sms;
  return waves(wide_rows) * wide_rows * 0.88 < waves(128) * 128;
}

// ---- the sm80 tuned table ------------------------------------------------------------------------
namespace {

struct TableRow {
  int sm, head_dim;
  bool causal;
  DType dtype;
  int bucket;
  const char* config;
};
constexpr DType bf16 = DType::kBF16, fp16 = DType::kF16;
const TableRow kShipped[] = {
#include "core/sm80_tuned_table.inc"
    {0, 0, false, DType::kF32, 0, ""},  // sentinel
};

using Key = std::tuple<int, bool, int, int>;  // head_dim, causal, dtype, bucket

std::map<Key, std::string> load_cache(const std::string& path) {
  std::map<Key, std::string> out;
  std::ifstream in(path);
  if (!in) return out;
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    for (const auto& e : j.at("entries")) {
      const std::string dt = e.at("dtype").get<std::string>();
      const int dtc = dt == "bf16" ? static_cast<int>(DType::kBF16) : static_cast<int>(DType::kF16);
      out[{e.at("head_dim").get<int>(), e.at("causal").get<bool>(), dtc, e.at("bucket").get<int>()}] =
          e.at("config").get<std::string>();
    }
  } catch (const std::exception&) {
    out.clear();  // a corrupt cache is ignored, never fatal
  }
  return out;
}

}  // namespace

std::string sm80_tuned_name(const cuda::DeviceInfo& dev, int head_dim, bool causal, DType dtype, int seqlen) {
  static std::mutex mu;
  static std::map<std::string, std::map<Key, std::string>> caches;  // per cache path
  const Key key{head_dim, causal, static_cast<int>(dtype), cuda::seqlen_bucket(seqlen)};
  {
    const std::string path = cuda::tune_cache_path(dev);
    std::lock_guard<std::mutex> lock(mu);
    auto it = caches.find(path);
    if (it == caches.end()) it = caches.emplace(path, load_cache(path)).first;
    auto hit = it->second.find(key);
    if (hit != it->second.end()) return hit->second;
  }
  const int sm = dev.sm_major * 10 + dev.sm_minor;
  for (const auto& r : kShipped)
    if (r.sm == sm && r.head_dim == head_dim && r.causal == causal && r.dtype == dtype && r.bucket == std::get<3>(key))
      return r.config;
  return {};
}

}  // namespace flashcpp::select

// The tuned table's buckets and cache path, declared in flashcpp/tune.h for `flashcpp tune`.
namespace flashcpp::cuda {

int seqlen_bucket(int seqlen) {
  int b = 0;
  for (int ub : kSeqlenBuckets) {
    if (seqlen <= ub) return b;
    ++b;
  }
  return b;
}

std::string seqlen_bucket_name(int bucket) {
  constexpr int n = sizeof(kSeqlenBuckets) / sizeof(kSeqlenBuckets[0]);
  if (bucket < n) return "le" + std::to_string(kSeqlenBuckets[bucket]);
  return "gt" + std::to_string(kSeqlenBuckets[n - 1]);
}

std::string tune_cache_path(const DeviceInfo& dev) {
  if (const char* p = std::getenv("FLASHCPP_TUNE_CACHE")) return p;
  std::string name;
  for (char c : dev.name) name += (std::isalnum(static_cast<unsigned char>(c)) ? c : '_');
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/flashcpp/prefill_sm80_" + name + ".json";
}

}  // namespace flashcpp::cuda

namespace flashcpp::select {

// ---- the CUDA prefill choice ---------------------------------------------------------------------
#if FLASHCPP_WITH_CUDA
namespace {

/// The optional masks a problem uses, for KernelChoice::reason ("" when none).
std::string fused_masks(const AttnParams& p) {
  const MaskParams& m = p.mask;
  std::string s;
  auto add = [&](const std::string& x) { s += (s.empty() ? "" : ", ") + x; };
  if (m.causal) add("causal");
  if (m.has_window()) add("window");
  if (m.global_tokens > 0) add(m.global_queries ? "global tokens and queries" : "global tokens");
  if (m.softcap > 0.f) add("softcap");
  if (m.alibi_slopes) add("ALiBi");
  if (m.is_varlen()) add("varlen");
  if (m.block_sparse)
    add("block-sparse " + std::to_string(m.block_sparse->block_m) + "x" + std::to_string(m.block_sparse->block_n));
  return s.empty() ? s : "; masks fused in the kernel: " + s;
}

/// The tile shapes of the compiled configs, e.g. "128x32, 64x64" (for sentences).
template <class Entries>
std::string tiles_of(const Entries& entries) {
  std::string out;
  for (const auto& e : entries) {
    const std::string t = std::to_string(e.tile.block_m) + "x" + std::to_string(e.tile.block_n);
    if (out.find(t) == std::string::npos) out += (out.empty() ? "" : ", ") + t;
  }
  return out;
}

#if FLASHCPP_HAS_SM80
bool sm80_fits(const TileConfig& t, const AttnParams& p) {
  return p.mask.block_sparse == nullptr || tiles_fit_block_sparse(*p.mask.block_sparse, t.block_m, t.block_n);
}

/// The automatic sm80 config: the tuned table's, else the first listed config (table order) that
/// fits the device's shared memory and the problem's masks; null when none does.
const cuda::Fa2Entry* sm80_auto(const AttnParams& p, const cuda::DeviceInfo& dev) {
  const auto entries = cuda::fa2_entries(p.head_dim_class());
  const std::string tuned = sm80_tuned_name(dev, p.head_dim_class(), p.mask.causal, p.q.dtype, std::max(p.seqlen_q, p.seqlen_k));
  auto usable = [&](const cuda::Fa2Entry& e) {
    return static_cast<std::size_t>(e.smem_bytes) <= dev.smem_optin && sm80_fits(e.tile, p);
  };
  for (const auto& e : entries)
    if (sm80_config_name(e.tile) == tuned && usable(e)) return &e;
  for (const auto& e : entries)
    if (usable(e)) return &e;
  return nullptr;
}

std::string sm80_misfit(const AttnParams& p, const TileConfig& t) {
  if (sm80_fits(t, p)) return {};
  return "sm80 config " + sm80_config_name(t) + " has " + std::to_string(t.block_m) + "x" + std::to_string(t.block_n) +
         " tiles, which do not divide the " + std::to_string(p.mask.block_sparse->block_m) + "x" +
         std::to_string(p.mask.block_sparse->block_n) + " block-sparse blocks";
}
#endif

#if FLASHCPP_HAS_SM90
/// The compiled configs of the problem's sm90 class (attention.h, cuda_sm90_head_dim_class).
std::span<const cuda::Fa3Entry> sm90_entries(const AttnParams& p) {
  return cuda::fa3_entries(p.head_dim, p.effective_head_dim_v());
}

/// Same tiles and stages (twins differ in scheduling or persistence only).
bool same_tiles(const TileConfig& x, const TileConfig& y) {
  return x.block_m == y.block_m && x.block_n == y.block_n && x.stages == y.stages;
}

/// Same tiles, stages, consumer schedule and Q K^T dims: twins that differ in persistence or in
/// the mask path only.
bool same_schedule(const TileConfig& x, const TileConfig& y) {
  return same_tiles(x, y) && x.ping_pong == y.ping_pong && x.sched == y.sched && x.qk_dims == y.qk_dims;
}

/// Whether a problem's masks are only causal and sequence ends: what a lean-mask config runs
/// (TileConfig::lean_mask; no window, sinks, softcap, ALiBi, block-sparse mask or rotary).
bool lean_masks_suffice(const AttnParams& p) {
  const MaskParams& m = p.mask;
  return !m.has_window() && m.global_tokens == 0 && m.softcap == 0.f && m.alibi_slopes == nullptr &&
         m.block_sparse == nullptr && !p.rotary.enabled();
}

/// Whether a config can run the problem's masks: a lean-mask config only causal and sequence
/// ends; a block-sparse mask only plain consumers (the pipelined ones do not read element bits:
/// no registers left for it; fa3_mainloop.cuh) whose tiles divide its blocks.
bool sm90_fits(const TileConfig& t, const AttnParams& p) {
  if (t.qk_dims > 0 && p.head_dim > t.qk_dims) return false;
  if (t.lean_mask && !lean_masks_suffice(p)) return false;
  return p.mask.block_sparse == nullptr ||
         (!t.ping_pong && tiles_fit_block_sparse(*p.mask.block_sparse, t.block_m, t.block_n));
}

/// The persistent twin of `base` (same tiles, stages, scheduling and Q K^T dims), if compiled: the
/// lean-mask one when base is lean, or when the problem's masks allow it and one is compiled (d256
/// builds a lean persistent twin only), else the one with base's mask path.
const cuda::Fa3Entry* sm90_twin(const AttnParams& p, const TileConfig& base) {
  const cuda::Fa3Entry* general = nullptr;
  for (const auto& e : sm90_entries(p))
    if (e.tile.persistent && same_schedule(e.tile, base) && sm90_fits(e.tile, p)) {
      if (e.tile.lean_mask) return &e;  // it fits: the masks are lean
      if (!base.lean_mask && general == nullptr) general = &e;
    }
  return general;
}

/// Whether the automatic choice is the persistent twin of `base`: problems of dense (or window /
/// sink) masks, without varlen or block-sparse walks, where sm90_persistent_pays.
bool sm90_prefer_persistent(const AttnParams& p, const TileConfig& base, int num_sms) {
  if (p.mask.is_varlen() || p.mask.block_sparse != nullptr) return false;
  const cuda::Fa3Entry* twin = sm90_twin(p, base);
  if (twin == nullptr) return false;
  const int m_blocks = (p.seqlen_q + base.block_m - 1) / base.block_m;
  if (static_cast<std::int64_t>(m_blocks) * p.heads_q * p.batch > std::numeric_limits<std::int32_t>::max())
    return false;  // units fit an int
  const int key_blocks = (p.seqlen_k + base.block_n - 1) / base.block_n;
  return sm90_persistent_pays(persistent_units(m_blocks, p.heads_q, p.batch), num_sms, p.mask.causal, key_blocks,
                              twin->q_bufs);
}

/// Whether a config's tile suits the problem: tiles of 128 rows always do; d64's 192-row tile on a
/// causal problem where its own persistent twin pays (the lean-mask one: it balances the triangle,
/// which the 10-tiles-per-SM rule of wide_tile_pays stood in for; measured on causal rows only),
/// else where wide_tile_pays, unless the problem is short and the 128-row config's persistent twin
/// pays (sm90_short_for_wide_tile). The 192-row persistent twin with the general mask path lost
/// everywhere (spills at 160 registers) and is not built.
bool sm90_suits(const TileConfig& t, const AttnParams& p, int num_sms) {
  if (t.block_m <= 128) return true;
  if (p.mask.causal && sm90_prefer_persistent(p, t, num_sms)) return true;
  if (!wide_tile_pays(p.seqlen_q, static_cast<std::int64_t>(p.heads_q) * p.batch, p.mask.causal, t.block_m, num_sms))
    return false;
  if (!sm90_short_for_wide_tile(p.seqlen_k, p.mask.causal)) return true;
  for (const auto& e : sm90_entries(p))  // the 128-row config the table lists first
    if (!e.tile.persistent && e.tile.block_m <= 128 && sm90_fits(e.tile, p))
      return !sm90_prefer_persistent(p, e.tile, num_sms);
  return true;
}

/// The automatic sm90 config: the first config (table order) that fits and suits the problem, or
/// its persistent twin (same tiles, stages and scheduling) when sm90_prefer_persistent says so.
const cuda::Fa3Entry* sm90_auto(const AttnParams& p, int num_sms) {
  const cuda::Fa3Entry* base = nullptr;
  for (const auto& e : sm90_entries(p))
    if (!e.tile.persistent && sm90_fits(e.tile, p) && sm90_suits(e.tile, p, num_sms)) {
      base = &e;
      break;
    }
  if (base == nullptr || !sm90_prefer_persistent(p, base->tile, num_sms)) return base;
  return sm90_twin(p, base->tile);
}

std::string sm90_misfit(const AttnParams& p, const TileConfig& t) {
  if (sm90_fits(t, p)) return {};
  const std::string name = sm90_config_name(t);
  if (t.qk_dims > 0 && p.head_dim > t.qk_dims)
    return "sm90 config " + name + " covers head dims up to " + std::to_string(t.qk_dims) + " (its Q K^T runs " +
           std::to_string(t.qk_dims / 16) + " k16 steps); head_dim " + std::to_string(p.head_dim) +
           " needs a config of the whole class (leave cuda_config empty and dispatch picks one)";
  if (t.lean_mask && !lean_masks_suffice(p)) {
    std::string twin;  // the same tiles with the general mask path, of the same persistence if compiled
    for (const auto& e : sm90_entries(p))
      if (!e.tile.lean_mask && same_schedule(e.tile, t) && (twin.empty() || e.tile.persistent == t.persistent))
        twin = sm90_config_name(e.tile);
    return "sm90 config " + name + " (lean masks) runs only causal and sequence-end masks, not this problem's " +
           "window, attention sinks, softcap, ALiBi, block-sparse mask or rotary; " +
           (twin.empty() ? std::string("leave cuda_config empty and dispatch picks a config that does")
                         : "its twin " + twin + " does");
  }
  if (t.ping_pong) {
    std::string twin;  // same tiles, stages and persistence with plain consumers, if compiled
    for (const auto& e : sm90_entries(p))
      if (!e.tile.ping_pong && same_tiles(e.tile, t) && e.tile.persistent == t.persistent)
        twin = sm90_config_name(e.tile);
    return "sm90 config " + name + " (pipelined consumers) does not run block-sparse masks; " +
           (twin.empty() ? std::string("leave cuda_config empty and dispatch picks a config that does")
                         : "its plain twin " + twin + " does");
  }
  return "sm90 config " + name + " has " + std::to_string(t.block_m) + "x" + std::to_string(t.block_n) +
         " tiles, which do not divide the " + std::to_string(p.mask.block_sparse->block_m) + "x" +
         std::to_string(p.mask.block_sparse->block_n) + " block-sparse blocks";
}
#endif

}  // namespace

/// "; head_dim 96 runs in the 128 class ..." when the problem's head dims are not a class of their
/// own (attention.h, cuda_head_dim_class; with `sm90`, cuda_sm90_head_dim_class, whose 192 / 128
/// class is named so), else "".
[[maybe_unused]] static std::string head_dim_class_note(const AttnParams& p, bool sm90 = false) {
  const int d = p.head_dim, dv = p.effective_head_dim_v(), c = sm90 ? p.sm90_head_dim_class() : p.head_dim_class();
  const int cv = c == kCudaSm90HeadDim192 ? kCudaSm90HeadDimV192 : c;
  const std::string dims = dv == d ? "head_dim " + std::to_string(d)
                                   : "head_dim " + std::to_string(d) + " / head_dim_v " + std::to_string(dv);
  const std::string cls = cv == c ? std::to_string(c) : std::to_string(c) + "/" + std::to_string(cv);
  if (d == c && dv == cv)  // its own class: named only where config names repeat across classes (192/128's)
    return cv == c ? std::string() : "; " + dims + " runs in the sm90 " + cls + " class";
  return "; " + dims + " runs in the " + cls + " class (zero columns inside the kernel, nothing copied)";
}

Status cuda_prefill(const AttnParams& p, const RunOptions& opt, const cuda::DeviceInfo& dev, KernelChoice* out,
                    bool explain) {
#if !FLASHCPP_HAS_SM80 && !FLASHCPP_HAS_SM90
  (void)out;  // no family to choose
  (void)explain;
  return build::refuse_cuda_prefill();
#endif
  if (dev.sm_major < 8)
    return Status::Unsupported("the CUDA kernels need compute capability 8.0 or newer; device '" + dev.name + "' is " +
                               std::to_string(dev.sm_major) + "." + std::to_string(dev.sm_minor));
  if (p.q.dtype == DType::kF32)
    return Status::Unsupported("fp32 inputs run on the CPU backend only; the CUDA kernels take fp16 or bf16");
  const float scale = p.effective_scale();
  if (scale < 0.f)
    return Status::Unsupported(
        "a negative softmax_scale runs on the CPU backends only (the CUDA prefill kernels fold a positive scale into exp2)");
  const BlockSparseMask* bs = p.mask.block_sparse;
  // For sentences only: a choice without `explain` (attention_forward's) builds no strings.
  [[maybe_unused]] const auto masks = [&] { return fused_masks(p); };
  const auto bs_blocks = [&] { return bs ? std::to_string(bs->block_m) + "x" + std::to_string(bs->block_n) : ""; };
  // opt.cuda_config: "" = automatic, "sm80" / "sm90" = that kernel family with its automatic
  // choice, anything else = an exact config name of either family.
  const std::string& want = opt.cuda_config;
  [[maybe_unused]] bool sm90_fell_back = false;  // an automatic choice on Hopper fell back to sm80 (block-sparse tiles)
  std::string sm90_note;                         // why, with `explain`
#if FLASHCPP_HAS_SM90
  const cuda::Fa3Entry* named90 = nullptr;  // an exact sm90 config name (names are built only then)
  if (want.rfind("sm90_", 0) == 0)
    for (const auto& e : sm90_entries(p))
      if (sm90_config_name(e.tile) == want) named90 = &e;
  if ((want == "sm90" || named90 != nullptr) && dev.sm_major != 9)
    return Status::Unsupported("the sm90 kernel family needs a Hopper (sm_90) device; '" + dev.name + "' is not one");
  if (dev.sm_major == 9 && !sm90_entries(p).empty() && (want.empty() || want == "sm90" || named90)) {
    const cuda::Fa3Entry* e = named90;
    if (named90 != nullptr) {
      const std::string misfit = sm90_misfit(p, named90->tile);
      if (!misfit.empty()) return Status::Unsupported(misfit);
    } else {
      e = sm90_auto(p, dev.num_sms);
      if (e == nullptr && want == "sm90")
        return Status::Unsupported("no sm90 config has tiles (" + tiles_of(sm90_entries(p)) +
                                   ") that divide the " + bs_blocks() +
                                   " block-sparse blocks; build the mask with multiples of them (e.g. 128x128), "
                                   "or run it on the sm80 kernel (cuda_config \"sm80\")");
      sm90_fell_back = e == nullptr;
      if (sm90_fell_back && explain)
        sm90_note = "; the sm90 tiles (" + tiles_of(sm90_entries(p)) + ") do not divide the " +
                    bs_blocks() + " block-sparse blocks, so this mask runs on the sm80 kernel";
    }
    if (e != nullptr) {
      out->id = KernelId::kCudaSm90;
      out->tile = e->tile;
      if (!explain) return Status::Ok();
      out->config = sm90_config_name(e->tile);
      out->reason = "wgmma/TMA warp-specialized kernel on " + dev.name + (named90 ? " (config forced)" : "") + masks() +
                    head_dim_class_note(p, /*sm90=*/true);
      return Status::Ok();
    }
  }
#else
  if (want == "sm90" || want.rfind("sm90_", 0) == 0)
    return build::refuse(build::Family::kSm90, "cuda_config '" + want + "' asks for them");
#endif
#if !FLASHCPP_HAS_SM80
  // Only the sm80 family could take what reaches here: say why the sm90 kernels do not.
  std::string why = "cuda_config '" + want + "' asks for them";
  if (want.empty() || want == "sm90") {
    why = "the sm90 kernels have no config for head_dim " + std::to_string(p.head_dim);
    if (dev.sm_major != 9)
      why = "device '" + dev.name + "' (sm_" + std::to_string(dev.sm_major * 10 + dev.sm_minor) +
            ") runs only them (the sm90 kernels need a Hopper device)";
    else if (sm90_fell_back)
      why = "the sm90 tiles do not divide the " + bs_blocks() + " block-sparse blocks of this problem";
  } else if (want != "sm80") {
    why = "config '" + want + "' is not an sm90 config of head_dim " + std::to_string(p.head_dim);
  }
  return build::refuse(build::Family::kSm80, why);
#else
  out->id = KernelId::kCudaSm80;
  const auto entries = cuda::fa2_entries(p.head_dim_class());
  if (!want.empty() && want != "sm80" && want != "sm90") {
    const cuda::Fa2Entry* named = nullptr;
    std::string names;
    for (const auto& e : entries) {
      if (sm80_config_name(e.tile) == want) named = &e;
      names += (names.empty() ? "" : ", ") + sm80_config_name(e.tile);
    }
    if (named == nullptr)
      return Status::Invalid("unknown config '" + want + "' for head_dim " + std::to_string(p.head_dim) +
                             " (compiled: " + names + ")");
    const std::string misfit = sm80_misfit(p, named->tile);
    if (!misfit.empty()) return Status::Unsupported(misfit);
    out->tile = named->tile;
    if (!explain) return Status::Ok();
    out->config = want;
    out->reason = "config forced by the caller" + masks() + head_dim_class_note(p);
    return Status::Ok();
  }
  const cuda::Fa2Entry* e = sm80_auto(p, dev);
  if (e == nullptr)
    return Status::Unsupported(
        bs ? "no sm80 config for head_dim " + std::to_string(p.head_dim) + " has tiles (" + tiles_of(entries) +
                 ") that divide the " + bs_blocks() +
                 " block-sparse blocks and fit this device's shared memory; build the mask with multiples of "
                 "128x128 (FlexAttention's default), or run it on the CPU backend"
           : "no sm80 config for head_dim " + std::to_string(p.head_dim) + " fits the shared memory of " + dev.name);
  out->tile = e->tile;
  if (!explain) return Status::Ok();
  out->config = sm80_config_name(e->tile);
  out->reason = "FA2-style mma.sync kernel on " + dev.name + " (sm_" + std::to_string(dev.sm_major * 10 + dev.sm_minor) +
                "), config from the tuned table" +
                (bs ? " (first config whose tiles divide the block-sparse blocks if the tuned one does not)" : "") +
                masks() + sm90_note + head_dim_class_note(p);
  return Status::Ok();
#endif  // FLASHCPP_HAS_SM80
}
#endif

Status prefill(const AttnParams& p, const RunOptions& opt, Backend b, KernelChoice* out, bool explain) {
  *out = KernelChoice{};
  switch (b) {
    case Backend::kCpuReference:
      out->id = KernelId::kCpuReference;
      if (explain) out->reason = "fp64 reference requested";
      return Status::Ok();
    case Backend::kCpu:
      out->id = KernelId::kCpuTiled;
      if (explain) out->reason = "CPU backend (host pointers)";
      return Status::Ok();
    case Backend::kCuda: {
#if FLASHCPP_WITH_CUDA && !FLASHCPP_HAS_SM80 && !FLASHCPP_HAS_SM90
      (void)p;
      (void)opt;
      return build::refuse_cuda_prefill();  // before the device: a property of the build
#elif FLASHCPP_WITH_CUDA
      cuda::DeviceInfo dev;
      FLASHCPP_RETURN_IF_ERROR(cuda::current_device(&dev));
      return cuda_prefill(p, opt, dev, out, explain);
#else
      (void)p;
      (void)opt;
      return build::refuse_no_cuda();
#endif
    }
    case Backend::kAuto: break;
  }
  return Status::Internal("select::prefill: the backend was not resolved");
}

// ---- backward ----------------------------------------------------------------------------------------
/// The CUDA backward (src/cuda/backward): on Hopper the warp-specialized wgmma kernel for the classes
/// 64 and 128 without softcap, ALiBi or block-sparse masks, the single-role wgmma kernel for the rest
/// of those classes; elsewhere (and for the 256 class, or block-sparse blocks its tiles do not
/// divide) the mma.sync kernel. opt.cuda_config: "" = that choice, "sm80" / "sm90" / "sm90ws" = that kernel.
#if FLASHCPP_WITH_CUDA
static Status cuda_backward(const AttnBackwardParams& p, const RunOptions& opt, KernelChoice* out) {
#if !FLASHCPP_HAS_SM80
  (void)p;
  (void)opt;
  (void)out;
  return build::refuse(build::Family::kSm80, "the CUDA attention backward is built with it");
#else
  std::string want, why_config;  // the family; "+g<N>" is checked here and read by backward_api
  if (!backward_config(opt.cuda_config, &want, nullptr, &why_config)) return Status::Invalid(why_config);
  cuda::DeviceInfo dev;
  FLASHCPP_RETURN_IF_ERROR(cuda::current_device(&dev));
  if (dev.sm_major < 8)
    return Status::Unsupported("the CUDA backward needs compute capability 8.0 or newer; device '" + dev.name + "' is " +
                               std::to_string(dev.sm_major) + "." + std::to_string(dev.sm_minor));
  if (p.q.dtype != DType::kBF16 && p.q.dtype != DType::kF16)
    return Status::Unsupported(std::string(dtype_name(p.q.dtype)) +
                               " gradients run on the CPU backends only; the CUDA backward takes fp16 or bf16");
  if (p.effective_scale() < 0.f)
    return Status::Unsupported(
        "a negative softmax_scale runs on the CPU backends only (the CUDA backward folds a positive scale into exp2)");
  const AttnParams f = p.forward();
  const BlockSparseMask* bs = p.mask.block_sparse;
  auto fits = [&](const cuda::BwdEntry& e) -> std::string {  // "" or why the entry cannot run
    if (bs && !tiles_fit_block_sparse(*bs, e.tile.block_m, e.tile.block_n))
      return "the CUDA backward's " + std::to_string(e.tile.block_m) + "x" + std::to_string(e.tile.block_n) +
             " tiles do not divide the " + std::to_string(bs->block_m) + "x" + std::to_string(bs->block_n) +
             " block-sparse blocks; build the mask with multiples of them (e.g. 128x128), or run the backward on the CPU";
    if (static_cast<std::size_t>(e.smem_bytes) > dev.smem_optin)
      return "the CUDA backward for head_dim class " + std::to_string(e.head_dim) + " needs " +
             std::to_string(e.smem_bytes) + " bytes of shared memory; " + dev.name + " allows " +
             std::to_string(dev.smem_optin);
    return {};
  };
  const cuda::BwdEntry* e = cuda::bwd_entry(f.head_dim_class());
  if (e == nullptr)
    return Status::Unsupported("no CUDA backward for head_dim " + std::to_string(p.head_dim) + " / head_dim_v " +
                               std::to_string(p.effective_head_dim_v()));
  const cuda::BwdEntry* e90 = cuda::bwd_entry_sm90(f.head_dim_class());
  std::string why90;  // why the wgmma kernel does not run this problem
  if (e90 == nullptr)
    why90 = FLASHCPP_HAS_SM90 ? "the wgmma backward has the head-dim classes 64 and 128"
                              : "this build has no sm90 kernels (FLASHCPP_WITH_SM90)";
  else if (dev.sm_major != 9)
    why90 = "the wgmma backward needs an sm_90 device; '" + dev.name + "' is " + std::to_string(dev.sm_major) + "." +
            std::to_string(dev.sm_minor);
  else
    why90 = fits(*e90);
  // The warp-specialized twin (TMA producer, dQ writer, two consumer warpgroups): no softcap, ALiBi
  // or block-sparse masks. Chosen by default wherever it runs: it measured 1.2-1.6x the single-role
  // wgmma kernel at both classes (reports/backward).
  const cuda::BwdEntry* ews = cuda::bwd_entry_sm90(f.head_dim_class(), true);
  const std::string why_ws =
      !why90.empty()   ? why90
      : ews == nullptr ? std::string("the warp-specialized backward has the head-dim classes 64 and 128")
      : (p.mask.softcap > 0.f || p.mask.alibi_slopes != nullptr || bs != nullptr)
          ? std::string("the warp-specialized backward takes no softcap, ALiBi or block-sparse mask")
          : fits(*ews);
  if (want == "sm90ws" && !why_ws.empty()) return Status::Unsupported("cuda_config 'sm90ws': " + why_ws);
  if (want == "sm90ws" || (want.empty() && why_ws.empty())) {
    out->id = KernelId::kCudaSm90;
    out->tile = ews->tile;
    out->config = "bwd_sm90ws_" + sm80_config_name(ews->tile);
    out->reason = "warp-specialized wgmma backward (src/cuda/backward/bwd_sm90_ws.cuh) on " + dev.name +
                  head_dim_class_note(f) + (p.deterministic ? "; deterministic dQ (key tiles add in ascending order)" : "");
    return Status::Ok();
  }
  if (want == "sm90" && !why90.empty()) return Status::Unsupported("cuda_config 'sm90': " + why90);
  const bool sm90 = why90.empty() && want != "sm80";
  if (sm90) e = e90;
  if (std::string why = fits(*e); !why.empty()) return Status::Unsupported(why);
  out->id = sm90 ? KernelId::kCudaSm90 : KernelId::kCudaSm80;
  out->tile = e->tile;
  out->config = (sm90 ? "bwd_sm90_" : "bwd_") + sm80_config_name(e->tile);
  out->reason = (sm90 ? "wgmma backward (src/cuda/backward/bwd_sm90.cuh) on " : "mma.sync backward (src/cuda/backward) on ") +
                dev.name + fused_masks(f) + head_dim_class_note(f) +
                (p.deterministic ? "; deterministic dQ (key tiles add in ascending order)" : "") +
                (sm90 && want.empty() ? "; not the warp-specialized kernel: " + why_ws
                                                                   : std::string()) +
                (!sm90 && dev.sm_major == 9 ? "; not the wgmma kernel: " + (want == "sm80" ? "cuda_config 'sm80'" : why90)
                                            : std::string());
  return Status::Ok();
#endif
}
#endif

int backward_key_group(bool deterministic, int key_tiles, int batch, int heads_kv, int resident_ctas, int forced) {
  if (key_tiles <= 0) return 1;
  const std::int64_t pairs = std::max<std::int64_t>(1, static_cast<std::int64_t>(batch) * heads_kv);
  std::int64_t g = key_tiles;
  if (forced > 0) g = forced;
  else if (deterministic) g = std::max<std::int64_t>(4, (std::max(resident_ctas, 1) + pairs - 1) / pairs);
  g = std::min<std::int64_t>(g, key_tiles);
  const std::int64_t groups_max = std::max<std::int64_t>(1, 65535 / std::max(batch, 1));  // grid z = batch x groups
  g = std::max(g, (key_tiles + groups_max - 1) / groups_max);
  return static_cast<int>(g);
}

bool backward_config(const std::string& cuda_config, std::string* family, int* key_group, std::string* why) {
  const std::size_t plus = cuda_config.find("+g");
  *family = cuda_config.substr(0, plus);
  int group = 0;
  const auto bad = [&] {
    *why = "the backward takes cuda_config \"\" (automatic), \"sm80\" (mma.sync), \"sm90\" (wgmma) or \"sm90ws\" "
           "(warp-specialized wgmma), optionally followed by \"+g<N>\" (N key tiles per group of the grid, 1 to "
           "65535), not '" + cuda_config + "'";
    return false;
  };
  if (!family->empty() && *family != "sm80" && *family != "sm90" && *family != "sm90ws") return bad();
  if (plus != std::string::npos) {
    const std::string n = cuda_config.substr(plus + 2);
    if (n.empty() || n.size() > 5 || n.find_first_not_of("0123456789") != std::string::npos) return bad();
    group = std::stoi(n);
    if (group < 1 || group > 65535) return bad();
  }
  if (key_group != nullptr) *key_group = group;
  return true;
}

Status backward(const AttnBackwardParams& p, const RunOptions& opt, Backend b, KernelChoice* out) {
  *out = KernelChoice{};
  switch (b) {
    case Backend::kCpuReference:
      out->id = KernelId::kCpuReference;
      out->reason = "fp64 reference backward requested (src/cpu/reference_backward.cc)";
      return Status::Ok();
    case Backend::kCpu:
      out->id = KernelId::kCpuTiled;
      out->reason = "tiled fp32 backward on the CPU (host pointers; src/cpu/tiled_backward.cc)";
      return Status::Ok();
    case Backend::kCuda:
#if FLASHCPP_WITH_CUDA
      return cuda_backward(p, opt, out);
#else
      (void)p;
      (void)opt;
      return build::refuse_no_cuda();
#endif
    case Backend::kAuto: break;
  }
  return Status::Internal("select::backward: the backend was not resolved");
}

// ---- decode: the split rule ------------------------------------------------------------------------
// The split heuristic (docs/decode.md has the reasoning and examples):
//   units    = heads_kv * row_blocks          CTAs one split of one sequence occupies
//   target   = num_sms * ctas_per_sm(D, fp8)  one full wave (ctas_per_sm from the tile config)
//   tiles_b  = 64-key tiles of the keys some query row of sequence b can see (window-aware)
//   if batch * units >= target: no split (the batch alone fills the GPU; merging would only add
//     traffic)
//   else: base = max(min_tiles, ceil(sum_b tiles_b * units / target)) tiles per split; chunk =
//     the candidate >= base (base, or where the longest sequence's count changes) of least
//     waves x longest split (wave_aware_chunk), and n_b = clamp(ceil(tiles_b / chunk), 1, max_splits)
//   min_tiles = ceil(max(256, 16 * rows) / 64): a split reads at least 256 keys, and at least 16
//     keys per query row it serves, so the partials it writes and the merge reads (8 bytes per
//     row and dim) stay under 1/8 of the K/V bytes it reads (4 bytes per key and dim).
//   small problems (ceil(sum_b tiles_b * units / target) < min_tiles: 256-key splits cannot fill
//     a wave) are latency-bound: base = min(base, max(ceil(16 * rows / 64), ceil(sum_b tiles_b *
//     units / budget))), budget = target (SmallPlan::kFullWave) or 5/8 of num_sms CTAs
//     (kShared, the engine's); more splits than above, never fewer.
// Splits are proportional to each sequence's length, so a ragged batch gives every CTA about the
// same number of tiles. A forced count (DecodePlanOptions::num_splits) gives every sequence that
// count, even beyond its tile count (the extra splits are empty and merge as LSE = -inf).
namespace {
constexpr int kMinSplitKeys = 256;
constexpr int kMinKeysPerRow = 16;
/// A problem too small to fill a wave with kMinSplitKeys-key splits is latency-bound: it splits
/// further, down to one tile per split, up to one full wave of CTAs (attention alone measured
/// 1.07-1.25x faster there than at the earlier 5/8 of the SMs, reports/decode), or with
/// SmallPlan::kShared up to 5/8 of the SM count (82 on an H200: the engine's short contexts, whose
/// GEMVs run beside attention, measured best at 72-80 CTAs and worse at 128+, docs/decode.md).
constexpr int kSharedSmallPlanEighths = 5;

std::int32_t split_count(std::int64_t tiles, std::int64_t chunk, int cap) {
  return static_cast<std::int32_t>(std::clamp<std::int64_t>((tiles + chunk - 1) / chunk, 1, cap));
}

/// The chunk (tiles per split) to plan with, >= base. Splitting at `base` fills one wave when the
/// splits divide evenly, but each n_b rounds up, and a few extra CTAs past the wave cost a whole
/// second wave: B=16, 8 KV heads, 8192 keys gets base 63 -> 3 splits -> 384 CTAs (1.45 waves,
/// 175 us on the H200) where 2 splits -> 256 CTAs take 137 us. So the candidates are base and
/// every chunk at which the longest sequence's split count changes; the cost of one is
/// waves x (tiles of the longest split), and a larger chunk (fewer splits, less merge traffic)
/// wins ties.
std::int64_t wave_aware_chunk(const std::vector<std::int64_t>& tiles, std::int64_t units, std::int64_t target,
                              std::int64_t base, int cap) {
  const std::int64_t max_tiles = *std::max_element(tiles.begin(), tiles.end());
  auto cost = [&](std::int64_t chunk) {
    std::int64_t items = 0, longest = 0;
    for (const std::int64_t t : tiles) {
      const std::int64_t n = split_count(t, chunk, cap);
      items += n;
      longest = std::max(longest, (t + n - 1) / n);
    }
    return ((items * units + target - 1) / target) * longest;
  };
  std::int64_t best = base, best_cost = cost(base);
  for (int n = cap; n >= 1; --n) {  // chunks in increasing order
    const std::int64_t chunk = (max_tiles + n - 1) / n;
    if (chunk <= base) continue;
    const std::int64_t c = cost(chunk);
    if (c <= best_cost) best = chunk, best_cost = c;
  }
  return best;
}

}  // namespace

Status decode_splits(const DecodeParams& p, const std::int32_t* lengths, int forced, int max_splits, int num_sms,
                     SplitDecision* out, DecodePlanOptions::SmallPlan small, int smem_per_sm) {
  using namespace flashcpp::decode;
  *out = SplitDecision{};
  out->splits.assign(static_cast<std::size_t>(p.batch), 1);
  if (p.batch == 0) return Status::Ok();
  const RowLayout rl = row_layout(p.heads_q, p.heads_kv, p.seqlen_q);
  const std::int64_t units = static_cast<std::int64_t>(p.heads_kv) * rl.row_blocks;
  const bool append = p.has_append();
  const int slots = static_cast<int>(p.cache.slots());
  const int wl = clamp_window(p.mask.window_left, slots), wr = clamp_window(p.mask.window_right, slots);
  const int cap = max_splits > 0 ? std::min(max_splits, kDecodeMaxSplits) : kDecodeMaxSplits;

  std::vector<std::int64_t> tiles(static_cast<std::size_t>(p.batch));
  std::int64_t total_tiles = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int raw = lengths ? lengths[b] : slots - (append ? p.seqlen_q : 0);
    const int len = total_len(raw, slots, p.seqlen_q, append);
    const MaskRules rules = sequence_rules(p.seqlen_q, len, p.mask.causal, wl, wr);
    int lo = 0, hi = 0;
    rules.key_range(0, p.seqlen_q, &lo, &hi);
    const int t0 = lo / kDecodeBlockN;
    tiles[b] = hi > lo ? (hi + kDecodeBlockN - 1) / kDecodeBlockN - t0 : 0;
    total_tiles += tiles[b] * units;
  }
  if (forced > 0) {
    std::fill(out->splits.begin(), out->splits.end(), forced);
  } else {
    const std::int64_t target = static_cast<std::int64_t>(std::max(num_sms, 1)) * ctas_per_sm(std::max(p.head_dim, p.effective_head_dim_v()), p.cache.fp8(), smem_per_sm);
    if (static_cast<std::int64_t>(p.batch) * units < target) {
      // >= 16 keys per row it serves, and >= kMinSplitKeys keys unless the problem is small (below)
      const std::int64_t row_tiles = (kMinKeysPerRow * rl.rows + kDecodeBlockN - 1) / kDecodeBlockN;
      static_assert(kMinSplitKeys % kDecodeBlockN == 0, "the key floor is whole tiles");
      const std::int64_t min_tiles = std::max<std::int64_t>(kMinSplitKeys / kDecodeBlockN, row_tiles);
      const std::int64_t fill = (total_tiles + target - 1) / target;  // tiles per CTA for one full wave
      std::int64_t base = std::max(min_tiles, fill);
      if (fill < min_tiles) {  // small: more splits (never fewer), up to the CTA budget
        const std::int64_t budget =
            small == DecodePlanOptions::SmallPlan::kShared
                ? std::max<std::int64_t>(1, std::max(num_sms, 1) * kSharedSmallPlanEighths / 8)
                : target;
        base = std::min(base, std::max<std::int64_t>({1, row_tiles, (total_tiles + budget - 1) / budget}));
      }
      const std::int64_t chunk = wave_aware_chunk(tiles, units, target, base, cap);
      for (int b = 0; b < p.batch; ++b) out->splits[b] = split_count(tiles[b], chunk, cap);
    }
  }
  std::int64_t items = 0;
  for (int b = 0; b < p.batch; ++b) {
    items += out->splits[b];
    out->max_splits = std::max<int>(out->max_splits, out->splits[b]);
  }
  if (items * units > std::numeric_limits<std::int32_t>::max())
    return Status::Unsupported("the plan needs " + std::to_string(items) + " work items x " + std::to_string(units) +
                               " CTAs each, more than a grid holds (2^31 - 1); lower num_splits or the batch");
  out->num_items = static_cast<int>(items);
  out->needs_merge = out->max_splits > 1;
  // Occupancy. An fp8 cache's config fits more CTAs per SM than a 16-bit cache's (Config<D>::
  // kCtasPerSm8), which helps a one-wave plan (the fp8 step is issue-bound) but not a batch that
  // fills several waves with whole sequences: 512 CTAs at D = 128 are 2 full waves of 2 per SM, or
  // a wave of 3 per SM and a 29% tail (measured 0.81x on an H100). A CTA's time grows with the
  // CTAs beside it on a memory-bound SM, so the cost of c per SM is waves(c) x (CTAs per SM in a
  // full wave, at most c); the larger c wins ties (a grid under one CTA per SM costs 1 either way).
  const int dim = std::max(p.head_dim, p.effective_head_dim_v());
  const int hi = ctas_per_sm(dim, p.cache.fp8(), smem_per_sm), lo = ctas_per_sm(dim, false, smem_per_sm);
  const std::int64_t ctas = items * units, sms = std::max(num_sms, 1), per_sm = (ctas + sms - 1) / sms;
  auto cost = [&](int c) { return (ctas + sms * c - 1) / (sms * c) * std::min<std::int64_t>(c, per_sm); };
  out->ctas_per_sm = lo < hi && cost(lo) < cost(hi) ? lo : hi;
  return Status::Ok();
}

}  // namespace flashcpp::select

// The tuned pick as `flashcpp tune` and the GPU tests name it (flashcpp/tune.h; without the sm80
// family, core/families.cc answers "").
#if FLASHCPP_HAS_SM80
namespace flashcpp::cuda {
std::string prefill_sm80_pick(const AttnParams& p, const DeviceInfo& dev) {
  const Fa2Entry* e = select::sm80_auto(p, dev);
  return e != nullptr ? select::sm80_config_name(e->tile) : std::string{};
}
}  // namespace flashcpp::cuda
#endif
