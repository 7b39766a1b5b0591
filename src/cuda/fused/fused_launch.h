// Host-side entry points of the fused CUDA kernels (src/cuda/fused/*.cu), called by the one
// dispatch in src/core/fused_api.cc after validation. Only defined when
// FLASHCPP_WITH_CUDA=1. Each launches on `stream`, allocates nothing and never synchronizes.
#pragma once

#include <string>

#include "flashcpp/fused.h"

namespace flashcpp::cuda {

/// Paths and switches the caller may force (RunOptions::cuda_config tokens "scalar",
/// "two_pass", "streaming", "slotsN", "headsN", "staged", "shared", "persistent", "stream", "stagesN"). They change speed only, never results.
struct FusedForce {
  bool scalar = false;     ///< element-wise accesses even when 16-byte vectors would fit
  bool two_pass = false;   ///< norms: re-read the row instead of keeping it in registers
  bool streaming = false;  ///< evict-first hints (ld/st.global.cs) on the 16-byte streams
  int slots = 0;           ///< norms, register kernel: 16-byte slots per tensor and thread (1, 2, 4; 0 = default)
  int heads = 0;           ///< rotary: heads a thread loads at once (1, 2); without shared, the register kernel
  bool staged = false;     ///< rotary: rows through shared memory with cp.async (16-byte path)
  bool persistent = false; ///< norms: a persistent grid that prefetches the next row (16-byte rows of > 32 vectors)
  bool shared = false;     ///< rotary: the shared-cos/sin kernel (with heads2: two heads a thread)
  bool stream = false;     ///< norms and rotary: the stream kernel (a resident grid, rows through cp.async stages)
  int stages = 0;          ///< stream kernel: rows (tokens) a block keeps in shared memory (2..4; 0 = by size)
};

/// The path a launch takes, as a name for tests and `flashcpp info`-style printing, e.g.
/// "rms_norm vec8 register group=128" or "rotary scalar".
struct FusedPath {
  bool vector = false;        ///< 16-byte accesses
  bool register_row = false;  ///< norms: row held in registers (else two passes)
  bool persistent = false;    ///< norms: the persistent register kernel
  bool stream = false;        ///< norms and rotary: rows streamed through shared memory by a resident grid
  bool shared = false;        ///< rotary: the shared-cos/sin kernel
  int per_thread = 0;         ///< stream: 16-byte vectors (norms, per tensor) or units (rotary) a thread holds
  int stages = 0;             ///< stream: rows (tokens) in shared memory per block
  int smem = 0;               ///< stream: dynamic shared memory of a block (its stages)
  int threads = 0;            ///< threads per block
  int group = 0;              ///< norms: threads per row
  std::string name;
};

// The *_path functions: the launch's choice; `named` false leaves FusedPath::name empty (the launches
// ask that way: the name's string building is host time on every eager call).
FusedPath rms_norm_path(const RmsNormParams& p, bool with_residual, const FusedForce& force, bool named = true);
Status rms_norm(const RmsNormParams& p, bool with_residual, const FusedForce& force, Stream stream);

FusedPath silu_and_mul_path(const SiluMulParams& p, const FusedForce& force, bool named = true);
Status silu_and_mul(const SiluMulParams& p, const FusedForce& force, Stream stream);

FusedPath rotary_path(const RopeParams& p, const FusedForce& force, bool named = true);
/// cu_seqlens (rotate_keys): packed sequences of at most p.seqlen tokens; see RotaryArgs.
Status apply_rotary(const RopeParams& p, const FusedForce& force, Stream stream,
                    const std::int32_t* cu_seqlens = nullptr);

FusedPath qk_norm_rope_path(const QkNormRopeParams& p, const FusedForce& force, bool named = true);
Status qk_norm_rope(const QkNormRopeParams& p, const FusedForce& force, Stream stream);

FusedPath rope_append_path(const RopeAppendParams& p, const FusedForce& force, bool named = true);
Status rope_append_kv(const RopeAppendParams& p, const FusedForce& force, Stream stream);

}  // namespace flashcpp::cuda
