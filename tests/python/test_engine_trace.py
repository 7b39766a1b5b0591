"""flashcpp.bench.engine.trace_step: the engine bench's kernel timeline of the batch-1 step, read from
`flashcpp decode --trace --json` (a stand-in script plays the CLI; CUPTI itself needs a GPU)."""
import os

import pytest

from flashcpp.bench import engine


def _fake_cli(tmp_path, with_trace):
    """A stand-in for `flashcpp decode`: writes the --json file the driver reads."""
    script = tmp_path / "fake_flashcpp"
    trace = ('{"file": "x", "steps": 3, "kernels": 30, "wall_us_per_step": 1000.0, "busy_us_per_step": 900.0, '
             '"gap_us_per_step": 100.0, "by_kernel": []}') if with_trace else "null"
    script.write_text("#!/usr/bin/env python3\n"
                      "import sys, json\n"
                      "a = sys.argv\n"
                      "assert a[1] == 'decode' and '--trace' in a and '--no-profile' in a\n"
                      "path = a[a.index('--json') + 1]\n"
                      f"t = json.loads('{trace}')\n"
                      "d = {'wall_us_per_step': 1010.0}\n"
                      "if t: d['trace'] = t\n"
                      "json.dump(d, open(path, 'w'))\n")
    script.chmod(0o755)
    return str(script)


def test_trace_step_reads_the_cli_trace(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    t = engine.trace_step(_fake_cli(tmp_path, True), "/model", str(out), str(work))
    assert t["wall_us_per_step"] == 1000.0 and t["gap_us_per_step"] == 100.0
    assert t["file"] == os.path.join("raw", "trace_b1_ctx512.csv")  # relative to the report directory
    assert t["wall_us_per_step_timed"] == 1010.0
    with pytest.raises(RuntimeError, match="no trace section"):
        engine.trace_step(_fake_cli(tmp_path, False), "/model", str(out), str(work))
