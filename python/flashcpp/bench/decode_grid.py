"""The decode grid: flashcpp's decode against every decode peer over the shapes serving meets.

    python -m flashcpp.bench.decode --grid [--grid-max-seconds S | --grid-subset N]
                                           [--grid-repeats R] [--grid-peers a,b] [--grid-dry-run]
                                           [--out reports/decode]

Grid (bf16, one query token per sequence): batch {1, 2, 3, 4, 8, 16, 32, 64, 128, 256} x context
{512, 2048, 8192, 32768, 131072} x (heads_q, heads_kv) {(32,32), (32,8), (64,8), (16,2), (8,1)} x
head_dim {64, 128, 256}, pruned to a KV cache of at most 40 GB (batch x context x heads_kv x
head_dim x 2 (K and V) x 2 bytes <= 40e9: 716 of the 750 shapes). Each shape runs in five layouts:
contiguous, paged with page 16 and with page 64 (a shuffled block table over one page pool), and,
from batch 4 up, ragged lengths on the contiguous and page-16 caches (each sequence's length drawn
uniformly from [context / 16, context], seeded by the point's name). That is 3 x 716 + 2 x 491 =
3,130 points.

Peers, in one process, on the same KV bytes:
  torch_cudnn, torch_flash  SDPA's CUDNN / FLASH (FA2) backends with enable_gqa on a contiguous
                            (B, Hkv, N, D) copy of the cache, as the decode bench takes them; ragged
                            lengths as a key-padding mask (FLASH refuses masks: a 'refused' row).
                            Contiguous layouts only: SDPA has no paged cache.
  flashinfer                BatchDecodeWithPagedKVCacheWrapper (CUDA-core decode, CUDA-graph mode)
                            on the page pool and table of a paged point, or on the contiguous cache
                            viewed as in-order pages of 16 keys (no copy).
  fa4                       flash_attn.cute.flash_attn_varlen_func (FlashAttention-4) with seqused_k,
                            page_table for paged points and num_splits (its heuristic, 0, first; 1
                            when split KV is refused): probed, and every refusal recorded.
A peer that does not import is named with the reason in the output and in grid_env.json.

Timing: inputs are allocated once for the whole run (K and V pools sized for the largest selected
point, every point a view of them; the SDPA copy likewise), each peer is called once (plans,
compiles; the outputs are compared with ours: max |diff| and `agrees`), captured in a CUDA graph of
`calls_per_replay` calls (about 300 us of work), replayed once, then `repeats` replays interleaved
across the peers in a rotating order, timed with CUDA events; a time is the median replay / calls.
A peer whose capture fails is timed the same way on eager calls (timing column says which).
Points whose KV fits in L2 (`l2_resident`) are replayed hot, for every peer alike.

Output in --out: grid.csv (one row per (point, peer), then a `best_peer` row per point: the fastest
peer that agrees with ours, speedup = its time / ours, `best_of` names it), grid_env.json,
grid_log.txt, grid_heatmap.png (the best_peer speedup per point; not drawn without matplotlib, and
said so). grid.csv and grid_log.txt grow as points finish, so a run that is killed keeps its rows.

--grid-max-seconds S stops starting points that would end past S seconds after start (and on
SIGTERM), --grid-subset N times the first N points of the stratified order. The order is
deterministic: each next point is the one whose (heads, head_dim) class, batch, context and layout
have been timed least, so any prefix of it covers every class, batch, context and layout as early as
possible (the first `cover` points cover each at least once; a subset is never smaller than that).
"""
from __future__ import annotations

import csv
import math
import os
import random
import statistics
import sys
import time
import zlib
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

BATCHES = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (512, 2048, 8192, 32768, 131072)
HEADS = ((32, 32), (32, 8), (64, 8), (16, 2), (8, 1))
HEAD_DIMS = (64, 128, 256)
# (name, page_size, ragged); the ragged layouts only from RAGGED_MIN_BATCH sequences up
LAYOUTS = (("contiguous", 0, False), ("paged16", 16, False), ("paged64", 64, False), ("ragged", 0, True),
           ("ragged_paged16", 16, True))
RAGGED_MIN_BATCH = 4
RAGGED_MIN_FRACTION = 16  # a ragged length is drawn from [context // 16, context]
KV_LIMIT_BYTES = 40 * 10 ** 9
ESIZE = 2  # bf16
PEERS = ("torch_cudnn", "torch_flash", "flashinfer", "fa4")
SDPA_PEERS = ("torch_cudnn", "torch_flash")

# The time model of the estimate (and of the deadline before the first points are measured):
# a call streams its KV at EST_TBPS after EST_LAUNCH_US; each point costs host time for plans,
# captures and checks; FlashInfer JIT-compiles a decode kernel per head dim (~9 s measured in the
# decode bench) and FA4 one per (head dim, GQA group, paged) variant (seconds each).
EST_TBPS = 3.0
EST_LAUNCH_US = 6.0
EST_HOST_S_POINT = 0.020
EST_HOST_S_PEER = 0.012
EST_JIT_S = {"flashinfer": 9.0, "fa4": 8.0}
TARGET_REPLAY_US = 300.0
MAX_CALLS_PER_REPLAY = 32
FINISH_RESERVE_S = 10.0  # the heatmap and the last writes, kept free before a deadline
MEMORY_MARGIN_BYTES = 8 * 10 ** 9  # workspaces, graphs and outputs beside the K/V pools

COLUMNS = ["case", "peer", "ours_us", "peer_us", "speedup", "batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k",
           "head_dim", "causal", "dtype", "page_size", "ragged", "group", "kv_tokens", "kv_bytes", "ours_tbps",
           "peer_tbps", "bar", "meets_bar", "splits", "ctas", "timing", "gpu", "git_commit", "layout", "best_of",
           "status", "max_abs_diff_vs_ours", "agrees", "ours_timing", "l2_resident", "calls_per_replay", "repeats",
           "kv_capacity_bytes", "point", "note"]


class Point(NamedTuple):
    batch: int
    context: int         # cache slots per sequence (every length, unless ragged)
    heads_q: int
    heads_kv: int
    head_dim: int
    page_size: int = 0   # 0: contiguous cache
    ragged: bool = False

    @property
    def layout(self) -> str:
        for name, ps, rg in LAYOUTS:
            if ps == self.page_size and rg == self.ragged:
                return name
        return f"ps{self.page_size}{'_ragged' if self.ragged else ''}"

    @property
    def cls(self) -> str:
        """The (heads, head_dim) class: heads_q/heads_kv and head dim."""
        return f"{self.heads_q}/{self.heads_kv} d{self.head_dim}"

    @property
    def name(self) -> str:
        s = f"grid_b{self.batch}_h{self.heads_q}kv{self.heads_kv}_n{self.context}_d{self.head_dim}"
        if self.page_size:
            s += f"_ps{self.page_size}"
        if self.ragged:
            s += "_ragged"
        return s + "_bf16"


def kv_capacity_bytes(batch: int, context: int, heads_kv: int, head_dim: int) -> int:
    """Bytes of the K and V caches of a shape (bf16): what the 40 GB pruning bounds."""
    return batch * context * heads_kv * head_dim * 2 * ESIZE


def ragged_lengths(p: Point) -> List[int]:
    """Keys per sequence: every slot, or (ragged) uniform in [context // 16, context], seeded by the
    shape (the same lengths on every run and machine, and in both ragged layouts of a shape)."""
    if not p.ragged:
        return [p.context] * p.batch
    rng = random.Random(zlib.crc32(p._replace(page_size=0).name.encode()))
    lo = max(1, p.context // RAGGED_MIN_FRACTION)
    return [rng.randint(lo, p.context) for _ in range(p.batch)]


def kv_read_bytes(p: Point) -> int:
    """Bytes of K and V the step must read (the used lengths only)."""
    return sum(ragged_lengths(p)) * p.heads_kv * p.head_dim * 2 * ESIZE


def enumerate_points(limit_bytes: int = KV_LIMIT_BYTES) -> List[Point]:
    """Every grid point with a KV cache of at most limit_bytes, layout by layout."""
    pts: List[Point] = []
    for _, ps, ragged in LAYOUTS:
        for hq, hkv in HEADS:
            for d in HEAD_DIMS:
                for b in BATCHES:
                    if ragged and b < RAGGED_MIN_BATCH:
                        continue
                    for n in CONTEXTS:
                        if kv_capacity_bytes(b, n, hkv, d) <= limit_bytes:
                            pts.append(Point(b, n, hq, hkv, d, ps, ragged))
    return pts


def _strata(p: Point) -> Tuple[str, int, int, str]:
    return (p.cls, p.batch, p.context, p.layout)


def stratified_order(points: Sequence[Point]) -> Tuple[List[Point], int]:
    """The points in a deterministic stratified order and the length of its first prefix that covers
    every (heads, head_dim) class, batch, context and layout present.

    Greedy: the next point is the one with the most strata values not yet timed, then the most values
    at their stratum's lowest count (among values that still have points left), then the lowest sum of
    counts above those minima; ties go to the earlier point of `points`."""
    import numpy as np

    n = len(points)
    if n == 0:
        return [], 0
    keys = [_strata(p) for p in points]
    ns = len(keys[0])
    values = [sorted({k[s] for k in keys}, key=str) for s in range(ns)]
    index = [{v: i for i, v in enumerate(vs)} for vs in values]
    S = np.array([[index[s][k[s]] for s in range(ns)] for k in keys], dtype=np.int64)  # (n, ns)
    counts = [np.zeros(len(vs), dtype=np.int64) for vs in values]
    left = [np.bincount(S[:, s], minlength=len(values[s])) for s in range(ns)]
    remaining = np.arange(n)
    order: List[int] = []
    cover = 0
    uncovered = sum(len(vs) for vs in values)
    while remaining.size:
        c = np.stack([counts[s][S[remaining, s]] for s in range(ns)], axis=1)      # (r, ns)
        mins = np.array([counts[s][left[s] > 0].min() for s in range(ns)])
        zeros = (c == 0).sum(1)
        behind = (c == mins[None, :]).sum(1)
        excess = (c - mins[None, :]).sum(1)
        score = zeros * 10 ** 10 + behind * 10 ** 6 - excess
        j = int(np.argmax(score))  # the first best: ties to the earlier point
        i = int(remaining[j])
        order.append(i)
        for s in range(ns):
            v = S[i, s]
            if counts[s][v] == 0:
                uncovered -= 1
            counts[s][v] += 1
            left[s][v] -= 1
        if uncovered == 0 and cover == 0:
            cover = len(order)
        remaining = np.delete(remaining, j)
    return [points[i] for i in order], cover


def select_points(ordered: Sequence[Point], cover: int, subset: Optional[int]) -> Tuple[List[Point], str]:
    """The points to time: all, or the first max(subset, cover) of the stratified order."""
    if subset is None:
        return list(ordered), f"all {len(ordered)} points"
    k = max(subset, cover)
    why = f"the first {k} of {len(ordered)} points in the stratified order"
    if subset < cover:
        why += f" (--grid-subset {subset} raised to {cover}, the shortest prefix covering every class, batch, " \
               f"context and layout)"
    return list(ordered[:k]), why


def peers_at(p: Point, peers: Iterable[str]) -> List[str]:
    """The peers that run a point: SDPA's backends on contiguous caches only."""
    return [x for x in peers if not (x in SDPA_PEERS and p.page_size)]


def est_call_us(p: Point) -> float:
    return kv_capacity_bytes(p.batch, p.context, p.heads_kv, p.head_dim) / (EST_TBPS * 1e6) + EST_LAUNCH_US


def calls_per_replay(est_us: float) -> int:
    return int(min(MAX_CALLS_PER_REPLAY, max(1, math.ceil(TARGET_REPLAY_US / max(est_us, 1e-3)))))


def est_device_s(p: Point, n_impls: int, repeats: int) -> float:
    """Device seconds of one point: each implementation's eager call, capture warm-up and
    (1 + repeats) replays; plus the SDPA copy of the cache on contiguous points."""
    us = est_call_us(p)
    n = calls_per_replay(us)
    per_impl = (2 + (1 + repeats) * n) * us
    copy = 0.0 if p.page_size else 2 * kv_capacity_bytes(p.batch, p.context, p.heads_kv, p.head_dim) / (EST_TBPS * 1e6)
    return (n_impls * per_impl + copy) * 1e-6


def est_point_s(p: Point, peers: Sequence[str], repeats: int, host_s: Optional[float] = None) -> float:
    n_peers = len(peers_at(p, peers))
    host = host_s if host_s is not None else EST_HOST_S_POINT + EST_HOST_S_PEER * (1 + n_peers)
    return host + est_device_s(p, 1 + n_peers, repeats)


def estimate(points: Sequence[Point], peers: Sequence[str], repeats: int) -> Dict[str, float]:
    """Seconds the points should take: device, host, one-time compiles (the model above)."""
    device = sum(est_device_s(p, 1 + len(peers_at(p, peers)), repeats) for p in points)
    host = sum(EST_HOST_S_POINT + EST_HOST_S_PEER * (1 + len(peers_at(p, peers))) for p in points)
    variants: set = set()
    for p in points:
        variants |= _variants(p, peers)
    jit = sum(EST_JIT_S[v[0]] for v in variants)
    return {"points": len(points), "device_s": round(device, 1), "host_s": round(host, 1), "compile_s": round(jit, 1),
            "total_s": round(device + host + jit, 1)}


def fit_count(points: Sequence[Point], peers: Sequence[str], repeats: int, seconds: float) -> int:
    """How many points of the order the model fits in `seconds` before FINISH_RESERVE_S: each point's
    time, plus a compile the first time a point needs a new FlashInfer / FA4 variant."""
    t = 0.0
    seen: set = set()
    for k, p in enumerate(points):
        t += est_point_s(p, peers, repeats)
        for v in _variants(p, peers) - seen:
            seen.add(v)
            t += EST_JIT_S[v[0]]
        if t > seconds - FINISH_RESERVE_S:
            return k
    return len(points)


def _variants(p: Point, peers: Sequence[str]) -> set:
    """The one-time compiles a point needs: FlashInfer's per head dim, FA4's per (head dim, group, paged)."""
    v = set()
    if "flashinfer" in peers:
        v.add(("flashinfer", p.head_dim))
    if "fa4" in peers:
        v.add(("fa4", p.head_dim, p.heads_q // p.heads_kv, bool(p.page_size)))
    return v


# ---- rows -------------------------------------------------------------------------------------


def point_rows(p: Point, res: Dict[str, Any], env: Dict[str, Any], index: int) -> List[Dict[str, object]]:
    """The CSV rows of one measured point: one per peer (timed or refused), then `best_peer`.

    res: {"ours_us": float or None, "ours_status": str, "splits", "ctas", "calls_per_replay",
    "repeats", "l2_resident", "peers": {name: {"us": float or None, "status": str, "timing": str,
    "diff": float or None, "agrees": bool or None, "note": str}}}."""
    lens = ragged_lengths(p)
    tokens = sum(lens)
    kv_bytes = tokens * p.heads_kv * p.head_dim * 2 * ESIZE
    ours = res.get("ours_us")
    ours_tbps = round(kv_bytes / ours / 1e6, 3) if ours else ""
    base = {"case": p.name, "ours_us": round(ours, 2) if ours else "", "batch": p.batch, "heads_q": p.heads_q,
            "heads_kv": p.heads_kv, "seqlen_q": 1, "seqlen_k": p.context, "head_dim": p.head_dim, "causal": 1,
            "dtype": "bf16", "page_size": p.page_size, "ragged": int(p.ragged), "group": "grid", "kv_tokens": tokens,
            "kv_bytes": kv_bytes, "ours_tbps": ours_tbps, "bar": "", "meets_bar": "n/a",
            "splits": res.get("splits", ""), "ctas": res.get("ctas", ""), "gpu": env.get("gpu", ""),
            "git_commit": env.get("git_commit", ""), "layout": p.layout, "best_of": "",
            "ours_timing": res.get("ours_timing", ""), "l2_resident": int(bool(res.get("l2_resident", False))),
            "calls_per_replay": res.get("calls_per_replay", ""),
            "repeats": res.get("repeats", ""),
            "kv_capacity_bytes": kv_capacity_bytes(p.batch, p.context, p.heads_kv, p.head_dim), "point": index}
    rows: List[Dict[str, object]] = []
    best: Optional[Tuple[float, str]] = None
    for name, r in res.get("peers", {}).items():
        us = r.get("us")
        timed = us is not None and ours is not None
        diff = r.get("diff")
        agrees = r.get("agrees")
        row = dict(base, peer=name, peer_us=round(us, 2) if us is not None else "",
                   speedup=round(us / ours, 3) if timed else "",
                   peer_tbps=round(kv_bytes / us / 1e6, 3) if us else "", timing=r.get("timing", ""),
                   status=r.get("status", "timed" if us is not None else "not timed"),
                   max_abs_diff_vs_ours=f"{diff:.3e}" if diff is not None else "",
                   agrees="" if agrees is None else ("yes" if agrees else "no"), note=r.get("note", ""))
        rows.append(row)
        if timed and agrees is not False and (best is None or us < best[0]):
            best = (us, name)
    if ours is None:
        note = f"flashcpp did not run: {res.get('ours_status', '')}"
    elif best is None:
        note = "no peer timed at this point (or none agreed with ours)"
    else:
        note = "the fastest peer that agrees with ours"
    rows.append(dict(base, peer="best_peer", peer_us=round(best[0], 2) if best else "",
                     speedup=round(best[0] / ours, 3) if best and ours else "",
                     peer_tbps=round(kv_bytes / best[0] / 1e6, 3) if best else "",
                     timing=res.get("peers", {}).get(best[1], {}).get("timing", "") if best else "",
                     best_of=best[1] if best else "", status="timed" if best and ours else "not timed",
                     max_abs_diff_vs_ours="", agrees="", note=note))
    return rows


class CsvStream:
    """grid.csv written as points finish: the header once, then each point's rows appended and
    flushed, so a run that is stopped or killed keeps every finished point."""

    def __init__(self, path: str, columns: Sequence[str] = COLUMNS):
        self.path = path
        self.columns = list(columns)
        self.rows = 0
        with open(path, "w", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writeheader()

    def append(self, rows: Sequence[Dict[str, object]]) -> None:
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns, extrasaction="raise")
            w.writerows(rows)
            f.flush()
        self.rows += len(rows)


def read_rows(path: str) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---- the loop -----------------------------------------------------------------------------------


class Log:
    """Progress lines on stdout and in grid_log.txt."""

    def __init__(self, path: Optional[str]):
        self.path = path
        if path:
            open(path, "w").close()

    def __call__(self, msg: str) -> None:
        print(msg, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(msg + "\n")


def run_points(points: Sequence[Point], measure: Callable[[Point, int], Dict[str, Any]], sink: CsvStream,
               env: Dict[str, Any], peers: Sequence[str], repeats: int, log: Callable[[str], None],
               max_seconds: Optional[float] = None, clock: Callable[[], float] = time.time,
               t0: Optional[float] = None, stop: Optional[Callable[[], bool]] = None,
               on_progress: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """Measures the points in order, appending each point's rows to `sink` as it finishes.

    With max_seconds, a point is started only if the model (its device time plus the median host
    time of the points so far) ends it FINISH_RESERVE_S before t0 + max_seconds; the others are
    counted as left out for time. `stop()` true (SIGTERM) ends the loop before the next point."""
    t0 = clock() if t0 is None else t0
    host_times: List[float] = []
    done = skipped = failed = 0
    stopped = "complete"
    best: List[float] = []
    for i, p in enumerate(points):
        if stop is not None and stop():
            stopped = "stopped by SIGTERM"
            break
        if max_seconds is not None:
            host = statistics.median(host_times[-25:]) if host_times else None
            need = est_point_s(p, peers, repeats, host)
            if clock() - t0 + need > max_seconds - FINISH_RESERVE_S:
                skipped += 1
                stopped = f"deadline: --grid-max-seconds {max_seconds:g}"
                continue
        ts = clock()
        try:
            res = measure(p, i)
        except Exception as e:  # one broken point is recorded, not the end of the run
            res = {"ours_us": None, "ours_status": f"{type(e).__name__}: {str(e)[:160]}", "peers": {}}
            failed += 1
        dt = clock() - ts
        n_impls = 1 + len(peers_at(p, peers))
        host_times.append(max(0.0, dt - est_device_s(p, n_impls, repeats)))
        rows = point_rows(p, res, env, i)
        sink.append(rows)
        done += 1
        b = rows[-1]
        if b["speedup"] != "":
            best.append(float(b["speedup"]))
        parts = [f"[{done}/{len(points)} {clock() - t0:6.1f}s] {p.name:44s}"]
        if res.get("ours_us"):
            parts.append(f"ours {res['ours_us']:9.2f} us {float(rows[0]['ours_tbps'] or 0):5.2f} TB/s")
        else:
            parts.append(f"ours FAILED ({res.get('ours_status', '')})")
        for r in rows[:-1]:
            parts.append(f"{r['peer']} {r['speedup']}x" if r["speedup"] != "" else f"{r['peer']} -")
        parts.append(f"best {b['best_of'] or '-'} {b['speedup'] or '-'}x")
        log("  ".join(parts))
        if on_progress is not None and done % 25 == 0:
            on_progress({"timed_points": done, "wall_s": round(clock() - t0, 1)})
    summary = {"timed_points": done, "left_out_for_time": skipped, "failed_points": failed, "stopped": stopped,
               "wall_s": round(clock() - t0, 1),
               "host_s_per_point_median": round(statistics.median(host_times), 4) if host_times else None}
    if best:
        summary["best_peer_speedup_min_median_max"] = [round(min(best), 3), round(statistics.median(best), 3),
                                                       round(max(best), 3)]
        summary["points_below_1x_best_peer"] = sum(1 for x in best if x < 1.0)
    return summary


# ---- heatmap ------------------------------------------------------------------------------------


def draw_heatmap(rows: Sequence[Dict[str, object]], path: str, title: str, dpi: int = 110) -> str:
    """grid_heatmap.png: the best_peer speedup of every point, one panel per layout, (heads,
    head_dim) classes down, batch within context across; pruned cells dark, untimed ones light.
    Returns a sentence saying what was drawn, or why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        import numpy as np
    except Exception as e:
        return f"heatmap not drawn: matplotlib does not import ({type(e).__name__}: {str(e)[:100]})"
    vals: Dict[Tuple[str, str, int, int], float] = {}
    for r in rows:
        if r.get("peer") == "best_peer" and r.get("speedup") not in ("", None):
            cls = f"{r['heads_q']}/{r['heads_kv']} d{r['head_dim']}"
            vals[(str(r["layout"]), cls, int(r["batch"]), int(r["seqlen_k"]))] = float(r["speedup"])
    if not vals:
        return "heatmap not drawn: no point has a best_peer speedup"
    layouts = [name for name, _, _ in LAYOUTS if any(k[0] == name for k in vals)]
    classes = [f"{hq}/{hkv} d{d}" for hq, hkv in HEADS for d in HEAD_DIMS]
    cols = [(n, b) for n in CONTEXTS for b in BATCHES]
    height = 3.4 * len(layouts) + 1.2
    fig, axes = plt.subplots(len(layouts), 1, figsize=(18, height), squeeze=False)
    fig.subplots_adjust(left=0.07, right=0.93, top=1 - 1.0 / height, bottom=0.4 / height, hspace=0.32)
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#e6e6e6")
    lim = 2.0  # log2: 0.25x .. 4x
    im = None
    for ax, lay in zip(axes[:, 0], layouts):
        ps = next(ps for name, ps, _ in LAYOUTS if name == lay)
        ragged = next(rg for name, _, rg in LAYOUTS if name == lay)
        grid = np.full((len(classes), len(cols)), np.nan)
        pruned = np.zeros_like(grid)
        for yi, (hq, hkv, d) in enumerate((hq, hkv, d) for hq, hkv in HEADS for d in HEAD_DIMS):
            for xi, (n, b) in enumerate(cols):
                v = vals.get((lay, classes[yi], b, n))
                if v is not None:
                    grid[yi, xi] = v
                elif kv_capacity_bytes(b, n, hkv, d) > KV_LIMIT_BYTES or (ragged and b < RAGGED_MIN_BATCH):
                    pruned[yi, xi] = 1
        im = ax.imshow(np.ma.masked_invalid(np.clip(np.log2(grid), -lim, lim)), cmap=cmap, vmin=-lim, vmax=lim,
                       aspect="auto", interpolation="nearest")
        ax.imshow(np.ma.masked_equal(pruned, 0), cmap=ListedColormap(["#555555"]), aspect="auto",
                  interpolation="nearest")
        for yi in range(len(classes)):
            for xi in range(len(cols)):
                if not np.isnan(grid[yi, xi]):
                    ax.text(xi, yi, f"{grid[yi, xi]:.2f}", ha="center", va="center", fontsize=3.6)
        for k in range(1, len(CONTEXTS)):
            ax.axvline(k * len(BATCHES) - 0.5, color="k", lw=0.8)
        ax.set_yticks(range(len(classes)))
        ax.set_yticklabels(classes, fontsize=6)
        ax.set_xticks(range(len(cols)))
        ax.set_xticklabels([str(b) for _, b in cols], fontsize=5)
        top = ax.secondary_xaxis("top")
        top.set_xticks([k * len(BATCHES) + (len(BATCHES) - 1) / 2 for k in range(len(CONTEXTS))])
        top.set_xticklabels([f"context {n}" for n in CONTEXTS], fontsize=7)
        ax.set_ylabel(f"{lay}{f' (page {ps})' if ps else ''}", fontsize=8)
    axes[-1, 0].set_xlabel("batch (within each context)", fontsize=8)
    cb = fig.colorbar(im, cax=fig.add_axes([0.945, 0.3, 0.01, 0.4]))
    ticks = [-2, -1, -0.5, 0, 0.5, 1, 2]
    cb.set_ticks(ticks)
    cb.set_ticklabels([f"{2 ** t:.2g}x" for t in ticks])
    cb.set_label("best peer time / flashcpp time (above 1: flashcpp faster)", fontsize=7)
    fig.suptitle(title + "\ndark: pruned (KV > 40 GB, or ragged below batch 4); light: not timed", fontsize=9)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return f"heatmap drawn: {path} ({len(vals)} points)"


# ---- the GPU side -------------------------------------------------------------------------------


def _probe_peers(wanted: Sequence[str]) -> Tuple[Dict[str, Any], Dict[str, str], Dict[str, str]]:
    """({peer: handle}, {peer: version or what it is}, {peer: why it is not used})."""
    have: Dict[str, Any] = {}
    about: Dict[str, str] = {}
    why: Dict[str, str] = {}
    for name in wanted:
        if name in SDPA_PEERS:
            have[name] = name
            about[name] = "torch SDPA " + ("CUDNN_ATTENTION" if name == "torch_cudnn" else "FLASH_ATTENTION (FA2)")
        elif name == "flashinfer":
            try:
                import flashinfer
                have[name] = flashinfer
                about[name] = f"flashinfer {getattr(flashinfer, '__version__', '?')}"
            except Exception as e:  # ImportError, or a build for another torch / CUDA
                why[name] = f"does not import ({type(e).__name__}: {str(e)[:120]})"
        elif name == "fa4":
            f, info = _probe_fa4()
            if f is None:
                why[name] = info
            else:
                have[name] = f
                about[name] = info
    return have, about, why


def _probe_fa4() -> Tuple[Optional[Dict[str, Any]], str]:
    """({"fn": flash_attn.cute.flash_attn_varlen_func, "params": its parameter names}, version) when
    it imports and takes seqused_k, page_table and num_splits (the decode keywords), else (None, why)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:
        return None, f"does not import (flash_attn.cute.flash_attn_varlen_func: {type(e).__name__}: {str(e)[:120]})"
    try:
        from importlib.metadata import version
        ver = version("flash-attn-4")
    except Exception:
        ver = "?"
    import inspect
    try:
        params = set(inspect.signature(flash_attn_varlen_func).parameters)
    except (TypeError, ValueError) as e:
        return None, f"flash-attn-4 {ver}: the signature of flash_attn_varlen_func cannot be read ({e})"
    missing = [k for k in ("seqused_k", "page_table", "num_splits") if k not in params]
    if missing:
        return None, (f"flash-attn-4 {ver}: flash_attn_varlen_func has no {', '.join(missing)} "
                      f"(its parameters: {', '.join(sorted(params))[:200]})")
    return {"fn": flash_attn_varlen_func, "params": params}, \
        f"flash-attn-4 {ver} (flash_attn.cute.flash_attn_varlen_func)"


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {(s[0] if s else '')[:160]}"


class Measure:
    """Measures one point (see the module doc for the method). One instance per run: it owns the K/V
    pools, the SDPA copy, FlashInfer's workspace and the refusals seen so far.

    device "cuda" is the bench. device "cpu" runs the same wiring on flashcpp's CPU backend and SDPA on
    the CPU (no graphs: wall-clock medians of eager calls), for tests of this file on machines
    without a GPU; its times mean nothing."""

    def __init__(self, torch, peers: Dict[str, Any], points: Sequence[Point], repeats: int, log,
                 device: str = "cuda"):
        self.torch = torch
        self.peers = peers
        self.repeats = repeats
        self.log = log
        self.dev = device
        self.cuda = device != "cpu"
        self.dt = torch.bfloat16
        props = torch.cuda.get_device_properties(0) if self.cuda else None
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 0)
        cap = max(kv_capacity_bytes(p.batch, p.context, p.heads_kv, p.head_dim) for p in points) // (2 * ESIZE)
        sdpa_cap = max([kv_capacity_bytes(p.batch, p.context, p.heads_kv, p.head_dim) // (2 * ESIZE)
                        for p in points if not p.page_size] or [0])
        g = torch.Generator(device=self.dev).manual_seed(20261203)
        # One K and one V pool for the whole run, every point a view of their first elements; filled
        # in slices so no fp32 temporary is made.
        self.k_pool = torch.empty(cap, device=self.dev, dtype=self.dt)
        self.v_pool = torch.empty(cap, device=self.dev, dtype=self.dt)
        step = 1 << 28
        for buf in (self.k_pool, self.v_pool):
            for s in range(0, cap, step):
                buf[s:s + step].normal_(generator=g)
        need_sdpa = any(x in peers for x in SDPA_PEERS) and sdpa_cap > 0
        self.k_hnd = torch.empty(sdpa_cap if need_sdpa else 0, device=self.dev, dtype=self.dt)
        self.v_hnd = torch.empty_like(self.k_hnd)
        self.fi_ws = torch.empty(256 << 20, dtype=torch.uint8, device=self.dev) if "flashinfer" in peers else None
        self.fa4_refused: Dict[Tuple[Any, ...], str] = {}  # (paged, head_dim, group) -> why
        self.fa4_split_refused: Optional[str] = None
        self.sdpa_refused: Dict[Tuple[str, bool], str] = {}
        self.refusals: Dict[str, Dict[str, int]] = {}
        self._sync()
        log(f"[decode grid] K/V pools {2 * cap * ESIZE / 1e9:.1f} GB, SDPA copy "
            f"{2 * self.k_hnd.numel() * ESIZE / 1e9:.1f} GB, L2 {self.l2_bytes / 1e6:.0f} MB")

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _oom(self, e: BaseException) -> bool:
        """True for an out-of-memory error (the allocator's cache is emptied then)."""
        if isinstance(e, self.torch.cuda.OutOfMemoryError):
            if self.cuda:
                self.torch.cuda.empty_cache()
            return True
        return False

    def _refused(self, peer: str, why: str) -> Dict[str, Any]:
        key = why[:120]
        self.refusals.setdefault(peer, {})
        self.refusals[peer][key] = self.refusals[peer].get(key, 0) + 1
        return {"us": None, "status": f"refused: {why}", "timing": "", "diff": None, "agrees": None, "note": ""}

    def __call__(self, p: Point, index: int) -> Dict[str, Any]:
        torch = self.torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from flashcpp.decode import BatchDecodeWithKVCache

        B, N, Hq, Hkv, D, ps = p.batch, p.context, p.heads_q, p.heads_kv, p.head_dim, p.page_size
        dev, dt = self.dev, self.dt
        elems = B * N * Hkv * D
        lens_list = ragged_lengths(p)
        lens_host = torch.tensor(lens_list, dtype=torch.int32)
        lens = lens_host.to(dev)
        kc = self.k_pool[:elems].view(B, N, Hkv, D)
        vc = self.v_pool[:elems].view(B, N, Hkv, D)
        g = torch.Generator(device=dev).manual_seed(31 + index)
        q = torch.randn(B, 1, Hq, D, device=dev, dtype=dt, generator=g)
        table = kp = vp = None
        if ps:
            pps = N // ps
            table = torch.randperm(B * pps, device=dev, generator=g).view(B, pps).to(torch.int32).contiguous()
            kp = self.k_pool[:elems].view(B * pps, ps, Hkv, D)
            vp = self.v_pool[:elems].view(B * pps, ps, Hkv, D)

        res: Dict[str, Any] = {"peers": {}, "repeats": self.repeats,
                               "l2_resident": self.l2_bytes > 0 and kv_read_bytes(p) <= self.l2_bytes}
        fns: Dict[str, Callable[[], Any]] = {}
        norm: Dict[str, Callable[[Any], Any]] = {}
        notes: Dict[str, str] = {}

        # ---- flashcpp ---------------------------------------------------------------------------
        o_ours = torch.empty_like(q)
        w = BatchDecodeWithKVCache()
        try:
            info = w.plan(B, Hq, Hkv, D, seqlen_q=1, kv_capacity=N, page_size=ps, cache_seqlens=lens_host,
                          causal=True, dtype=dt, device=dev)
            res["splits"], res["ctas"] = getattr(info, "max_splits", ""), getattr(info, "ctas", "")
        except Exception as e:
            return {"ours_us": None, "ours_status": f"plan refused: {_first_line(e)}", "peers": {}}
        if ps:
            fns["flashcpp"] = lambda: w.run(q, kp, vp, lens, block_table=table, out=o_ours)
        else:
            fns["flashcpp"] = lambda: w.run(q, kc, vc, lens, out=o_ours)
        norm["flashcpp"] = lambda r: o_ours

        # ---- SDPA (contiguous caches) ------------------------------------------------------------
        sdpa = [x for x in SDPA_PEERS if x in self.peers] if not ps else []
        if sdpa:
            kh = self.k_hnd[:elems].view(B, Hkv, N, D)
            vh = self.v_hnd[:elems].view(B, Hkv, N, D)
            kh.copy_(kc.transpose(1, 2))
            vh.copy_(vc.transpose(1, 2))
            qt = q.transpose(1, 2)
            mask = (torch.arange(N, device=dev)[None, :] < lens[:, None])[:, None, None, :] if p.ragged else None
            for name in sdpa:
                if (name, p.ragged) in self.sdpa_refused:  # FA2 takes no mask: tried once, then recorded
                    res["peers"][name] = self._refused(name, self.sdpa_refused[(name, p.ragged)])
                    continue
                be = SDPBackend.CUDNN_ATTENTION if name == "torch_cudnn" else SDPBackend.FLASH_ATTENTION

                def f(be=be, mask=mask, kh=kh, vh=vh):
                    with sdpa_kernel(be):
                        return F.scaled_dot_product_attention(qt, kh, vh, attn_mask=mask, enable_gqa=Hq != Hkv)
                fns[name] = f
                norm[name] = lambda r: r.transpose(1, 2)

        # ---- FlashInfer ------------------------------------------------------------------------------
        if "flashinfer" in self.peers:
            try:
                fns["flashinfer"], o_fi = self._flashinfer(p, q, kc, vc, kp, vp, table, lens_list)
                norm["flashinfer"] = lambda r, o_fi=o_fi: o_fi.unsqueeze(1)
            except Exception as e:
                res["peers"]["flashinfer"] = self._refused("flashinfer", _first_line(e))

        # ---- FA4 ------------------------------------------------------------------------------------
        if "fa4" in self.peers:
            key = (bool(ps), D, Hq // Hkv)
            if key in self.fa4_refused:
                res["peers"]["fa4"] = self._refused("fa4", self.fa4_refused[key])
            else:
                f4, why, note = self._fa4(p, q, kc, vc, kp, vp, table, lens)
                if f4 is None:
                    self.fa4_refused[key] = why
                    res["peers"]["fa4"] = self._refused("fa4", why)
                else:
                    fns["fa4"] = f4
                    norm["fa4"] = lambda r: r
                    notes["fa4"] = note

        # ---- one call each (plans, compiles), then the outputs against ours -------------------------
        outs: Dict[str, Any] = {}
        for name in list(fns):
            try:
                with torch.no_grad():
                    r = fns[name]()
                outs[name] = norm[name](r[0] if isinstance(r, (tuple, list)) else r)
            except Exception as e:
                fns.pop(name)
                if name == "flashcpp":
                    return {"ours_us": None, "ours_status": f"run refused: {_first_line(e)}", "peers": res["peers"]}
                if not self._oom(e) and name == "torch_flash" and p.ragged:
                    self.sdpa_refused[(name, True)] = _first_line(e)
                res["peers"][name] = self._refused(name, _first_line(e))
        self._sync()
        ref = outs["flashcpp"].float()
        others = [n for n in outs if n != "flashcpp"]
        stats = [ref.abs().max(), (~torch.isfinite(ref)).sum().float()]
        for n in others:
            if outs[n].shape == ref.shape:
                stats.append((outs[n].float() - ref).abs().max())
            else:  # a layout this bench got wrong: no ratio without a comparison
                stats.append(torch.tensor(float("inf"), device=dev))
                notes[n] = f"output shape {tuple(outs[n].shape)} vs ours {tuple(ref.shape)}"
        vals = torch.stack(stats).tolist()
        if vals[1] > 0:
            return {"ours_us": None, "ours_status": f"flashcpp output has {int(vals[1])} NaN/Inf",
                    "peers": res["peers"]}
        tol = 1e-3 + vals[0] / 64  # bf16: a few ulps of the largest output, plus 1e-3
        diffs = dict(zip(others, vals[2:]))
        del outs, ref

        # ---- capture, then interleaved replays ------------------------------------------------------
        n = calls_per_replay(est_call_us(p))
        res["calls_per_replay"] = n
        graphs: Dict[str, Any] = {}
        timing: Dict[str, str] = {}
        for name, fn in list(fns.items()):
            try:
                graphs[name] = self._capture(fn, n)
                timing[name] = "cuda_graph_median" if self.cuda else "cpu_wall_median"
            except Exception as e:
                self._sync()
                if self._oom(e) and name != "flashcpp":
                    fns.pop(name)
                    res["peers"][name] = self._refused(name, "graph capture: " + _first_line(e))
                    continue
                graphs[name] = None
                timing[name] = "cuda_events_eager_median"
                notes[name] = (notes.get(name, "") +
                               f" graph capture failed ({_first_line(e)[:80]}); eager calls").strip()
        names = list(fns)
        for name in names:  # one untimed replay each
            self._replay(graphs[name], fns[name], n)
        us = self._interleaved(names, graphs, fns, n)
        del graphs
        res["ours_us"] = us["flashcpp"]
        for name in names:
            if name == "flashcpp":
                continue
            d = diffs.get(name)
            res["peers"][name] = {"us": us[name], "status": "timed", "timing": timing[name], "diff": d,
                                  "agrees": None if d is None else bool(d <= tol), "note": notes.get(name, "")}
        res["ours_timing"] = timing["flashcpp"]
        # the peers in a fixed order in the CSV
        order = [x for x in PEERS if x in res["peers"]]
        res["peers"] = {x: res["peers"][x] for x in order}
        return res

    def _interleaved(self, names: List[str], graphs: Dict[str, Any], fns: Dict[str, Callable[[], Any]],
                     n: int) -> Dict[str, float]:
        """`repeats` rounds, each replaying every implementation once, the order rotated per round;
        the median per call in microseconds (CUDA events on a GPU, wall clock on the CPU)."""
        torch = self.torch
        times: Dict[str, List[float]] = {name: [] for name in names}
        ev = []
        for r in range(self.repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                if self.cuda:
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    self._replay(graphs[name], fns[name], n)
                    e.record()
                    ev.append((name, s, e))
                else:
                    t = time.perf_counter()
                    self._replay(graphs[name], fns[name], n)
                    times[name].append((time.perf_counter() - t) * 1e6 / n)
        self._sync()
        for name, s, e in ev:
            times[name].append(s.elapsed_time(e) * 1e3 / n)
        return {name: statistics.median(v) for name, v in times.items()}

    def _capture(self, fn: Callable[[], Any], n: int) -> Any:
        """A CUDA graph of n calls (None on the CPU: eager calls are timed there)."""
        torch = self.torch
        if not self.cuda:
            return None
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            fn()  # a warm-up on the capture's side stream
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.no_grad():
            for _ in range(n):
                fn()
        return g

    def _replay(self, graph: Any, fn: Callable[[], Any], n: int) -> None:
        if graph is not None:
            graph.replay()
        else:
            with self.torch.no_grad():
                for _ in range(n):
                    fn()

    def _flashinfer(self, p: Point, q, kc, vc, kp, vp, table, lens_list: List[int]) -> Tuple[Callable[[], Any], Any]:
        """FlashInfer's paged decode wrapper (CUDA-core path, CUDA-graph mode) on the same keys: the
        pool and table of a paged point, or the contiguous cache as in-order pages of 16 keys.
        Returns the call and its output buffer (B, Hq, D)."""
        torch = self.torch
        fi = self.peers["flashinfer"]
        B, N, Hq, Hkv, D = p.batch, p.context, p.heads_q, p.heads_kv, p.head_dim
        dev = q.device
        if p.page_size:
            page, pk, pv, pages = p.page_size, kp, vp, table
        else:
            page = 16
            pk, pv = kc.view(B * N // page, page, Hkv, D), vc.view(B * N // page, page, Hkv, D)
            pages = torch.arange(B * N // page, device=dev, dtype=torch.int32).view(B, N // page)
        n_pages = [(n + page - 1) // page for n in lens_list]
        npg = torch.tensor(n_pages, dtype=torch.int32, device=dev)
        indices = pages[torch.arange(pages.shape[1], device=dev)[None, :] < npg[:, None]].to(torch.int32).contiguous()
        cum = [0]
        for x in n_pages:
            cum.append(cum[-1] + x)
        indptr = torch.tensor(cum, dtype=torch.int32, device=dev)
        last = torch.tensor([n - (k - 1) * page for n, k in zip(lens_list, n_pages)], dtype=torch.int32, device=dev)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(self.fi_ws, "NHD", use_cuda_graph=True, use_tensor_cores=False,
                                                  paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                                                  paged_kv_last_page_len_buffer=last)
        w.plan(indptr, indices, last, Hq, Hkv, D, page, pos_encoding_mode="NONE", q_data_type=q.dtype,
               kv_data_type=q.dtype)
        q3 = q[:, 0]
        o = torch.empty_like(q3)

        def fn():
            return w.run(q3, (pk, pv), out=o)
        fn.keep = (w, indptr, indices, last)  # type: ignore[attr-defined]  # read at run time
        return fn, o

    def _fa4(self, p: Point, q, kc, vc, kp, vp, table, lens) -> Tuple[Optional[Callable[[], Any]], str, str]:
        """FA4's varlen forward for the point, probed: (call, "", note) or (None, why, "").

        Tries num_splits=0 (FA4's own heuristic) and, when split KV is refused, num_splits=1; with
        page_table on paged points. A refusal of one (paged, head_dim, group) variant is kept, so the
        variant is not compiled again."""
        torch = self.torch
        f, params = self.peers["fa4"]["fn"], self.peers["fa4"]["params"]
        kw: Dict[str, Any] = {"seqused_k": lens}
        if "causal" in params:  # one query token: causal or not is the same step
            kw["causal"] = False
        if "max_seqlen_k" in params:
            kw["max_seqlen_k"] = p.context
        if p.page_size:
            k, v = kp, vp
            kw["page_table"] = table
        else:
            k, v = kc, vc
        tries = [1] if self.fa4_split_refused else [0, 1]
        why = ""
        for ns in tries:
            def call(ns=ns):
                return f(q, k, v, num_splits=ns, **kw)
            try:
                with torch.no_grad():
                    call()
                self._sync()
                note = f"num_splits={ns}" + (" (FA4's heuristic)" if ns == 0 else "")
                if ns == 1 and self.fa4_split_refused:
                    note += f"; split KV refused: {self.fa4_split_refused[:100]}"
                return call, "", note
            except Exception as e:
                why = _first_line(e)
                if self._oom(e):
                    return None, why, ""
                if ns == 0 and "split" in str(e).lower():  # recorded once; one split from here on
                    self.fa4_split_refused = why
                    self.log(f"[decode grid] fa4: num_splits=0 refused ({why}); num_splits=1 from here on")
                # anything else refused with its heuristic is tried once more with one split
        return None, why, ""


# ---- entry points -------------------------------------------------------------------------------


_FULL_ORDER: List[Tuple[List[Point], int]] = []


def full_order() -> Tuple[List[Point], int]:
    """The whole grid in stratified order and its cover length (computed once per process)."""
    if not _FULL_ORDER:
        _FULL_ORDER.append(stratified_order(enumerate_points()))
    return list(_FULL_ORDER[0][0]), _FULL_ORDER[0][1]


def plan_points(subset: Optional[int]) -> Tuple[List[Point], List[Point], int, str]:
    """(all points in stratified order, the selected ones, cover length, how they were selected)."""
    ordered, cover = full_order()
    selected, how = select_points(ordered, cover, subset)
    return ordered, selected, cover, how


def fit_memory(points: Sequence[Point], free_bytes: int, sdpa: bool,
               margin: int = MEMORY_MARGIN_BYTES) -> Tuple[List[Point], str]:
    """The points whose caches fit the device: the K/V pools hold the largest point, and with SDPA
    peers a contiguous copy of the largest contiguous one, so a cache may take half of what is free
    (less a margin for workspaces and graphs) with SDPA, all of it without. On an H200 every point fits."""
    budget = max(0, free_bytes - margin) // (2 if sdpa else 1)
    kept = [p for p in points if kv_capacity_bytes(p.batch, p.context, p.heads_kv, p.head_dim) <= budget]
    dropped = len(points) - len(kept)
    if not dropped:
        return list(points), f"every selected point fits the device ({free_bytes / 1e9:.0f} GB free)"
    return kept, (f"{dropped} points left out: their KV cache is over {budget / 1e9:.1f} GB, what "
                  f"{free_bytes / 1e9:.0f} GB free allows{' with the SDPA copy' if sdpa else ''}")


def describe_estimate(selected: Sequence[Point], peers: Sequence[str], repeats: int, max_seconds: Optional[float],
                      cover: int) -> List[str]:
    est = estimate(selected, peers, repeats)
    by_layout: Dict[str, int] = {}
    for p in selected:
        by_layout[p.layout] = by_layout.get(p.layout, 0) + 1
    lines = [f"[decode grid] {len(selected)} points ({', '.join(f'{k} {v}' for k, v in by_layout.items())}), "
             f"peers {', '.join(peers) or 'none'}, {repeats} timed replays each",
             f"[decode grid] estimate: {est['total_s']:.0f} s = device {est['device_s']:.0f} s + host "
             f"{est['host_s']:.0f} s + compiles {est['compile_s']:.0f} s (model: {EST_TBPS} TB/s, "
             f"{EST_HOST_S_POINT * 1e3:.0f} ms + {EST_HOST_S_PEER * 1e3:.0f} ms per implementation of host time "
             f"a point)",
             f"[decode grid] the first {cover} points of the order cover every (heads, head_dim) class, batch, "
             f"context and layout"]
    if max_seconds is not None:
        k = fit_count(selected, peers, repeats, max_seconds)
        lines.append(f"[decode grid] --grid-max-seconds {max_seconds:g}: about {k} of {len(selected)} points fit "
                     f"by the model ({'the cover fits' if k >= cover else 'NOT the whole cover'}); the run "
                     f"re-estimates from its measured host time per point")
    return lines


def dry_run(out: str, subset: Optional[int], max_seconds: Optional[float], repeats: int,
            peers: Sequence[str]) -> int:
    """No GPU: the order, the selection and the estimate, with grid_plan.csv listing the points."""
    os.makedirs(out, exist_ok=True)
    ordered, selected, cover, how = plan_points(subset)
    log = Log(None)
    log(f"[decode grid] dry run: {how}")
    for line in describe_estimate(selected, peers, repeats, max_seconds, cover):
        log(line)
    path = os.path.join(out, "grid_plan.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["order", "case", "layout", "batch", "context", "heads_q", "heads_kv", "head_dim", "page_size",
                    "ragged", "kv_capacity_bytes", "kv_bytes", "peers", "est_s"])
        for i, p in enumerate(selected):
            w.writerow([i, p.name, p.layout, p.batch, p.context, p.heads_q, p.heads_kv, p.head_dim, p.page_size,
                        int(p.ragged), kv_capacity_bytes(p.batch, p.context, p.heads_kv, p.head_dim), kv_read_bytes(p),
                        ";".join(peers_at(p, peers)), round(est_point_s(p, peers, repeats), 4)])
    log(f"[decode grid] wrote {path} ({len(selected)} points)")
    return 0


def run_grid(out: str, subset: Optional[int] = None, max_seconds: Optional[float] = None, repeats: int = 5,
             peers: Sequence[str] = PEERS, t0: Optional[float] = None) -> int:
    """Times the grid on the GPU; writes grid.csv, grid_env.json, grid_log.txt, grid_heatmap.png."""
    import signal

    t0 = time.time() if t0 is None else t0
    import torch

    import flashcpp
    from .common import ceilings, environment, write_json

    if not torch.cuda.is_available() or not flashcpp.WITH_CUDA:
        print("[decode grid] needs a CUDA device and a flashcpp build with FLASHCPP_CUDA=ON", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    log = Log(os.path.join(out, "grid_log.txt"))
    ordered, selected, cover, how = plan_points(subset)
    have, about, why = _probe_peers(peers)
    active = [x for x in peers if x in have]
    selected, mem_note = fit_memory(selected, torch.cuda.mem_get_info()[0], any(x in have for x in SDPA_PEERS))
    if not selected:
        log(f"[decode grid] no point to time: {mem_note}")
        return 1
    env: Dict[str, Any] = environment()
    env.update(ceilings())
    env["date"] = time.strftime("%Y-%m-%d")
    env["grid"] = {"batches": list(BATCHES), "contexts": list(CONTEXTS), "heads": [list(h) for h in HEADS],
                   "head_dims": list(HEAD_DIMS), "layouts": [name for name, _, _ in LAYOUTS],
                   "ragged": f"contiguous and page 16, batch >= {RAGGED_MIN_BATCH}, lengths uniform in "
                             f"[context // {RAGGED_MIN_FRACTION}, context]",
                   "kv_limit_bytes": KV_LIMIT_BYTES, "points": len(ordered), "cover": cover, "selected": how,
                   "device_memory": mem_note, "max_seconds": max_seconds}
    env["peers"] = {x: about[x] for x in active}
    env["peers_not_used"] = why
    env["peers_per_layout"] = "SDPA (torch_cudnn, torch_flash) on contiguous caches only; flashinfer and fa4 on all"
    env["timing"] = (f"CUDA graphs of calls_per_replay calls (~{TARGET_REPLAY_US:.0f} us of work, at most "
                     f"{MAX_CALLS_PER_REPLAY}), one untimed replay, then {repeats} replays interleaved across the "
                     f"implementations in rotating order, CUDA events; median replay / calls")
    log(f"[decode grid] {env['gpu']}, torch {env['torch']}, cuDNN {env['cudnn']}, {env['git_commit']}; {how}; "
        f"{mem_note}")
    for x in active:
        log(f"[decode grid] peer {x}: {about[x]}")
    for x, w in why.items():
        log(f"[decode grid] peer {x} NOT USED: {w}")
    for line in describe_estimate(selected, active, repeats, max_seconds, cover):
        log(line)
    env_path = os.path.join(out, "grid_env.json")
    write_json(env_path, env)

    stop = {"flag": False}

    def on_term(signum, frame):  # finish the point under way, then write what was timed
        stop["flag"] = True
    old = signal.signal(signal.SIGTERM, on_term)
    sink = CsvStream(os.path.join(out, "grid.csv"))
    try:
        measure = Measure(torch, have, selected, repeats, log)

        def progress(d: Dict[str, Any]) -> None:
            env["progress"] = d
            env["peer_refusals"] = measure.refusals
            write_json(env_path, env)
        summary = run_points(selected, measure, sink, env, active, repeats, log, max_seconds=max_seconds, t0=t0,
                             stop=lambda: stop["flag"], on_progress=progress)
        env["peer_refusals"] = measure.refusals
        env["fa4_split_kv"] = measure.fa4_split_refused or ("not refused" if "fa4" in have else "")
    finally:
        signal.signal(signal.SIGTERM, old)
    env.pop("progress", None)
    env["run"] = summary
    rows = read_rows(sink.path)
    title = (f"Decode grid on {env['gpu']}: best peer / flashcpp ({', '.join(active)}), {env['git_commit']}, "
             f"{env['date']}; {summary['timed_points']} of {len(ordered)} points")
    env["heatmap"] = draw_heatmap(rows, os.path.join(out, "grid_heatmap.png"), title)
    env["wall_s"] = round(time.time() - t0, 1)
    write_json(env_path, env)
    log(f"[decode grid] {summary['timed_points']} points timed ({summary['stopped']}; {summary['left_out_for_time']} "
        f"left out for time, {summary['failed_points']} failed), {sink.rows} rows in {sink.path}")
    if "best_peer_speedup_min_median_max" in summary:
        lo, med, hi = summary["best_peer_speedup_min_median_max"]
        log(f"[decode grid] best_peer speedup min {lo} median {med} max {hi}; "
            f"{summary['points_below_1x_best_peer']} points below 1.0x")
    for x, w in why.items():
        log(f"[decode grid] peer {x} was not used: {w}")
    for x, reasons in measure.refusals.items():
        for r, c in reasons.items():
            log(f"[decode grid] {x} refused {c} points: {r}")
    log(f"[decode grid] {env['heatmap']}; {env_path}; {env['wall_s']} s")
    return 0
