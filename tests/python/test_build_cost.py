"""scripts/build_cost.py, a build's CPU seconds by part from ninja's log: each object counts once
(its latest step), under the first part whose path key it holds, and a missing log is an error."""

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "build_cost.py")


def run(build):
    r = subprocess.run([sys.executable, SCRIPT, str(build)], capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def step(start_ms, end_ms, out):
    return f"{start_ms}\t{end_ms}\t0\t{out}\tdeadbeef\n"


def parts(stdout):
    rows = {}
    for line in stdout.splitlines():
        name, rest = line[:34].strip(), line[34:].split()
        rows[name] = float(rest[0])
    return rows


def test_parts_and_latest_step(tmp_path):
    log = "# ninja log v5\n"
    log += step(0, 50_000, "CMakeFiles/flashcpp.dir/src/cuda/decode/decode_hd128.cu.o")
    # rebuilt later: only this step counts (an incremental build appends)
    log += step(60_000, 90_000, "CMakeFiles/flashcpp.dir/src/cuda/decode/decode_hd128.cu.o")
    log += step(0, 20_000, "CMakeFiles/flashcpp.dir/src/cuda/prefill/fa3_hd64.cu.o")
    log += step(0, 12_500, "CMakeFiles/flashcpp.dir/src/cuda/prefill/fa2_hd64.cu.o")
    log += step(0, 4_000, "CMakeFiles/flashcpp.dir/src/cuda/common/fill.cu.o")
    log += step(0, 3_000, "CMakeFiles/flashcpp.dir/src/core/selector.cc.o")
    log += step(0, 7_000, "CMakeFiles/flashcpp_cpu_tests.dir/tests/cpu/test_tiled.cc.o")
    log += step(0, 1_000, "CMakeFiles/flashcpp_cli_tests.dir/tests/cli/test_cli.cc.o")
    log += step(0, 2_000, "flashcpp_cpu_tests")
    (tmp_path / ".ninja_log").write_text(log)
    rc, out, err = run(tmp_path)
    assert rc == 0, err
    rows = parts(out)
    assert rows["decode kernels"] == 30.0
    assert rows["sm90 prefill kernels"] == 20.0
    assert rows["sm80 prefill kernels"] == 12.5
    assert rows["other library CUDA"] == 4.0
    assert rows["library host code"] == 3.0
    assert rows["CPU and CLI tests"] == 8.0
    assert rows["other (links, custom steps)"] == 2.0
    assert rows["total"] == 79.5
    assert "backward kernels" not in rows  # parts without steps are not printed


def test_missing_log_is_an_error(tmp_path):
    rc, out, err = run(tmp_path)
    assert rc == 2
    assert "no " in err and ".ninja_log" in err
