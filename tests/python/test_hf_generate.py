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


@pytest.mark.skipif(torch.cuda.is_available() and flashcpp.WITH_CUDA, reason="this machine has a GPU and CUDA build")
def test_no_cuda_device_exits_2_in_one_sentence(tmp_path, capsys):
    assert hf_generate.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA device" in err
