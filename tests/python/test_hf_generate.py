"""python -m flashcpp.bench.hf_generate on the CPU, quick (Llama and Gemma-2): greedy tokens equal to
transformers' own attention, the CSV written, exit status 0; and a missing device is exit status 2 with
one sentence. On a GPU machine the same command with --device cuda is the issue's check."""
import csv

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import flashcpp  # noqa: E402
from flashcpp.bench import hf_generate  # noqa: E402


def test_quick_cpu_run_matches_the_reference(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's and flashcpp's CPU threads otherwise fight on a small machine
    try:
        assert hf_generate.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = list(csv.DictReader(open(tmp_path / "hf_generate.csv")))
    assert [r["arch"] for r in rows] == ["llama", "gemma2"]
    for r in rows:
        assert r["error"] == "" and r["tokens_equal"] == "True", r
        assert float(r["max_abs_dlogit"]) < 1e-3 * max(1.0, float(r["max_abs_logit"])), r
        assert r["reference"] == ("eager" if r["arch"] == "gemma2" else "sdpa")
        for col in ("fcpp_s", "ref_s", "prefill_fcpp_ms", "prefill_ref_ms", "nopad_fcpp_s", "nopad_ref_s"):
            assert float(r[col]) > 0, (col, r)
        for col in ("speedup", "prefill_speedup", "nopad_speedup"):
            assert float(r[col]) > 0, (col, r)
        # the repeats' spread brackets their median's ratio (each repeat's ratio is one of the set)
        assert 0 < float(r["speedup_lo"]) <= float(r["speedup_hi"]), r


@pytest.mark.skipif(torch.cuda.is_available() and flashcpp.WITH_CUDA, reason="this machine has a GPU and CUDA build")
def test_no_cuda_device_exits_2_in_one_sentence(tmp_path, capsys):
    assert hf_generate.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA device" in err


def test_token_comparison_takes_runs_that_stop_apart():
    """Once tokens differ, one run may reach EOS steps before the other (Phi-3 on an H100, e5f49c3:
    23 against 22 steps raised a shape error and the architecture went unreported)."""
    g = torch.Generator().manual_seed(3)
    sr = torch.randn(2, 5, 11, generator=g)
    sr[1, 2, 7], sr[1, 2, 4] = 9.0, 8.99  # a near tie at row 1, step 2
    so = sr[:, :4].clone()
    tr = sr.argmax(-1)
    to = tr[:, :4].clone()
    to[1, 2] = 4
    eq, where, tie = hf_generate._compare_tokens(torch, tr, sr, to, so, 0.02)
    assert eq is False and where.startswith("row 1 step 2:") and "then 5 vs 4 steps" in where and tie
    eq, where, tie = hf_generate._compare_tokens(torch, tr, sr, to, so, 0.001)
    assert eq is False and tie is False  # a margin of 0.01 is no tie under a 0.001 logit difference
    assert hf_generate._compare_tokens(torch, tr, sr, tr.clone(), sr, 0.0) == (True, "", "")
    eq, where, tie = hf_generate._compare_tokens(torch, tr, sr, tr[:, :3], sr[:, :3], 0.0)
    assert eq is False and tie is False and "the same first 3 steps, then 5 vs 3 steps" in where
