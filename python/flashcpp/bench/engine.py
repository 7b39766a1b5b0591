"""The Llama decode engine end to end: `flashcpp decode` vs PyTorch, correctness and tokens/s.

    python -m flashcpp.bench engine --flashcpp-bin build/flashcpp [--model-dir /tmp/llama1b] [--quick]
                                    [--out reports/engine]

1. Checkpoint. If --model-dir holds no config.json + *.safetensors, a random-weight Llama-3.2-1B-shaped
   checkpoint is made there with transformers (hidden 2048, 16 layers, 32 q / 8 kv heads of 64, vocab
   128256, tied embeddings, rope theta 500000 with llama3 scaling; torch.manual_seed(0), the default
   initializer_range 0.02, bf16). config.json carries the rope settings both as the hub's Llama-3.2
   files do (rope_theta, rope_scaling) and as transformers 5 writes them (rope_parameters).
2. Correctness (correctness_report.json). A fixed 32-token prompt; transformers' LlamaForCausalLM in bf16
   (sdpa) prefills it and makes 32 greedy tokens with its KV cache: logits rows 0..62 in the layout of
   `flashcpp decode --dump-logits` (row P-1+s = logits after feeding generated token s). The reference is
   the same transformers model in fp32 (same bf16-rounded weights, TF32 off) on the same token sequence.
   Tolerance, the DESIGN rule: max |logits - fp32 reference| <= 2 x (that error of transformers bf16, a
   plain bf16 implementation) + 1% of the reference logits' RMS. Each candidate (flashcpp graph, flashcpp
   --eager, the compact PyTorch model) feeds its own greedy tokens: rows are compared up to the first
   step whose token differs from transformers'; there the two tokens must be a near-tie (their fp32
   reference logits within the tolerance), and transformers' top-2 gap is reported. A batch of 4
   different prompts (--prompt-file) checks that sequences of a batch do not disturb each other.
3. Speed (benchmark.csv, benchmark.png). Decode only (no prefill): every sequence starts from a KV cache
   holding `context` random tokens (`--context N` for flashcpp, `fill_caches_random` for the compact
   model); tokens/s = batch x decode steps / decode wall time, medians of interleaved repeats. Rows:
   torch_eager, torch_compile (mode="reduce-overhead"), torch_graph (eager step captured in one
   torch.cuda.CUDAGraph, token and position updates inside the graph), torch_compile_graph (default-mode
   compile captured the same way), flashcpp_eager (--eager); ours = flashcpp_graph. The floor is
   batch / ((weight bytes + KV bytes of `context` tokens) / 4.3 TB/s). The issue's bar: b1_ctx512
   flashcpp_graph >= 1300 tok/s and >= 2x the best PyTorch row (`meets_bar`).
   Modes listed in --isolate (default torch_compile_graph) are timed in a child process of their own,
   next to a torch_eager reference for the logits check: PyTorch 2.11 crashed (SIGSEGV) replaying a
   default-mode compile captured in a torch.cuda.CUDAGraph after reduce-overhead compiles of another
   batch size in the same process. A child that dies costs only its own cells (an error is recorded).
   --quick: batch 1 at 512 tokens of context only, 32 steps, three repeats (a repeat costs about two
   seconds; with one, the check against reports/ could not tell a noisy row from a drift), and without
   the isolated modes (their child process and its compiles were a third of the quick run).
"""
from __future__ import annotations

import argparse
import copy
import csv
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .common import progress, write_csv, write_json

HBM_TBPS = 4.3
BAR_TOK_S = 1300.0
BAR_VS_TORCH = 2.0
PROMPT_LEN = 32
NEW_TOKENS = 32
TORCH_MODES = ("torch_eager", "torch_compile", "torch_graph", "torch_compile_graph")
FLASHCPP_MODES = ("flashcpp_graph", "flashcpp_eager")

# Llama-3.2-1B shape (random weights)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
                bos_token_id=128000, eos_token_id=128001)


# ---------------------------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------------------------

def has_checkpoint(d: str) -> bool:
    return os.path.isfile(os.path.join(d, "config.json")) and bool(glob.glob(os.path.join(d, "*.safetensors")))


def make_checkpoint(d: str, device: str = "cuda", shape: Optional[dict] = None) -> None:
    """A random-weight Llama checkpoint (Llama-3.2-1B shape unless `shape`), saved as transformers does."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = copy.deepcopy(LLAMA_1B if shape is None else shape)
    progress(f"[bench engine] making a random-weight checkpoint in {d} ({shape['num_hidden_layers']} layers, "
             f"hidden {shape['hidden_size']}, vocab {shape['vocab_size']})")
    cfg = LlamaConfig(**copy.deepcopy(shape))  # (transformers 5 edits the rope dict it is given)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    del model
    # Write the rope settings in both the hub's (transformers 4) and transformers 5's spelling, so any
    # config reader finds them (transformers itself reads either).
    path = os.path.join(d, "config.json")
    with open(path) as f:
        c = json.load(f)
    c.setdefault("rope_theta", shape["rope_theta"])
    c["rope_scaling"] = {k: v for k, v in shape["rope_scaling"].items() if k != "rope_theta"}
    c.setdefault("rope_parameters", dict(shape["rope_scaling"], rope_theta=shape["rope_theta"]))
    c.setdefault("architectures", ["LlamaForCausalLM"])
    c["torch_dtype"] = "bfloat16"
    with open(path, "w") as f:
        json.dump(c, f, indent=2)
        f.write("\n")


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter once (a tied lm_head is the embedding);
    an untied embedding table is only gathered (a few rows), so it is left out."""
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    if not model.args.tie_word_embeddings:
        total -= model.embed.weight.numel() * model.embed.weight.element_size()
    return total


def kv_bytes_per_token(model) -> int:
    a = model.args
    return a.n_layers * 2 * a.n_kv_heads * a.head_dim * model.lm_head.weight.element_size()


# ---------------------------------------------------------------------------------------------
# flashcpp decode
# ---------------------------------------------------------------------------------------------

def run_flashcpp(binary: str, args: Sequence[str], workdir: str, tag: str, timeout: int = 600) -> dict:
    """`binary decode ARGS --json F`; the parsed JSON (RuntimeError with the tail of stderr on failure)."""
    jpath = os.path.join(workdir, f"{tag}.json")
    if os.path.exists(jpath):
        os.remove(jpath)
    cmd = [binary, "decode", *[str(a) for a in args], "--json", jpath]
    progress("  $ " + " ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout or "").strip().splitlines()[-8:]
        raise RuntimeError(f"flashcpp decode exited {p.returncode}: " + " | ".join(tail))
    with open(jpath) as f:
        return json.load(f)


def trace_step(binary: str, model_dir: str, out: str, workdir: str, context: int = 512) -> dict:
    """The kernel timeline of the batch-1 step as it runs in the CUDA graph (`flashcpp decode
    --trace`, CUPTI): CSV under out/raw/, and per kernel its launch gap and busy time per step."""
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    csv_path = os.path.join(out, "raw", f"trace_b1_ctx{context}.csv")
    j = run_flashcpp(binary, ["--model", model_dir, "--context", context, "--max-new-tokens", 32, "--no-profile",
                              "--trace", csv_path], workdir, f"trace_b1_ctx{context}")
    t = j.get("trace")
    if not t:
        raise RuntimeError("flashcpp decode --trace wrote no trace section")
    return dict(t, file=os.path.relpath(csv_path, out), wall_us_per_step_timed=j.get("wall_us_per_step"))


def read_dump(path: str, vocab: int):
    import numpy as np
    a = np.fromfile(path, dtype="<f4")
    if a.size % vocab:
        raise RuntimeError(f"{path}: {a.size} floats is not a multiple of vocab {vocab}")
    return a.reshape(-1, vocab)


# ---------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------

def hf_load(model_dir: str, dtype, device: str, attn: str):
    """transformers' model in `dtype` (bf16 -> fp32 is exact). The dtype goes to from_pretrained, not to
    .to(): .to(bf16) would also round the rotary inv_freq buffer, which transformers keeps in fp32."""
    import transformers
    from transformers import LlamaForCausalLM
    ver = tuple(int(v) for v in transformers.__version__.split(".")[:2] if v.isdigit())
    key = "dtype" if ver >= (4, 56) else "torch_dtype"
    m = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation=attn, **{key: dtype})
    return m.to(device=device).eval()


def hf_greedy(hf, prompt, new_tokens: int):
    """prompt (B, P) -> (tokens (B, N), logits (B, P+N-1, V) fp32) with transformers' own KV cache."""
    import inspect

    import torch
    # transformers >= 5.2x calls the KV cache `cache`; earlier ones `past_key_values`
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = hf(input_ids=prompt, use_cache=True)
        rows, toks = [out.logits.float()], []
        tok = rows[0][:, -1].argmax(-1, keepdim=True)
        for _ in range(1, new_tokens):
            toks.append(tok)
            out = hf(input_ids=tok, use_cache=True, **{key: getattr(out, key)})
            rows.append(out.logits.float())
            tok = rows[-1][:, -1].argmax(-1, keepdim=True)
        toks.append(tok)
    return torch.cat(toks, 1), torch.cat(rows, 1)


def compare(name: str, toks, logits, hf_toks, hf_logits, ref, tol: float, plen: int) -> dict:
    """One case: candidate tokens (N,) and logits (R, V) against transformers bf16 (tokens, logits) and
    the fp32 reference on transformers' token sequence. Rows after the first token divergence are not
    comparable (different inputs) and are skipped."""
    import torch
    n = len(hf_toks)
    toks = [int(t) for t in toks]
    hf_toks = [int(t) for t in hf_toks]
    div = next((s for s in range(min(n, len(toks))) if toks[s] != hf_toks[s]), None)
    if div is None and len(toks) < n:
        div = len(toks)
    last = plen - 1 + (n - 1 if div is None else div)  # row that produced token div (0-based)
    case = {"name": name, "steps": n, "tokens_agree": div is None,
            "first_divergent_step": None if div is None else div + 1, "tolerance": round(tol, 5)}
    errs_ok = True
    if logits is not None:
        rows = min(last + 1, logits.shape[0], ref.shape[0])
        x = logits[:rows].float()
        e_ref = (x - ref[:rows]).abs()
        e_hf = (x - hf_logits[:rows]).abs()
        finite = bool(torch.isfinite(x).all())
        case.update({"rows_compared": rows, "rows_expected": plen + n - 1,
                     "max_abs_err": round(float(e_ref.max()), 5),
                     "mean_abs_err": round(float(e_ref.mean()), 6),
                     "max_abs_diff_vs_transformers_bf16": round(float(e_hf.max()), 5),
                     "mean_abs_diff_vs_transformers_bf16": round(float(e_hf.mean()), 6),
                     "per_position_max_abs_err": [round(float(v), 4) for v in e_ref.amax(-1)],
                     "per_position_mean_abs_err": [round(float(v), 5) for v in e_ref.mean(-1)],
                     "per_position_max_abs_diff_vs_transformers_bf16": [round(float(v), 4) for v in e_hf.amax(-1)],
                     "finite": finite, "dump_rows": int(logits.shape[0])})
        errs_ok = finite and float(e_ref.max()) <= tol and int(logits.shape[0]) == plen + n - 1
    steps_cmp = n if div is None else div + 1
    case["top1_agree"] = [toks[s] == hf_toks[s] for s in range(min(steps_cmp, len(toks)))]
    near_tie = True
    if div is not None and div < len(toks):
        r = plen - 1 + div
        top2 = hf_logits[r].float().topk(2).values
        gap_ref = float(ref[r, hf_toks[div]] - ref[r, toks[div]])
        case.update({"divergence_row": r, "transformers_top2_gap": round(float(top2[0] - top2[1]), 5),
                     "ref_gap_between_the_two_tokens": round(gap_ref, 5)})
        near_tie = gap_ref <= tol
    case["pass"] = bool(errs_ok and near_tie)
    return case


def batch_case(name: str, seqs: List[List[int]], hf_toks, hf_logits, tol: float, plen: int,
               seq0_logits=None, baseline: float = 0.0) -> dict:
    """Greedy tokens of every sequence of a batch vs transformers' for the same prompt; a divergence
    must be a near-tie of transformers' bf16 logits. Sequence 0's logits (if dumped) within tol+baseline
    of transformers bf16 (|x - bf16| <= |x - fp32| + |fp32 - bf16|)."""
    n = hf_toks.shape[1]
    ok, per = True, []
    for i, t in enumerate(seqs):
        h = [int(v) for v in hf_toks[i]]
        div = next((s for s in range(min(n, len(t))) if int(t[s]) != h[s]), None)
        if div is None and len(t) < n:
            per.append({"seq": i, "agree_steps": len(t), "error": "too few tokens"})
            ok = False
            continue
        item = {"seq": i, "agree_steps": n if div is None else div}
        if div is not None:
            r = plen - 1 + div
            gap = float(hf_logits[i, r, h[div]] - hf_logits[i, r, int(t[div])])
            item["transformers_gap_between_the_two_tokens"] = round(gap, 5)
            ok &= gap <= tol
        per.append(item)
    case = {"name": name, "batch": len(seqs), "sequences": per, "tolerance": round(tol + baseline, 5)}
    if len(seqs) != hf_toks.shape[0]:
        ok = False
        case["error"] = f"{len(seqs)} sequences returned, {hf_toks.shape[0]} expected"
    if seq0_logits is not None:
        d0 = per[0]["agree_steps"] if per else 0
        rows = min(plen + min(d0, n - 1), seq0_logits.shape[0])
        err = float((seq0_logits[:rows].float() - hf_logits[0, :rows]).abs().max())
        case["max_abs_err"] = round(err, 5)
        case["max_abs_err_is"] = "sequence 0 logits vs transformers bf16 (batch of 4)"
        ok &= err <= tol + baseline
    else:
        case["max_abs_err"] = None
    case["pass"] = bool(ok)
    return case


def correctness(model, model_dir: str, binary: Optional[str], workdir: str, device: str, env: dict) -> dict:
    import torch

    from .engine_model import greedy, rope_inv_freq

    a = model.args
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, a.vocab_size, (1, PROMPT_LEN), generator=g)
    prompts4 = torch.cat([prompt, torch.randint(0, a.vocab_size, (3, PROMPT_LEN), generator=g)])
    prev_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        hf = hf_load(model_dir, torch.bfloat16, device, "sdpa")
        inv_hf = getattr(getattr(hf.model, "rotary_emb", None), "inv_freq", None)
        hf_toks, hf_logits = hf_greedy(hf, prompt.to(device), NEW_TOKENS)
        hf_toks4, hf_logits4 = hf_greedy(hf, prompts4.to(device), NEW_TOKENS)
        del hf
        hf32 = hf_load(model_dir, torch.float32, device, "eager")
        with torch.no_grad():
            seq = torch.cat([prompt.to(device), hf_toks[:, :-1]], 1)
            ref = hf32(input_ids=seq).logits.float()[0]
        del hf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev_tf32
    if device == "cuda":
        torch.cuda.empty_cache()
    hf_logits, hf_toks0 = hf_logits[0], hf_toks[0]
    baseline = float((hf_logits - ref).abs().max())
    ref_rms = float(ref.pow(2).mean().sqrt())
    tol = 2.0 * baseline + 0.01 * ref_rms
    info = {"prompt_ids": prompt[0].tolist(), "new_tokens": NEW_TOKENS, "logits_rms": round(ref_rms, 4),
            "transformers_bf16_vs_fp32_max": round(baseline, 5), "tolerance": round(tol, 5),
            "tolerance_rule": "max |logits - fp32 transformers| <= 2 x (transformers bf16 vs fp32) "
                              "+ 0.01 x RMS(fp32 logits); a token divergence must be a near-tie "
                              "(fp32 logits of the two tokens within the tolerance)",
            "transformers_tokens": hf_toks0.tolist()}
    if inv_hf is not None:
        info["rope_inv_freq_max_diff_vs_transformers"] = float(
            (rope_inv_freq(a).to(inv_hf.device) - inv_hf.float()).abs().max())
    progress(f"[bench engine] logits RMS {ref_rms:.3f}; transformers bf16 vs fp32 max {baseline:.4f}; "
             f"tolerance {tol:.4f}")
    cases = [{"name": "transformers_bf16_vs_fp32", "pass": bool(math.isfinite(baseline)),
              "max_abs_err": round(baseline, 5), "tolerance": round(tol, 5),
              "note": "the yardstick: a plain bf16 implementation against the fp32 reference"}]

    toks, lg = greedy(model, prompt.to(device), NEW_TOKENS)
    cases.append(compare("compact_torch_vs_transformers", toks[0].tolist(), lg[0], hf_toks0, hf_logits, ref,
                         tol, PROMPT_LEN))
    toks4, lg4 = greedy(model, prompts4.to(device), NEW_TOKENS)
    cases.append(batch_case("compact_torch_batch4_prompts", toks4.tolist(), hf_toks4, hf_logits4, tol,
                            PROMPT_LEN, lg4[0], baseline))
    del lg, lg4
    if binary:
        ids = ",".join(str(int(t)) for t in prompt[0])
        pfile = os.path.join(workdir, "prompts4.txt")
        with open(pfile, "w") as f:
            for row in prompts4.tolist():
                f.write(" ".join(str(t) for t in row) + "\n")
        runs = [("flashcpp_graph_vs_transformers", ["--prompt-ids", ids], []),
                ("flashcpp_eager_vs_transformers", ["--prompt-ids", ids], ["--eager"]),
                ("flashcpp_graph_batch4_prompts", ["--prompt-file", pfile, "--batch", "4"], [])]
        for name, pargs, extra in runs:
            dump = os.path.join(workdir, f"{name}.f32")
            try:
                j = run_flashcpp(binary, ["--model", model_dir, *pargs, "--max-new-tokens", NEW_TOKENS,
                                          "--dump-logits", dump, *extra], workdir, name)
                x = torch.from_numpy(read_dump(dump, a.vocab_size)).to(device)
                if name.endswith("batch4_prompts"):
                    c = batch_case(name, j["tokens"], hf_toks4, hf_logits4, tol, PROMPT_LEN, x, baseline)
                else:
                    c = compare(name, j["tokens"][0], x, hf_toks0, hf_logits, ref, tol, PROMPT_LEN)
                c.update({"mode": j.get("mode"), "flashcpp_prefill_ms": j.get("prefill_ms")})
                del x
            except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
                c = {"name": name, "pass": False, "max_abs_err": None, "tolerance": round(tol, 5),
                     "error": str(e)[:2000]}
            cases.append(c)
    for c in cases:
        extra = "" if c.get("tokens_agree", True) else f" (tokens diverge at step {c.get('first_divergent_step')})"
        progress(f"  {c['name']:36s} {'PASS' if c['pass'] else 'FAIL'}  max_abs_err {c.get('max_abs_err')}"
                 f"  tol {c['tolerance']}{extra}{'  ' + c['error'] if 'error' in c else ''}")
    return {"environment": env, "setup": info, "cases": cases}


# ---------------------------------------------------------------------------------------------
# speed: the compact PyTorch model in four modes
# ---------------------------------------------------------------------------------------------

class TorchDecoder:
    """Greedy decode from a fixed state (token tok0 at position ctx of caches pre-filled with `ctx`
    random tokens), in one of the four PyTorch modes. run(n) makes n decode steps; logits() is the
    last step's."""

    def __init__(self, mode: str, model, tok0, kv_pos, ctx: int, compiled: Dict[str, Callable]):
        import torch
        self.mode, self.model, self.tok0, self.kv_pos, self.ctx = mode, model, tok0, kv_pos, ctx
        self.dev = tok0.device
        self.tok = tok0.clone()
        self.pos = torch.tensor([ctx], device=self.dev, dtype=torch.long)
        self._logits = None
        self.graph = None
        from .engine_model import decode_one
        self.fn = {"torch_eager": decode_one, "torch_graph": decode_one,
                   "torch_compile": compiled.get("reduce-overhead"),
                   "torch_compile_graph": compiled.get("default")}[mode]
        if mode in ("torch_graph", "torch_compile_graph"):
            fn = self.fn

            def body():
                nxt, lg = fn(model, self.tok, self.pos, kv_pos)
                self.tok.copy_(nxt)
                self.pos.add_(1)
                return lg

            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):  # warm-up (and the compile) outside the capture
                    body()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._logits = body()

    def reset(self) -> None:
        self.tok.copy_(self.tok0)
        self.pos.fill_(self.ctx)

    def run(self, n: int) -> None:
        import torch
        self.reset()
        if self.graph is not None:
            for _ in range(n):
                self.graph.replay()
            return
        fn = self.fn
        mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
        tok = self.tok
        for _ in range(n):
            if self.mode == "torch_compile" and mark is not None:
                mark()
            nxt, lg = fn(self.model, tok, self.pos, self.kv_pos)
            tok = nxt.clone() if self.mode == "torch_compile" else nxt
            self.pos += 1
        self._logits = lg.clone()

    def logits(self):
        return self._logits


def make_compiled(modes: Sequence[str]) -> Dict[str, Callable]:
    import torch

    from .engine_model import decode_one, decode_one_default
    cfg = torch._dynamo.config
    for k in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
              "accumulated_recompile_limit"):
        if hasattr(cfg, k):
            setattr(cfg, k, max(getattr(cfg, k), 64))
    out = {}
    if "torch_compile" in modes:
        out["reduce-overhead"] = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True)
    if "torch_compile_graph" in modes:
        out["default"] = torch.compile(decode_one_default, mode="default", fullgraph=True)
    return out


def setup_case(model, batch: int, ctx: int, steps: int, max_len: int, seed: int = 0):
    """State for one case: caches of (batch, max_len) (reallocated only when that changes, so one
    torch.compile per batch size), `ctx` random tokens in them, a random first token, and
    kv_pos = arange(n) with n = ctx + steps rounded up: attention reads n positions, as a cache sized
    to this case would. n is marked dynamic, so a new context does not recompile."""
    import torch
    n = 64 * math.ceil((ctx + steps + 8) / 64)
    if n > max_len:
        raise ValueError(f"context {ctx} + {steps} steps does not fit a cache of {max_len}")
    kc = model.layers[0].attn.k_cache
    if kc is None or kc.shape[0] != batch or kc.shape[2] != max_len:
        for blk in model.layers:
            blk.attn.k_cache = blk.attn.v_cache = None
        model.setup_caches(batch, max_len)
    model.fill_caches_random(ctx, seed=seed)
    dev = model.lm_head.weight.device
    g = torch.Generator().manual_seed(seed + batch)
    tok0 = torch.randint(0, model.args.vocab_size, (batch, 1), generator=g).to(dev)
    kv_pos = torch.arange(n, device=dev)
    maybe = getattr(torch._dynamo, "maybe_mark_dynamic", None)
    if maybe is not None:
        maybe(kv_pos, 0)
    return tok0, kv_pos


def cache_len_for(cases, batch: int, steps: int) -> int:
    """Cache length for every case of a batch size: the longest n plus 64, so that n never equals it
    (inductor guards n != cache length: a slice of the whole cache would be a different graph)."""
    return 64 + max(64 * math.ceil((c + steps + 8) / 64) for b, c in cases if b == batch)


def timed(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def cases_for(quick: bool, spec: Optional[str] = None) -> List[Tuple[int, int]]:
    """(batch, context), grouped by batch so torch.compile works once per batch size.
    `spec` ("1x512,1x16384,8x512") overrides the preset."""
    if spec:
        pairs = [tuple(int(v) for v in item.split("x")) for item in spec.split(",") if item]
        return sorted(pairs, key=lambda bc: (bc[0], bc[1]))
    if quick:
        return [(1, 512)]
    return [(1, 512), (1, 16384), (1, 32768), (8, 512), (8, 16384), (32, 512)]


def case_id(batch: int, ctx: int) -> str:
    return f"b{batch}_ctx{ctx // 1024}k" if ctx >= 1024 and ctx % 1024 == 0 else f"b{batch}_ctx{ctx}"


def cases_spec(cases) -> str:
    return ",".join(f"{b}x{c}" for b, c in cases)


def run_isolated(mode: str, model_dir: str, workdir: str, cases, steps: int, repeats: int, device: str,
                 errors: List[str]) -> Dict[str, Tuple[List[float], float]]:
    """Time one PyTorch mode in a child process (with torch_eager as its logits reference and no flashcpp
    rows): {case id: (tokens/s of each repeat, max |logits - torch_eager|)}. A child that fails or dies
    records an error and leaves that mode's cells empty."""
    out = os.path.join(workdir, f"isolated_{mode}")
    cmd = [sys.executable, "-m", "flashcpp.bench.engine", "--out", out, "--model-dir", model_dir,
           "--flashcpp-bin", "", "--skip-correctness", "--isolate", "", "--device", device,
           "--modes", ",".join(dict.fromkeys(("torch_eager", mode))), "--cases", cases_spec(cases),
           "--steps", str(steps), "--repeats", str(repeats)]
    progress(f"  {mode}: in a process of its own: " + " ".join(cmd[1:]))
    got: Dict[str, Tuple[List[float], float]] = {}
    try:
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        pypath = os.pathsep.join(d for d in (pkg_root, os.environ.get("PYTHONPATH", "")) if d)
        p = subprocess.run(cmd, timeout=3600, env=dict(os.environ, FLASHCPP_BENCH_CHILD="1", PYTHONPATH=pypath))
        path = os.path.join(out, "benchmark.csv")
        if os.path.exists(path):
            with open(path) as f:
                for r in csv.DictReader(f):
                    if r["peer"] == mode and r["peer_tok_s_runs"]:
                        d = r.get("max_abs_logit_diff_vs_torch_eager", "")
                        got[r["case"]] = ([float(v) for v in r["peer_tok_s_runs"].split()],
                                          float(d) if d else float("nan"))
        if p.returncode != 0:
            how = f"died of signal {-p.returncode}" if p.returncode < 0 else f"exited {p.returncode}"
            missing = [case_id(b, c) for b, c in cases if case_id(b, c) not in got]
            errors.append(f"{mode} (own process) {how}; cells without a measurement: {', '.join(missing) or 'none'}")
            progress(f"  {errors[-1]}")
    except Exception as e:  # noqa: BLE001
        errors.append(f"{mode} (own process): {e}")
        progress(f"  {errors[-1]}")
    return got


def speed(model, binary: Optional[str], model_dir: str, workdir: str, cases, steps: int, repeats: int,
          modes: Sequence[str], device: str, env: dict, errors: List[str],
          isolate: Sequence[str] = ()) -> List[Dict[str, object]]:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    own = [m for m in modes if m in isolate]
    inproc = [m for m in modes if m not in own]
    isolated = {m: run_isolated(m, model_dir, workdir, cases, steps, repeats, device, errors) for m in own}
    compiled = make_compiled(inproc)
    wbytes = weight_bytes(model)
    kv_tok = kv_bytes_per_token(model)
    rows: List[Dict[str, object]] = []
    for batch, ctx in cases:
        cid = case_id(batch, ctx)
        t_case = time.perf_counter()
        try:
            tok0, kv_pos = setup_case(model, batch, ctx, steps, cache_len_for(cases, batch, steps))
        except Exception as e:  # noqa: BLE001  (e.g. out of memory: the other cases still run)
            errors.append(f"{cid} setup: {e}")
            progress(f"  {cid}: setup FAILED {str(e)[:300]}")
            continue
        decs: Dict[str, TorchDecoder] = {}
        tok_s: Dict[str, List[float]] = {m: [] for m in (*modes, *FLASHCPP_MODES)}
        fc_json: Dict[str, dict] = {}
        check: Dict[str, float] = {}
        ref_lg = None
        for m in own:
            runs, diff = isolated[m].get(cid, ([], float("nan")))
            tok_s[m], check[m] = list(runs), diff
        for m in inproc:
            try:
                t0 = time.perf_counter()
                d = TorchDecoder(m, model, tok0, kv_pos, ctx, compiled)
                d.run(min(steps, 8))  # warm-up (compiles / records the first time)
                d.run(2)  # the logits of step 2 from the case's start state, against eager's
                lg = d.logits().float()
                if m == "torch_eager":
                    ref_lg = lg
                check[m] = float((lg - ref_lg).abs().max()) if ref_lg is not None else float("nan")
                decs[m] = d
                progress(f"  {cid} {m}: ready in {time.perf_counter() - t0:.1f} s")
            except Exception as e:  # noqa: BLE001
                errors.append(f"{cid} {m}: {e}")
                progress(f"  {cid} {m}: FAILED {str(e)[:300]}")
        for r in range(repeats):
            for m, d in decs.items():
                dt = timed(lambda: d.run(steps), sync)
                tok_s[m].append(batch * steps / dt)
            if binary:
                if device == "cuda":
                    torch.cuda.empty_cache()
                for m in FLASHCPP_MODES:
                    if m in fc_json and fc_json[m].get("failed"):
                        continue
                    try:
                        eager = ["--eager"] if m == "flashcpp_eager" else []
                        j = run_flashcpp(binary, ["--model", model_dir, "--batch", batch, "--context", ctx,
                                                  "--max-new-tokens", steps, *eager], workdir, f"{cid}_{m}_{r}")
                        v = j.get("decode_tok_s") or batch * steps / (float(j["decode_ms"]) / 1e3)
                        tok_s[m].append(float(v))
                        fc_json.setdefault(m, {}).setdefault("runs", []).append(j)
                    except Exception as e:  # noqa: BLE001
                        errors.append(f"{cid} {m}: {e}")
                        progress(f"  {cid} {m}: FAILED {str(e)[:300]}")
                        fc_json.setdefault(m, {})["failed"] = str(e)[:500]
        med = {m: (statistics.median(v) if v else float("nan")) for m, v in tok_s.items()}
        floor = batch / ((wbytes + kv_tok * batch * ctx) / (HBM_TBPS * 1e12))
        ours = med["flashcpp_graph"]
        best_torch = max((med[m] for m in modes if not math.isnan(med[m])), default=float("nan"))

        def split(m: str) -> Dict[str, object]:
            runs = fc_json.get(m, {}).get("runs", [])
            kern = [float(j["kernel_us_per_step"]) for j in runs if j.get("kernel_us_per_step") is not None]
            wall = [float(j["wall_us_per_step"]) for j in runs if j.get("wall_us_per_step") is not None]
            k = statistics.median(kern) if kern else None
            w = statistics.median(wall) if wall else None
            return {"kernel_us_per_step": "" if k is None else round(k, 2),
                    "wall_us_per_step": "" if w is None else round(w, 2),
                    "overhead_us_per_step": "" if k is None or w is None else round(w - k, 2)}

        s_ours = split("flashcpp_graph")
        if case_id(1, 512) == cid:
            meets = (ours >= BAR_TOK_S and ours >= BAR_VS_TORCH * best_torch) if not math.isnan(ours) else False
            bar, meets_s = f">= {BAR_TOK_S:.0f} tok/s and >= {BAR_VS_TORCH:.0f}x best torch", "yes" if meets else "no"
        else:
            bar, meets_s = "", "n/a"
        for peer in (*modes, "flashcpp_eager"):
            p = med[peer]
            row = {"case": cid, "peer": peer, "ours_tok_s": _r(ours), "peer_tok_s": _r(p),
                   "speedup": _r(ours / p, 3) if p and not math.isnan(p) and not math.isnan(ours) else "",
                   "batch": batch, "context": ctx, "decode_steps": steps, "repeats": repeats,
                   "floor_tok_s": _r(floor), "ours_frac_of_floor": _r(ours / floor, 3),
                   "peer_frac_of_floor": _r(p / floor, 3),
                   "ours_us_per_step": _r(1e6 * batch / ours, 2), "peer_us_per_step": _r(1e6 * batch / p, 2),
                   "ours_kernel_us_per_step": s_ours["kernel_us_per_step"],
                   "ours_wall_us_per_step": s_ours["wall_us_per_step"],
                   "ours_overhead_us_per_step": s_ours["overhead_us_per_step"],
                   "best_torch_tok_s": _r(best_torch), "ours_vs_best_torch": _r(ours / best_torch, 3),
                   "bar": bar, "meets_bar": meets_s,
                   "peer_tok_s_runs": " ".join(f"{v:.1f}" for v in tok_s[peer]),
                   "ours_tok_s_runs": " ".join(f"{v:.1f}" for v in tok_s["flashcpp_graph"]),
                   "weights_bytes": wbytes, "kv_bytes_per_step": kv_tok * batch * ctx}
            if peer == "flashcpp_eager":
                s_p = split(peer)
                row.update({"peer_kernel_us_per_step": s_p["kernel_us_per_step"],
                            "peer_wall_us_per_step": s_p["wall_us_per_step"],
                            "peer_overhead_us_per_step": s_p["overhead_us_per_step"]})
            else:
                row["max_abs_logit_diff_vs_torch_eager"] = "" if math.isnan(check.get(peer, float("nan"))) \
                    else f"{check[peer]:.3e}"
            row.update({"gpu": env.get("gpu", ""), "git_commit": env.get("git_commit", "")})
            rows.append(row)
        progress(f"[bench engine] {cid}: " + "  ".join(f"{m} {med[m]:.0f}" for m in (*FLASHCPP_MODES, *modes))
                 + f"  floor {floor:.0f} tok/s  ({time.perf_counter() - t_case:.0f} s)")
        for d in decs.values():
            d.graph = None
        del decs
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return rows


def _r(v: float, nd: int = 1):
    return "" if v is None or (isinstance(v, float) and (math.isnan(v) or math.isinf(v))) else round(float(v), nd)


def plot(rows: List[Dict[str, object]], path: str, env: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = ["flashcpp_graph", "flashcpp_eager", "torch_compile_graph", "torch_graph", "torch_compile",
             "torch_eager"]
    impls = [i for i in impls if i == "flashcpp_graph" or any(r["peer"] == i for r in rows)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 5))
    w = 0.8 / len(impls)
    for k, name in enumerate(impls):
        ys = []
        for c in cases:
            rs = [r for r in rows if r["case"] == c]
            if name == "flashcpp_graph":
                v = rs[0]["ours_tok_s"]
            else:
                m = [r for r in rs if r["peer"] == name]
                v = m[0]["peer_tok_s"] if m else ""
            ys.append(float(v) if v != "" else 0.0)
        ax.bar([x - 0.4 + (k + 0.5) * w for x in range(len(cases))], ys, w, label=name)
    for x, c in enumerate(cases):
        f = float([r for r in rows if r["case"] == c][0]["floor_tok_s"])
        ax.plot([x - 0.45, x + 0.45], [f, f], "k--", lw=1.2, label="floor (bytes / 4.3 TB/s)" if x == 0 else None)
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases)
    ax.set_ylabel("decode tokens/s (batch x steps / s)")
    ax.set_title(f"Llama-3.2-1B shape decode, bf16, on {env.get('gpu', '')} (torch {env.get('torch', '')}, "
                 f"{env.get('git_commit', '')})", fontsize=9)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows: List[Dict[str, object]]) -> str:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cols = ["flashcpp_graph", "flashcpp_eager", "torch_eager", "torch_compile", "torch_graph",
            "torch_compile_graph"]
    lines = [f"{'case':12s} {'floor':>7s} " + " ".join(f"{c:>19s}" for c in cols) + "  vs best torch  bar"]
    for c in cases:
        rs = [r for r in rows if r["case"] == c]
        vals = {"flashcpp_graph": rs[0]["ours_tok_s"], **{r["peer"]: r["peer_tok_s"] for r in rs}}
        lines.append(f"{c:12s} {rs[0]['floor_tok_s']!s:>7s} " + " ".join(f"{vals.get(k, '')!s:>19s}" for k in cols)
                     + f"  {rs[0]['ours_vs_best_torch']!s:>13s}  {rs[0]['meets_bar']}")
    return "\n".join(lines) + "\n(tokens/s, decode only; medians)"


def run(quick: bool, out: str, flashcpp_bin: Optional[str] = "build/flashcpp", model_dir: str = "/tmp/llama1b",
        steps: Optional[int] = None, repeats: Optional[int] = None, modes: Sequence[str] = TORCH_MODES,
        device: str = "cuda", skip_speed: bool = False, skip_correctness: bool = False,
        shape: Optional[dict] = None, cases: Optional[str] = None,
        isolate: Sequence[str] = ("torch_compile_graph",)) -> int:
    import torch

    from .engine_model import Llama

    t_start = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    errors: List[str] = []
    if device == "cuda":
        from .common import ceilings, environment
        env = environment()
        if not os.environ.get("FLASHCPP_BENCH_CHILD"):  # a child's parent has measured them
            env.update(ceilings())
    else:
        from .common import git_commit
        env = {"gpu": "cpu", "torch": torch.__version__, "git_commit": git_commit()}
    env["device"], env["backend"] = env.get("gpu"), device
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        env["transformers"] = "missing"
    binary = flashcpp_bin
    if binary and not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        errors.append(f"flashcpp binary {binary!r} not found or not executable: flashcpp rows skipped")
        progress(f"[bench engine] {errors[-1]}")
        binary = None
    elif binary:
        binary = os.path.abspath(binary)
    env["flashcpp_bin"] = binary or ""
    if not has_checkpoint(model_dir):
        make_checkpoint(model_dir, device=device, shape=shape)
    env["model_dir"] = model_dir
    progress(f"[bench engine] {env}")
    model = Llama.from_pretrained(model_dir, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    workdir = tempfile.mkdtemp(prefix="flashcpp_engine_")
    status = 0
    summary = ""
    if not skip_correctness:
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                rep = correctness(model, model_dir, binary, workdir, device, env)
            write_json(os.path.join(out, "correctness_report.json"), rep)
            bad = [c["name"] for c in rep["cases"] if not c["pass"]]
            summary = (f"correctness: {len(rep['cases']) - len(bad)}/{len(rep['cases'])} cases pass"
                       + (f" (FAIL: {', '.join(bad)})" if bad else "") + f", tolerance {rep['setup']['tolerance']}")
            if bad:
                status = 1
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            errors.append(f"correctness: {e}")
            status = 1
        progress(f"[bench engine] correctness took {time.perf_counter() - t0:.0f} s")
        if device == "cuda":
            torch.cuda.empty_cache()
    rows: List[Dict[str, object]] = []
    if quick and isolate:  # the quick subset skips the modes that need a process of their own
        modes = [m for m in modes if m not in isolate]
        isolate = ()
    if not skip_speed:
        with torch.no_grad():
            rows = speed(model, binary, model_dir, workdir, cases_for(quick, cases), steps or (32 if quick else 128),
                         repeats or 3, modes, device, env, errors, isolate=isolate)
        write_csv(os.path.join(out, "benchmark.csv"), rows)
        trace = None
        if binary and device == "cuda":
            try:  # where the batch-1 step's time goes in the graph itself (needs a CUPTI build)
                trace = trace_step(binary, model_dir, out, workdir)
                progress(f"[bench engine] trace b1 ctx512: wall {trace['wall_us_per_step']:.1f} us/step = busy "
                         f"{trace['busy_us_per_step']:.1f} + launch gaps {trace['gap_us_per_step']:.1f}")
            except Exception as e:  # noqa: BLE001 -- the trace is extra evidence, not a benchmark row
                trace = {"error": str(e)[:300]}
                progress(f"[bench engine] trace skipped: {trace['error']}")
        env_out = dict(env, errors=errors, total_seconds=round(time.perf_counter() - t_start, 1))
        if trace is not None:
            env_out["trace_b1_ctx512"] = trace
        write_json(os.path.join(out, "benchmark_env.json"), env_out)
        if rows:
            try:
                import matplotlib  # noqa: F401
            except ImportError:  # the CSV and JSON are the measurement; the plot is a view of them
                progress("[bench engine] benchmark.png not drawn: matplotlib is not installed (pip install matplotlib)")
            else:
                plot(rows, os.path.join(out, "benchmark.png"), env)
    if errors:
        status = 1
        progress("[bench engine] errors:\n  " + "\n  ".join(errors))
    progress(f"[bench engine] wrote {out}/ in {time.perf_counter() - t_start:.0f} s")
    if summary:
        progress(summary)
    if rows:
        progress(table(rows))
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench.engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flashcpp-bin", default="build/flashcpp")
    ap.add_argument("--model-dir", default="/tmp/llama1b")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="reports/engine")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per measurement (128; 32 quick)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (3)")
    ap.add_argument("--modes", default=",".join(TORCH_MODES), help="PyTorch modes to time")
    ap.add_argument("--cases", default=None, help="batch x context list, e.g. 1x512,1x16384,8x512,32x512")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--isolate", default="torch_compile_graph",
                    help="PyTorch modes timed in a child process of their own ('' for none)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = ap.parse_args(argv)
    return run(a.quick, a.out, a.flashcpp_bin, a.model_dir, a.steps, a.repeats,
               [m for m in a.modes.split(",") if m], device=a.device, skip_speed=a.skip_speed,
               skip_correctness=a.skip_correctness, cases=a.cases,
               isolate=[m for m in a.isolate.split(",") if m])


if __name__ == "__main__":
    sys.exit(main())
