"""flashcpp.bench.summary: the generated reports/SUMMARY.md from small hand-made CSVs (no GPU:
what is tested is the aggregation; the figures of a real run come from make bench)."""
import json
import os

from bench_csv import write_csv
from flashcpp.bench import summary


def make_reports(d):
    os.makedirs(os.path.join(d, "prefill"))
    with open(os.path.join(d, "prefill", "benchmark_env.json"), "w") as fh:
        json.dump({"gpu": "test GPU", "driver": "1.2", "gemm_bf16_tflops": 800.0, "copy_tbps": 4.0,
                   "git_commit": "abc1234"}, fh)
    write_csv(os.path.join(d, "hopper", "benchmark.csv"), [
        {"case": "a", "peer": "cudnn", "speedup": 1.2}, {"case": "b", "peer": "cudnn", "speedup": 0.8},
        {"case": "c", "peer": "cudnn", "speedup": 1.0}, {"case": "a", "peer": "flash", "speedup": 1.5},
        {"case": "d", "peer": "flash", "speedup": "nan"}, {"case": "e", "peer": "flash", "speedup": ""}])
    write_csv(os.path.join(d, "decode", "benchmark.csv"), [
        {"case": "x", "peer": "torch_cudnn", "speedup": 0.9, "bar": "cudnn>=1.0x", "meets_bar": "no"},
        {"case": "x", "peer": "flashcpp_prefill_naive", "speedup": 0.5, "bar": "cudnn>=1.0x", "meets_bar": "no"},
        {"case": "y", "peer": "torch_cudnn", "speedup": 0.997, "bar": "cudnn>=1.0x", "meets_bar": "no"},
        {"case": "z", "peer": "torch_cudnn", "speedup": 1.1, "bar": "cudnn>=1.0x", "meets_bar": "yes"},
        {"case": "w", "peer": "torch_cudnn", "speedup": 1.1, "bar": "", "meets_bar": "n/a"}])
    write_csv(os.path.join(d, "masks", "benchmark.csv"), [
        {"case": "m", "peer": "flex", "speedup": 1.04, "bar": "1.0", "meets_bar": "True"}])


def test_tables(tmp_path):
    d = str(tmp_path)
    make_reports(d)
    data = summary.load(d)
    assert list(data) == ["hopper", "masks", "decode"]  # areas in AREAS order, only those with a CSV
    assert data["hopper"][1]["gpu"] == "test GPU"  # hopper reads prefill's environment
    assert data["decode"][1] == {}  # no environment file: empty, not an error
    peers = {p["peer"]: p for p in summary.peer_table(data["hopper"][0])}
    c = peers["cudnn"]
    assert (c["rows"], c["min"], c["median"], c["max"], c["below_1"]) == (3, 0.8, 1.0, 1.2, 1)
    f = peers["flash"]
    assert (f["rows"], f["unmeasured"], f["below_1"]) == (1, 2, 0)  # NaN and empty are not ratios
    dec = summary.peer_table(data["decode"][0])
    assert [p["peer"] for p in dec] == ["torch_cudnn", "flashcpp_prefill_naive"]  # ours after the peers
    assert dec[1]["internal"] and not dec[0]["internal"]
    bars = summary.bar_table(data["decode"][0])
    assert bars == [{"bar": "cudnn>=1.0x", "met": 1, "rows": 3}]  # case x counted once; w has no bar
    assert summary.bar_table(data["masks"][0]) == [{"bar": ">= 1.0x", "met": 1, "rows": 1}]
    ls = summary.losses(data["decode"][0])
    assert [(x["case"], x["peer"]) for x in ls] == [("x", "torch_cudnn"), ("y", "torch_cudnn")]  # worst first, no ablations


def test_render_and_write(tmp_path):
    d = str(tmp_path)
    make_reports(d)
    path = summary.write(d)
    text = open(path).read()
    assert path.endswith("SUMMARY.md")
    assert "| hopper | test GPU |" in text and "abc1234" in text
    assert "| hopper | cudnn | 3 | 0.80x | 1.00x | 1.20x | 1 |" in text
    assert "| hopper | flash | 1 (2 unmeasured) |" in text
    assert "flashcpp_prefill_naive (ours)" in text
    assert "y vs torch_cudnn 0.997x" in text  # a loss that two decimals would show as 1.00x
    assert "| decode | cudnn>=1.0x | 1 of 3 |" in text
    assert "b vs cudnn 0.80x" in text


def test_empty_and_cli(tmp_path, capsys):
    d = str(tmp_path)
    assert "No area has a benchmark.csv" in summary.render(summary.load(d))
    assert summary.main(["summary", d]) == 0
    assert os.path.exists(os.path.join(d, "SUMMARY.md"))
    assert summary.main(["summary", os.path.join(d, "missing")]) == 2
