"""The binding's shape: the C++ params structs as classes whose fields read and write as
attributes (pointers as ints, enums as codes or names, checked when set), one call per entry point.
numpy only, CPU backend."""
import numpy as np
import pytest

import flashcpp
from flashcpp import _flashcpp as _C


def _problem(rng, batch=2, seqlen=5, heads=4, dim=64):
    q, k, v = (rng.standard_normal((batch, seqlen, heads, dim)).astype(np.float32) for _ in range(3))
    return q, k, v


def _view(x):
    s = [n // x.itemsize for n in x.strides]
    return _C.TensorView(x.ctypes.data, _C.DTYPE_F32, s[0], s[1], s[2])


def test_fields_read_back_and_nested_structs_are_views():
    p = _C.AttnParams()
    p.batch, p.head_dim, p.lse, p.softmax_scale = 3, 128, 0x1000, 0.25
    assert (p.batch, p.head_dim, p.lse, p.softmax_scale) == (3, 128, 0x1000, 0.25)
    p.mask.causal = True  # p.mask is the struct inside p, not a copy
    p.mask.window_left = 7
    p.rotary.spec.llama3 = _C.Llama3Scaling(8.0, 1.0, 4.0, 8192)  # two levels down: still views
    assert p.mask.causal and p.mask.window_left == 7 and p.rotary.spec.llama3.factor == 8.0
    p.q = _C.TensorView(0x2000, _C.DTYPE_BF16, 10, 20, 30)
    assert (p.q.data, p.q.dtype, p.q.batch_stride, p.q.seq_stride, p.q.head_stride) == (0x2000, 1, 10, 20, 30)
    assert p.mask.block_sparse is None
    bs = _C.BlockSparseMask()
    bs.block_m = 128
    p.mask.block_sparse = bs
    assert p.mask.block_sparse.block_m == 128
    p.mask.block_sparse = None
    assert p.mask.block_sparse is None
    with pytest.raises(TypeError, match="takes a BlockSparseMask or None"):
        p.mask.block_sparse = 5


def test_checked_setters_keep_the_old_sentences():
    with pytest.raises(ValueError, match=r"dtype code 7 is not one of 0 \(fp16\), 1 \(bf16\), 2 \(fp32\)"):
        _C.TensorView(0, 7)
    with pytest.raises(ValueError, match="backend 'gpu' is not one of auto, cpu, cpu-reference, cuda"):
        _C.RunOptions("gpu")
    opt = _C.RunOptions()
    with pytest.raises(ValueError, match="backend 'gpu' is not one of"):
        opt.backend = "gpu"
    assert opt.backend == "auto"
    with pytest.raises(ValueError, match=r"rotary style code 5 is not 0 \(none\), 1 \(neox\) or 2 \(interleaved\)"):
        _C.DecodeParams().rotary.style = 5
    for spec in (_C.RotarySpec(), _C.AttnRotary().spec, _C.RopeParams().rotary):  # one class, one setter
        with pytest.raises(ValueError, match=r"rotary style code 3 is not 0 \(none\)"):
            spec.style = 3


def test_one_call_matches_the_public_function(rng):
    q, k, v = _problem(rng)
    want, want_lse = flashcpp.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    out = np.empty_like(q)
    lse = np.empty((2, 4, 5), np.float32)
    p = _C.AttnParams()
    p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim = 2, 5, 5, 4, 4, 64
    p.q, p.k, p.v, p.o = _view(q), _view(k), _view(v), _view(out)
    p.lse = lse.ctypes.data
    p.mask.causal = True
    opt = _C.RunOptions("cpu")
    assert _C.select_kernel(p, opt)[0] == "cpu_tiled_online_softmax"
    assert _C.attention_forward(p, opt) is None
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    p.head_dim = 84  # the C++ validator's refusal arrives as ValueError
    with pytest.raises(ValueError, match=r"head_dim 84 is not supported \(it must be a multiple of 8 in \[8, 256\]\)"):
        _C.attention_forward(p, opt)
    p.head_dim, p.head_dim_v = 64, 264
    with pytest.raises(ValueError, match=r"head_dim_v 264 is not supported \(it must be a multiple of 8"):
        _C.attention_forward(p, opt)


def test_plan_checks_the_host_lengths_against_the_batch():
    p = _C.DecodeParams()
    p.batch, p.heads_q, p.heads_kv, p.head_dim = 2, 4, 4, 64
    p.q = p.o = _C.TensorView(0, _C.DTYPE_F32)
    p.cache.capacity = 16
    p.cache.k = p.cache.v = _C.TensorView(0, _C.DTYPE_F32)
    opt = _C.DecodePlanOptions()
    opt.backend = "cpu"
    opt.host_cache_seqlens = np.array([3, 4, 5], np.int32)  # kept alive by opt
    with pytest.raises(ValueError, match="host_cache_seqlens has 3 entries; the plan is for batch 2"):
        _C.decode_workspace_size(p, opt, False)
    opt.host_cache_seqlens = np.array([3, 4], np.int32)
    ints, floats = _C.decode_workspace_size(p, opt, False)
    assert ints > 0 and floats >= 0
