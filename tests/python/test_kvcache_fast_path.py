"""The eager fast path of flash_attn_with_kvcache (flashcpp/_decode.py, _fast_kvcache): a plain step
on torch tensors fills DecodeParams from shapes, strides and pointers and runs the plan.

It must give exactly what the general path gives (_decode._with_kvcache, the general body:
compared bit for bit, outputs, LSE and the appended cache), refuse what it refuses, and step aside
for what it does not take. Host tensors here, where a plan is made per call for the host lengths;
on CUDA the same params run the shape's cached plan."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import flashcpp  # noqa: E402
from flashcpp import _decode  # noqa: E402


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rand(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def _cache(B, slots, Hkv, D, Dv, dtype, page, seed, device):
    """A contiguous cache, or a paged one with a shuffled block table."""
    if not page:
        return (_rand((B, slots, Hkv, D), dtype, seed, device), _rand((B, slots, Hkv, Dv), dtype, seed + 1, device),
                None)
    pps = -(-slots // page)
    pages = torch.randperm(B * pps + 2, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    table = pages[:B * pps].reshape(B, pps).contiguous().to(device)
    n = B * pps + 2
    return _rand((n, page, Hkv, D), dtype, seed, device), _rand((n, page, Hkv, Dv), dtype, seed + 1, device), table


CASES = [
    # (B, Sq, Hq, Hkv, D, Dv, slots, page, append, causal, window, softcap, scale, splits)
    (3, 1, 8, 2, 64, 64, 300, 0, False, True, (-1, -1), 0.0, None, 0),
    (2, 4, 4, 4, 128, 128, 200, 16, True, True, (-1, -1), 0.0, None, 3),
    (1, 1, 6, 1, 32, 48, 77, 0, True, False, (20, 0), 25.0, 0.2, 0),
    (4, 2, 8, 4, 96, 96, 130, 64, False, True, (50, 3), 0.0, 0.0, 2),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_fast_path_equals_the_general_path(dtype, case, device):
    """On CUDA (bf16/fp16: the CUDA decode kernels' dtypes) the fast path runs the shape's cached plan."""
    B, Sq, Hq, Hkv, D, Dv, slots, page, append, causal, window, softcap, scale, splits = case
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA decode kernels take bf16/fp16")
    q = _rand((B, Sq, Hq, D), dtype, 1, device)
    kc, vc, table = _cache(B, slots, Hkv, D, Dv, dtype, page, 2, device)
    lens = torch.tensor([slots - Sq - 3 * b if append else slots - 5 * b for b in range(B)], dtype=torch.int32,
                        device=device)
    k = _rand((B, Sq, Hkv, D), dtype, 4, device) if append else None
    v = _rand((B, Sq, Hkv, Dv), dtype, 5, device) if append else None
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap, num_splits=splits)
    kc2, vc2 = kc.clone(), vc.clone()
    assert _decode._fast_kvcache(q, kc2, vc2, k, v, lens, table, scale, causal, window, softcap, splits, True) \
        is not None
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = flashcpp.flash_attn_with_kvcache(q, kc2, vc2, k=k, v=v, cache_seqlens=lens, block_table=table,
                                                return_softmax_lse=True, **kw)
    kc3, vc3 = kc.clone(), vc.clone()
    go, gl = _decode._with_kvcache(q, kc3, vc3, k, v, None, None, lens, table, scale, causal, window, softcap, True,
                                   None, splits, True, None)
    assert out.shape == (B, Sq, Hq, Dv) and out.dtype == dtype and lse.shape == (B, Hq, Sq)
    assert torch.equal(out, go) and torch.equal(lse, gl)
    assert torch.equal(kc2, kc3) and torch.equal(vc2, vc3)  # the append wrote the same cache
    if append:
        assert not torch.equal(kc2, kc)
    assert torch.isfinite(out).all()


def test_nan_in_the_cache_reaches_only_its_column():
    q = _rand((1, 1, 2, 32), torch.float32, 6)
    kc, vc = _rand((1, 10, 1, 32), torch.float32, 7), _rand((1, 10, 1, 32), torch.float32, 8)
    vc[0, 4, 0, 9] = math.nan
    out = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([10], dtype=torch.int32))
    assert torch.isnan(out[0, 0, :, 9]).all()
    assert torch.isfinite(out[0, 0, :, :9]).all() and torch.isfinite(out[0, 0, :, 10:]).all()


def test_refusals_are_the_general_paths():
    q = _rand((2, 1, 4, 32), torch.float32, 9)
    kc, vc = _rand((2, 16, 2, 32), torch.float32, 10), _rand((2, 16, 2, 32), torch.float32, 11)
    too_long = torch.tensor([16, 17], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=too_long)
    for kw in (dict(softcap=-1.0), dict(softmax_scale=math.nan), dict(window_size=(-3, 0))):
        lens = torch.tensor([5, 6], dtype=torch.int32)
        with pytest.raises(ValueError) as fast:
            flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **kw)
        with pytest.raises(ValueError) as general:
            flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=[5, 6], **kw)  # a list: the general path
        assert type(fast.value) is type(general.value), kw


def test_what_the_fast_path_steps_aside_for():
    q = _rand((2, 1, 4, 32), torch.float32, 12)
    kc, vc = _rand((2, 16, 2, 32), torch.float32, 13), _rand((2, 16, 2, 32), torch.float32, 14)
    lens = torch.tensor([5, 6], dtype=torch.int32)
    f = _decode._fast_kvcache
    args = (None, False, (-1, -1), 0.0, 0, False)
    assert f(q, kc, vc, None, None, lens, None, *args) is not None
    assert f(q, kc, vc, None, None, lens.long(), None, *args) is None  # int64 lengths
    assert f(q, kc, vc, None, None, [5, 6], None, *args) is None  # host list
    assert f(q, kc, vc, None, None, None, None, *args) is None  # full caches: the general path
    assert f(q, kc.half(), vc.half(), None, None, lens, None, *args) is None  # mixed dtypes
    assert f(q.double(), kc.double(), vc.double(), None, None, lens, None, *args) is None
    assert f(q[:0], kc[:0], vc[:0], None, None, lens[:0], None, *args) is None  # empty batch
    assert f(q, kc, vc, q[:, :, :2], None, lens, None, *args) is None  # k without v
    assert f(q, kc, vc, None, None, torch.tensor([5, 0, 6, 0], dtype=torch.int32)[::2], None, *args) is None  # strided
    pkc, pvc = kc.reshape(8, 4, 2, 32), vc.reshape(8, 4, 2, 32)  # 8 pages of 4 slots
    table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    assert f(q, pkc, pvc, None, None, lens, table, *args) is not None
    assert f(q, pkc, pvc, None, None, lens, table.long(), *args) is None  # int64 block table
    assert f(q, pkc, pvc, None, None, lens, table.t().contiguous().t(), *args) is None  # not contiguous
    assert f(q, kc, vc, None, None, lens, None, None, False, (-1, -1), 0.0, -1, False) is None  # num_splits < 0
    big = _rand((2, 17, 4, 32), torch.float32, 15)
    assert f(big, kc, vc, None, None, lens, None, *args) is None  # seqlen_q past the decode range
    # those calls still run (or refuse) through the general path
    a = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=[5, 6])
    b = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    assert torch.equal(a, b)
    with pytest.raises(TypeError):
        flashcpp.flash_attn_with_kvcache(q, kc.half(), vc.half(), cache_seqlens=lens)
    with pytest.raises(ValueError, match="seqlen_q 17 is outside the decode range"):
        flashcpp.flash_attn_with_kvcache(big, kc, vc, cache_seqlens=lens)
    np.testing.assert_array_equal(flashcpp.flash_attn_with_kvcache(q.numpy(), kc.numpy(), vc.numpy(),
                                                                   cache_seqlens=lens.numpy()), b.numpy())
