"""`python -m flashcpp.bench AREA` where it cannot run (no torch, a CPU-only torch, no GPU, or a
build without the CUDA kernels) ends in one sentence and exit status 2, not a traceback."""
import os
import subprocess
import sys

import pytest

from flashcpp.bench.__main__ import _no_gpu_reason, main

REASON = _no_gpu_reason()
pytestmark = pytest.mark.skipif(REASON is None, reason="this machine can run the benchmarks")


@pytest.mark.parametrize("area", ["prefill", "fused", "decode", "engine", "masks", "backward", "headdims"])
def test_each_area_says_why_in_one_sentence(area, capsys, tmp_path):
    assert main([area, "--quick", "--out", str(tmp_path / area)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith(".\n") and REASON in err
    assert not (tmp_path / area).exists()  # nothing started


def test_the_process_exits_2_without_a_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flashcpp.bench", "prefill", "--quick", "--out", str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ), cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().endswith(".")
    assert r.stderr.strip().splitlines() == [f"python -m flashcpp.bench prefill: {REASON}."]
