"""flashcpp inside Hugging Face transformers (issue [integrations]): greedy tokens, logits and
generate time against transformers' own attention, one small random model per architecture.

    python -m flashcpp.bench.hf_generate --out reports/integrations [--device cuda] [--quick]

For each architecture (Llama, Mistral with a sliding window, Qwen2 with q/k/v bias, Gemma-2 with
logit softcap and sliding window, Phi-3 at head_dim 96), a random bf16 model (fp32 on the CPU) runs a
left-padded batch of 2 through `attn_implementation="fcpp"` (after
`flashcpp.integrations.transformers.register()`) and through the reference (`sdpa`; `eager` for
Gemma-2, whose softcap sdpa does not take):

  - forward logits of the real tokens: max |difference|;
  - NEW greedy tokens (prefill through varlen, then decode steps through the KV cache): equal, or the
    first difference with the reference's top-2 margin there; a difference is a near-tie when that
    margin is at most twice the logit difference between the two implementations at that step;
  - time, each implementation on the same model, interleaved, median of REPS after a warm-up: the
    padded generate of exactly NEW tokens (EOS suppressed, so a near-tie cannot shorten one side's run;
    fcpp_s, ref_s, speedup = ref_s / fcpp_s, and speedup_lo / speedup_hi, the lowest and highest
    ratio of the repeats: how far one run resolves it), its prefill alone (one forward
    over the padded prompt: prefill_fcpp_ms, prefill_ref_ms, prefill_speedup) and generate on an
    unpadded batch of the same size (nopad_fcpp_s, nopad_ref_s, nopad_speedup), whose layers take
    the plain paths (no mask) where the padded ones pack the prompt and page the cache.

Writes hf_generate.csv (one row per architecture: arch, device, dtype, reference, tokens_equal,
first_diff, near_tie, max_abs_dlogit, max_abs_logit, the times and speedups above, error) and
prints one line per architecture. Exit status 1 when a greedy sequence differs at a step that is
not a near-tie, 2 for bad arguments or a missing device.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Tuple

NEW = 24
REPS = 5


def _archs(transformers, quick: bool) -> Dict[str, Any]:
    common = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.15)
    archs = {
        "llama": (transformers.LlamaForCausalLM, lambda: transformers.LlamaConfig(head_dim=64, **common)),
        "mistral": (transformers.MistralForCausalLM,
                    lambda: transformers.MistralConfig(head_dim=64, sliding_window=7, **common)),
        "qwen2": (transformers.Qwen2ForCausalLM, lambda: transformers.Qwen2Config(**common)),
        "gemma2": (transformers.Gemma2ForCausalLM, lambda: transformers.Gemma2Config(
            head_dim=64, query_pre_attn_scalar=64, sliding_window=7, attn_logit_softcapping=20.0,
            final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"], **common)),
        "phi3": (transformers.Phi3ForCausalLM, lambda: transformers.Phi3Config(
            **dict(common, hidden_size=384, num_attention_heads=4, num_key_value_heads=2))),  # head_dim 96
    }
    return {k: archs[k] for k in (("llama", "gemma2") if quick else archs)}


def _run_arch(torch, name: str, cls, cfg, impl: str, ref: str, dev: str, dt, ids, mask, ids_nopad) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation=ref, dtype=dt).to(dev).eval()
    out: Dict[str, Any] = {}
    n = ids.shape[1]
    ones = torch.ones_like(mask)

    def generate(i, m):  # timed: exactly NEW steps for both (EOS would end a run whose tokens diverged sooner)
        return model.generate(input_ids=i, attention_mask=m, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=0)

    runs = {"generate": lambda: generate(ids, mask), "prefill": lambda: model(input_ids=ids, attention_mask=mask),
            "nopad": lambda: generate(ids_nopad, ones)}
    for which in (ref, impl):  # the checks, which also warm every path up
        model.set_attn_implementation(which)
        with torch.no_grad():
            lg = model(input_ids=ids, attention_mask=mask).logits[mask.bool()].float()
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            runs["nopad"]()
        out[which] = (lg, gen.sequences[:, n:], torch.stack(gen.scores, 1).float())
    times: Dict[Any, List[float]] = {(w, r): [] for w in (ref, impl) for r in runs}
    for _ in range(REPS):  # interleaved: each repeat times both implementations
        for which in (ref, impl):
            model.set_attn_implementation(which)
            with torch.no_grad():
                for what, run in runs.items():
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    run()
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    times[which, what].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    (lr, tr, sr), (lo, to, so) = out[ref], out[impl]
    dlogit = (lo - lr).abs().max().item()
    equal, first_diff, near_tie = _compare_tokens(torch, tr, sr, to, so, dlogit)
    row = {"arch": name, "reference": ref, "max_abs_dlogit": dlogit, "max_abs_logit": lr.abs().max().item(),
           "tokens_equal": equal, "first_diff": first_diff, "near_tie": near_tie,
           "fcpp_s": round(med[impl, "generate"], 4), "ref_s": round(med[ref, "generate"], 4),
           "speedup": round(med[ref, "generate"] / med[impl, "generate"], 3),
           # the spread of the repeats' own ratios (each repeat times both back to back): how far one
           # run resolves the speedup on this host
           "speedup_lo": round(min(r / i for r, i in zip(times[ref, "generate"], times[impl, "generate"])), 3),
           "speedup_hi": round(max(r / i for r, i in zip(times[ref, "generate"], times[impl, "generate"])), 3),
           "prefill_fcpp_ms": round(med[impl, "prefill"] * 1e3, 3), "prefill_ref_ms": round(med[ref, "prefill"] * 1e3, 3),
           "prefill_speedup": round(med[ref, "prefill"] / med[impl, "prefill"], 3),
           "nopad_fcpp_s": round(med[impl, "nopad"], 4), "nopad_ref_s": round(med[ref, "nopad"], 4),
           "nopad_speedup": round(med[ref, "nopad"] / med[impl, "nopad"], 3), "error": ""}
    return row


def _compare_tokens(torch, tr, sr, to, so, dlogit: float) -> Tuple[bool, str, Any]:
    """(equal, first difference, near tie) of two greedy generations: tokens (batch, steps) and scores
    (batch, steps, vocab) of the reference and of flashcpp. Once a row's tokens differ, the two runs
    may stop at EOS after different numbers of steps, so the steps are compared over the shorter run.
    A difference is a near tie when the reference's top-2 margin there is within twice the logit
    difference (over the prefill, or at that step, where both runs have read the same tokens)."""
    steps = min(tr.shape[1], to.shape[1])
    if tr.shape == to.shape and torch.equal(tr, to):
        return True, "", ""
    diff = (tr[:, :steps] != to[:, :steps]).nonzero()
    if len(diff) == 0:  # equal tokens cannot stop apart; said rather than assumed
        return False, f"the same first {steps} steps, then {tr.shape[1]} vs {to.shape[1]} steps", False
    b, step = [int(x) for x in diff[0]]
    top2 = sr[b, step].topk(2).values
    margin = (top2[0] - top2[1]).item()
    step_diff = (so[b, step] - sr[b, step]).abs().max().item()  # the same prefix up to this step
    where = f"row {b} step {step}: top-2 margin {margin:.3e}, logit difference {step_diff:.3e}"
    if tr.shape[1] != to.shape[1]:
        where += f"; then {tr.shape[1]} vs {to.shape[1]} steps (EOS)"
    return False, where, margin <= 2 * max(dlogit, step_diff)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench.hf_generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for hf_generate.csv")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="Llama and Gemma-2 only")
    args = ap.parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"python -m flashcpp.bench.hf_generate: needs torch and transformers ({e}).", file=sys.stderr)
        return 2
    import flashcpp
    import flashcpp.integrations.transformers as fcpp_hf
    if args.device == "cuda" and not (torch.cuda.is_available() and flashcpp.WITH_CUDA):
        print("python -m flashcpp.bench.hf_generate: --device cuda needs a CUDA device and a CUDA build of flashcpp.",
              file=sys.stderr)
        return 2
    from .common import write_csv
    dev = args.device
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    impl = fcpp_hf.register()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    ids[1, :5] = 0
    ids_nopad = torch.randint(3, 128, (2, 16), generator=g)
    ids, mask, ids_nopad = ids.to(dev), mask.to(dev), ids_nopad.to(dev)
    rows: List[Dict[str, Any]] = []
    bad = 0
    for name, (cls, make_cfg) in _archs(transformers, args.quick).items():
        ref = "eager" if name == "gemma2" else "sdpa"
        try:
            row = _run_arch(torch, name, cls, make_cfg(), impl, ref, dev, dt, ids, mask, ids_nopad)
        except Exception as e:  # a refusal (e.g. a head dim the CUDA decode kernels do not take) is reported
            row = {"arch": name, "reference": ref, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        row.update(device=dev, dtype="bf16" if dt == torch.bfloat16 else "fp32")
        rows.append(row)
        if row["error"]:
            print(f"{name:8s} {dev}: not run: {row['error']}", flush=True)
            continue
        bad += 0 if row["tokens_equal"] or row["near_tie"] else 1
        print(f"{name:8s} {dev} {row['dtype']}: max|dlogit| {row['max_abs_dlogit']:.3e} (max|logit| "
              f"{row['max_abs_logit']:.2f}); greedy {NEW} tokens x 2 rows equal to {ref}: {row['tokens_equal']}"
              f"{' (' + row['first_diff'] + (', near-tie' if row['near_tie'] else ', NOT a tie') + ')' if row['first_diff'] else ''}"
              f"; generate {row['fcpp_s'] * 1e3:.1f} ms vs {ref} {row['ref_s'] * 1e3:.1f} ms ({row['speedup']:.2f}x)"
              f", its prefill {row['prefill_fcpp_ms']:.2f} vs {row['prefill_ref_ms']:.2f} ms ({row['prefill_speedup']:.2f}x)"
              f", unpadded {row['nopad_fcpp_s'] * 1e3:.1f} vs {row['nopad_ref_s'] * 1e3:.1f} ms "
              f"({row['nopad_speedup']:.2f}x)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, "hf_generate.csv"), rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
