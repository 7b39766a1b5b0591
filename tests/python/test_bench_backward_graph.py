"""bench backward's CUDA-graph column: an implementation that cannot be captured is left out of it
with a line that says why, and the others keep their figures (no GPU needed: the timing is stubbed)."""
import types

from flashcpp.bench import backward


def test_a_peer_that_cannot_be_captured_keeps_only_its_eager_figure(monkeypatch, capsys):
    synced = []
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: synced.append(1)))

    def timed(fn, rep_ms):
        return fn()

    def refuses():
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(backward, "bench_graph_us", timed)
    t = backward._graph_times(fake_torch, {"flashcpp": lambda: 10.0, "fa4": refuses, "torch_cudnn": lambda: 12.5}, 5)
    assert t == {"flashcpp": 10.0, "torch_cudnn": 12.5}
    assert synced == [1]  # the stream is drained after the failed capture before the next one
    err = capsys.readouterr()
    assert "fa4: no CUDA-graph timing (RuntimeError: operation not permitted" in err.out + err.err
    assert backward._rounded(None) == "" and backward._rounded(3.14159) == 3.14
