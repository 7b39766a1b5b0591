"""flashcpp.bench.compare: the reproduction check between two report directories (no GPU: hand-made
CSVs; what is tested is the matching, the drift and the exit status)."""
import os

from bench_csv import write_csv
from flashcpp.bench import compare


def runs(tmp_path, new_decode):
    ref, new = str(tmp_path / "ref"), str(tmp_path / "new")
    write_csv(os.path.join(ref, "decode", "benchmark.csv"), [
        {"case": "a", "peer": "torch_cudnn", "speedup": 1.00, "git_commit": "r"},
        {"case": "a", "peer": "flashinfer", "speedup": 1.50, "git_commit": "r"},
        {"case": "b", "peer": "torch_cudnn", "speedup": 0.90, "git_commit": "r"},
        {"case": "only_in_ref", "peer": "torch_cudnn", "speedup": 1.0, "git_commit": "r"}])
    write_csv(os.path.join(new, "decode", "benchmark.csv"), new_decode)
    write_csv(os.path.join(ref, "fused", "benchmark.csv"), [{"case": "f", "peer": "torch_compile", "speedup": 1.0}])
    return ref, new


def test_drift_and_matching(tmp_path):
    ref, new = runs(tmp_path, [
        {"case": "a", "peer": "torch_cudnn", "speedup": 1.05, "git_commit": "n"},   # +5%: within 10%
        {"case": "a", "peer": "flashinfer", "speedup": 1.20, "git_commit": "n"},    # -20%: out
        {"case": "b", "peer": "torch_cudnn", "speedup": "nan", "git_commit": "n"},  # no ratio: not compared
        {"case": "only_in_new", "peer": "torch_cudnn", "speedup": 2.0, "git_commit": "n"}])
    rows = compare.compare(ref, new)
    assert [(r["case"], r["peer"]) for r in rows] == [("a", "flashinfer"), ("a", "torch_cudnn")]
    by = {r["peer"]: r for r in rows}
    assert abs(by["torch_cudnn"]["drift"] - 0.05) < 1e-9 and by["torch_cudnn"]["ok"]
    assert abs(by["flashinfer"]["drift"] + 0.20) < 1e-9 and not by["flashinfer"]["ok"]
    assert by["flashinfer"]["ref_commit"] == "r" and by["flashinfer"]["new_commit"] == "n"
    # fused exists only in the reference: not compared
    assert {r["area"] for r in rows} == {"decode"}
    text = compare.render(rows, ref, new, 0.10)
    assert "## Out of tolerance: 1 of 2" in text
    assert "| decode | a | flashinfer | 1.500x | 1.200x | -20.0% |" in text
    assert compare.main([ref, new, "--out", str(tmp_path / "c.md")]) == 1
    assert os.path.exists(tmp_path / "c.md")
    assert compare.main([ref, new, "--tolerance", "0.25"]) == 0  # a looser tolerance passes


def test_reproduced_and_errors(tmp_path, capsys):
    ref, new = runs(tmp_path, [{"case": "a", "peer": "torch_cudnn", "speedup": 0.97, "git_commit": "n"}])
    assert compare.main([ref, new]) == 0
    assert "Every matched row is within tolerance." in capsys.readouterr().out
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert compare.main([ref, empty]) == 2  # nothing matched
    assert compare.main([ref, str(tmp_path / "missing")]) == 2
    assert compare.main([ref, new, "--tolerance", "0"]) == 2
