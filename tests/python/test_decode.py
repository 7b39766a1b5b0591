"""flash_attn_with_kvcache and BatchDecodeWithPagedKVCache on host arrays (numpy), against the
fp64 reference of attn_reference.py on a dense copy of the cache, and the rotary rule of
include/flashcpp/decode.h written out independently here."""
import numpy as np
import pytest

import flashcpp
from attn_reference import alibi_slopes, attention_ref, tolerance


def rotate_ref(x, pos, rotary_dim, interleaved, theta=10000.0, cos=None, sin=None):
    """x (T, H, D) rotated at positions pos (T,) in float64 (the exact rotation)."""
    x = np.asarray(x, dtype=np.float64).copy()
    half = rotary_dim // 2
    if cos is None:
        inv = theta ** (-np.arange(half) * 2.0 / rotary_dim)
        ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]
        c, s = np.cos(ang), np.sin(ang)
    else:
        c, s = np.asarray(cos, np.float64)[pos], np.asarray(sin, np.float64)[pos]
    c, s = c[:, None, :], s[:, None, :]
    if interleaved:
        a, b = x[..., 0:rotary_dim:2].copy(), x[..., 1:rotary_dim:2].copy()
        x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., :half].copy(), x[..., half:rotary_dim].copy()
        x[..., :half], x[..., half:rotary_dim] = a * c - b * s, b * c + a * s
    return x


def make_cache(rng, batch, lens, slots, hkv, d, dtype, page_size=0):
    """Random keys below each length, NaN above; contiguous or paged with shuffled pages."""
    k = np.full((batch, slots, hkv, d), np.nan, dtype=dtype)
    v = np.full_like(k, np.nan)
    for b, n in enumerate(lens):
        k[b, :n] = rng.standard_normal((n, hkv, d))
        v[b, :n] = rng.standard_normal((n, hkv, d))
    if not page_size:
        return k, v, None
    pps = (slots + page_size - 1) // page_size
    pages = rng.permutation(batch * pps + 3).astype(np.int32)
    table = pages[:batch * pps].reshape(batch, pps)
    kp = np.full((batch * pps + 3, page_size, hkv, d), np.nan, dtype=dtype)
    vp = np.full_like(kp, np.nan)
    for b in range(batch):
        for j in range(slots):
            kp[table[b, j // page_size], j % page_size] = k[b, j]
            vp[table[b, j // page_size], j % page_size] = v[b, j]
    return kp, vp, table


def dense(k, table, b, n, page_size):
    if table is None:
        return k[b, :n]
    j = np.arange(n)
    return k[table[b, j // page_size], j % page_size]


@pytest.mark.parametrize("page_size", [0, 1, 16, 256])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_decode_matches_reference(rng, page_size, dtype):
    B, Hq, Hkv, D, slots = 3, 8, 2, 64, 300
    lens = [0, 1, 257]
    kc, vc, table = make_cache(rng, B, lens, slots, Hkv, D, dtype, page_size)
    q = rng.standard_normal((B, 1, Hq, D)).astype(dtype)
    out, lse = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=np.array(lens, np.int32),
                                                block_table=table, causal=True, return_softmax_lse=True)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (B, Hq, 1)
    ps = page_size or 1
    for b, n in enumerate(lens):
        ro, rl = attention_ref(q[b:b + 1], dense(kc, table, b, n, ps)[None], dense(vc, table, b, n, ps)[None],
                               causal=True)
        assert np.abs(out[b] - ro[0]).max() <= tolerance(dtype)
        if n == 0:
            assert np.all(out[b] == 0) and np.all(np.isneginf(lse[b]))
        else:
            assert np.abs(lse[b] - rl[0]).max() < 1e-4


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tables", [False, True])
def test_append_with_rotary_updates_the_cache(rng, interleaved, tables):
    B, Sq, Hq, Hkv, D, slots = 2, 4, 4, 2, 64, 200
    lens = [100, 0]
    kc, vc, table = make_cache(rng, B, lens, slots, Hkv, D, np.float32, 16)
    q = rng.standard_normal((B, Sq, Hq, D)).astype(np.float32)
    kn = rng.standard_normal((B, Sq, Hkv, D)).astype(np.float32)
    vn = rng.standard_normal((B, Sq, Hkv, D)).astype(np.float32)
    rd = 32 if tables else D
    cos = sin = None
    if tables:
        ang = rng.uniform(-np.pi, np.pi, (slots, rd // 2))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    k0 = kc.copy()
    out = flashcpp.flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin,
                                           rope_theta=None if tables else 10000.0,
                                           cache_seqlens=np.array(lens, np.int32), block_table=table,
                                           causal=True, rotary_interleaved=interleaved)
    for b, c in enumerate(lens):
        pos = c + np.arange(Sq)
        want_k = rotate_ref(kn[b], pos, rd, interleaved, cos=cos, sin=sin)
        got_k = dense(kc, table, b, c + Sq, 16)[c:]
        assert np.abs(got_k - want_k).max() < 1e-5 * (1 + pos.max())  # fp32 angles
        assert np.array_equal(dense(vc, table, b, c + Sq, 16)[c:], vn[b])
        assert np.array_equal(dense(kc, table, b, c, 16), dense(k0, table, b, c, 16))  # old keys untouched
        qr = rotate_ref(q[b], pos, rd, interleaved, cos=cos, sin=sin)
        ro, _ = attention_ref(qr[None], dense(kc, table, b, c + Sq, 16)[None], dense(vc, table, b, c + Sq, 16)[None],
                              causal=True)
        assert np.abs(out[b] - ro[0]).max() < 1e-4


def test_gqa_masks_and_query_lengths(rng):
    B, Hq, Hkv, D, slots = 2, 8, 1, 128, 500
    lens = [400, 33]
    kc, vc, _ = make_cache(rng, B, lens, slots, Hkv, D, np.float32)
    for sq in (1, 3, 16):
        for kw in (dict(window_size=(50, -1)), dict(softcap=3.0), dict(alibi_slopes=alibi_slopes(Hq)),
                   dict(softmax_scale=0.05)):
            q = rng.standard_normal((B, sq, Hq, D)).astype(np.float32)
            lq = [n + 0 for n in lens]
            out = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=np.array(lq, np.int32), causal=True, **kw)
            ref_kw = dict(kw)
            if "window_size" in ref_kw:
                ref_kw["window"] = ref_kw.pop("window_size")
            for b, n in enumerate(lq):
                ro, _ = attention_ref(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], causal=True, **ref_kw)
                assert np.abs(out[b] - ro[0]).max() < 2e-5, (sq, kw)


def test_batch_decode_wrapper_plan_run(rng):
    B, Hq, Hkv, D, ps = 3, 4, 2, 64, 16
    lens = [33, 16, 1]
    n_pages = [(n + ps - 1) // ps for n in lens]
    total = sum(n_pages)
    pages = rng.permutation(total + 2).astype(np.int32)[:total]
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * ps for n, p in zip(lens, n_pages)], np.int32)
    kc = rng.standard_normal((total + 2, ps, Hkv, D)).astype(np.float32)
    vc = rng.standard_normal((total + 2, ps, Hkv, D)).astype(np.float32)
    w = flashcpp.BatchDecodeWithPagedKVCache(None, "NHD")
    w.plan(indptr, pages, last, Hq, Hkv, D, ps)
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    o, lse = w.run(q, (kc, vc), return_lse=True)
    assert o.shape == (B, Hq, D) and lse.shape == (B, Hq)
    for b, n in enumerate(lens):
        pg = pages[indptr[b]:indptr[b + 1]]
        j = np.arange(n)
        k = kc[pg[j // ps], j % ps]
        v = vc[pg[j // ps], j % ps]
        ro, rl = attention_ref(q[b][None, None], k[None], v[None])
        assert np.abs(o[b] - ro[0, 0]).max() < 2e-5
        assert np.abs(lse[b] - rl[0, :, 0]).max() < 1e-4


def test_decode_errors(rng):
    kc = np.zeros((2, 64, 2, 64), np.float32)
    q = np.zeros((2, 17, 4, 64), np.float32)
    with pytest.raises(ValueError, match="seqlen_q 17 is outside the decode range 1..16"):
        flashcpp.flash_attn_with_kvcache(q, kc, kc)
    q = np.zeros((2, 1, 4, 64), np.float32)
    with pytest.raises(ValueError, match="page_size 48 .* not a power of two"):
        flashcpp.flash_attn_with_kvcache(q, np.zeros((4, 48, 2, 64), np.float32), np.zeros((4, 48, 2, 64), np.float32),
                                         block_table=np.zeros((2, 2), np.int32), cache_seqlens=1)
    with pytest.raises(ValueError, match="exceed the cache's 64 slots"):
        flashcpp.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=np.array([64, 65], np.int32))
    with pytest.raises(ValueError, match="block_table\\[0\\] holds page 9"):
        flashcpp.flash_attn_with_kvcache(q, np.zeros((4, 16, 2, 64), np.float32), np.zeros((4, 16, 2, 64), np.float32),
                                         block_table=np.array([[9], [0]], np.int32), cache_seqlens=3)
    with pytest.raises(NotImplementedError, match="cache_batch_idx"):
        flashcpp.flash_attn_with_kvcache(q, kc, kc, cache_batch_idx=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="k and v come together"):
        flashcpp.flash_attn_with_kvcache(q, kc, kc, k=np.zeros((2, 1, 2, 64), np.float32), cache_seqlens=0)
    with pytest.raises(NotImplementedError, match="pos_encoding_mode"):
        flashcpp.BatchDecodeWithPagedKVCache().plan(np.array([0, 1]), np.array([0]), np.array([1]), 4, 2, 64, 16,
                                                    pos_encoding_mode="ROPE_LLAMA")


# ---- BatchDecodeWithKVCache: plan once, run many (the CPU backend walks the GPU's work list) ----------

@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_plan_run_wrapper(rng, page_size, num_splits):
    from flashcpp.decode import BatchDecodeWithKVCache
    B, Hq, Hkv, D, slots = 3, 8, 2, 128, 400
    lens = [399, 0, 130]
    kc, vc, table = make_cache(rng, B, [399, 5, 130], slots, Hkv, D, np.float32, page_size)  # NaN past these
    w = BatchDecodeWithKVCache()
    cap = table.shape[1] * page_size if page_size else slots
    plan = w.plan(B, Hq, Hkv, D, kv_capacity=cap, page_size=page_size, cache_seqlens=lens, causal=True,
                  dtype=np.float32, device="cpu", num_splits=num_splits)
    assert plan.backend == "cpu" and plan.paged == bool(page_size) and w.plan_info is plan
    if num_splits:
        assert plan.max_splits == num_splits
    out = np.full((B, 1, Hq, D), np.nan, np.float32)
    lse = np.full((B, Hq, 1), np.nan, np.float32)
    for _ in range(2):  # one plan, several steps with new queries and lengths
        q = rng.standard_normal((B, 1, Hq, D)).astype(np.float32)
        o, l = w.run(q, kc, vc, np.array(lens, np.int32), block_table=table, out=out, lse=lse)
        assert o is out and l is lse
        for b, n in enumerate(lens):
            ro, rl = attention_ref(q[b:b + 1], dense(kc, table, b, n, page_size or 1)[None],
                                   dense(vc, table, b, n, page_size or 1)[None], causal=True)
            assert np.abs(out[b] - ro[0]).max() < 2e-5
            if n:
                assert np.abs(lse[b] - rl[0]).max() < 1e-4
            else:
                assert np.all(out[b] == 0) and np.all(np.isneginf(lse[b]))
        lens = [130, 5, 0]


def test_plan_run_wrapper_torch_cpu_bf16():
    torch = pytest.importorskip("torch")
    from flashcpp.decode import BatchDecodeWithKVCache
    g = torch.Generator().manual_seed(3)
    B, Sq, Hq, Hkv, D, S = 2, 4, 8, 8, 64, 256
    kc = torch.randn(B, S, Hkv, D, generator=g).to(torch.bfloat16)
    vc = torch.randn(B, S, Hkv, D, generator=g).to(torch.bfloat16)
    q = torch.randn(B, Sq, Hq, D, generator=g).to(torch.bfloat16)
    lens = torch.tensor([256, 9], dtype=torch.int32)
    w = BatchDecodeWithKVCache()
    w.plan(B, Hq, Hkv, D, seqlen_q=Sq, kv_capacity=S, cache_seqlens=lens, causal=True, dtype=torch.bfloat16,
           device="cpu")
    out = w.run(q, kc, vc, lens)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    for b, n in enumerate(lens.tolist()):
        ro, _ = attention_ref(q[b:b + 1].float().numpy(), kc[b:b + 1, :n].float().numpy(),
                              vc[b:b + 1, :n].float().numpy(), causal=True)
        assert np.abs(out[b].float().numpy() - ro[0]).max() <= tolerance("bfloat16")


def test_plan_small_plan_spreads_a_short_step():
    # B1 GQA 32/8 D64 over 2049 keys: too short for 256-key splits to fill a wave. "full_wave"
    # splits it down to one 64-key tile per split (33 splits, 264 CTAs on the 132 SMs the CPU
    # backend plans for), "shared" stops at 5/8 of the SMs (9 splits, 72 CTAs; docs/decode.md).
    from flashcpp.decode import BatchDecodeWithKVCache
    counts = {}
    for sp in ("full_wave", "shared"):
        w = BatchDecodeWithKVCache()
        plan = w.plan(1, 32, 8, 64, kv_capacity=2049, cache_seqlens=[2049], dtype=np.float32, device="cpu",
                      small_plan=sp)
        counts[sp] = plan.max_splits
    assert counts == {"full_wave": 33, "shared": 9}
    with pytest.raises(ValueError, match="small_plan must be 'full_wave' or 'shared'"):
        BatchDecodeWithKVCache().plan(1, 32, 8, 64, kv_capacity=64, dtype=np.float32, device="cpu", small_plan="half")


def test_plan_run_wrapper_errors(rng):
    from flashcpp.decode import BatchDecodeWithKVCache
    w = BatchDecodeWithKVCache()
    kc = np.zeros((2, 64, 2, 64), np.float32)
    q = np.zeros((2, 1, 4, 64), np.float32)
    lens = np.array([3, 64], np.int32)
    with pytest.raises(RuntimeError, match="call plan\\(\\) before run\\(\\)"):
        w.run(q, kc, kc.copy(), lens)
    with pytest.raises(ValueError, match="num_splits 300 is outside \\[0, 256\\]"):  # the C++ sentence
        w.plan(2, 4, 2, 64, kv_capacity=64, dtype=np.float32, device="cpu", num_splits=300)
    for cap in (300, -1):  # a cap above the most splits a plan makes is refused as num_splits is
        with pytest.raises(ValueError, match=f"max_splits {cap} is outside \\[0, 256\\]"):
            w.plan(2, 4, 2, 64, kv_capacity=64, dtype=np.float32, device="cpu", max_splits=cap)
    with pytest.raises(ValueError, match="head_dim 84 is not supported \\(it must be a multiple of 8 in \\[8, 256\\]\\)"):
        w.plan(2, 4, 2, 84, kv_capacity=64, dtype=np.float32, device="cpu")
    with pytest.raises(ValueError, match="head_dim_v 264 is not supported \\(it must be a multiple of 8"):
        w.plan(2, 4, 2, 64, head_dim_v=264, kv_capacity=64, dtype=np.float32, device="cpu")
    with pytest.raises(ValueError, match="needs kv_capacity"):
        w.plan(2, 4, 2, 64, dtype=np.float32, device="cpu")
    with pytest.raises(ValueError, match="exceed the cache's 64 slots"):
        w.plan(2, 4, 2, 64, kv_capacity=64, cache_seqlens=[64, 64], append=True, dtype=np.float32, device="cpu")
    w.plan(2, 4, 2, 64, kv_capacity=64, dtype=np.float32, device="cpu")
    with pytest.raises(ValueError, match="as planned"):
        w.run(q[:1], kc, kc.copy(), lens)
    with pytest.raises(TypeError, match="the plan is for float32"):
        w.run(q.astype(np.float16), kc, kc.copy(), lens)
    with pytest.raises(ValueError, match="plan has append=False"):
        w.run(q, kc, kc.copy(), lens, k=np.zeros((2, 1, 2, 64), np.float32), v=np.zeros((2, 1, 2, 64), np.float32))
    with pytest.raises(ValueError, match="plan is for a contiguous cache"):
        w.run(q, kc, kc.copy(), lens, block_table=np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="cache_seqlens\\[1\\] 65 = 65 keys exceed"):  # C++, host values
        w.run(q, kc, kc.copy(), np.array([3, 65], np.int32))
    with pytest.raises(ValueError, match="o overlaps"):  # C++: the output aliases an input
        w.run(q, kc, kc.copy(), lens, out=q)
    small = BatchDecodeWithKVCache(np.zeros(64, np.uint8))
    with pytest.raises(ValueError, match="workspace_buffer has 64 bytes"):
        small.plan(2, 4, 2, 64, kv_capacity=64, dtype=np.float32, device="cpu")


def test_plan_run_wrapper_user_workspace(rng):
    from flashcpp.decode import BatchDecodeWithKVCache
    B, Hq, Hkv, D, slots = 2, 4, 4, 64, 2000
    lens = [2000, 1500]
    kc, vc, _ = make_cache(rng, B, lens, slots, Hkv, D, np.float32)
    w = BatchDecodeWithKVCache(np.zeros(1 << 20, np.uint8))
    plan = w.plan(B, Hq, Hkv, D, kv_capacity=slots, cache_seqlens=lens, dtype="float32", device="cpu",
                  num_splits=8)
    assert plan.needs_merge and plan.float_bytes > 0
    q = rng.standard_normal((B, 1, Hq, D)).astype(np.float32)
    out = w.run(q, kc, vc, np.array(lens, np.int32))
    for b, n in enumerate(lens):
        ro, _ = attention_ref(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n])
        assert np.abs(out[b] - ro[0]).max() < 2e-5


def test_cached_plans_do_not_leak_at_exit(tmp_path):
    """A DecodePlan held by the kvcache plan table is released before nanobind's leak check at
    interpreter exit (it printed 'nanobind: leaked 1 instances' after the host-overhead bench)."""
    import subprocess
    import sys
    script = tmp_path / "hold_plan.py"
    script.write_text(
        "import numpy as np\n"
        "from flashcpp import _decode\n"
        "from flashcpp.decode import BatchDecodeWithKVCache\n"
        "w = BatchDecodeWithKVCache()\n"
        "w.plan(2, 4, 2, 64, kv_capacity=64, page_size=0, cache_seqlens=[3, 5], causal=True, dtype=np.float32,"
        " device='cpu')\n"
        "_decode._PLAN_CACHE[('held at exit',)] = w\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "leaked" not in r.stderr, r.stderr
