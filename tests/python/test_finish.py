"""flashcpp.bench.finish: the steps after the areas in one process (no GPU: hand-made CSVs). What is
tested is which files each step leaves and the exit status: drift is reported, not a failure; a step
that cannot run is."""
import os

from bench_csv import write_csv
from flashcpp.bench import finish


def run_dir(path, speedup):
    d = str(path)
    write_csv(os.path.join(d, "fused", "benchmark.csv"), [
        {"case": "rmsnorm_residual_8192x4096_bf16", "peer": "torch_compile", "speedup": speedup, "ours_us": 71.6,
         "peer_us": 71.6 * speedup, "bytes": 4 * 8192 * 4096 * 2, "git_commit": "c"}])
    return d


def test_every_step_writes_its_file(tmp_path):
    ref, new = run_dir(tmp_path / "ref", 1.0), run_dir(tmp_path / "new", 1.5)  # +50%: outside 10%
    assert finish.main([new, "--reference", ref]) == 0  # drift goes to COMPARE.md, not the exit status
    for f in ("roofline.csv", "SUMMARY.md", "COMPARE.md"):
        assert os.path.isfile(os.path.join(new, f)), f
    assert "## Out of tolerance: 1 of 1" in open(os.path.join(new, "COMPARE.md")).read()
    # no audit JSON: no audit plots, and that is not an error
    assert not os.path.exists(os.path.join(new, "numerics"))


def test_without_reference_no_compare(tmp_path):
    new = run_dir(tmp_path / "new", 1.0)
    assert finish.main([new]) == 0
    assert os.path.isfile(os.path.join(new, "SUMMARY.md"))
    assert not os.path.exists(os.path.join(new, "COMPARE.md"))


def test_a_step_that_cannot_run_fails(tmp_path, capsys):
    new = run_dir(tmp_path / "new", 1.0)
    os.makedirs(os.path.join(new, "numerics"))
    with open(os.path.join(new, "numerics", "audit.json"), "w") as fh:
        fh.write("{not json")
    assert finish.main([new]) == 2
    assert "audit_plot" in capsys.readouterr().err
    assert finish.main([str(tmp_path / "missing")]) == 2
    # a reference that matches nothing: compare cannot check anything, which is an error (exit 2)
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    os.remove(os.path.join(new, "numerics", "audit.json"))
    assert finish.main([new, "--reference", empty]) == 2
