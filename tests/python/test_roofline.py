"""flashcpp.bench.roofline: the points and the fraction of the roof from small hand-made CSVs
(no GPU: the counting rules are what is tested; the figures of a real run come from make bench)."""
import csv
import json
import os

import pytest

from bench_csv import write_csv
from flashcpp.bench import roofline


@pytest.fixture
def reports(tmp_path):
    d = str(tmp_path)
    os.makedirs(os.path.join(d, "prefill"))
    json.dump({"gpu": "test GPU", "gemm_bf16_tflops": 800.0, "copy_tbps": 4.0},
              open(os.path.join(d, "prefill", "benchmark_env.json"), "w"))
    # attention: (1, 8, 4096, 128) non-causal at 500 TFLOP/s; the same case twice (two peers)
    flops = 4 * 8 * 4096 * 4096 * 128
    us = flops / 500e12 * 1e6
    row = {"case": "a", "peer": "cudnn", "ours_us": us, "batch": 1, "heads_q": 8, "heads_kv": 8, "seqlen_q": 4096,
           "seqlen_k": 4096, "head_dim": 128, "ours_tflops": 500.0}
    write_csv(os.path.join(d, "hopper", "benchmark.csv"), [row, dict(row, peer="flash")])
    # decode: 1 x 32 heads x 8192 keys x d128, KV 128 MiB read in 40 us
    write_csv(os.path.join(d, "decode", "benchmark.csv"),
              [{"case": "dec", "ours_us": 40.0, "heads_q": 32, "seqlen_q": 1, "head_dim": 128, "kv_tokens": 8192,
                "kv_bytes": 2 * 32 * 8192 * 128 * 2}])
    # fused: SwiGLU 8192 x 14336 moving 3 tensors
    write_csv(os.path.join(d, "fused", "benchmark.csv"),
              [{"case": "sw", "ours_us": 170.0, "kernel": "swiglu_fused", "rows": 8192, "d": 14336,
                "bytes": 3 * 8192 * 14336 * 2}])
    return d


def test_points_and_roof(reports):
    pts = {p["case"]: p for p in roofline.points(reports)}
    assert set(pts) == {"a", "dec", "sw"}  # one point per case, not per peer row
    a = pts["a"]
    assert a["intensity"] == pytest.approx(4 * 4096 * 4096 * 128 * 8 / (2 * 128 * 8 * 4 * 4096), rel=1e-3)
    assert a["tflops"] == pytest.approx(500.0, rel=1e-3)
    dec = pts["dec"]
    assert dec["intensity"] == pytest.approx(1.0, rel=1e-3)  # MHA decode: 4D FLOPs per key and head, 4D bytes of K and V
    assert dec["tbps"] == pytest.approx(2 * 32 * 8192 * 128 * 2 / 40e-6 / 1e12, rel=1e-3)
    ceil = roofline.ceilings(reports)
    # compute-bound point: 500 of 800; memory-bound point: its TB/s over 4.0
    assert roofline.attained_fraction(a, ceil) == pytest.approx(500 / 800, rel=1e-3)
    assert roofline.attained_fraction(dec, ceil) == pytest.approx(dec["tbps"] / 4.0, rel=1e-3)


def test_write_csv_and_plot(reports):
    pytest.importorskip("matplotlib")
    pts = roofline.write(reports)
    rows = list(csv.DictReader(open(os.path.join(reports, "roofline.csv"))))
    assert len(rows) == len(pts) == 3 and all(r["frac_of_roof"] for r in rows)
    assert os.path.getsize(os.path.join(reports, "roofline.png")) > 1000


def test_no_ceilings_no_fraction(tmp_path):
    write_csv(os.path.join(str(tmp_path), "decode", "benchmark.csv"),
              [{"case": "dec", "ours_us": 40.0, "heads_q": 32, "seqlen_q": 1, "head_dim": 128, "kv_tokens": 8192,
                "kv_bytes": 1 << 27}])
    pts = roofline.write(str(tmp_path))
    assert len(pts) == 1 and pts[0]["frac_of_roof"] == ""
    assert not os.path.exists(os.path.join(str(tmp_path), "roofline.png"))
