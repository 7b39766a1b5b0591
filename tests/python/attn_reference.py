"""fp64 numpy reference of flashcpp's attention semantics (include/flashcpp/attention.h),
written from the rules, element by element in the mask: the ground truth of the Python tests.

    s(i,j) = scale * q_i . k_j;  softcap: s = c * tanh(s / c);  ALiBi: s += slope * (j - ia)
    ia = i + seqlen_k - seqlen_q (bottom-right alignment)
    visible: causal j <= ia; window j in [ia - left, ia + right] (-1 = unbounded)
    O = softmax(s) V over visible keys; LSE = log sum exp(s); no visible key: O = 0, LSE = -inf
"""
import numpy as np


def visible_mask(seqlen_q, seqlen_k, causal=False, window=(-1, -1)):
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    ia = i + seqlen_k - seqlen_q
    vis = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if causal:
        vis &= j <= ia
    left, right = window
    if left >= 0:
        vis &= j >= ia - left
    if right >= 0:
        vis &= j <= ia + right
    return vis


def attention_ref(q, k, v, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
                  alibi_slopes=None, mask=None):
    """q (B, Nq, Hq, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv), any float dtype -> (out fp64
    (B, Nq, Hq, Dv), lse fp64 (B, Hq, Nq)). alibi_slopes: (Hq,) or (B, Hq). mask: bool, broadcastable to
    (B, Hq, Nq, Nk), True = visible, ANDed with the other rules (a block-sparse mask's to_dense)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Nq, Hq, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scale = 1.0 / np.sqrt(D) if softmax_scale is None else softmax_scale
    k = np.repeat(k, group, axis=2)  # query head h reads kv head h // group
    v = np.repeat(v, group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=np.float64), (B, Hq))
        ia = np.arange(Nq)[:, None] + Nk - Nq
        dist = np.arange(Nk)[None, :] - ia
        s = s + slopes[:, :, None, None] * dist[None, None]
    vis = visible_mask(Nq, Nk, causal, window)[None, None]
    if mask is not None:
        vis = vis & np.asarray(mask, dtype=bool)
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if Nk else np.full(s.shape[:-1] + (1,), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    denom = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(denom > 0, np.log(denom) + m_safe, -np.inf)[..., 0]
        p = np.where(denom > 0, p / np.where(denom > 0, denom, 1.0), 0.0)
    out = np.einsum("bhij,bjhd->bihd", p, v)
    return out, lse


def varlen_ref(q, k, v, cu_q, cu_k, **kw):
    """Packed q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv) -> (out (Tq, Hq, Dv), lse (Hq, Tq));
    rows past cu_q[-1] are 0 / -inf."""
    Tq, Hq, _ = q.shape
    out = np.zeros((Tq, Hq, v.shape[-1]))
    lse = np.full((Hq, Tq), -np.inf)
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs:
            continue
        kw_b = dict(kw)
        if kw_b.get("alibi_slopes") is not None:
            a = np.asarray(kw_b["alibi_slopes"])
            kw_b["alibi_slopes"] = a[b] if a.ndim == 2 else a
        o, l = attention_ref(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], **kw_b)
        out[qs:qe] = o[0]
        lse[:, qs:qe] = l[0]
    return out, lse


def tolerance(dtype):
    """atol for outputs of O(1) magnitude vs the fp64 reference: fp32 accumulation in every
    backend, plus one rounding of the output to the storage dtype."""
    name = dtype if isinstance(dtype, str) else str(getattr(dtype, "__name__", dtype))
    if "float" not in name:
        name = np.dtype(dtype).name  # ml_dtypes and other numpy dtype objects
    if "float32" in name:
        return 2e-5
    if "bfloat16" in name:
        return 2e-2
    return 3e-3  # float16


def alibi_slopes(heads):
    """BLOOM's geometric slopes 2^(-8h/H), h = 1..H."""
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)
