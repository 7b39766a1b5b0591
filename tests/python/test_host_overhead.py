"""python -m flashcpp.bench.host_overhead (issue 32's host-overhead table) in its CPU mode: tiny
shapes, few calls, so the harness itself is checked here; the CUDA figures come from an NVIDIA
machine (reports/integrations/README.md)."""
import csv
import json
import math

import pytest

torch = pytest.importorskip("torch")
import flashcpp  # noqa: E402
from flashcpp.bench import host_overhead as ho  # noqa: E402

ISSUE_COLUMNS = ["call", "shape", "dtype", "host_us", "cpu_us", "kernel_us", "peer", "peer_host_us", "peer_kernel_us"]
# the calls with an eager fast path: a plain call must take it
FAST = {"flash_attn_func", "flash_attn_with_kvcache", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary"}


def _positive(s):
    v = float(s)
    return math.isfinite(v) and v > 0


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("host_overhead")
    rc = ho.main(["--device", "cpu", "--tiny", "--quick", "--calls", "5", "--repeats", "2", "--out", str(out)])
    with open(out / "host_overhead.csv", newline="") as f:
        rows = list(csv.reader(f))
    env = json.loads((out / "host_overhead_env.json").read_text())
    return rc, rows, env


def test_cpu_mode_writes_the_table(cpu_run):
    rc, rows, env = cpu_run
    assert rc == 0
    header, body = rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]
    assert header == ho.COLUMNS and header[:9] == ISSUE_COLUMNS
    assert all(len(r) == len(header) for r in rows)
    assert {r["call"] for r in body} == set(ho.CALLS)
    for r in body:
        what = f"{r['call']} {r['shape']} {r['peer']}"
        assert r["dtype"] == "bf16" and r["shape"], what
        assert _positive(r["host_us"]) and _positive(r["cpu_us"]), what
        assert r["kernel_us"] == r["peer_kernel_us"] == r["loop_us"] == r["peer_loop_us"] == "", what  # no GPU
        assert r["kernel_method"] == r["peer_kernel_method"] == "", what
        assert r["peer"].startswith("torch_") and _positive(r["peer_host_us"]), what  # torch peers run on host
        assert r["path"] == ("fast" if r["call"] in FAST else "general"), what
    # one row per (case, peer): each call has exactly its torch peer on the host
    assert len(body) == len({(r["call"], r["shape"], r["peer"]) for r in body}) == len(ho.CALLS)


def test_cpu_mode_environment(cpu_run):
    _, _, env = cpu_run
    assert env["device"] == "cpu" and env["device_name"] and env["torch"] == torch.__version__
    assert env["git_commit"] and env["calls_per_loop"] == 5 and env["repeats"] == 2
    assert env["cpu_threads"] == 1 and env["torch_threads"] == 1
    assert set(env["peers_not_found"]) == {"quack", "flashinfer", "flash_attn"}  # CUDA-only peers
    assert env["skipped"] == {}


def test_fast_path_detection_and_timer():
    x, w = torch.randn(4, 32), torch.randn(32)
    assert ho._path(lambda: flashcpp.rms_norm(x, w)) == "fast"
    assert ho._path(lambda: flashcpp.rms_norm(x, w, backend="cpu")) == "general"
    assert ho._path(lambda: flashcpp.rms_norm(x.numpy(), w.numpy())) == "general"
    host, cpu, loop = ho.Timer(torch, cuda=False).loop(lambda: flashcpp.rms_norm(x, w), 20)
    assert _positive(host) and _positive(cpu) and loop is None


def test_a_peer_that_fails_is_dropped_with_its_reason():
    x, w = torch.randn(4, 32), torch.randn(32)

    def broken():
        raise RuntimeError("no kernel for this shape")

    case = ho.Case("rms_norm", "4x32", "fp32", lambda: flashcpp.rms_norm(x, w),
                   {"good": lambda: torch.nn.functional.rms_norm(x, (32,), w), "broken": broken})
    skipped = {}
    rows = ho.measure_case(case, ho.Timer(torch, cuda=False), calls=5, repeats=2, cpu_budget_s=0.001,
                           skipped=skipped)
    assert [r["peer"] for r in rows] == ["good"]
    assert skipped == {"rms_norm 4x32 broken": "RuntimeError: no kernel for this shape"}
    case.peers = {}
    rows = ho.measure_case(case, ho.Timer(torch, cuda=False), 5, 2, 0.001, {})
    assert len(rows) == 1 and rows[0]["peer"] == "" and rows[0]["peer_host_us"] is None


@pytest.mark.skipif(torch.cuda.is_available() and getattr(flashcpp, "WITH_CUDA", False),
                    reason="this machine can run the CUDA mode")
def test_cuda_mode_without_a_gpu_says_why(tmp_path, capsys):
    assert ho.main(["--device", "cuda", "--quick", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cpu" in err
    assert not (tmp_path / "o").exists()


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        ho.main(["--device", "cpu", "--calls", "0", "--out", "/nonexistent"])
    with pytest.raises(SystemExit):
        ho.main(["--device", "tpu", "--out", "/nonexistent"])
