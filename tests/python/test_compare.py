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
    assert "| decode | a | flashinfer | 1.500x | 1.200x | -20.0% | - |" in text
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


def test_noisy_rows_are_listed_apart(tmp_path):
    """A row whose repeats inside one run spread past the tolerance cannot fail the check by drift alone
    (unless --strict), but it is still reported, with its spread; a steady row outside still fails."""
    ref, new = str(tmp_path / "ref"), str(tmp_path / "new")
    write_csv(os.path.join(ref, "engine", "benchmark.csv"), [
        {"case": "b1", "peer": "torch_eager", "speedup": 17.3, "peer_tok_s_runs": "108.0 58.8 50.8",
         "ours_tok_s_runs": "1020.0 1019.8 1019.4"},
        {"case": "b1", "peer": "torch_compile", "speedup": 1.26, "peer_tok_s_runs": "809.0 805.0 810.0",
         "ours_tok_s_runs": "1020.0 1019.8 1019.4"}])
    write_csv(os.path.join(new, "engine", "benchmark.csv"), [
        {"case": "b1", "peer": "torch_eager", "speedup": 13.4, "peer_tok_s_runs": "76.0 81.1 78.8",
         "ours_tok_s_runs": "1058.9 1059.3 1058.7"},
        {"case": "b1", "peer": "torch_compile", "speedup": 1.35, "peer_tok_s_runs": "783.7 780.0 784.6",
         "ours_tok_s_runs": "1058.9 1059.3 1058.7"}])
    rows = {r["peer"]: r for r in compare.compare(ref, new)}
    assert rows["torch_eager"]["noisy"] and not rows["torch_eager"]["ok"]
    assert abs(rows["torch_eager"]["spread"] - (108.0 / 50.8 - 1)) < 1e-9
    assert not rows["torch_compile"]["noisy"] and rows["torch_compile"]["ok"]  # +7.1%
    text = compare.render(list(rows.values()), ref, new, 0.10)
    assert "## Out of tolerance: 0 of 2" in text and "## Outside, on noisy rows: 1 of 2" in text
    assert "| engine | b1 | torch_eager | 17.300x | 13.400x | -22.5% | 113% |" in text
    assert compare.main([ref, new]) == 0
    assert compare.main([ref, new, "--strict"]) == 1
    assert compare.main([ref, new, "--tolerance", "0.05"]) == 1  # torch_compile's +7.1% is steady: it fails
    assert compare.repeat_spread({"peer_tok_s_runs": "", "ours_tok_s_runs": "5"}) is None
