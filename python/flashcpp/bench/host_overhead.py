"""Eager host overhead of flashcpp's calls and their peers (issue 32, [integrations]).

    python -m flashcpp.bench.host_overhead --out DIR [--device cuda|cpu] [--quick]
                                           [--calls N] [--repeats R] [--tiny]

For each of flash_attn_func, flash_attn_with_kvcache, rms_norm, fused_add_rms_norm, silu_and_mul
and apply_rotary on small shapes (and the issue's 4096 x 2048 bf16 for the norms and SwiGLU), one
plain eager call is timed back to back, N calls per loop, nothing synchronized inside the loop:

  host_us    wall time (time.perf_counter) of the loop / N: the rate at which the host enqueues
             calls; on CUDA the kernels run behind it, so this is the host's cost per call as long
             as the launch queue does not fill (N is kept small: 100, --quick 50).
  cpu_us     this thread's CPU time (time.thread_time) over the same loop / N.
  loop_us    CUDA events around the same loop / N, read after a sync: what back-to-back eager calls
             achieve, max(host, kernel) roughly.
  kernel_us  the kernel time per call: CUDA events around replays of a CUDA graph that holds 20
             calls (kernel_method "graph"; the inputs stay in L2 where they fit), or loop_us
             where the call could not be captured (kernel_method "events", an upper bound).

Implementations are interleaved (each repeat runs flashcpp and every peer in a rotated order),
after a warm-up; every figure is the median over the repeats (7, --quick 3). The garbage
collector is off inside the timed loops. `path` says whether flashcpp's call took its eager fast
path ("fast": no Python-side Meta was built) or the general path.

Peers, where they import: torch SDPA (and flash_attn's functions, FlashInfer's single prefill /
decode) for the attention calls; torch.nn.functional.rms_norm, x + residual then rms_norm,
F.silu(g) * u and Hugging Face's rotate_half rotary (precomputed cos/sin) for the fused ops;
quack's rmsnorm and FlashInfer's rmsnorm / fused_add_rmsnorm / silu_and_mul / apply_rope_pos_ids.
Each peer runs the same work in its own native layout, made outside the loop. One CSV row per
(call, shape, peer); flashcpp's figures repeat on each row of a case (one measurement).

--device cpu (CI, machines without a GPU): the same loops on host tensors, with cpu_threads=1
where the call takes it (rms_norm, fused_add_rms_norm, silu_and_mul, apply_rotary) and
torch.set_num_threads(1) for the peers; host_us then includes the computation, kernel_us is
empty, and N is cut so that a loop takes about 20 ms (--quick 10). --tiny: test shapes.

Writes DIR/host_overhead.csv (call, shape, dtype, host_us, cpu_us, kernel_us, peer, peer_host_us,
peer_kernel_us, kernel_method, loop_us, peer_loop_us, peer_kernel_method, path) and
DIR/host_overhead_env.json (git commit from FLASHCPP_GIT_COMMIT or git, torch, device name,
calls, repeats, peers and why any was skipped). The goal of the issue: host_us <= 5 per plain
call on the H200.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

COLUMNS = ["call", "shape", "dtype", "host_us", "cpu_us", "kernel_us", "peer", "peer_host_us", "peer_kernel_us",
           "kernel_method", "loop_us", "peer_loop_us", "peer_kernel_method", "path"]
CALLS = ("flash_attn_func", "flash_attn_with_kvcache", "rms_norm", "fused_add_rms_norm", "silu_and_mul",
         "apply_rotary")
EPS = 1e-6
GRAPH_CALLS = 20     # calls captured in one CUDA graph
GRAPH_REPLAYS = 10   # replays timed per repeat


# ---- environment ----------------------------------------------------------------------------

def git_commit() -> str:
    """FLASHCPP_GIT_COMMIT, else HEAD of the flashcpp checkout this module (or the working
    directory) lies in: a repository whose top holds python/flashcpp (an installed copy in
    site-packages may sit inside some other repository), else "unknown"."""
    env = os.environ.get("FLASHCPP_GIT_COMMIT")
    if env:
        return env
    for where in (os.path.dirname(os.path.abspath(__file__)), os.getcwd()):
        try:
            top = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], cwd=where,
                                          stderr=subprocess.DEVNULL).decode().strip()
            if os.path.isfile(os.path.join(top, "python", "flashcpp", "__init__.py")):
                return subprocess.check_output(["git", "rev-parse", "--short=12", "HEAD"], cwd=top,
                                               stderr=subprocess.DEVNULL).decode().strip()
        except Exception:
            continue
    return "unknown"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(torch, cuda: bool) -> Dict[str, Any]:
    import flashcpp
    env: Dict[str, Any] = {
        "git_commit": git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "flashcpp_with_cuda": bool(getattr(flashcpp, "WITH_CUDA", False)),
        "flashcpp_file": getattr(flashcpp, "__file__", None),
        "device": "cuda" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name() if cuda else _cpu_name(),
        "host_cpu": _cpu_name(),
        "host_cores": os.cpu_count(),
    }
    if cuda:
        env["cuda_runtime"] = torch.version.cuda
        try:
            out = subprocess.check_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                          stderr=subprocess.DEVNULL)
            env["driver"] = out.decode().strip().splitlines()[0]
        except Exception:
            env["driver"] = "unknown"
    return env


# ---- peers ------------------------------------------------------------------------------------

def _import_peers(cuda: bool) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """({name: module or function}, {name: why not}) for quack, FlashInfer and flash_attn."""
    have: Dict[str, Any] = {}
    why: Dict[str, str] = {}
    if not cuda:
        for name in ("quack", "flashinfer", "flash_attn"):
            why[name] = "CUDA only (--device cpu)"
        return have, why
    try:  # quack's forward without autograd (what the project's anchor timed), else its rmsnorm
        try:
            from quack.rmsnorm import rmsnorm_fwd

            def quack_rms(x, w, residual=None, eps=EPS):
                return rmsnorm_fwd(x, w, residual=residual, eps=eps)
            quack_rms.__doc__ = "quack.rmsnorm.rmsnorm_fwd"
        except ImportError:
            from quack import rmsnorm

            def quack_rms(x, w, residual=None, eps=EPS):
                if residual is None:
                    return rmsnorm(x, w, eps=eps)
                return rmsnorm(x, w, residual=residual, eps=eps, prenorm=True)
            quack_rms.__doc__ = "quack.rmsnorm"
        have["quack"] = quack_rms
    except Exception as e:
        why["quack"] = f"does not import ({type(e).__name__}: {str(e)[:100]})"
    try:
        import flashinfer
        have["flashinfer"] = flashinfer
    except Exception as e:
        why["flashinfer"] = f"does not import ({type(e).__name__}: {str(e)[:100]})"
    try:
        import flash_attn
        have["flash_attn"] = flash_attn
    except Exception as e:
        why["flash_attn"] = f"does not import ({type(e).__name__}: {str(e)[:100]})"
    return have, why


# ---- cases ------------------------------------------------------------------------------------

class Case:
    def __init__(self, call: str, shape: str, dtype: str, ours: Callable[[], Any],
                 peers: Dict[str, Callable[[], Any]]):
        self.call, self.shape, self.dtype, self.ours, self.peers = call, shape, dtype, ours, peers


def _dims(t) -> str:
    return "x".join(str(n) for n in t)


def build_cases(torch, flashcpp, cuda: bool, tiny: bool, libs: Dict[str, Any]) -> List[Case]:
    """Every (call, shape) with flashcpp's plain call and its peers' callables."""
    import torch.nn.functional as F

    dev = "cuda" if cuda else "cpu"
    dt = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, dtype=dt):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    threads = {} if cuda else {"cpu_threads": 1}
    fi, fa, quack_rms = libs.get("flashinfer"), libs.get("flash_attn"), libs.get("quack")
    B, S, H, D = (1, 16, 2, 32) if tiny else (1, 128, 8, 128)
    cached = 64 if tiny else 1024
    rows_set = (4,) if tiny else (8, 4096)
    hidden = 64 if tiny else 2048
    cases: List[Case] = []

    # flash_attn_func: causal prefill, (B, S, H, D)
    q, k, v = rand(B, S, H, D), rand(B, S, H, D), rand(B, S, H, D)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    peers = {"torch_sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)}
    if fa is not None:
        peers["flash_attn"] = lambda: fa.flash_attn_func(q, k, v, causal=True)
    if fi is not None:
        q0, k0, v0 = q[0], k[0], v[0]
        peers["flashinfer"] = lambda: fi.single_prefill_with_kv_cache(q0, k0, v0, causal=True)
    cases.append(Case("flash_attn_func", _dims((B, S, H, D)) + " causal", "bf16",
                      lambda: flashcpp.flash_attn_func(q, k, v, causal=True), peers))

    # flash_attn_with_kvcache: one decode step of batch 1, H heads, `cached` keys in the cache
    qd = rand(B, 1, H, D)
    kc, vc = rand(B, cached, H, D), rand(B, cached, H, D)
    lens = torch.full((B,), cached, dtype=torch.int32, device=dev)
    qdt, kct, vct = (t.transpose(1, 2).contiguous() for t in (qd, kc, vc))
    peers = {"torch_sdpa": lambda: F.scaled_dot_product_attention(qdt, kct, vct)}
    if fa is not None:
        peers["flash_attn"] = lambda: fa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens)
    if fi is not None:
        qd0, kc0, vc0 = qd[0, 0], kc[0], vc[0]
        peers["flashinfer"] = lambda: fi.single_decode_with_kv_cache(qd0, kc0, vc0)
    cases.append(Case("flash_attn_with_kvcache", f"q {_dims((B, 1, H, D))} cache {cached}", "bf16",
                      lambda: flashcpp.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens), peers))

    for rows in rows_set:
        shape = _dims((rows, hidden))
        x, r, w = rand(rows, hidden), rand(rows, hidden), rand(hidden)
        # rms_norm
        peers = {"torch_rms_norm": lambda x=x, w=w: F.rms_norm(x, (hidden,), w, EPS)}
        if quack_rms is not None:
            peers["quack"] = lambda x=x, w=w: quack_rms(x, w, eps=EPS)
        if fi is not None:
            peers["flashinfer"] = lambda x=x, w=w: fi.rmsnorm(x, w, eps=EPS)
        cases.append(Case("rms_norm", shape, "bf16", lambda x=x, w=w: flashcpp.rms_norm(x, w, EPS, **threads), peers))

        # fused_add_rms_norm, in place as documented (x <- norm(x + r), r <- x + r)
        xa, ra = x.clone(), r.clone()

        def torch_add_norm(x=x, r=r, w=w):
            h = x + r
            return F.rms_norm(h, (hidden,), w, EPS), h

        peers = {"torch_add_rms_norm": torch_add_norm}
        if quack_rms is not None:
            peers["quack"] = lambda x=x, r=r, w=w: quack_rms(x, w, residual=r, eps=EPS)
        if fi is not None:
            xf, rf = x.clone(), r.clone()
            peers["flashinfer"] = lambda xf=xf, rf=rf, w=w: fi.fused_add_rmsnorm(xf, rf, w, eps=EPS)
        cases.append(Case("fused_add_rms_norm", shape, "bf16",
                          lambda xa=xa, ra=ra, w=w: flashcpp.fused_add_rms_norm(xa, ra, w, EPS, **threads), peers))

        # silu_and_mul: x (rows, hidden) = [gate | up], out (rows, hidden / 2)
        d = hidden // 2
        gate, up = x[:, :d].contiguous(), x[:, d:].contiguous()
        peers = {"torch_silu_mul": lambda gate=gate, up=up: F.silu(gate) * up}
        if fi is not None:
            peers["flashinfer"] = lambda x=x: fi.silu_and_mul(x)
        cases.append(Case("silu_and_mul", shape + " [gate|up]", "bf16",
                          lambda x=x: flashcpp.silu_and_mul(x, **threads), peers))

    # apply_rotary: q and k (B, S, H, D), neox over all of head_dim, positions 0..S-1
    qr, kr = rand(B, S, H, D), rand(B, S, H, D)
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=dev) / D)
    freqs = torch.arange(S, dtype=torch.float32, device=dev)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[None, :, None, :]
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)

    def rotate_half(t):
        return torch.cat([-t[..., D // 2:], t[..., : D // 2]], dim=-1)

    peers = {"torch_rotate_half": lambda: (qr * cos + rotate_half(qr) * sin, kr * cos + rotate_half(kr) * sin)}
    if fi is not None:
        q3, k3 = qr.view(B * S, H, D), kr.view(B * S, H, D)
        pos = torch.arange(B * S, dtype=torch.int32, device=dev)
        peers["flashinfer"] = lambda: fi.apply_rope_pos_ids(q3, k3, pos)
    cases.append(Case("apply_rotary", _dims((B, S, H, D)) + " q,k", "bf16",
                      lambda: flashcpp.apply_rotary(qr, kr, **threads), peers))
    return cases


# ---- timing -----------------------------------------------------------------------------------

class Timer:
    def __init__(self, torch, cuda: bool):
        self.torch, self.cuda = torch, cuda

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def loop(self, fn: Callable[[], Any], n: int) -> Tuple[float, float, Optional[float]]:
        """(wall us, thread CPU us, CUDA-event us or None) per call of n back-to-back calls."""
        self.sync()
        ev = None
        if self.cuda:
            ev = (self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True))
            ev[0].record()
        gc_was = gc.isenabled()
        gc.disable()
        try:
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(n):
                fn()
            c1, w1 = time.thread_time(), time.perf_counter()
        finally:
            if gc_was:
                gc.enable()
        loop = None
        if ev is not None:
            ev[1].record()
            ev[1].synchronize()
            loop = 1e3 * ev[0].elapsed_time(ev[1]) / n
        return 1e6 * (w1 - w0) / n, 1e6 * (c1 - c0) / n, loop

    def capture(self, fn: Callable[[], Any]) -> Any:
        """A CUDA graph of GRAPH_CALLS calls of fn (warmed up on a side stream first)."""
        torch = self.torch
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return graph

    def replay(self, graph: Any) -> float:
        """Kernel us per call: CUDA events around GRAPH_REPLAYS replays."""
        torch = self.torch
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(GRAPH_REPLAYS):
            graph.replay()
        b.record()
        b.synchronize()
        return 1e3 * a.elapsed_time(b) / (GRAPH_REPLAYS * GRAPH_CALLS)


def _path(fn: Callable[[], Any]) -> str:
    """'fast' when one call of fn builds no flashcpp Meta (the eager fast path), else 'general'."""
    from flashcpp import _core
    real = _core.meta
    count = [0]

    def counting(*a, **k):
        count[0] += 1
        return real(*a, **k)

    _core.meta = counting
    try:
        fn()
    finally:
        _core.meta = real
    return "fast" if count[0] == 0 else "general"


def _median(xs: List[Optional[float]]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def measure_case(case: Case, timer: Timer, calls: int, repeats: int, cpu_budget_s: float,
                 skipped: Dict[str, str]) -> List[Dict[str, Any]]:
    impls: Dict[str, Callable[[], Any]] = {"flashcpp": case.ours}
    for name, fn in case.peers.items():
        try:  # a peer that refuses this case (or whose JIT fails) is dropped with its reason
            fn()
            timer.sync()
            impls[name] = fn
        except Exception as e:
            skipped[f"{case.call} {case.shape} {name}"] = f"{type(e).__name__}: {str(e)[:160]}"
    n: Dict[str, int] = {}
    for name, fn in impls.items():  # warm-up, and N per implementation
        for _ in range(3):
            fn()
        timer.sync()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        timer.sync()
        one = (time.perf_counter() - t0) / 3
        n[name] = calls if timer.cuda else max(3, min(calls, int(cpu_budget_s / max(one, 1e-9))))
    graphs: Dict[str, Any] = {}
    if timer.cuda:
        for name, fn in impls.items():
            try:
                graphs[name] = timer.capture(fn)
            except Exception as e:
                skipped[f"{case.call} {case.shape} {name} graph"] = f"{type(e).__name__}: {str(e)[:160]}"
                try:
                    timer.sync()
                except Exception:
                    pass
    res: Dict[str, Dict[str, List[Optional[float]]]] = {
        k: {"host": [], "cpu": [], "loop": [], "graph": []} for k in impls}
    names = list(impls)
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            host, cpu, loop = timer.loop(impls[name], n[name])
            res[name]["host"].append(host)
            res[name]["cpu"].append(cpu)
            res[name]["loop"].append(loop)
            if name in graphs:
                res[name]["graph"].append(timer.replay(graphs[name]))
    del graphs

    def figures(name: str) -> Tuple[float, float, Optional[float], Optional[float], str]:
        r = res[name]
        host, cpu, loop, graph = (_median(r[k]) for k in ("host", "cpu", "loop", "graph"))
        if not timer.cuda:
            return host, cpu, None, None, ""
        return host, cpu, loop, graph if graph is not None else loop, "graph" if graph is not None else "events"

    host, cpu, loop, kernel, method = figures("flashcpp")
    base = {"call": case.call, "shape": case.shape, "dtype": case.dtype, "host_us": host, "cpu_us": cpu,
            "kernel_us": kernel, "kernel_method": method, "loop_us": loop, "path": _path(case.ours)}
    rows = []
    for name in names[1:] or [None]:
        row = dict(base, peer="", peer_host_us=None, peer_kernel_us=None, peer_loop_us=None, peer_kernel_method="")
        if name is not None:
            ph, _, pl, pk, pm = figures(name)
            row.update(peer=name, peer_host_us=ph, peer_kernel_us=pk, peer_loop_us=pl, peer_kernel_method=pm)
        rows.append(row)
    return rows


# ---- output -------------------------------------------------------------------------------------

def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def write_csv(path: str, rows: List[Dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow([_fmt(r.get(c)) for c in COLUMNS])


def print_table(rows: List[Dict[str, Any]]) -> None:
    print(f"{'call':<24} {'shape':<28} {'path':<7} {'host_us':>8} {'cpu_us':>8} {'kernel_us':>9}   "
          f"{'peer':<20} {'host_us':>8} {'kernel_us':>9}")
    for r in rows:
        print(f"{r['call']:<24} {r['shape']:<28} {r['path']:<7} {_fmt(r['host_us']):>8} {_fmt(r['cpu_us']):>8} "
              f"{_fmt(r['kernel_us']):>9}   {r['peer']:<20} {_fmt(r['peer_host_us']):>8} "
              f"{_fmt(r['peer_kernel_us']):>9}", flush=True)


# ---- entry point --------------------------------------------------------------------------------

def run(out: str, device: str = "cuda", quick: bool = False, calls: Optional[int] = None,
        repeats: Optional[int] = None, tiny: bool = False) -> int:
    import torch

    import flashcpp
    cuda = device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            print("python -m flashcpp.bench.host_overhead: --device cuda needs an NVIDIA GPU and a CUDA build of "
                  "torch; none here (--device cpu runs the same loops on host tensors).", file=sys.stderr)
            return 2
        if not getattr(flashcpp, "WITH_CUDA", False):
            print("python -m flashcpp.bench.host_overhead: this flashcpp build has no CUDA kernels "
                  "(FLASHCPP_CUDA=OFF); --device cpu runs the same loops on host tensors.", file=sys.stderr)
            return 2
    threads_before = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)  # the peers on one thread, as flashcpp's fused ops (restored below)
    try:
        return _run(torch, flashcpp, out, cuda, quick, calls, repeats, tiny)
    finally:
        torch.set_num_threads(threads_before)


def _run(torch, flashcpp, out: str, cuda: bool, quick: bool, calls: Optional[int], repeats: Optional[int],
         tiny: bool) -> int:
    if calls is None:
        calls = (50 if quick else 100) if cuda else (200 if quick else 1000)
    repeats = repeats or (3 if quick else 7)
    cpu_budget_s = 0.010 if quick else 0.020
    os.makedirs(out, exist_ok=True)
    libs, why = _import_peers(cuda)
    env = environment(torch, cuda)
    env.update({"calls_per_loop": calls, "repeats": repeats, "graph_calls": GRAPH_CALLS if cuda else None,
                "graph_replays": GRAPH_REPLAYS if cuda else None, "quick": quick, "tiny": tiny,
                "torch_threads": torch.get_num_threads(), "cpu_threads": None if cuda else 1,
                "cpu_loop_budget_s": None if cuda else cpu_budget_s,
                "peers_found": {k: getattr(v, "__doc__", None) if k == "quack" else getattr(v, "__version__", "?")
                                for k, v in libs.items()},
                "peers_not_found": why, "skipped": {}})
    if not cuda:
        env["note"] = ("host tensors: host_us includes the computation; flash_attn_func and "
                       "flash_attn_with_kvcache take no cpu_threads and use every core")
    rows: List[Dict[str, Any]] = []
    for case in build_cases(torch, flashcpp, cuda, tiny, libs):
        rows += measure_case(case, Timer(torch, cuda), calls, repeats, cpu_budget_s, env["skipped"])
    write_csv(os.path.join(out, "host_overhead.csv"), rows)
    with open(os.path.join(out, "host_overhead_env.json"), "w") as f:
        json.dump(env, f, indent=1)
        f.write("\n")
    print_table(rows)
    print(f"wrote {os.path.join(out, 'host_overhead.csv')} and host_overhead_env.json "
          f"({env['device_name']}, {env['git_commit']})", flush=True)
    bad = [r for r in rows if not (isinstance(r["host_us"], float) and math.isfinite(r["host_us"]))]
    return 1 if bad else 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench.host_overhead",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for host_overhead.csv and host_overhead_env.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="fewer calls per loop and 3 repeats")
    ap.add_argument("--calls", type=int, default=None, help="calls per timed loop (an upper bound on --device cpu)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (the figures are their median)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the tests)")
    a = ap.parse_args(argv)
    for name in ("calls", "repeats"):
        v = getattr(a, name)
        if v is not None and v < 1:
            ap.error(f"--{name} must be >= 1")
    return run(a.out, a.device, a.quick, a.calls, a.repeats, a.tiny)


if __name__ == "__main__":
    sys.exit(main())
