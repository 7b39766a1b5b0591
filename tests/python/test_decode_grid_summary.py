"""flashcpp.bench.decode_grid_summary on a small synthetic grid.csv: the headline, the bandwidth bar,
the batch x context medians, the classes, and the comparison of two runs."""
import csv

import pytest

from flashcpp.bench import decode_grid_summary as dgs

FIELDS = ["case", "peer", "ours_us", "speedup", "batch", "heads_q", "heads_kv", "seqlen_k", "head_dim", "layout",
          "kv_bytes", "ours_tbps", "best_of"]


def write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(r)
            # a peer row of the same point: never read by the summary
            w.writerow(dict(r, peer="torch_cudnn", speedup="9.9"))


def point(case, us, speedup, batch=1, ctx=512, hq=32, hkv=8, d=128, layout="contiguous", gb=0.1, tbps=1.0,
          best="torch_cudnn"):
    return {"case": case, "peer": "best_peer", "ours_us": us, "speedup": speedup, "batch": batch, "heads_q": hq,
            "heads_kv": hkv, "seqlen_k": ctx, "head_dim": d, "layout": layout, "kv_bytes": int(gb * 1e9),
            "ours_tbps": tbps, "best_of": best}


@pytest.fixture
def grids(tmp_path):
    old = [point("a", 10.0, 0.5), point("b", 20.0, 0.9, ctx=2048), point("c", 100.0, 1.2, batch=4, gb=2.0, tbps=4.2),
           point("d", 200.0, 1.1, layout="paged16", gb=3.0, tbps=3.0, best="fa4")]
    new = [point("a", 8.0, 0.625), point("b", 20.0, 0.9, ctx=2048), point("c", 110.0, 1.09, batch=4, gb=2.0, tbps=3.8),
           point("e", 5.0, 1.5)]
    po, pn = tmp_path / "old.csv", tmp_path / "new.csv"
    write(po, old)
    write(pn, new)
    return str(po), str(pn)


def test_summary_tables(grids, capsys):
    old, _ = grids
    assert dgs.main([old]) == 0
    out = capsys.readouterr().out
    assert "**4 points; best-peer speedup min 0.500x, median 1.000x, max 1.200x; 2 below 1.0x.**" in out
    assert "Bandwidth bar (>= 3.9 TB/s where KV >= 1 GB): 1 of 2 points meet it." in out
    assert "| paged16 | 128 | 1 | 3.00 | 3.00 | 1 |" in out
    assert "| 1 | 0.50 | 0.90 |" in out  # contiguous, batch 1: contexts 512 and 2048
    assert "| 4 | 1.20 | - |" in out
    assert "| 32/8 | 128 | 4 | 0.50 | 1.00 | 2 | torch_cudnn 2 |" in out


def test_compare_two_runs(grids, capsys, tmp_path):
    old, new = grids
    md = tmp_path / "cmp.md"
    assert dgs.main([new, "--compare", old, "--out", str(md)]) == 0
    out = capsys.readouterr().out
    assert "3 points in both runs; 1 only in the new one, 1 only in the old one." in out
    # contiguous: our time a 0.8, b 1.0, c 1.1 -> median 1.0; speedup 1.25, 1.0, 0.908 -> 1.0;
    # below 1.0x: a and b in both runs
    assert "| contiguous | 3 | 1.000 | 1.000 | 2 -> 2 |" in out
    assert "- a: 10.00 -> 8.00 us (0.800)" in out
    assert md.read_text() == out


def test_no_best_peer_rows_or_no_file_is_status_2(tmp_path, capsys):
    p = tmp_path / "empty.csv"
    p.write_text(",".join(FIELDS) + "\n")
    assert dgs.main([str(p)]) == 2
    assert "no best_peer rows" in capsys.readouterr().err
    assert dgs.main([str(tmp_path / "missing.csv")]) == 2
    assert "cannot read" in capsys.readouterr().err
