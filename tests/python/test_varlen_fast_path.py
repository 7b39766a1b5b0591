"""The eager fast path of flash_attn_varlen_func (_C.varlen_fast, python/src/eager_fast.cc): a plain
call on packed torch tensors fills AttnParams (cu_seqlens, maxima, total_q) in one C++ call.

It must give exactly what the general path gives (flashcpp.attention with cu_seqlens runs the
general path: compared bit for bit, the LSE and the packed rows past cu_seqlens_q[-1] included),
refuse what it refuses, and step aside for what it does not take. Host tensors, and CUDA tensors
(bf16/fp16) where a device is present: the transformers integration's padded prefill runs here."""
import importlib
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import flashcpp  # noqa: E402
from flashcpp import _flashcpp as _C  # noqa: E402
attn_mod = importlib.import_module("flashcpp.attention")
from attn_reference import attention_ref, tolerance  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flashcpp.WITH_CUDA else [])


def _rand(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def _qkv(seed, total_q=9, total_k=11):
    return (_rand((total_q, 2, 32), torch.float32, seed), _rand((total_k, 2, 32), torch.float32, seed + 1),
            _rand((total_k, 2, 32), torch.float32, seed + 2))


def _cu(lens, device="cpu"):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=device)


CASES = [
    # (lens_q, lens_k, spare_q, Hq, Hkv, D, Dv, causal, window, softcap, scale)
    ([7, 1, 12], [7, 1, 12], 0, 4, 2, 64, 64, True, (-1, -1), 0.0, None),
    ([3, 0, 9], [20, 4, 9], 5, 8, 1, 128, 128, True, (-1, -1), 0.0, None),  # an empty sequence, spare rows
    ([16, 11], [16, 11], 0, 2, 2, 32, 48, True, (6, 0), 30.0, 0.3),
    ([5], [300], 2, 6, 3, 96, 96, False, (100, 4), 0.0, 0.0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_fast_path_equals_the_general_path(case, dtype, device):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA attention kernels take bf16/fp16")
    lens_q, lens_k, spare, Hq, Hkv, D, Dv, causal, window, softcap, scale = case
    Tq, Tk = sum(lens_q) + spare, sum(lens_k)
    q = _rand((Tq, Hq, D), dtype, 1, device)
    k, v = _rand((Tk, Hkv, D), dtype, 2, device), _rand((Tk, Hkv, Dv), dtype, 3, device)
    cq, ck = _cu(lens_q, device), _cu(lens_k, device)
    mq, mk = max(max(lens_q), 1), max(lens_k)
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    assert _C.varlen_fast(q, k, v, cq, ck, mq, mk, scale, causal, *window, softcap, True) is not None
    out, lse = flashcpp.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, return_lse=True, **kw)
    if device == "cuda":  # rows past cu_seqlens_q[-1] are left as they are there: compare the covered ones
        out, lse = out[:sum(lens_q)], lse[:, :sum(lens_q)]
    go, gl = flashcpp.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk,
                                return_lse=True, **kw)
    if device == "cuda":
        go, gl = go[:sum(lens_q)], gl[:, :sum(lens_q)]
    assert out.dtype == dtype and out.shape[1:] == (Hq, Dv) and lse.shape[0] == Hq
    assert torch.equal(out, go) and torch.equal(lse, gl)
    plain = flashcpp.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, **kw)  # without the LSE
    assert torch.equal(plain[:out.shape[0]], out)
    if device == "cpu":  # and against the fp64 reference, sequence by sequence
        assert torch.all(out[sum(lens_q):] == 0) and torch.all(torch.isneginf(lse[:, sum(lens_q):]))
        sc = 1 / math.sqrt(D) if scale is None else (2.0 ** -100 if scale == 0 else scale)
        for b in range(len(lens_q)):
            if lens_q[b] == 0:
                continue
            qs, ks = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
            ro, _ = attention_ref(q[None, qs].float().numpy(), k[None, ks].float().numpy(), v[None, ks].float().numpy(),
                                  softmax_scale=sc, causal=causal, window=window, softcap=softcap)
            assert np.abs(out[qs].float().numpy() - ro[0]).max() <= tolerance(str(dtype).replace("torch.", ""))


def test_strided_packed_tensors_and_nan():
    """Packed tensors whose token stride is not heads * dim (a slice of a wider buffer) are read
    through their strides; a NaN in one value column reaches only that column of its sequence."""
    wide = _rand((30, 2, 80), torch.float32, 4)
    q, k, v = wide[:20, :, :32], wide[5:25, :, 40:72], wide[10:30, :, 16:48].clone()
    v[13, 1, 7] = math.nan  # sequence 1 (keys 12..19), KV head 1
    cq = ck = _cu([12, 8])
    out = flashcpp.flash_attn_varlen_func(q, k, v, cq, ck, 12, 12, causal=True)
    go = flashcpp.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=12, max_seqlen_k=12,
                            causal=True)[0]
    assert torch.equal(torch.nan_to_num(out, nan=7.0), torch.nan_to_num(go, nan=7.0))
    assert torch.isnan(out[13:, 1, 7]).all()  # every query that sees the NaN key (causal: from its position on)
    # and nothing outside that column of sequence 1 (a query before it may read 0 * NaN inside a tile)
    assert torch.isfinite(out[:12]).all()
    assert torch.isfinite(out[12:, 0]).all()
    assert torch.isfinite(out[12:, 1, :7]).all() and torch.isfinite(out[12:, 1, 8:]).all()


def test_what_the_fast_path_steps_aside_for():
    q, k, v = _qkv(5)
    cq, ck = _cu([4, 5]), _cu([6, 5])
    f = _C.varlen_fast
    plain = (None, False, -1, -1, 0.0, False)
    assert f(q, k, v, cq, ck, 5, 6, *plain) is not None
    assert f(q, k, v, cq.long(), ck, 5, 6, *plain) is None  # int64 prefix sums
    assert f(q, k, v, [0, 4, 9], ck, 5, 6, *plain) is None  # a list
    assert f(q, k, v, cq, ck[:2], 5, 6, *plain) is None  # different batches
    assert f(q, k, v, _cu([]), _cu([]), 5, 6, *plain) is None  # batch 0: the general path fills every row
    assert f(q, k, v, cq, ck, 0, 6, *plain) is None  # a zero maximum
    assert f(q, k, v, cq, ck, 5.0, 6, *plain) is None  # a float maximum
    assert f(q, k, v, cq, ck, True, 6, *plain) is None  # a bool maximum
    assert f(q, k, v, cq, ck, 2 ** 31, 6, *plain) is None
    assert f(q.double(), k.double(), v.double(), cq, ck, 5, 6, *plain) is None
    assert f(q[None], k[None], v[None], cq, ck, 5, 6, *plain) is None  # 4-D: flash_attn_func's
    assert f(q.requires_grad_(), k, v, cq, ck, 5, 6, *plain) is None  # autograd: the registered op
    q.requires_grad_(False)
    assert f(q, k, v, torch.tensor([0, 4, 9, 0], dtype=torch.int32)[::2], _cu([11]), 5, 11, *plain) is None
    # host values the general path refuses with its sentences: the fast path leaves them to it
    bad = [(torch.tensor([1, 4, 9], dtype=torch.int32), ck, 5, 6, "must be 0"),
           (torch.tensor([0, 6, 5], dtype=torch.int32), ck, 6, 6, "non-decreasing"),
           (cq, ck, 4, 6, "exceeds the max_seqlen"),
           (cq, torch.tensor([0, 6, 12], dtype=torch.int32), 5, 6, "exceeds the 11 packed tokens")]
    for bq, bk, mq, mk, msg in bad:
        assert f(q, k, v, bq, bk, mq, mk, *plain) is None, msg
        with pytest.raises(ValueError, match=msg):
            flashcpp.flash_attn_varlen_func(q, k, v, bq, bk, mq, mk)


def test_refusals_are_the_general_paths():
    q, k, v = _qkv(8)
    cq, ck = _cu([4, 5]), _cu([6, 5])
    for kw in (dict(softcap=-1.0), dict(softcap=math.nan), dict(softmax_scale=math.inf), dict(window_size=(-2, 0))):
        with pytest.raises(ValueError) as fast:
            flashcpp.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, **kw)
        with pytest.raises(ValueError) as general:
            flashcpp.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=5, max_seqlen_k=6, **kw)
        assert str(fast.value) == str(general.value), kw
    with pytest.raises(NotImplementedError):
        flashcpp.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, dropout_p=0.1)


def test_gradients_still_flow_through_the_registered_op():
    q, k, v = (t.requires_grad_() for t in _qkv(11))
    cq, ck = _cu([4, 5]), _cu([6, 5])
    out = flashcpp.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, causal=True)
    assert out.requires_grad
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_what_the_probe_found():
    """A negative view of cu_seqlens (its memory holds the negatives) and a head dim of 0 go to the
    general path's sentences; a scale or softcap that float32 rounds to 0 (where C++ reads 0 as
    the default scale, or no softcap) gives uniform weights, or is refused."""
    q, k, v = _qkv(14)
    cq, ck = _cu([4, 5]), _cu([6, 5])
    for neg_q, neg_k in ((torch._neg_view(cq), ck), (cq, torch._neg_view(ck))):
        assert _C.varlen_fast(q, k, v, neg_q, neg_k, 5, 6, None, False, -1, -1, 0.0, False) is None
        with pytest.raises(ValueError, match="negative view"):
            flashcpp.flash_attn_varlen_func(q, k, v, neg_q, neg_k, 5, 6)
    with pytest.raises(ValueError, match="head_dim_v 0 is not supported"):
        flashcpp.flash_attn_varlen_func(q, k, v[..., :0], cq, ck, 5, 6)
    with pytest.raises(ValueError, match="head_dim_v 0 is not supported"):
        flashcpp.flash_attn_func(q[None], k[None], v[None, ..., :0])
    uniform = flashcpp.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, softmax_scale=0.0)
    default = flashcpp.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6)
    for tiny in (1e-50, -1e-50):
        assert torch.equal(flashcpp.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, softmax_scale=tiny), uniform)
        got = flashcpp.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=5, max_seqlen_k=6,
                                 softmax_scale=tiny)[0]
        assert torch.equal(got, uniform) and not torch.equal(got, default)
        assert torch.equal(flashcpp.flash_attn_func(q[None], k[None], v[None], softmax_scale=tiny),
                           flashcpp.flash_attn_func(q[None], k[None], v[None], softmax_scale=0.0))
    for call in (lambda: flashcpp.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, softcap=1e-300),
                 lambda: flashcpp.flash_attn_func(q[None], k[None], v[None], softcap=1e-300),
                 lambda: flashcpp.attention(q[None], k[None], v[None], softcap=1e-300)):
        with pytest.raises(ValueError, match="rounds to 0 in float32"):
            call()


@pytest.mark.skipif(not hasattr(torch, "uint32"), reason="this torch has no uint32")
def test_unsigned_prefix_sums_are_read_or_refused_in_a_sentence():
    """uint16/32/64 cu_seqlens run as their int32 values (torch had no host min/max for them, so
    the range check raised its own NotImplementedError); a value past int32 is named."""
    q, k, v = _qkv(17)
    want = flashcpp.flash_attn_varlen_func(q, k, v, _cu([4, 5]), _cu([6, 5]), 5, 6)
    for dt in (torch.uint16, torch.uint32, torch.uint64):
        got = flashcpp.flash_attn_varlen_func(q, k, v, _cu([4, 5]).to(dt), _cu([6, 5]).to(dt), 5, 6)
        assert torch.equal(got, want), dt
    with pytest.raises(ValueError, match="cu_seqlens_q values must fit int32"):
        flashcpp.flash_attn_varlen_func(q, k, v, torch.tensor([0, 4, 2 ** 32 + 9]).to(torch.uint64), _cu([6, 5]), 5, 6)
