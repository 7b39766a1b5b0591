"""The fused bench's extra peers (python -m flashcpp.bench fused): quack, Liger-Kernel and (on the
fp8-cache rope_append_kv rows) FlashInfer are timed only where they import and agree with eager
PyTorch; the others are named, never timed silently.
CPU-only: the peers' CUDA calls are replaced by plain functions."""
import pytest

torch = pytest.importorskip("torch")

from flashcpp.bench import fused  # noqa: E402


def test_missing_peers_are_named_with_their_reason():
    mods, why = fused._extra_peers()
    assert set(mods) | set(why) == {"quack", "liger", "flashinfer"}
    assert not (set(mods) & set(why))
    for name, reason in why.items():
        assert reason and ":" in reason, (name, reason)


def test_checked_extra_keeps_agreeing_peers_and_drops_the_rest(capsys):
    x = torch.randn(8, 16)
    peer = lambda: (x * 2, x)  # noqa: E731

    def close():
        return x * 2 + 1e-3, x

    def wrong():
        return x * 2 + 1.0, x

    def broken():
        raise RuntimeError("refuses this shape")

    calls = []

    def in_place():
        return x * 2, x

    in_place.check_inputs = lambda: calls.append("reset")
    kept = fused._checked_extra({"close": close, "wrong": wrong, "broken": broken, "in_place": in_place}, peer, "c")
    assert list(kept) == ["close", "in_place"] and calls == ["reset"]
    out = capsys.readouterr().out
    assert "wrong dropped for c: max |diff| vs eager 1.000e+00" in out
    assert "broken unavailable for c: RuntimeError: refuses this shape" in out


def test_a_nan_result_is_dropped(capsys):
    x = torch.randn(4)
    kept = fused._checked_extra({"nan": lambda: x * float("nan")}, lambda: x, "c")
    assert kept == {} and "nan dropped" in capsys.readouterr().out


def test_fp8_rows_allow_one_e4m3_step(capsys):
    x = torch.randn(4)
    one_step = {"fp8": lambda: x + 0.5}  # two roundings of one value one e4m3 step apart (|x| < 8)
    assert fused._checked_extra(one_step, lambda: x, "c") == {}
    assert list(fused._checked_extra(one_step, lambda: x, "c_fp8", tol=0.6)) == ["fp8"]
    assert fused._checked_extra({"off": lambda: x + 1.0}, lambda: x, "c_fp8", tol=0.6) == {}
