"""Training check (issue 28, the backward): train one small GPT-style model twice from the same
seeds and the same data order, once with ``flashcpp.flash_attn_func`` as its attention and once
with ``torch.nn.functional.scaled_dot_product_attention``, and compare the loss curves.

    python -m flashcpp.bench.train_check --out DIR [--device cpu|cuda] [--dtype bf16|fp32]
        [--steps N] [--layers L --d-model D --heads H --seq S --batch B] [--vocab V] [--lr LR]
        [--seed S] [--untied] [--deterministic] [--bound-factor K] [--threads T] [--quick]

Defaults are the issue's GPU configuration (6 layers, d_model 512, 8 heads, sequence 1024,
batch 8, 300 steps, bf16 on CUDA); ``--quick`` is a tiny CPU-sized model (2 layers, d_model 64,
4 heads, sequence 32, batch 4, 30 steps) in fp32.

The model (plain torch modules, written here): token and learned position embeddings, L pre-norm
blocks (LayerNorm, causal multi-head attention with one fused qkv projection and an output
projection, LayerNorm, a 4x GELU MLP), a final LayerNorm and a language-model head tied to the
token embedding (``--untied``: its own weight). No dropout. The only difference between the runs
is the attention call: flashcpp takes (batch, seq, heads, head_dim) and SDPA (batch, heads, seq,
head_dim); both get views of the same qkv projection (``transpose``, no copy for flashcpp), with
``causal=True`` / ``is_causal=True`` (seqlen_q == seqlen_k, so flashcpp's bottom-right causal
alignment equals SDPA's top-left one).

The task (fixed, learnable, needs attention): each sequence is a first half drawn from a fixed
random first-order Markov chain over the vocabulary (each token has 4 successors with
Dirichlet-drawn probabilities; the chain comes from a seeded generator) followed by an exact
copy of that first half. Next-token loss on the first half can fall to the chain's entropy rate
by learning bigrams; on the second half only attention (an induction-style lookup of the
position S/2 back) takes it towards zero. Batch t is drawn from its own generator seeded with
(seed, t), so every run sees the same batches in the same order. The initial weights are made once
(seeded) and loaded into every run; AdamW (betas 0.9/0.95, weight decay 0.1, a short linear
warm-up then constant), gradient clipping at 1.0. ``--dtype bf16`` is mixed precision as it is
trained in practice: fp32 weights and optimizer, ``torch.autocast`` to bf16 (so q, k, v reach the
attention in bf16); ``--dtype fp32`` runs everything in fp32.

The agreement bound. Two correct implementations of attention do not give bitwise-equal losses:
their outputs and gradients differ by rounding, and training amplifies that difference step after
step (each update moves the weights a little differently, the next batch sees other weights). How
far two correct runs drift apart is a property of the model, the dtype and the step count, not of
flashcpp, so the bound is measured, not assumed: a third run, the *noise run*, trains the same
model on the same data with SDPA again but with a different, equally correct order of
computation: the reference SDPA run is pinned to SDPA's FLASH_ATTENTION backend (torch's fused
kernel, on the CPU and on CUDA) and the noise run to its MATH backend. The noise run differs from the
reference run exactly as flashcpp should: in rounding only. With noise = max_t |L_sdpa(t) -
L_noise(t)| the check passes when

    max_t |L_flashcpp(t) - L_sdpa(t)| <= K * max(noise, floor),   K = 4 (--bound-factor)

and every loss is finite. K covers that the two differences grow from different perturbations:
measured on the CPU at the --quick configuration, max|flashcpp - SDPA| / max|SDPA - noise| was
0.7 to 1.2 in bf16 (4 seeds, 100 steps) and 1 to 3 in fp32 (8 seeds, 30 steps), where both
differences are 1 to 4 ulps of the loss. The floor (1e-6 of the initial loss in fp32, about 15
ulps of it; 2e-4 in bf16, a twentieth of bf16's unit roundoff 2^-8) keeps the bound from
collapsing where the two SDPA orders happen to round alike. At the --quick sizes the floor sets the
fp32 bound (the JSON says so: floor_used) and the measured noise sets the bf16 one (1.5e-3 to
2.1e-3 over 100 steps, against a floor of 7e-4). We chose a different computation order over a perturbed seed: two
seeds give runs that differ by far more than rounding (the SDPA curves of seeds 0 and 1 end 0.22
apart after 30 steps), a bound so loose that a wrong gradient could pass; a reordering perturbs
at the rounding level, the scale at which flashcpp and SDPA are supposed to differ. A wrong
attention moves the loss by orders of magnitude more: flashcpp without its causal mask is 0.08
off SDPA within 10 steps, 6000 times the fp32 bound (the tests check that it is caught). In fp32
the largest relative difference measured on the CPU is 1.2e-7 to 4.4e-7 over 30 to 200 steps,
far under the 1e-4 the issue expects; in bf16 it is 0.9e-3 to 1.5e-3 over 100 steps.

Outputs in ``--out``: ``losses.csv`` (step, loss_flashcpp, loss_sdpa, abs_diff, and loss_noise,
noise_diff), ``train_check.json`` (the configuration, max |diff|, the max over the last 10% of
steps, relative figures, the noise, the bound and how it was formed, pass/fail, the git commit from
FLASHCPP_GIT_COMMIT or git, torch's version, the device) and ``train_check.png`` when matplotlib
imports (the JSON says when it was not drawn). Exit status: 0 when the curves agree, 1 when they do
not, 2 (one sentence on stderr, nothing written) for bad arguments or when the device or the
backward is not available, such as CUDA tensors before the CUDA backward kernels exist.

torch and flashcpp are imported inside the functions: this module imports without them.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

PROG = "python -m flashcpp.bench.train_check"
FULL = dict(layers=6, d_model=512, heads=8, seq=1024, batch=8, steps=300, vocab=256)
QUICK = dict(layers=2, d_model=64, heads=4, seq=32, batch=4, steps=30, vocab=32)
#: Floor of the noise, relative to the initial loss (see the module docstring).
NOISE_FLOOR_REL = {"fp32": 1e-6, "bf16": 2e-4}
BOUND_FACTOR = 4.0
SUCCESSORS = 4


class Unavailable(Exception):
    """The device, the dtype or the backward cannot run here (exit status 2, one sentence)."""


def git_commit() -> str:
    env = os.environ.get("FLASHCPP_GIT_COMMIT")
    if env:
        return env
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.check_output(["git", "rev-parse", "--short=12", "HEAD"], cwd=here,
                                       stderr=subprocess.DEVNULL).decode().strip()
    except Exception:
        return "unknown"


# ---- the model --------------------------------------------------------------------------------

def flashcpp_attention(q, k, v, causal: bool = True):
    """q, k, v: (B, S, H, D) views; flashcpp's layout, no copy."""
    import flashcpp
    return flashcpp.flash_attn_func(q, k, v, causal=causal)


def sdpa_attention(q, k, v, causal: bool = True):
    """SDPA takes (B, H, S, D): transposed views in, the output transposed back."""
    import torch.nn.functional as F
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return o.transpose(1, 2)


def build_model(cfg: Dict[str, Any], attention: Callable):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg["d_model"]
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x):
            B, S, d = x.shape
            H = cfg["heads"]
            qkv = self.qkv(self.ln1(x)).view(B, S, 3, H, d // H)
            o = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
            x = x + self.proj(o.reshape(B, S, d))
            return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            d, V = cfg["d_model"], cfg["vocab"]
            self.tok = nn.Embedding(V, d)
            self.pos = nn.Embedding(cfg["seq"], d)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, V, bias=False)
            if not cfg["untied"]:
                self.head.weight = self.tok.weight

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln_f(x))

    return GPT()


def init_state(cfg: Dict[str, Any]):
    """The initial weights, made once from the seed (GPT-2's init: normal 0.02, residual
    projections scaled by 1/sqrt(2 layers), zero biases)."""
    import torch
    model = build_model(cfg, sdpa_attention)
    g = torch.Generator().manual_seed(cfg["seed"])
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * cfg["layers"]) if name.endswith(("proj.weight", "out.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return {k: v.clone() for k, v in model.state_dict().items()}


# ---- the task ---------------------------------------------------------------------------------

def markov_chain(vocab: int, seed: int):
    """A fixed random first-order chain: each token has SUCCESSORS successors, Dirichlet(1) weights."""
    import torch
    g = torch.Generator().manual_seed(seed * 7919 + 1)
    probs = torch.zeros(vocab, vocab, dtype=torch.float64)
    for a in range(vocab):
        succ = torch.randperm(vocab, generator=g)[:SUCCESSORS]
        w = -torch.log(torch.rand(SUCCESSORS, generator=g, dtype=torch.float64))  # Dirichlet(1)
        probs[a, succ] = w / w.sum()
    return probs


def batch_at(step: int, cfg: Dict[str, Any], chain):
    """Batch `step` (B, S+1 tokens): a Markov first half and its copy; its own generator, so every
    run sees the same batches in the same order."""
    import torch
    B, S = cfg["batch"], cfg["seq"] + 1
    half = (S + 1) // 2
    g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + step + 17)
    toks = torch.empty(B, half, dtype=torch.long)
    toks[:, 0] = torch.randint(0, cfg["vocab"], (B,), generator=g)
    for t in range(1, half):
        toks[:, t] = torch.multinomial(chain[toks[:, t - 1]], 1, generator=g).squeeze(1)
    return torch.cat([toks, toks], dim=1)[:, :S]


# ---- training ---------------------------------------------------------------------------------

def train(cfg: Dict[str, Any], attention: Callable, state, batches, sdpa_backend=None,
          stop_after: Optional[int] = None) -> List[float]:
    """Losses per step of one run (the same initial state, batches and optimizer for every run).
    sdpa_backend: a torch.nn.attention.SDPBackend to pin for the whole run (None: torch's choice);
    stop_after: run only the first steps of the same schedule."""
    import contextlib
    import torch
    import torch.nn.functional as F

    dev = torch.device(cfg["device"])
    model = build_model(cfg, attention).to(dev)
    model.load_state_dict(state)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg["lr"], betas=(0.9, 0.95), eps=1e-8, foreach=False)
    warmup = max(1, cfg["steps"] // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    amp = (torch.autocast(dev.type, dtype=torch.bfloat16) if cfg["dtype"] == "bf16" else contextlib.nullcontext())
    if sdpa_backend is not None:
        from torch.nn.attention import sdpa_kernel
        pin = sdpa_kernel(sdpa_backend)
    else:
        pin = contextlib.nullcontext()
    losses = []
    with pin:
        for step in range(cfg["steps"] if stop_after is None else min(stop_after, cfg["steps"])):
            tokens = batches[step].to(dev)
            with amp:
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, cfg["vocab"]), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
            opt.step()
            sched.step()
            losses.append(float(loss.item()))
    return losses


def noise_backends(device: str):
    """(reference SDPA backend, noise-run SDPA backend): two correct computation orders."""
    from torch.nn.attention import SDPBackend
    return SDPBackend.FLASH_ATTENTION, SDPBackend.MATH  # torch has a fused flash kernel on CPU and CUDA


def probe(cfg: Dict[str, Any]) -> None:
    """A forward and a backward of flashcpp's attention on the run's device and dtype; raises
    Unavailable with one sentence when they cannot run here."""
    import torch
    dev = cfg["device"]
    if dev == "cuda":
        if not torch.cuda.is_available():
            raise Unavailable("--device cuda needs an NVIDIA GPU and a CUDA build of torch, and none was found")
        import flashcpp
        if not flashcpp.WITH_CUDA:
            raise Unavailable("this flashcpp build has no CUDA kernels (built with FLASHCPP_CUDA=OFF)")
    dtype = torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32
    hd = cfg["d_model"] // cfg["heads"]
    q = torch.randn(1, 8, cfg["heads"], hd, device=dev, dtype=dtype, requires_grad=True)
    try:
        flashcpp_attention(q, q, q).float().sum().backward()
        if dev == "cuda":
            torch.cuda.synchronize()
    except NotImplementedError as e:
        msg = str(e).strip().rstrip(".").split("\n")[0]
        raise Unavailable(f"flashcpp's attention backward cannot run on {dev} in {cfg['dtype']} in this build: {msg}")
    except (RuntimeError, ValueError, TypeError) as e:
        msg = str(e).strip().rstrip(".").split("\n")[0]
        raise Unavailable(f"flashcpp's attention cannot run on {dev} in {cfg['dtype']}: {msg}")


def compare(flash: Sequence[float], sdpa: Sequence[float], noise: Sequence[float], dtype: str,
            factor: float = BOUND_FACTOR) -> Dict[str, Any]:
    """The verdict from the three curves (see the module docstring for the rule)."""
    n = len(sdpa)
    diff = [abs(a - b) for a, b in zip(flash, sdpa)]
    ndiff = [abs(a - b) for a, b in zip(sdpa, noise)]
    rel = [d / abs(b) if b else math.inf for d, b in zip(diff, sdpa)]
    tail = max(1, int(math.ceil(n * 0.1)))
    finite = all(math.isfinite(x) for x in list(flash) + list(sdpa) + list(noise))
    noise_max = max(ndiff) if finite else math.nan
    floor = NOISE_FLOOR_REL[dtype] * abs(sdpa[0])
    bound = factor * max(noise_max, floor) if finite else math.nan
    max_diff = max(diff) if finite else math.nan
    ok = finite and max_diff <= bound
    return {
        "steps": n,
        "max_abs_diff": max_diff,
        "argmax_step": int(max(range(n), key=lambda i: diff[i])) if finite else None,
        "last10pct_steps": tail,
        "last10pct_max_abs_diff": max(diff[-tail:]) if finite else math.nan,
        "last10pct_mean_abs_diff": sum(diff[-tail:]) / tail if finite else math.nan,
        "max_rel_diff": max(rel) if finite else math.nan,
        "last10pct_max_rel_diff": max(rel[-tail:]) if finite else math.nan,
        "noise_max_abs_diff": noise_max,
        "noise_last10pct_max_abs_diff": max(ndiff[-tail:]) if finite else math.nan,
        "noise_floor": floor,
        "floor_used": bool(finite and floor > noise_max),
        "bound_factor": factor,
        "bound": bound,
        "bound_rule": (f"max_t |L_flashcpp - L_sdpa| <= {factor:g} * max(max_t |L_sdpa - L_noise|, "
                       f"{NOISE_FLOOR_REL[dtype]:g} * L_sdpa(0)); L_noise: SDPA with another backend (another "
                       f"computation order)"),
        "ratio_to_noise": (max_diff / max(noise_max, floor)) if finite and max(noise_max, floor) > 0 else None,
        "ratio_to_measured_noise": (max_diff / noise_max) if finite and noise_max > 0 else None,
        "all_finite": finite,
        "loss_first": sdpa[0],
        "loss_last": {"flashcpp": flash[-1], "sdpa": sdpa[-1], "noise": noise[-1]},
        "loss_decreased": bool(finite and sdpa[-1] < sdpa[0] and flash[-1] < flash[0]),
        "pass": bool(ok),
    }


def write_outputs(out: str, cfg: Dict[str, Any], flash, sdpa, noise, summary: Dict[str, Any]) -> Dict[str, Any]:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "losses.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss_flashcpp", "loss_sdpa", "abs_diff", "loss_noise", "noise_diff"])
        for i, (a, b, c) in enumerate(zip(flash, sdpa, noise)):
            w.writerow([i, repr(a), repr(b), repr(abs(a - b)), repr(c), repr(abs(b - c))])
    plot = os.path.join(out, "train_check.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        summary["plot"] = None
        summary["plot_note"] = f"train_check.png not drawn: matplotlib does not import ({type(e).__name__})"
    else:
        fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
        steps = list(range(len(sdpa)))
        ax0.plot(steps, sdpa, label="SDPA", lw=1.6)
        ax0.plot(steps, flash, label="flashcpp", lw=1.0, ls="--")
        ax0.set_ylabel("training loss")
        ax0.legend()
        ax0.set_title(f"{cfg['layers']}L d{cfg['d_model']} {cfg['heads']}h seq {cfg['seq']} batch {cfg['batch']}, "
                      f"{cfg['dtype']} on {summary['device_name']}: {'PASS' if summary['pass'] else 'FAIL'}")
        eps = 1e-12
        ax1.semilogy(steps, [max(abs(a - b), eps) for a, b in zip(flash, sdpa)], label="|flashcpp - SDPA|")
        ax1.semilogy(steps, [max(abs(b - c), eps) for b, c in zip(sdpa, noise)],
                     label="|SDPA - SDPA other order| (noise)", alpha=0.8)
        ax1.axhline(summary["bound"], color="r", ls=":", label=f"bound ({summary['bound']:.2e})")
        ax1.set_xlabel("step")
        ax1.set_ylabel("|loss difference|")
        ax1.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        plt.close(fig)
        summary["plot"] = "train_check.png"
    with open(os.path.join(out, "train_check.json"), "w") as f:
        json.dump({k: v for k, v in summary.items() if k != "losses"}, f, indent=2, allow_nan=True)
        f.write("\n")
    return summary


def run_check(cfg: Dict[str, Any], out: Optional[str] = None, flash_attention: Optional[Callable] = None,
              log: Callable[[str], None] = lambda s: None) -> Dict[str, Any]:
    """The three runs and the verdict; writes the outputs when `out` is given. flash_attention
    replaces flashcpp's call (the tests pass a deliberately wrong one). Raises Unavailable."""
    import torch
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    probe(cfg)
    torch.manual_seed(cfg["seed"])
    state = init_state(cfg)
    chain = markov_chain(cfg["vocab"], cfg["seed"])
    batches = [batch_at(s, cfg, chain) for s in range(cfg["steps"])]
    ref_backend, noise_backend = noise_backends(cfg["device"])
    times = {}
    t0 = time.perf_counter()
    try:
        flash = train(cfg, flash_attention or flashcpp_attention, state, batches)
    except NotImplementedError as e:
        raise Unavailable(f"flashcpp's backward is not available on {cfg['device']}: {str(e).splitlines()[0].rstrip('.')}")
    times["flashcpp_s"] = time.perf_counter() - t0
    log(f"flashcpp: {times['flashcpp_s']:.1f} s, loss {flash[0]:.4f} -> {flash[-1]:.4f}")
    t0 = time.perf_counter()
    sdpa = train(cfg, sdpa_attention, state, batches, sdpa_backend=ref_backend)
    times["sdpa_s"] = time.perf_counter() - t0
    log(f"sdpa ({ref_backend.name}): {times['sdpa_s']:.1f} s, loss {sdpa[0]:.4f} -> {sdpa[-1]:.4f}")
    t0 = time.perf_counter()
    noise = train(cfg, sdpa_attention, state, batches, sdpa_backend=noise_backend)
    times["noise_s"] = time.perf_counter() - t0
    log(f"noise run, sdpa ({noise_backend.name}): {times['noise_s']:.1f} s, loss {noise[0]:.4f} -> {noise[-1]:.4f}")
    summary = compare(flash, sdpa, noise, cfg["dtype"], cfg.get("bound_factor", BOUND_FACTOR))
    summary.update({
        "config": {k: cfg[k] for k in sorted(cfg)},
        "sdpa_backend": ref_backend.name,
        "noise_sdpa_backend": noise_backend.name,
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "device": cfg["device"],
        "device_name": torch.cuda.get_device_name() if cfg["device"] == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "times_s": times,
    })
    try:
        import flashcpp
        summary["flashcpp"] = getattr(flashcpp, "__version__", "unknown")
    except Exception:  # noqa: BLE001
        pass
    summary["losses"] = {"flashcpp": flash, "sdpa": sdpa, "noise": noise}
    if out is not None:
        write_outputs(out, cfg, flash, sdpa, noise, summary)
    return summary


# ---- command line -----------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence, exit status 2
        print(f"{PROG}: {message.rstrip('.')}.", file=sys.stderr)
        raise SystemExit(2)


def parse(argv=None) -> Dict[str, Any]:
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (losses.csv, train_check.json, train_check.png)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda, cpu with --quick")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16, fp32 with --quick")
    ap.add_argument("--quick", action="store_true", help="the tiny CPU configuration (2L d64 4h seq 32 batch 4, 30 steps)")
    for name in ("steps", "layers", "d-model", "heads", "seq", "batch", "vocab"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None, help="AdamW's peak learning rate (default 1e-3, 3e-3 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--untied", action="store_true", help="an lm head of its own instead of the tied embedding")
    ap.add_argument("--deterministic", action="store_true", help="flashcpp's deterministic backward")
    ap.add_argument("--bound-factor", type=float, default=BOUND_FACTOR, help="K in the bound (default 4)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch's CPU threads (default torch's choice; 1 is faster on a busy machine, flashcpp's "
                         "CPU backend starts its own)")
    a = ap.parse_args(argv)
    base = QUICK if a.quick else FULL
    cfg: Dict[str, Any] = {k: base[k] for k in base}
    for k in ("steps", "layers", "d_model", "heads", "seq", "batch", "vocab"):
        v = getattr(a, k)
        if v is not None:
            cfg[k] = v
    cfg.update(device=a.device or ("cpu" if a.quick else "cuda"), dtype=a.dtype or ("fp32" if a.quick else "bf16"),
               lr=a.lr if a.lr is not None else (3e-3 if a.quick else 1e-3), seed=a.seed, untied=a.untied,
               deterministic=a.deterministic, bound_factor=a.bound_factor)
    if a.threads is not None:
        if a.threads < 1:
            ap.error(f"--threads must be at least 1, got {a.threads}")
        cfg["threads"] = a.threads
    for k in ("steps", "layers", "d_model", "heads", "seq", "batch"):
        if cfg[k] < 1:
            ap.error(f"--{k.replace('_', '-')} must be at least 1, got {cfg[k]}")
    if cfg["vocab"] < SUCCESSORS:
        ap.error(f"--vocab must be at least {SUCCESSORS}, got {cfg['vocab']}")
    if cfg["seq"] < 2:
        ap.error("--seq must be at least 2 (a first half and its copy)")
    if cfg["d_model"] % cfg["heads"]:
        ap.error(f"--d-model {cfg['d_model']} is not a multiple of --heads {cfg['heads']}")
    hd = cfg["d_model"] // cfg["heads"]
    if hd % 8 or not 8 <= hd <= 256:
        ap.error(f"the head dim d_model/heads = {hd} must be a multiple of 8 in [8, 256] (flashcpp's head dims)")
    if not (cfg["lr"] > 0 and math.isfinite(cfg["lr"])) or not (cfg["bound_factor"] > 0):
        ap.error("--lr and --bound-factor must be positive")
    return {"cfg": cfg, "out": a.out}


def main(argv=None) -> int:
    parsed = parse(argv)
    cfg, out = parsed["cfg"], parsed["out"]
    if cfg["deterministic"]:
        def attention(q, k, v, causal=True):
            import flashcpp
            return flashcpp.flash_attn_func(q, k, v, causal=causal, deterministic=True)
    else:
        attention = None
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"{PROG}: the training check needs torch, and it is not installed.", file=sys.stderr)
        return 2
    log = lambda s: print(f"[train_check] {s}", flush=True)  # noqa: E731
    log(f"{cfg['layers']}L d_model {cfg['d_model']} {cfg['heads']} heads seq {cfg['seq']} batch {cfg['batch']} "
        f"vocab {cfg['vocab']}, {cfg['steps']} steps, {cfg['dtype']} on {cfg['device']}")
    try:
        s = run_check(cfg, out=out, flash_attention=attention, log=log)
    except Unavailable as e:
        print(f"{PROG}: {str(e).rstrip('.')}.", file=sys.stderr)
        return 2
    log(f"max |flashcpp - sdpa| {s['max_abs_diff']:.3e} (step {s['argmax_step']}), last 10% {s['last10pct_max_abs_diff']:.3e}, "
        f"max rel {s['max_rel_diff']:.3e}; noise {s['noise_max_abs_diff']:.3e}; bound {s['bound']:.3e}: "
        f"{'PASS' if s['pass'] else 'FAIL'}")
    log(f"wrote {out}/losses.csv, train_check.json, " + (s["plot"] if s.get("plot") else s.get("plot_note", "")))
    return 0 if s["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
