"""The decode grid's CPU side (flashcpp.bench.decode_grid): the enumeration and its 40 GB pruning
against the formula, the stratified order and its subsets, the ragged lengths, the best_peer rows,
the CSV written as points finish, the deadline, the heatmap, a dry run of the command line, and the
measurement's wiring on the CPU backend. No GPU; a few seconds."""
import csv
import itertools
import os
import sys

import pytest

from flashcpp.bench import decode_grid as g

LIMIT = 40 * 10 ** 9


def _shapes():
    """Every (batch, context, (heads_q, heads_kv), head_dim) of the issue's grid, written out here
    rather than read from the module, so a changed axis fails the counts below."""
    return list(itertools.product([1, 2, 3, 4, 8, 16, 32, 64, 128, 256], [512, 2048, 8192, 32768, 131072],
                                  [(32, 32), (32, 8), (64, 8), (16, 2), (8, 1)], [64, 128, 256]))


def _kv_bytes(b, n, hkv, d):
    return b * n * hkv * d * 2 * 2  # K and V, bf16


@pytest.fixture(scope="module")
def order():
    return g.full_order()


def test_enumeration_is_the_grid_pruned_at_40_gb():
    shapes = _shapes()
    assert len(shapes) == 750
    kept = [(b, n, h, d) for b, n, h, d in shapes if _kv_bytes(b, n, h[1], d) <= LIMIT]
    assert len(kept) == 716
    ragged = [s for s in kept if s[0] >= 4]
    assert len(ragged) == 491
    pts = g.enumerate_points()
    assert len(pts) == 3 * 716 + 2 * 491 == 3130
    want = {(b, n, hq, hkv, d, ps, False) for b, n, (hq, hkv), d in kept for ps in (0, 16, 64)}
    want |= {(b, n, hq, hkv, d, ps, True) for b, n, (hq, hkv), d in ragged for ps in (0, 16)}
    assert {tuple(p) for p in pts} == want
    assert len(set(pts)) == len(pts)
    by_layout = {}
    for p in pts:
        by_layout[p.layout] = by_layout.get(p.layout, 0) + 1
    assert by_layout == {"contiguous": 716, "paged16": 716, "paged64": 716, "ragged": 491, "ragged_paged16": 491}


def test_pruning_is_the_kv_formula_at_the_limit():
    # the anchor's cache (B1, 32 KV heads, 8192 keys, d128) is the decode bench's kv_bytes
    assert g.kv_capacity_bytes(1, 8192, 32, 128) == 134217728
    kept = {(p.batch, p.context, p.heads_kv, p.head_dim) for p in g.enumerate_points()}
    assert (64, 131072, 8, 128) in kept            # 34.4e9 bytes
    assert (128, 131072, 8, 128) not in kept       # 68.7e9
    assert (256, 131072, 32, 256) not in kept      # 1.1e12
    assert max(g.kv_capacity_bytes(b, n, h, d) for b, n, h, d in kept) == 2 ** 35
    # the bound is <=: at exactly 2^35 bytes the shapes of that size are in, one byte less they are out
    at = [s for s in _shapes() if _kv_bytes(s[0], s[1], s[2][1], s[3]) == 2 ** 35]
    n_at = sum(3 + 2 * (s[0] >= 4) for s in at)
    assert n_at > 0
    assert len(g.enumerate_points(2 ** 35)) - len(g.enumerate_points(2 ** 35 - 1)) == n_at


def test_order_is_deterministic_and_covers_every_stratum_first(order):
    ordered, cover = order
    pts = g.enumerate_points()
    assert sorted(ordered) == sorted(pts)
    assert g.stratified_order(pts) == (ordered, cover)  # computed again, the same
    strata = {"class": lambda p: p.cls, "batch": lambda p: p.batch, "context": lambda p: p.context,
              "layout": lambda p: p.layout}
    every = {k: {f(p) for p in pts} for k, f in strata.items()}
    assert [len(v) for v in every.values()] == [15, 10, 5, 5]
    assert cover == 15  # one point per (heads, head_dim) class is the least possible
    for k, f in strata.items():
        assert {f(p) for p in ordered[:cover]} == every[k], k
    assert any({f(p) for p in ordered[:cover - 1]} != every[k] for k, f in strata.items())
    for n in (100, 500):  # balanced prefixes: every batch and layout the same number of times
        for k in ("batch", "layout"):
            counts = {}
            for p in ordered[:n]:
                counts[strata[k](p)] = counts.get(strata[k](p), 0) + 1
            assert max(counts.values()) - min(counts.values()) <= 1, (n, k, counts)


def test_subsets_are_prefixes_never_shorter_than_the_cover(order):
    ordered, cover = order
    sel, how = g.select_points(ordered, cover, 3)
    assert sel == ordered[:cover] and "raised to 15" in how
    sel, how = g.select_points(ordered, cover, 40)
    assert sel == ordered[:40] and "raised" not in how
    sel, how = g.select_points(ordered, cover, None)
    assert sel == ordered and how == "all 3130 points"


def test_ragged_lengths_are_seeded_and_bounded():
    p = g.Point(16, 8192, 32, 8, 128, 0, True)
    lens = g.ragged_lengths(p)
    assert lens == g.ragged_lengths(g.Point(16, 8192, 32, 8, 128, 0, True))
    assert len(lens) == 16 and all(8192 // 16 <= n <= 8192 for n in lens) and len(set(lens)) > 1
    assert g.kv_read_bytes(p) == sum(lens) * 8 * 128 * 4
    q = p._replace(ragged=False)
    assert g.ragged_lengths(q) == [8192] * 16 and g.kv_read_bytes(q) == g.kv_capacity_bytes(16, 8192, 8, 128)
    assert g.ragged_lengths(p._replace(page_size=16)) == lens  # both ragged layouts of a shape alike
    assert g.ragged_lengths(p._replace(heads_q=64)) != lens  # another shape, other lengths


def _peer(us, agrees=True, diff=1e-3):
    return {"us": us, "status": "timed", "timing": "cuda_graph_median", "diff": diff, "agrees": agrees, "note": ""}


def test_best_peer_is_the_fastest_agreeing_peer():
    """best_peer = the peer of the largest throughput (max peer_tbps, min peer_us) among those that
    agree with ours, so its speedup is the smallest of the peers' speedups: ours against the best."""
    p = g.Point(4, 2048, 32, 8, 128)
    res = {"ours_us": 10.0, "splits": 2, "ctas": 64, "calls_per_replay": 30, "repeats": 5, "l2_resident": True,
           "peers": {"torch_cudnn": _peer(12.0), "torch_flash": _peer(15.5),
                     "flashinfer": _peer(9.0), "fa4": {"us": None, "status": "refused: AssertionError: paged"}}}
    rows = g.point_rows(p, res, {"gpu": "H200", "git_commit": "abc"}, 7)
    assert [r["peer"] for r in rows] == ["torch_cudnn", "torch_flash", "flashinfer", "fa4", "best_peer"]
    assert all(set(r) <= set(g.COLUMNS) for r in rows)
    timed = [r for r in rows[:-1] if r["speedup"] != ""]
    assert [r["speedup"] for r in timed] == [1.2, 1.55, 0.9]
    best = rows[-1]
    assert best["best_of"] == "flashinfer" and best["peer_us"] == 9.0
    assert best["peer_tbps"] == max(r["peer_tbps"] for r in timed)
    assert best["speedup"] == min(r["speedup"] for r in timed) == 0.9
    assert rows[3]["speedup"] == "" and rows[3]["status"].startswith("refused")
    kv = 4 * 2048 * 8 * 128 * 4
    assert all(r["kv_bytes"] == kv and r["ours_tbps"] == round(kv / 10.0 / 1e6, 3) for r in rows)
    assert rows[0]["peer_tbps"] == round(kv / 12.0 / 1e6, 3) and best["l2_resident"] == 1 and best["point"] == 7
    # a peer that disagrees with ours is not the best, however fast
    res["peers"]["flashinfer"] = _peer(5.0, agrees=False, diff=0.3)
    best = g.point_rows(p, res, {}, 7)[-1]
    assert best["best_of"] == "torch_cudnn" and best["speedup"] == 1.2
    # no peer timed: the row says so instead of a ratio
    best = g.point_rows(p, {"ours_us": 10.0, "peers": {}}, {}, 7)[-1]
    assert best["speedup"] == "" and best["best_of"] == "" and "no peer" in best["note"]
    best = g.point_rows(p, {"ours_us": None, "ours_status": "plan refused: X", "peers": {"fa4": _peer(3.0)}}, {}, 7)[-1]
    assert best["speedup"] == "" and "flashcpp did not run" in best["note"]


def _fake_measure(p, i):
    us = g.est_call_us(p)
    return {"ours_us": us, "repeats": 5, "calls_per_replay": 1,
            "peers": {name: _peer(us * (1.1 if name == "flashinfer" else 1.5)) for name in g.peers_at(p, g.PEERS)}}


def test_the_csv_keeps_every_finished_point_when_the_run_is_killed(tmp_path, order):
    ordered, _ = order
    pts = ordered[:6]
    sink = g.CsvStream(str(tmp_path / "grid.csv"))

    def measure(p, i):
        if i == 3:
            raise KeyboardInterrupt  # a kill in the middle of the fourth point
        return _fake_measure(p, i)
    with pytest.raises(KeyboardInterrupt):
        g.run_points(pts, measure, sink, {}, list(g.PEERS), 5, lambda s: None)
    with open(sink.path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        assert reader.fieldnames == g.COLUMNS
    want = sum(len(g.peers_at(p, g.PEERS)) + 1 for p in pts[:3])
    assert len(rows) == want == sink.rows
    assert [r["case"] for r in rows if r["peer"] == "best_peer"] == [p.name for p in pts[:3]]
    assert all(r["best_of"] == "flashinfer" and float(r["speedup"]) == 1.1 for r in rows if r["peer"] == "best_peer")


def test_the_deadline_and_sigterm_stop_starting_points(tmp_path, order):
    ordered, _ = order
    clock = {"t": 0.0}

    def measure(p, i):
        clock["t"] += 1.0
        return _fake_measure(p, i)
    sink = g.CsvStream(str(tmp_path / "a.csv"))
    # 1 s a point; a point starts only if it ends FINISH_RESERVE_S before the limit: 5 of 20
    s = g.run_points(ordered[:20], measure, sink, {}, list(g.PEERS), 5, lambda m: None,
                     max_seconds=g.FINISH_RESERVE_S + 5, clock=lambda: clock["t"], t0=0.0)
    assert (s["timed_points"], s["left_out_for_time"]) == (5, 15) and s["stopped"].startswith("deadline")
    stop_after = {"n": 0}

    def measure2(p, i):
        stop_after["n"] += 1
        return _fake_measure(p, i)
    s = g.run_points(ordered[:20], measure2, g.CsvStream(str(tmp_path / "b.csv")), {}, list(g.PEERS), 5,
                     lambda m: None, stop=lambda: stop_after["n"] >= 2)
    assert s["timed_points"] == 2 and s["stopped"] == "stopped by SIGTERM"

    def broken(p, i):
        if i == 1:
            raise RuntimeError("boom")
        return _fake_measure(p, i)
    sink = g.CsvStream(str(tmp_path / "c.csv"))
    s = g.run_points(ordered[:3], broken, sink, {}, list(g.PEERS), 5, lambda m: None)
    assert s["timed_points"] == 3 and s["failed_points"] == 1
    bad = [r for r in g.read_rows(sink.path) if r["case"] == ordered[1].name]
    assert len(bad) == 1 and "RuntimeError: boom" in bad[0]["note"]


def test_estimate_adds_up_and_fits_the_cover_in_six_minutes(order):
    ordered, cover = order
    est = g.estimate(ordered, list(g.PEERS), 5)
    assert est["points"] == 3130
    assert abs(est["total_s"] - (est["device_s"] + est["host_s"] + est["compile_s"])) < 0.2
    # FlashInfer: 3 head dims; FA4: 3 head dims x groups {1, 4, 8} x (contiguous, paged)
    assert est["compile_s"] == pytest.approx(3 * g.EST_JIT_S["flashinfer"] + 18 * g.EST_JIT_S["fa4"])
    k = g.fit_count(ordered, list(g.PEERS), 5, 330)
    assert cover <= k < len(ordered)
    assert g.fit_count(ordered, [], 5, 1e6) == len(ordered)


def test_heatmap_drawn_or_said_not(tmp_path, monkeypatch, order):
    ordered, _ = order
    rows = []
    for i, p in enumerate(ordered[:120]):
        rows += g.point_rows(p, _fake_measure(p, i), {}, i)
    rows = [{k: str(v) for k, v in r.items()} for r in rows]  # as read back from the CSV
    path = str(tmp_path / "h.png")
    try:
        import matplotlib  # noqa: F401
        msg = g.draw_heatmap(rows, path, "t", dpi=40)
        assert msg == f"heatmap drawn: {path} (120 points)" and os.path.getsize(path) > 5000
    except ImportError:
        pass
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path2 = str(tmp_path / "h2.png")
    msg = g.draw_heatmap(rows, path2, "t")
    assert msg.startswith("heatmap not drawn: matplotlib does not import") and not os.path.exists(path2)


def test_dry_run_of_the_command_line(tmp_path, capsys):
    from flashcpp.bench import decode
    out = str(tmp_path / "dry")
    assert decode.main(["--grid", "--grid-dry-run", "--grid-subset", "20", "--grid-max-seconds", "360",
                        "--out", out]) == 0
    text = capsys.readouterr().out
    assert "the first 20 of 3130 points" in text and "estimate:" in text and "--grid-max-seconds 360" in text
    with open(os.path.join(out, "grid_plan.csv"), newline="") as f:
        plan = list(csv.DictReader(f))
    assert len(plan) == 20 and [int(r["order"]) for r in plan] == list(range(20))
    assert all(r["peers"] == "flashinfer;fa4" for r in plan if int(r["page_size"]))
    assert all(r["peers"] == "torch_cudnn;torch_flash;flashinfer;fa4" for r in plan if not int(r["page_size"]))
    with pytest.raises(SystemExit):
        decode.main(["--grid", "--grid-dry-run", "--grid-peers", "cudnn", "--out", out])


def test_measure_wiring_on_the_cpu_backend(tmp_path, monkeypatch):
    """The per-point code (views of the pools, page tables, ragged lengths, the SDPA mask, the
    comparison with ours, the rows) on flashcpp's CPU backend; the times mean nothing here."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(g, "MAX_CALLS_PER_REPLAY", 2)
    pts = [g.Point(2, 64, 4, 2, 64), g.Point(4, 128, 8, 1, 128, 16, True), g.Point(3, 256, 4, 4, 64, 64),
           g.Point(4, 64, 8, 8, 64, 0, True)]
    peers = {"torch_cudnn": "torch_cudnn", "torch_flash": "torch_flash"}
    m = g.Measure(torch, peers, pts, 2, lambda s: None, device="cpu")
    sink = g.CsvStream(str(tmp_path / "grid.csv"))
    s = g.run_points(pts, m, sink, {"gpu": "cpu"}, list(peers), 2, lambda s: None)
    assert s["timed_points"] == 4 and s["failed_points"] == 0
    rows = g.read_rows(sink.path)
    for p in pts:
        mine = [r for r in rows if r["case"] == p.name]
        assert float(mine[0]["ours_us"]) > 0 and int(mine[0]["kv_bytes"]) == g.kv_read_bytes(p)
        names = [r["peer"] for r in mine]
        assert names == (["best_peer"] if p.page_size else ["torch_cudnn", "torch_flash", "best_peer"])
        for r in mine[:-1]:  # each SDPA backend either ran and agrees with ours, or says why not
            assert (r["agrees"] == "yes" and r["status"] == "timed") or r["status"].startswith("refused: "), r
    assert any(r["peer"] == "torch_flash" and r["agrees"] == "yes" and r["ragged"] == "1" for r in rows)


def test_points_over_the_device_memory_are_left_out_and_said(order):
    ordered, _ = order
    big = g.kv_capacity_bytes(64, 131072, 8, 128)  # 2^35, the largest
    kept, why = g.fit_memory(ordered, 141 * 10 ** 9, sdpa=True)  # an H200: pools + SDPA copy fit
    assert kept == ordered and "every selected point fits" in why
    kept, why = g.fit_memory(ordered, 2 * big + g.MEMORY_MARGIN_BYTES - 1, sdpa=True)
    over = [p for p in ordered if g.kv_capacity_bytes(p.batch, p.context, p.heads_kv, p.head_dim) == big]
    assert len(kept) == len(ordered) - len(over) and f"{len(over)} points left out" in why
    assert g.fit_memory(ordered, big + g.MEMORY_MARGIN_BYTES, sdpa=False)[0] == ordered


def _fake_fa4_module(monkeypatch, calls, with_page_table=True):
    """A stand-in flash_attn.cute whose flash_attn_varlen_func refuses as FA4's sm90 path may:
    page_table ("paged KV not supported on SM 9.0") and num_splits != 1 ("SplitKV not supported"),
    and otherwise computes decode over seqused_k keys."""
    import types
    torch = pytest.importorskip("torch")

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                               seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                               num_splits=1, pack_gqa=None, return_lse=False):
        calls.append((page_table is not None, num_splits))
        assert page_table is None, "paged KV not supported on SM 9.0"
        assert num_splits == 1, "SplitKV not supported on SM 9.0"
        b, n, hkv, d = k.shape
        hq = q.shape[2]
        keep = torch.arange(n)[None, :] < seqused_k[:, None]
        kk, vv = (x.transpose(1, 2).float().repeat_interleave(hq // hkv, 1) for x in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), kk, vv,
                                                             attn_mask=keep[:, None, None, :])
        return o.transpose(1, 2).to(q.dtype), None
    if not with_page_table:
        def flash_attn_varlen_func(q, k, v, seqused_k=None, num_splits=1):  # noqa: F811
            raise AssertionError("not called")
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = flash_attn_varlen_func
    pkg = types.ModuleType("flash_attn")
    pkg.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return torch


def test_fa4_is_probed_and_each_refusal_recorded(tmp_path, monkeypatch):
    calls = []
    torch = _fake_fa4_module(monkeypatch, calls)
    monkeypatch.setattr(g, "MAX_CALLS_PER_REPLAY", 2)
    have, about, why = g._probe_peers(["fa4"])
    assert "fa4" in have and not why and "flash_attn_varlen_func" in about["fa4"]
    pts = [g.Point(2, 64, 4, 2, 64), g.Point(2, 64, 4, 2, 64, 16), g.Point(2, 128, 4, 2, 64, 64),
           g.Point(4, 128, 8, 1, 128, 0, True)]
    logged = []
    m = g.Measure(torch, have, pts, 2, logged.append, device="cpu")
    sink = g.CsvStream(str(tmp_path / "grid.csv"))
    g.run_points(pts, m, sink, {}, ["fa4"], 2, lambda s: None)
    rows = [r for r in g.read_rows(sink.path) if r["peer"] == "fa4"]
    assert [r["status"].split(":")[0] for r in rows] == ["timed", "refused", "refused", "timed"]
    assert rows[0]["agrees"] == "yes" and rows[3]["agrees"] == "yes"  # ragged: seqused_k honoured
    assert "num_splits=1" in rows[0]["note"] and "SplitKV not supported" in rows[0]["note"]
    assert "paged KV not supported on SM 9.0" in rows[1]["status"] == rows[2]["status"]
    # split KV tried once (heuristic 0), paged tried once per (paged, head_dim, group) variant
    assert calls.count((False, 0)) == 1 and calls.count((True, 1)) == 1
    assert m.fa4_split_refused.startswith("AssertionError: SplitKV")
    assert list(m.refusals["fa4"].values()) == [2]
    assert any("num_splits=1 from here on" in s for s in logged)
    best = [r for r in g.read_rows(sink.path) if r["peer"] == "best_peer"]
    assert [b["best_of"] for b in best] == ["fa4", "", "", "fa4"]


def test_fa4_without_the_decode_keywords_is_skipped_with_its_signature(monkeypatch):
    _fake_fa4_module(monkeypatch, [], with_page_table=False)
    have, about, why = g._probe_peers(["fa4", "flashinfer"])
    assert "fa4" not in have and "has no page_table" in why["fa4"] and "seqused_k" in why["fa4"]
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    have, about, why = g._probe_peers(["fa4"])
    assert why["fa4"].startswith("does not import (flash_attn.cute.flash_attn_varlen_func: ")


def test_run_grid_writes_its_files_and_says_which_peers_it_lacks(tmp_path, monkeypatch):
    """run_grid's own steps (selection, peers, env, log, CSV, heatmap, SIGTERM handler) with the
    measurement on the CPU backend and four small points standing in for the grid."""
    torch = pytest.importorskip("torch")
    import json

    import flashcpp
    from flashcpp.bench import common
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (100 * 10 ** 9, 141 * 10 ** 9))
    monkeypatch.setattr(flashcpp, "WITH_CUDA", True)
    monkeypatch.setattr(common, "environment", lambda: {"gpu": "CPU stand-in", "torch": torch.__version__,
                                                        "cudnn": None, "git_commit": "test"})
    monkeypatch.setattr(common, "ceilings", lambda: {"copy_tbps": 0.0})
    pts = [g.Point(2, 64, 32, 8, 64), g.Point(4, 128, 8, 1, 128, 16, True), g.Point(3, 64, 16, 2, 256, 64),
           g.Point(4, 64, 32, 32, 64, 0, True)]
    monkeypatch.setattr(g, "plan_points", lambda subset: (pts, pts, 4, "the four test points"))
    real = g.Measure
    monkeypatch.setattr(g, "Measure", lambda *a, **k: real(*a, device="cpu", **k))
    monkeypatch.setattr(g, "MAX_CALLS_PER_REPLAY", 2)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not importable, as on a machine without it
    monkeypatch.setattr(g, "draw_heatmap", lambda rows, path, title: f"heatmap stand-in ({len(rows)} rows)")
    out = str(tmp_path / "grid")
    assert g.run_grid(out, repeats=2, peers=["torch_flash", "flashinfer"]) == 0
    env = json.load(open(os.path.join(out, "grid_env.json")))
    assert env["peers_not_used"]["flashinfer"].startswith("does not import")
    assert list(env["peers"]) == ["torch_flash"] and env["run"]["timed_points"] == 4
    assert env["run"]["stopped"] == "complete" and env["heatmap"].startswith("heatmap ")
    log = open(os.path.join(out, "grid_log.txt")).read()
    assert "peer flashinfer NOT USED: does not import" in log and "estimate:" in log
    rows = g.read_rows(os.path.join(out, "grid.csv"))
    assert len([r for r in rows if r["peer"] == "best_peer"]) == 4
    assert all(r["peer"] in ("torch_flash", "best_peer") for r in rows)
