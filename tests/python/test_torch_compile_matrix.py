"""torch.compile(fullgraph=True) and torch.library.opcheck over every torch entry point, on the
CPU and on CUDA: layouts (contiguous graph inputs, SDPA's (B, H, N, D) through a transpose, views
cut inside the graph), MHA and GQA, return_lse, each mask (causal, window, softcap, ALiBi,
block-sparse, rotary, rotary with k_out), varlen, flash_attn_with_kvcache (contiguous, paged,
append). Compiled results must equal eager ones bit for bit (same kernels), mutated arguments
included.

Also, without a GPU: the same cases traced by Dynamo (torch.export, strict) over fake CUDA tensors,
which is the register_fake path torch.compile takes on a GPU machine. torch 2.11 failed there with
IndexError('tuple index out of range') for every plain tensor: its ADInplaceOrView kernel of a
mutating custom op indexed the boxed arguments, from which the dispatcher drops trailing defaults,
at the position of the mutated Optional argument (then the last one of flashcpp::flash_attn_fwd).

Head dims the CUDA kernels are not built for (v's head dim differing from q's: HEAD_DIM_V_CASES) run
the compile and opcheck cases on the CPU only, and the fake-CUDA traces, whose fakes give the output
v's head dim (on a GPU the call itself is refused by C++ with NotImplementedError).

Needs torch (skipped without it, as in CI); the CUDA cases need a device and a FLASHCPP_CUDA=ON
build. On the H200: ``pytest tests/python/test_torch_compile_matrix.py``.
"""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch.compile tests need torch")

import flashcpp  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and flashcpp.WITH_CUDA
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a FLASHCPP_CUDA=ON build")
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]
# CPU: aot_eager (Dynamo + AOTAutograd, the graph run eagerly: no C++ compile per case);
# CUDA: inductor, what torch.compile uses by default.
BACKEND = {"cpu": "aot_eager", "cuda": "inductor"}
DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}
B, N, D = 2, 256, 64


class _Maker:
    """Tensors for a case: random real ones, or fake ones (shapes only) inside a FakeTensorMode."""

    def __init__(self, device, fake=False, seed=0):
        self.device, self.fake = device, fake
        self.gen = np.random.default_rng(seed)

    def randn(self, *shape, dtype=None):
        dtype = DTYPE[self.device] if dtype is None else dtype
        if self.fake:
            return torch.empty(shape, dtype=dtype, device=self.device)
        x = torch.from_numpy(self.gen.standard_normal(shape).astype(np.float32))
        return x.to(device=self.device, dtype=dtype)

    def array(self, a, dtype=None):
        """A tensor holding a (numpy) array's values: masks, lengths, slopes, positions."""
        a = np.asarray(a)
        if a.dtype == np.uint64:
            a = a.view(np.int64)
        dtype = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                 np.dtype(np.float32): torch.float32}[a.dtype] if dtype is None else dtype
        if self.fake:
            return torch.empty(a.shape, dtype=dtype, device=self.device)
        return torch.from_numpy(np.array(a)).to(device=self.device, dtype=dtype)


def _dense(hq, hkv, **kw):
    def build(m):
        return (lambda q, k, v: flashcpp.flash_attn_func(q, k, v, **kw)), (
            m.randn(B, N, hq, D), m.randn(B, N, hkv, D), m.randn(B, N, hkv, D)), ()
    return build


def _sdpa_layout(m):
    # graph inputs in SDPA's (B, H, N, D) layout, transposed outside the graph: strided inputs
    qs, ks, vs = (m.randn(B, 4, N, D) for _ in range(3))
    return (lambda q, k, v: flashcpp.flash_attn_func(q, k, v, causal=True)), (
        qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)), ()


def _sdpa_in_graph(m):
    # the transpose inside the graph
    def fn(qs, ks, vs):
        return flashcpp.flash_attn_func(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), causal=True)
    return fn, (m.randn(B, 4, N, D), m.randn(B, 2, N, D), m.randn(B, 2, N, D)), ()


def _views(m):
    # q, k, v cut from one packed projection output inside the graph
    def fn(qkv):
        q, k, v = qkv.unbind(2)
        return flashcpp.flash_attn_func(q, k, v, causal=True, return_lse=True)
    return fn, (m.randn(B, N, 3, 4, D),), ()


def _alibi(m):
    slopes = m.array(flashcpp.alibi_slopes(4))

    def fn(q, k, v, s):
        return flashcpp.flash_attn_func(q, k, v, causal=True, alibi_slopes=s, return_lse=True)
    return fn, (m.randn(B, N, 4, D), m.randn(B, N, 2, D), m.randn(B, N, 2, D), slopes), ()


def _block_sparse(m):
    mask = np.tril(np.ones((N, N), dtype=bool))
    mask[:, :128] = True
    bs = flashcpp.block_sparse_from_mask(mask, 128, 128)
    arrays = tuple(m.array(getattr(bs, f)) for f in ("row_ptr", "col_idx", "partial", "element_masks"))

    def fn(q, k, v, row_ptr, col_idx, partial, element_masks):
        spec = dataclasses.replace(bs, row_ptr=row_ptr, col_idx=col_idx, partial=partial, element_masks=element_masks)
        return flashcpp.flash_attn_func(q, k, v, block_sparse=spec, return_lse=True)
    return fn, (m.randn(B, N, 4, D), m.randn(B, N, 2, D), m.randn(B, N, 2, D), *arrays), ()


def _rotary(m):
    pos = m.array(np.arange(B * N, dtype=np.int32).reshape(B, N) % 97 + 3)

    def fn(q, k, v, pos_q):
        return flashcpp.flash_attn_func(q, k, v, causal=True, rotary=flashcpp.Rotary(positions_q=pos_q))
    return fn, (m.randn(B, N, 4, D), m.randn(B, N, 2, D), m.randn(B, N, 2, D), pos), ()


def _rotary_k_out(m):
    def fn(q, k, v, buf):
        return flashcpp.flash_attn_func(q, k, v, causal=True, rotary=flashcpp.Rotary(k_out=buf))
    return fn, (m.randn(B, N, 4, D), m.randn(B, N, 2, D), m.randn(B, N, 2, D), m.randn(B, N, 2, D)), (3,)


def _rotary_in_place(m):
    def fn(q, k, v):
        return flashcpp.flash_attn_func(q, k, v, causal=True, rotary=flashcpp.Rotary(k_out=k))
    return fn, (m.randn(B, N, 4, D), m.randn(B, N, 2, D), m.randn(B, N, 2, D)), (1,)


def _varlen(m):
    cu_q = m.array(np.array([0, 100, 100, 300], dtype=np.int32))
    cu_k = m.array(np.array([0, 120, 250, 400], dtype=np.int32))

    def fn(q, k, v, cu_q, cu_k):
        return flashcpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 150, causal=True, window_size=(64, 0),
                                               softcap=20.0, return_lse=True)
    return fn, (m.randn(300, 4, D), m.randn(400, 2, D), m.randn(400, 2, D), cu_q, cu_k), ()


S_CACHE = 96


def _kvcache(m):
    lens = m.array(np.array([17, 80], dtype=np.int32))

    def fn(q, kc, vc, lens):
        return flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, return_softmax_lse=True)
    return fn, (m.randn(B, 1, 8, D), m.randn(B, S_CACHE, 2, D), m.randn(B, S_CACHE, 2, D), lens), ()


def _kvcache_append(m):
    lens = m.array(np.array([17, 80], dtype=np.int32))

    def fn(q, kc, vc, k, v, lens):
        return flashcpp.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True, window_size=(40, -1),
                                                rope_theta=10000.0)
    return fn, (m.randn(B, 2, 8, D), m.randn(B, S_CACHE, 2, D), m.randn(B, S_CACHE, 2, D), m.randn(B, 2, 2, D),
                m.randn(B, 2, 2, D), lens), (1, 2)


def _kvcache_paged(m):
    page, pages_per_seq = 16, 6
    table = m.array(np.arange(B * pages_per_seq, dtype=np.int32)[::-1].reshape(B, pages_per_seq).copy())
    lens = m.array(np.array([33, 90], dtype=np.int32))

    def fn(q, kc, vc, lens, table):
        return flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, softcap=30.0)
    npages = B * pages_per_seq
    return fn, (m.randn(B, 1, 4, D), m.randn(npages, page, 4, D), m.randn(npages, page, 4, D), lens, table), ()


def _head_dim_v_dense(m):
    # DeepSeek's 192/128: q and k at 192, v and the output at 128
    def fn(q, k, v):
        return flashcpp.flash_attn_func(q, k, v, causal=True, return_lse=True)
    return fn, (m.randn(B, 64, 4, 192), m.randn(B, 64, 2, 192), m.randn(B, 64, 2, 128)), ()


def _head_dim_v_varlen(m):
    cu = m.array(np.array([0, 20, 64], dtype=np.int32))

    def fn(q, k, v, cu):
        return flashcpp.flash_attn_varlen_func(q, k, v, cu, cu, 44, 44, causal=True, return_lse=True)
    return fn, (m.randn(64, 4, 96), m.randn(64, 2, 96), m.randn(64, 2, 80), cu), ()


def _head_dim_v_kvcache_append(m):
    lens = m.array(np.array([5, 30], dtype=np.int32))

    def fn(q, kc, vc, k, v, lens):
        return flashcpp.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    return fn, (m.randn(B, 1, 4, 64), m.randn(B, 32, 2, 64), m.randn(B, 32, 2, 128), m.randn(B, 1, 2, 64),
                m.randn(B, 1, 2, 128), lens), (1, 2)


HEAD_DIM_V_CASES = {
    "head_dim_v-192-128": _head_dim_v_dense,
    "head_dim_v-96-80-varlen": _head_dim_v_varlen,
    "head_dim_v-64-128-kvcache-append": _head_dim_v_kvcache_append,
}

CASES = {
    "contiguous-mha": _dense(4, 4, causal=True),
    "contiguous-gqa": _dense(8, 2, causal=True),
    "return_lse": _dense(4, 2, return_lse=True),
    "sdpa-layout": _sdpa_layout,
    "sdpa-transpose-in-graph": _sdpa_in_graph,
    "views": _views,
    "window": _dense(4, 2, window_size=(48, 16), return_lse=True),
    "softcap": _dense(4, 2, causal=True, softcap=15.0),
    "softmax_scale": _dense(4, 2, softmax_scale=0.2),
    "alibi": _alibi,
    "block_sparse": _block_sparse,
    "rotary": _rotary,
    "rotary-k_out": _rotary_k_out,
    "rotary-k_out-in-place": _rotary_in_place,
    "varlen": _varlen,
    "kvcache": _kvcache,
    "kvcache-append": _kvcache_append,
    "kvcache-paged": _kvcache_paged,
}


ALL_CASES = {**CASES, **HEAD_DIM_V_CASES}
# (case, device): every case on the CPU, the CUDA kernels' cases on CUDA too
CASE_DEVICES = [pytest.param(c, "cpu", id=f"{c}-cpu") for c in ALL_CASES] + [
    pytest.param(c, "cuda", marks=NEEDS_CUDA, id=f"{c}-cuda") for c in CASES]


def _flat(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _clone(args):
    """Copies of the tensors with their strides (SDPA-layout inputs stay strided)."""
    def copy(a):
        b = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
        return b.copy_(a)
    return tuple(copy(a) if isinstance(a, torch.Tensor) else a for a in args)


class _OpRecorder(TorchDispatchMode):
    """Records the flashcpp ops that run inside it, with their arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "flashcpp":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


@pytest.mark.parametrize("case,device", CASE_DEVICES)
def test_compile_fullgraph_equals_eager(case, device):
    fn, args, mutated = ALL_CASES[case](_Maker(device))
    eager_args, compiled_args = _clone(args), _clone(args)
    with torch.no_grad():
        want = fn(*eager_args)
        torch._dynamo.reset()
        got = torch.compile(fn, fullgraph=True, backend=BACKEND[device])(*compiled_args)
    for w, g in zip(_flat(want), _flat(got)):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w), f"{case} on {device}: compiled differs from eager"
    for i in mutated:  # the writes of the mutating ops (rotated keys, appended tokens) reach the inputs
        assert torch.equal(compiled_args[i], eager_args[i])
        assert not torch.equal(compiled_args[i], args[i])


@pytest.mark.parametrize("case,device", CASE_DEVICES)
def test_opcheck(case, device, monkeypatch):
    fn, args, _ = ALL_CASES[case](_Maker(device))
    # Eager calls skip the dispatcher; make the functions take their registered ops, and record them.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with _OpRecorder() as rec:
        fn(*_clone(args))
    assert rec.calls, f"{case}: no flashcpp op ran"
    monkeypatch.undo()
    for func, op_args, op_kwargs in rec.calls:
        torch.library.opcheck(func, _clone(op_args), dict(op_kwargs))


def _export(fn, args):
    class Wrap(torch.nn.Module):
        def forward(self, *a):
            return fn(*a)
    return torch.export.export(Wrap(), tuple(args), strict=True)


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_dynamo_traces_fake_cuda_tensors(case):
    """Runs anywhere torch is: Dynamo over CUDA FakeTensors (no GPU needed) reaches each op's
    register_fake and must trace without a graph break or an error."""
    with FakeTensorMode() as mode:
        fn, args, _ = ALL_CASES[case](_Maker("cuda", fake=True))
    assert all(a.device.type == "cuda" for a in args if isinstance(a, torch.Tensor))
    exported = _export(fn, args)
    graph = str(exported.graph)
    assert "flashcpp" in graph, f"{case}: no flashcpp op in the traced graph:\n{graph}"
    if case in HEAD_DIM_V_CASES:  # the fakes give the output v's head dim
        out = next(n for n in exported.graph.nodes if n.op == "output").args[0]
        first = out[0] if isinstance(out, (tuple, list)) else out
        assert first.meta["val"].shape[-1] == args[2].shape[-1], case
    del mode


@pytest.mark.parametrize("device", DEVICES)
def test_issue_25_repro(device):
    """The report's call: contiguous bf16 q (2, N, 16, 128), k/v with 4 or 16 heads, causal, an
    epilogue after the op, default backend (inductor), with and without no_grad."""
    n = 1024 if device == "cuda" else 64
    m = _Maker(device)
    f = torch.compile(lambda q, k, v: flashcpp.flash_attn_func(q, k, v, causal=True) * 2, fullgraph=True)
    for hkv in ((4, 16) if device == "cuda" else (4,)):  # CPU: each inductor compile takes ~15 s on 2 cores
        q = m.randn(2, n, 16, 128, dtype=torch.bfloat16)
        k, v = m.randn(2, n, hkv, 128, dtype=torch.bfloat16), m.randn(2, n, hkv, 128, dtype=torch.bfloat16)
        want = flashcpp.flash_attn_func(q, k, v, causal=True) * 2
        for grad_off in (True, False):
            torch._dynamo.reset()
            with torch.set_grad_enabled(not grad_off):
                got = f(q, k, v)
            assert torch.equal(got, want)
