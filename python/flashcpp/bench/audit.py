"""Numerics audit on a GPU: flashcpp's kernels and torch SDPA's FLASH and CUDNN backends on the
same stress inputs, against one fp64 reference, in one process.

    python -m flashcpp.bench.audit [--quick] [--n 8192,16384,32768,65536] [--dtypes bf16,fp16]
        [--families ...] [--masks none,causal,window] [--heads 4] [--head-dim 128] [--window 1024]
        [--seed S] [--flashcpp build/flashcpp] [--out reports/numerics]

The inputs are not re-implemented here: for each problem (family, dtype, N, mask) the C++ tool
writes them (``flashcpp audit --dump-inputs``, the generators of tools/harness/audit_inputs.cc,
the same seed rule), so the rows this driver measures are exactly the rows ``flashcpp audit``
measures. Each problem is loaded to the GPU and run through

* ``flashcpp_sm80`` / ``flashcpp_sm90``: ``flashcpp.attention(..., backend="cuda", cuda_config=...)``
  (``flashcpp_<config>``: that one compiled config, e.g. ``flashcpp_sm90_m192n128s4p``);
* ``torch_flash`` / ``torch_cudnn``: ``F.scaled_dot_product_attention`` under ``sdpa_kernel``
  (SDPA's (B, H, N, D) view through ``transpose``; ``is_causal`` for causal, which equals flashcpp's
  bottom-right alignment here since seqlen_q == seqlen_k; the sliding window as a boolean
  ``attn_mask``, which a backend may refuse: that is recorded as "unsupported", never hidden);

and compared with an fp64 reference computed here in torch (query-row chunks: S = QK^T, masked
softmax, P V and P |V|, all float64). The metrics are those of ``flashcpp audit`` (docs/audit.md):
per-row relative error ``max_e |o - r| / max(max_e |r|, atol)``, its CDF and quantiles, rows over
the dtype band, non-finite rows, and the ratio to the defect bound. The report,
``<out>/audit_peers.json``, uses the ``results`` schema of ``flashcpp audit --json`` (with
``kernel`` = flashcpp_sm80, flashcpp_sm90, torch_flash, torch_cudnn) plus a ``comparison`` list
(p99 and max of every implementation per problem, and flashcpp's ratio to each peer);
``python -m flashcpp.bench.audit_plot`` draws it (``peers_*.png``).

torch, numpy and flashcpp are imported inside the functions: this module imports without them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

FAMILIES = ["random", "subnormal", "one_hot", "near_ties", "constant", "outlier_keys", "large_scale", "long_range"]
MASKS = ["none", "causal", "window"]
PEERS = ["torch_flash", "torch_cudnn"]
OURS = ["flashcpp_sm80", "flashcpp_sm90"]
#: docs/tolerances.md: per element |o - r| <= atol + rtol |r|; LSE within lse_atol.
TOLERANCE = {"bf16": {"atol": 1e-2, "rtol": 1e-2, "lse_atol": 1e-3},
             "fp16": {"atol": 1e-2, "rtol": 1e-2, "lse_atol": 1e-3}}
#: docs/audit.md, "The defect bound" (same constants as tools/audit.h DefectBound).
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
TAU = {"bf16": 1e-30, "fp16": 2.0 ** -25}
P_FLOOR = {"bf16": 2.0 ** -134, "fp16": 2.0 ** -25}
SAFETY, EPS_EXP, LSE_SLACK = 4.0, 2.0 ** -21, 2.0 ** -20
#: Elements of one fp64 score chunk (query rows x keys) in the reference: 2^28 doubles = 2 GiB.
CHUNK_ELEMS = 1 << 28


def cdf_quantiles() -> List[float]:
    """The quantiles of tools/audit.h cdf_quantiles(): 0..0.99 by 0.01, then the tail."""
    return [i / 100 for i in range(100)] + [0.995, 0.999, 0.9995, 0.9999, 1.0]


def _nearest_rank(sorted_vals: Sequence[float], q: float) -> float:
    n = len(sorted_vals)
    return sorted_vals[min(n - 1, int(q * (n - 1) + 0.5))]


def _num(x: float) -> Optional[float]:
    return float(x) if math.isfinite(x) else None


def _finite_max(t) -> Optional[float]:
    """Largest finite element of a tensor (None when there is none)."""
    import torch
    f = t[torch.isfinite(t)]
    return float(f.max().item()) if f.numel() else None


# ---- inputs --------------------------------------------------------------------------------

def find_flashcpp(path: Optional[str]) -> str:
    """The flashcpp CLI: --flashcpp, $FLASHCPP_BIN, build*/flashcpp under the repository, or PATH."""
    cands = [path, os.environ.get("FLASHCPP_BIN")]
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    cands += [os.path.join(root, d, "flashcpp") for d in ("build", "build-cuda", "build-cpu")]
    cands.append(shutil.which("flashcpp"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("flashcpp CLI not found: pass --flashcpp PATH or set FLASHCPP_BIN")


def dump_problem(exe: str, tmp: str, *, n: int, dtype: str, family: str, mask: str, heads: int, head_dim: int,
                 window: int, seed: int) -> Dict[str, Any]:
    """Writes one problem's inputs with the C++ generators; returns its manifest entry."""
    for f in os.listdir(tmp):
        os.remove(os.path.join(tmp, f))
    cmd = [exe, "audit", "--dump-inputs", tmp, "--backend", "cuda", "--n", str(n), "--dtypes", dtype,
           "--families", family, "--masks", mask, "--heads", str(heads), "--head-dim", str(head_dim),
           "--window", str(window), "--seed", str(seed)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(tmp, "manifest.json")) as f:
        manifest = json.load(f)
    (entry,) = manifest["problems"]
    entry["_dir"] = tmp
    entry["_families"] = manifest["families"]
    return entry


def load_inputs(entry: Dict[str, Any]):
    """(q, k, v) on the GPU, (1, N, H, D) in the problem's dtype."""
    import numpy as np
    import torch
    tdt = torch.bfloat16 if entry["dtype"] == "bf16" else torch.float16
    shape = (1, entry["seqlen"], entry["heads"], entry["head_dim"])
    out = []
    for t in ("q", "k", "v"):
        raw = np.fromfile(os.path.join(entry["_dir"], entry["files"][t]), dtype=np.int16)
        out.append(torch.from_numpy(raw).view(tdt).reshape(shape).cuda())
    return tuple(out)


# ---- fp64 reference ------------------------------------------------------------------------

def reference_fp64(q, k, v, *, causal: bool, window_left: int, scale: float):
    """O, A = P|V| (N, H, D) and LSE (H, N) in float64, chunked over query rows."""
    import torch
    _, n, h, d = q.shape
    qd, kd, vd = (x[0].double() for x in (q, k, v))
    o = torch.empty(n, h, d, dtype=torch.float64, device=q.device)
    a = torch.empty_like(o)
    lse = torch.empty(h, n, dtype=torch.float64, device=q.device)
    rows = max(1, CHUNK_ELEMS // n)
    j = torch.arange(n, device=q.device)
    for hh in range(h):
        kh, vh = kd[:, hh], vd[:, hh]
        vabs = vh.abs()
        for i0 in range(0, n, rows):
            i1 = min(n, i0 + rows)
            s = (qd[i0:i1, hh] @ kh.T) * scale
            i = torch.arange(i0, i1, device=q.device)[:, None]
            hidden = torch.zeros_like(s, dtype=torch.bool)
            if causal:
                hidden |= j[None, :] > i
            if window_left >= 0:
                hidden |= j[None, :] < i - window_left
            s.masked_fill_(hidden, float("-inf"))
            m = s.amax(dim=1, keepdim=True)
            p = torch.exp(s - m)
            l = p.sum(dim=1, keepdim=True)
            o[i0:i1, hh] = (p @ vh) / l
            a[i0:i1, hh] = (p @ vabs) / l
            lse[hh, i0:i1] = (m + torch.log(l))[:, 0]
            del s, p, hidden
    return o, a, lse


# ---- implementations -----------------------------------------------------------------------

def run_impls(q, k, v, *, causal: bool, window_left: int, impls: Sequence[str]) -> Dict[str, Tuple[Any, Any, str]]:
    """name -> (o (N, H, D) or None, lse (H, N) or None, message)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashcpp

    out: Dict[str, Tuple[Any, Any, str]] = {}
    for name in impls:
        try:
            if name.startswith("flashcpp_"):
                o, lse = flashcpp.attention(q, k, v, causal=causal, window_size=(window_left, -1), backend="cuda",
                                            cuda_config=name.split("_", 1)[1], return_lse=True)
                torch.cuda.synchronize()
                out[name] = (o[0], lse[0], "")
            else:
                be = {"torch_flash": SDPBackend.FLASH_ATTENTION, "torch_cudnn": SDPBackend.CUDNN_ATTENTION}[name]
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                kwargs: Dict[str, Any] = {}
                if window_left >= 0:  # causal sliding window: a boolean mask (True = attend)
                    n = q.shape[1]
                    i = torch.arange(n, device=q.device)[:, None]
                    j = torch.arange(n, device=q.device)[None, :]
                    kwargs["attn_mask"] = (j <= i) & (j >= i - window_left)
                else:
                    kwargs["is_causal"] = causal
                with sdpa_kernel(be):
                    o = F.scaled_dot_product_attention(qt, kt, vt, **kwargs)
                torch.cuda.synchronize()
                out[name] = (o.transpose(1, 2)[0], None, "")
        except Exception as e:  # a backend that refuses a problem is reported, not hidden
            out[name] = (None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    return out


# ---- metrics -------------------------------------------------------------------------------

def measure(o, lse, ref_o, ref_a, ref_lse, q, k, v, *, dtype: str, causal: bool, window_left: int, scale: float
            ) -> Dict[str, Any]:
    """The per-row metrics of tools/harness/audit.cc measure(), in torch."""
    import torch
    tol = TOLERANCE[dtype]
    n, h, d = ref_o.shape
    od = o.double()
    finite = torch.isfinite(od).all(dim=-1)
    err = (od - ref_o).abs().nan_to_num(nan=float("inf"))
    ref_abs = ref_o.abs()
    den = ref_abs.amax(dim=-1).clamp_min(tol["atol"])
    rel = torch.where(finite, err.amax(dim=-1) / den, torch.full_like(den, float("inf")))
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    floor_rel = (ref_o.to(tdt).double() - ref_o).abs().amax(dim=-1) / den
    tol_ratio = err / (tol["atol"] + tol["rtol"] * ref_abs)
    over = (tol_ratio > 1).any(dim=-1) | ~finite
    # Defect bound: scale |q_i| max_j |k_j| per head, visible keys per row.
    qn = q[0].double().norm(dim=-1)                       # (N, H)
    kmax = k[0].double().norm(dim=-1).amax(dim=0)         # (H,)
    qk = scale * qn * kmax[None, :]
    i = torch.arange(n, device=o.device, dtype=torch.float64)[:, None]
    nvis = (i + 1 if causal else torch.full_like(i, float(n)))
    if window_left >= 0:
        nvis = torch.clamp(nvis, max=float(window_left + 1))
    gamma = (256.0 + nvis / 64.0) * 2.0 ** -24
    eta = (d + 8) * 2.0 ** -24 * qk
    weight = UNIT_ROUNDOFF[dtype] + EPS_EXP + eta + gamma   # (N, H)
    vmax = v[0].double().abs().amax(dim=(0, 2))           # (H,)
    p_abs = (nvis * P_FLOOR[dtype])[..., None] * vmax[None, :, None]  # (N, H, 1)
    bound = SAFETY * (UNIT_ROUNDOFF[dtype] * ref_abs + weight[..., None] * (ref_a + ref_abs) + p_abs) + TAU[dtype]
    bound_ratio = (err / bound).amax(dim=-1)
    rel_sorted = torch.sort(rel.flatten()).values.cpu().tolist()
    floor_sorted = torch.sort(floor_rel.flatten()).values.cpu().tolist()
    qs = lambda v: {"p50": _num(_nearest_rank(v, .5)), "p90": _num(_nearest_rank(v, .9)),  # noqa: E731
                    "p99": _num(_nearest_rank(v, .99)), "p999": _num(_nearest_rank(v, .999)), "max": _num(v[-1])}
    res: Dict[str, Any] = {
        "rows": n * h,
        "row_rel_err": qs(rel_sorted),
        "cdf": [_num(_nearest_rank(rel_sorted, x)) for x in cdf_quantiles()],
        "floor_rel_err": qs(floor_sorted),
        "max_abs_err": _finite_max(err),
        "max_tol_ratio": _finite_max(tol_ratio),
        "rows_over_tol": int(over.sum().item()),
        "frac_rows_over_tol": over.double().mean().item(),
        "nonfinite_rows": int((~finite).sum().item()),
        "max_bound_ratio": _finite_max(bound_ratio),
        "defect_rows": int(((bound_ratio > 1) | ~finite).sum().item()),
        "tolerance": tol,
        "lse_max_abs_err": None, "rows_lse_over_tol": None, "lse_defect_rows": None,
    }
    if lse is not None:
        ld = lse.double()
        lerr = (ld - ref_lse).abs()
        lfin = torch.isfinite(ld)
        lb = SAFETY * ((weight - UNIT_ROUNDOFF[dtype]).T + 2.0 ** -24 * ref_lse.abs()) + LSE_SLACK
        res["lse_max_abs_err"] = _finite_max(lerr)
        res["rows_lse_over_tol"] = int(((lerr > tol["lse_atol"]) | ~lfin).sum().item())
        res["lse_defect_rows"] = int(((lerr > lb) | ~lfin).sum().item())
    res["status"] = "fail" if res["defect_rows"] or (res["lse_defect_rows"] or 0) else "pass"
    return res


def first_exceed(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Smallest N per (kernel, dtype, family, mask) with rows over the dtype band (null: none)."""
    groups: Dict[Tuple[str, str, str, str], List[Dict[str, Any]]] = {}
    for r in results:
        if r["status"] != "unsupported":
            groups.setdefault((r["kernel"], r["dtype"], r["family"], r["mask"]), []).append(r)
    out = []
    for (kern, dt, fam, mask), rs in groups.items():
        rs.sort(key=lambda r: r["seqlen"])
        first = next((r["seqlen"] for r in rs if r["rows_over_tol"]), None)
        out.append({"kernel": kern, "dtype": dt, "family": fam, "mask": mask, "seqlens": [r["seqlen"] for r in rs],
                    "first_n_over_tol": first, "over_tol_at_smallest_n": first is not None and first == rs[0]["seqlen"],
                    "frac_rows_over_tol": [r["frac_rows_over_tol"] for r in rs],
                    "p99_row_rel_err": [r["row_rel_err"]["p99"] for r in rs]})
    return out


# ---- driver --------------------------------------------------------------------------------

def run(*, seqlens: Sequence[int], dtypes: Sequence[str], families: Sequence[str], masks: Sequence[str], heads: int,
        head_dim: int, window: int, seed: int, exe: str, out: str, impls: Sequence[str]) -> int:
    import torch

    from .common import environment, progress, write_json

    os.makedirs(out, exist_ok=True)
    env = environment()
    env["seed"] = seed
    env["flashcpp_cli"] = exe
    progress(f"[audit] {env}")
    results: List[Dict[str, Any]] = []
    comparison: List[Dict[str, Any]] = []
    family_text: Dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="flashcpp_audit_") as tmp:
        for n in sorted(seqlens):
            for dtype in dtypes:
                for family in families:
                    for mask in masks:
                        e = dump_problem(exe, tmp, n=n, dtype=dtype, family=family, mask=mask, heads=heads,
                                         head_dim=head_dim, window=window, seed=seed)
                        family_text = e["_families"]
                        q, k, v = load_inputs(e)
                        causal, wl, scale = e["causal"], e["window_left"], e["softmax_scale"]
                        ref_o, ref_a, ref_lse = reference_fp64(q, k, v, causal=causal, window_left=wl, scale=scale)
                        row = {"name": e["name"], "family": family, "dtype": dtype, "seqlen": n, "mask": mask}
                        line = [f"{e['name']:48s}"]
                        for name, (o, lse, msg) in run_impls(q, k, v, causal=causal, window_left=wl,
                                                            impls=impls).items():
                            r = {"name": e["name"], "family": family, "dtype": dtype, "seqlen": n, "heads": heads,
                                 "head_dim": head_dim, "mask": mask, "window": wl if wl >= 0 else None,
                                 "kernel": name, "seed": e["seed"], "reference": "torch_fp64", "message": msg}
                            if o is None:
                                r.update(status="unsupported", cdf=[])
                                line.append(f"{name} n/a")
                            else:
                                r.update(measure(o, lse, ref_o, ref_a, ref_lse, q, k, v, dtype=dtype,
                                                 causal=causal, window_left=wl, scale=scale))
                                row[name] = {"p99": r["row_rel_err"]["p99"], "max": r["row_rel_err"]["max"],
                                             "frac_rows_over_tol": r["frac_rows_over_tol"]}
                                p99 = r["row_rel_err"]["p99"]
                                line.append(f"{name} p99 {p99:.2e}" if p99 is not None else f"{name} p99 inf")
                                if r["status"] == "fail":
                                    line.append("(DEFECT)")
                            results.append(r)
                        for ours in [i for i in impls if i.startswith("flashcpp_")]:
                            for peer in PEERS:
                                a, b = row.get(ours), row.get(peer)
                                if a and b and a["p99"] and b["p99"]:
                                    row[f"{ours}_vs_{peer}_p99"] = a["p99"] / b["p99"]
                        comparison.append(row)
                        progress("  ".join(line))
                        del q, k, v, ref_o, ref_a, ref_lse
                        torch.cuda.empty_cache()
    report = {"tool": "python -m flashcpp.bench.audit", "environment": env,
              "config": {"seqlens": sorted(seqlens), "dtypes": list(dtypes), "families": list(families),
                         "masks": list(masks), "kernels": list(impls), "batch": 1, "heads": heads,
                         "head_dim": head_dim, "window": window, "layout": "bshd"},
              "families": family_text, "tolerance_policy": TOLERANCE, "cdf_quantiles": cdf_quantiles(),
              "results": results, "first_exceed": first_exceed(results), "comparison": comparison,
              "summary": {s: sum(r["status"] == s for r in results) for s in ("pass", "fail", "unsupported")}}
    path = os.path.join(out, "audit_peers.json")
    write_json(path, report)
    from .audit_plot import plot_report
    pngs = plot_report(path, out, prefix="peers")
    progress(f"[audit] wrote {path} and {len(pngs)} plots; {report['summary']}")
    return 1 if report["summary"]["fail"] else 0


def _csv(s: str) -> List[str]:
    return [x for x in s.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench.audit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N 1024,4096 (minutes)")
    ap.add_argument("--n", default=None, help="sequence lengths (default 8192,16384,32768,65536)")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--impls", default=",".join(OURS + PEERS),
                    help="subset of flashcpp_sm80,flashcpp_sm90,torch_flash,torch_cudnn; or flashcpp_<config> "
                         "for one compiled config (e.g. flashcpp_sm90_m192n128s4p; `flashcpp info` lists them)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=None,
                    help="window_left of the window mask (default 1024; 256 with --quick)")
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: fresh, printed and recorded)")
    ap.add_argument("--flashcpp", default=None,
                    help="path of the flashcpp CLI (default: $FLASHCPP_BIN, build/flashcpp)")
    ap.add_argument("--out", default="reports/numerics")
    args = ap.parse_args(argv)
    if args.n:
        seqlens = [int(x) for x in _csv(args.n)]
    else:
        seqlens = [1024, 4096] if args.quick else [8192, 16384, 32768, 65536]
    for name, vals, allowed in (("--dtypes", _csv(args.dtypes), TOLERANCE),
                                ("--families", _csv(args.families), FAMILIES),
                                ("--masks", _csv(args.masks), MASKS), ("--impls", _csv(args.impls), OURS + PEERS)):
        one_config = name == "--impls"  # flashcpp_<config>: any compiled config, checked when it runs
        bad = [v for v in vals if v not in allowed and not (one_config and v.startswith("flashcpp_") and len(v) > 9)]
        if bad:
            ap.error(f"{name}: unknown {bad} (choose from {list(allowed)})")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    window = args.window if args.window is not None else (256 if args.quick else 1024)
    return run(seqlens=seqlens, dtypes=_csv(args.dtypes), families=_csv(args.families), masks=_csv(args.masks),
               heads=args.heads, head_dim=args.head_dim, window=window, seed=seed, exe=find_flashcpp(args.flashcpp),
               out=args.out, impls=_csv(args.impls))


if __name__ == "__main__":
    sys.exit(main())
