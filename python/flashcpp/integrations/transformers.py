"""flashcpp as an attention implementation of Hugging Face transformers (5.x).

    import flashcpp.integrations.transformers as fcpp_hf
    name = fcpp_hf.register()                     # "fcpp"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)
    model.generate(...)                           # or a training step: loss.backward()

``register()`` adds two entries under the same name through transformers' public extension points:

* ``AttentionInterface``: :func:`attention_forward`, called by every attention layer with
  query/key/value in (batch, heads, seqlen, head_dim). It runs :func:`flashcpp.flash_attn_func`
  (or :func:`flashcpp.flash_attn_varlen_func`) on the (batch, seqlen, heads, head_dim) views of them
  (no copy; k and v keep their fewer heads under GQA) and returns (batch, seqlen_q, heads, head_dim)
  and no attention weights.
* ``AttentionMaskInterface``: :func:`attention_mask`, which builds what the model passes to the
  layers as ``attention_mask``: ``None`` when every key is a real token (causality, the sliding
  window and the softcap are applied inside the kernel from the layer's arguments), else the 2-D
  boolean padding mask (batch, n) of the keys this call attends to (n < kv_length when a static
  cache hands over empty slots past the last query). Without a mask entry transformers would give
  the layers no mask at all and padded batches would attend to padding.

Why the name is not "flashcpp": transformers 5.x treats every ``attn_implementation`` whose name
contains "flash" as a flash-attn package or a Hub kernel and tries to import one when the model is
built (``lazy_import_flash_attention``), which fails for any other implementation. ``register()``
refuses such names for that reason.

What a call does (``attention_forward``):

* causal: the ``is_causal`` argument, else the module's ``is_causal`` (True for decoders), and
  False when the config sets ``is_causal=False``. flashcpp aligns causal masks bottom-right, so a
  decode step (seqlen_q < seqlen_k, the cache in front) sees the whole cache;
* ``sliding_window=w`` (Mistral, Qwen2's sliding layers, Gemma-2's alternate layers, Phi-3): the
  query at position i sees keys i-w+1..i (``window_size=(w-1, 0)``), transformers' own definition
  (``sliding_window_overlay``); without causality |i-j| <= w, as its bidirectional overlay;
* ``softcap`` (Gemma-2's ``attn_logit_softcapping``), ``scaling`` (softmax_scale);
* a 2-D padding mask: the real tokens are packed (varlen, ``cu_seqlens`` from the mask), run
  through ``flash_attn_varlen_func`` and scattered back; padded query rows get zeros (their logits
  are not defined by any implementation). Queries are the last seqlen_q columns of the mask (left
  padding, as generate builds it). A decode step (one query per row, no gradient) reads the
  cache where it lies instead: ``flash_attn_with_kvcache`` over a paged view of it, one page per
  key and one sequence per (row, KV head), whose block table lists each row's real keys (see
  ``_padded_decode``). Neither form waits for the device;
* ``cu_seq_lens_q/k`` and ``max_length_q/k`` (padding-free training, e.g.
  ``DataCollatorWithFlattening``): varlen over the flattened tokens;
* ``position_ids`` that restart inside a row (sequences packed without a mask; only when
  seqlen_q == seqlen_k): varlen with one sequence per run of consecutive positions, the rule
  transformers' masks use (their sdpa/eager masks look for it only without a cache, so
  packed rows are compared with ``use_cache=False``; flashcpp isolates them either way, as
  transformers' flash-attn path does);
* refused with an error that says so: dropout > 0 (flashcpp runs no dropout), ``s_aux``
  (attention sinks), a 4-D or otherwise custom mask, mask overlays that transformers builds from
  ``or_mask_function``/``and_mask_function``/``block_sequence_ids`` (bidirectional image-token
  blocks and the like). ``output_attentions`` gives no weights (None), as flash-attn's.

Gradients flow through torch.autograd (flashcpp's backward on either backend). fp32 CUDA inputs
are cast to the autocast dtype under ``torch.autocast``; without it the CUDA kernels refuse fp32
(they run fp16/bf16, at every head dim that is a multiple of 8 up to 256).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from .. import _core
from ..attention import flash_attn_func, flash_attn_varlen_func
from ..decode import flash_attn_with_kvcache

__all__ = ["NAME", "register", "attention_forward", "attention_mask"]

#: The default ``attn_implementation`` name :func:`register` uses.
NAME = "fcpp"


def register(name: str = NAME) -> str:
    """Register flashcpp with transformers as ``attn_implementation=name``; returns the name.

    Registers :func:`attention_forward` in ``transformers.AttentionInterface`` and
    :func:`attention_mask` in ``transformers.AttentionMaskInterface`` (both class-wide, so every
    model built afterwards can use the name; calling it again is harmless). A model already built
    switches with ``model.set_attn_implementation(name)``.
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as e:  # transformers missing, or older than the mask interface (4.53)
        raise ImportError("flashcpp.integrations.transformers needs Hugging Face transformers 5.x "
                          "(pip install 'transformers>=5,<6'): " + str(e)) from e
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string; got {name!r}")
    if "flash" in name:
        raise ValueError(
            f"name {name!r} contains 'flash': transformers treats such attn_implementation names as "
            "flash-attn packages or Hub kernels and tries to import one when a model is built; "
            f"pick another name (the default is {NAME!r})")
    if "sdpa" in name or "flex_attention" in name or "/" in name or "|" in name:
        raise ValueError(f"name {name!r} would be read by transformers as one of its own implementations "
                         "(sdpa, flex_attention, paged|..., a Hub kernel org/name); pick another name")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


# --------------------------------------------------------------------------------------------
# The mask entry: what create_causal_mask / create_sliding_window_causal_mask hand the layers.
# --------------------------------------------------------------------------------------------

def _check_mask_function(mask_function: Any, use_vmap: bool) -> None:
    # transformers sets use_vmap exactly when the model adds or_mask_function / and_mask_function
    # to the causal or sliding pattern; block_sequence_ids (tokens that see each other both ways
    # within a block) arrives as an or_masks(...) combination. Neither fits causal + window +
    # padding, so they are refused rather than silently run as plain causal attention.
    if use_vmap:
        raise NotImplementedError(
            "flashcpp's transformers integration runs causal / sliding-window attention with padding; "
            "this model adds a custom mask (or_mask_function / and_mask_function), which it does not "
            "express; use attn_implementation='sdpa' or 'eager' for it")
    qualname = getattr(mask_function, "__qualname__", "") or ""
    if qualname.startswith("or_masks."):
        raise NotImplementedError(
            "flashcpp's transformers integration does not express masks that open blocks of tokens "
            "both ways (block_sequence_ids, e.g. image tokens); use attn_implementation='sdpa' or 'eager'")


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
                   mask_function: Any = None, attention_mask: Optional[torch.Tensor] = None,
                   use_vmap: bool = False, device: Any = None, **kwargs: Any) -> Optional[torch.Tensor]:
    """transformers' mask-interface entry: ``None`` when every one of the kv_length keys this call
    attends to is a real token, else a (batch_size, n) bool tensor, True for real tokens, over the
    first n of those keys; the layer drops keys past n, and its queries are the last seqlen_q of
    the n positions.

    The keys of a call are positions kv_offset .. kv_offset + kv_length - 1 (a sliding-window cache
    keeps only the last ones). A static cache also hands over its slots past the last query
    (q_offset + q_length - 1), which hold no tokens yet: n stops there. The 2-D ``attention_mask``
    covers positions 0 .. (seen + q_length - 1).
    """
    _check_mask_function(mask_function, use_vmap)
    full = kv_offset + kv_length
    # A static cache hands the layers every slot of its buffer, also those past the last query's
    # position: the mask then ends at that position, and the layer drops the keys past its end.
    last = q_offset + q_length
    end = min(full, int(last))
    if attention_mask is None:
        if end == full:
            return None
        return torch.ones((batch_size, end - kv_offset), dtype=torch.bool, device=device)
    if attention_mask.dim() != 2:
        raise NotImplementedError(
            f"flashcpp's transformers integration takes a 2-D padding mask (batch, seqlen); got a "
            f"{attention_mask.dim()}-D attention_mask (a custom mask: use attn_implementation='sdpa' or 'eager')")
    mask = attention_mask.to(device=device if device is not None else attention_mask.device, dtype=torch.bool)
    if mask.shape[-1] < end:
        mask = torch.nn.functional.pad(mask, (0, end - mask.shape[-1]), value=False)
    mask = mask[:, kv_offset:end]
    if end == full and bool(mask.all()):
        return None
    return mask


# --------------------------------------------------------------------------------------------
# The attention entry.
# --------------------------------------------------------------------------------------------

def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu


class _TensorMemo:
    """The last answers computed from a few tensors. A forward pass hands the same position_ids and
    the same padding mask to every layer (one mask per layer type: Gemma-2 alternates sliding and
    full layers, so two are live at once), and each answer costs a few launches and a device-to-host
    sync (the host waits for the GPU) or a dozen launches, so only the first layer of each type pays
    for it. Keyed by the tensor itself (a weak reference: a new tensor at a reused address does not
    match), its in-place version counter and the caller's key; not used while torch.compile traces,
    nor for inference tensors (they keep no version counter)."""

    SIZE = 4  # entries kept, most recent first

    def __init__(self) -> None:
        self._entries: List[Any] = []

    def get(self, t: torch.Tensor, key: Any, compute: Any) -> Any:
        if torch.compiler.is_compiling() or t.is_inference():
            return compute()
        version = t._version
        for i, entry in enumerate(self._entries):
            if entry[0]() is t and entry[1] == version and entry[2] == key:
                if i:
                    self._entries.insert(0, self._entries.pop(i))
                return entry[3]
        result = compute()
        self._entries = [(weakref.ref(t), version, key, result)] + self._entries[:self.SIZE - 1]
        return result


_PACKED_MEMO = _TensorMemo()
_PADDING_MEMO = _TensorMemo()


def _packed_from_positions(position_ids: Optional[torch.Tensor], batch: int, length: int):
    """cu_seqlens and the longest run when position_ids restart inside a row (sequences packed
    without a mask), else None. A token starts a sequence when its position is not the previous
    one plus 1 (transformers' find_packed_sequence_indices), and every row starts one."""
    if position_ids is None or length <= 1 or position_ids.dim() != 2 or position_ids.shape[-1] != length:
        return None
    return _PACKED_MEMO.get(position_ids, batch, lambda: _packed_runs(position_ids, batch, length))


class _Padding(NamedTuple):
    """Where the real tokens of a padded batch are, found without a device-to-host sync.

    ``q_rows``/``q_pos`` and ``k_rows``/``k_pos`` index the (batch, position) of every query and
    key slot in row-major order, real tokens first (so gathering by them packs the sequences back
    to back), then one filler per padding slot that repeats the last slot (varlen reads no row past
    cu_seqlens[-1]). ``q_dest`` is where each packed output row goes in the flattened
    (batch * len_q) output, the fillers to one extra row that is dropped. The maxima are the padded
    lengths, which bound every sequence: finding the true ones would wait for the device."""
    q_rows: torch.Tensor
    q_pos: torch.Tensor
    q_dest: torch.Tensor
    k_rows: torch.Tensor
    k_pos: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def _real_slots(mask: torch.Tensor) -> torch.Tensor:
    """The flat indices of the True entries of a 2-D bool mask, ascending, then mask.numel() for
    every False one: a static size, so no sync (torch.nonzero would wait for the device to learn
    its length)."""
    n, flat = mask.numel(), mask.reshape(-1)
    try:
        return torch.nonzero_static(flat, size=n, fill_value=n).reshape(-1)
    except (AttributeError, NotImplementedError):  # a torch without it (on this device): the same, with a sync
        real = torch.nonzero(flat).reshape(-1)
        return torch.cat([real, real.new_full((n - real.numel(),), n)])


def _padding(attention_mask: torch.Tensor, len_q: int) -> _Padding:
    """The packing of a (batch, len_k) key mask (True or nonzero for real tokens) whose last len_q
    positions are the queries; computed once per mask tensor (every layer gets the same one)."""
    if len_q > attention_mask.shape[-1]:
        raise ValueError(f"{len_q} queries are more than the mask's {attention_mask.shape[-1]} keys: the queries "
                         f"are the mask's last positions")

    def compute() -> _Padding:
        mask_k = attention_mask.to(torch.bool)
        len_k = mask_k.shape[-1]
        dest_k = _real_slots(mask_k)
        slots_k = dest_k.clamp(max=mask_k.numel() - 1)
        per_k = max(len_k, 1)
        k_rows, k_pos = slots_k // per_k, slots_k % per_k
        cu_k = _cu_seqlens(mask_k.sum(-1, dtype=torch.int32))
        if len_q == len_k:  # a prefill: the queries are the keys (half the launches)
            return _Padding(k_rows, k_pos, dest_k, k_rows, k_pos, cu_k, cu_k, len_q, len_k)
        mask_q = mask_k[:, len_k - len_q:]
        dest_q = _real_slots(mask_q)
        src_q = dest_q.clamp(max=mask_q.numel() - 1)
        per_q = max(len_q, 1)
        return _Padding(src_q // per_q, src_q % per_q, dest_q, k_rows, k_pos,
                        _cu_seqlens(mask_q.sum(-1, dtype=torch.int32)), cu_k, len_q, len_k)
    return _PADDING_MEMO.get(attention_mask, len_q, compute)


def _packed_runs(position_ids: torch.Tensor, batch: int, length: int):
    pos = position_ids.expand(batch, -1) if position_ids.shape[0] == 1 else position_ids
    if pos.shape[0] != batch:
        return None
    starts = torch.ones(pos.shape, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    begin = torch.nonzero(starts.reshape(-1), as_tuple=False).reshape(-1)
    total = torch.tensor([batch * length], dtype=begin.dtype, device=begin.device)
    cu = torch.cat([begin, total]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max().item())


class _DecodePages(NamedTuple):
    """The paged view of a padded decode step (``_padded_decode``): per (row, KV head) sequence,
    its cache length and the pages (key slots) of its real keys, in order."""
    lens: torch.Tensor
    table: torch.Tensor


_DECODE_MEMO = _TensorMemo()
# The block table's width, a multiple of this: the decode plan is cached by it, so a growing cache
# makes a new plan once per this many steps, not at every step.
_TABLE_QUANTUM = 256
# (device, width, batch, heads_kv, p_b, p_h) -> (positions 0 .. width - 1, the same + width, the
# (batch, heads_kv, 1) page bases), int32: made once per table width and layout, not per step.
_PAGE_CONSTANTS: dict = {}


def _page_constants(device: torch.device, width: int, batch: int, heads_kv: int, p_b: int, p_h: int):
    key = (device, width, batch, heads_kv, p_b, p_h)
    c = _PAGE_CONSTANTS.get(key)
    if c is None:
        if len(_PAGE_CONSTANTS) >= 8:
            _PAGE_CONSTANTS.clear()
        at = torch.arange(width, dtype=torch.int32, device=device)
        base = (torch.arange(batch, dtype=torch.int32, device=device)[:, None] * p_b
                + torch.arange(heads_kv, dtype=torch.int32, device=device)[None, :] * p_h)
        c = _PAGE_CONSTANTS[key] = (at, at + width, base[:, :, None])
    return c


def _decode_pages(attention_mask: torch.Tensor, heads_kv: int, strides: Tuple[int, int]) -> _DecodePages:
    """The block table and lengths of a padded decode step over a (batch, heads_kv, len_k, dim)
    cache whose batch and head strides are ``strides`` = (p_b, p_h) position strides (a page is one
    key slot): sequence b * heads_kv + h lists, for j < its length, the page of the j-th real key of
    row b, b * p_b + h * p_h + position. A row whose query (the last position) is padding gets
    length 0: no key, O = 0, as the packed path gives it. Computed once per mask (no sync), in eight
    launches: a decode step of a tiny model is bound by host time, and this runs at every step."""
    def compute() -> _DecodePages:
        mask = attention_mask.to(torch.bool)
        batch, len_k = mask.shape
        width = -(-len_k // _TABLE_QUANTUM) * _TABLE_QUANTUM
        at, at_pad, base = _page_constants(mask.device, width, batch, heads_kv, *strides)
        # Sort keys: a real key's position, a padding slot's position + width (and the columns past
        # len_k are padding), so each row's real positions come first, in order; the rest clamp to
        # the last slot (valid pages, never read).
        real = torch.nn.functional.pad(mask, (0, width - len_k))
        positions = torch.where(real, at, at_pad).sort(dim=-1).values.clamp_(max=len_k - 1)
        table = (base + positions[:, None, :]).view(batch * heads_kv, width)
        lens = torch.where(mask[:, -1], mask.sum(-1, dtype=torch.int32), 0)
        return _DecodePages(lens[:, None].expand(batch, heads_kv).reshape(-1), table)
    return _DECODE_MEMO.get(attention_mask, (heads_kv, strides), compute)


def _padded_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                   opts: dict) -> Optional[torch.Tensor]:
    """One decode step of a padded batch (query (batch, heads_q, 1, dim); key/value (batch, heads_kv,
    >= len_k, dim), len_k the mask's width) as flash_attn_with_kvcache over the cache in place:
    no gather, no copy. Sequence b * heads_kv + h is KV head h of row b, with its group of query heads
    as heads_q / heads_kv query heads over one KV head; each key slot is a page of page_size 1,
    which the block table picks from the real positions. None when the layout does not allow it
    (the caller packs instead): the head dims contiguous, and in key and in value the position
    stride dividing the batch and head strides with the same quotients (so one table serves both)."""
    batch, heads_q, _, dim = query.shape
    heads_kv = key.shape[1]
    len_k = attention_mask.shape[-1]
    def pages_of(t: torch.Tensor) -> Optional[Tuple[int, int, int]]:  # (batch, head, position) strides in pages
        s_b, s_h, s_p, s_d = t.stride()
        if s_d != 1 or s_p <= 0 or s_b % s_p or s_h % s_p:
            return None
        return s_b // s_p, s_h // s_p, s_p

    kp, vp = pages_of(key), pages_of(value)
    # One block table serves both: key and value must number their slots alike.
    if kp is None or vp is None or kp[:2] != vp[:2] or len_k == 0 or heads_q % heads_kv:
        return None
    group = heads_q // heads_kv
    pages = _decode_pages(attention_mask, heads_kv, kp[:2])
    num_pages = (batch - 1) * kp[0] + (heads_kv - 1) * kp[1] + len_k
    k_pages = key.as_strided((num_pages, 1, 1, dim), (kp[2], kp[2], kp[2], 1))
    v_pages = value.as_strided((num_pages, 1, 1, value.shape[-1]), (vp[2], vp[2], vp[2], 1))
    # (batch, heads_kv * group, 1, dim) -> (batch * heads_kv, 1, group, dim): a view when query is
    # contiguous (the heads of a group are adjacent)
    q = query.reshape(batch, heads_kv, group, dim).reshape(batch * heads_kv, 1, group, dim)
    out = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=pages.lens, block_table=pages.table,
                                  softmax_scale=opts["softmax_scale"], causal=opts["causal"],
                                  window_size=opts["window_size"], softcap=opts["softcap"])
    return out.view(batch, 1, heads_q, out.shape[-1])


def _packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor,
                      opts: dict) -> torch.Tensor:
    """A padded step in packed form: q (batch, len_q, heads_q, dim), k/v (batch, >= len_k, heads_kv,
    dim[_v]) views; queries are the last len_q positions of the (batch, len_k) mask (left padding).
    The real tokens are gathered by index, not by the bool mask (a bool index finds its True entries
    on every call, a sync), run through flash_attn_varlen_func and scattered back; the fillers'
    rows go to a spare output row that is dropped, and padded query rows stay zero."""
    batch, len_q = q.shape[:2]
    pad = _padding(attention_mask, len_q)
    out_packed = flash_attn_varlen_func(
        q[pad.q_rows, pad.q_pos], k[pad.k_rows, pad.k_pos], v[pad.k_rows, pad.k_pos], pad.cu_q, pad.cu_k,
        pad.max_q, pad.max_k, **opts)
    rows = batch * len_q
    out = out_packed.new_zeros((rows + 1,) + tuple(out_packed.shape[1:]))
    out.index_put_((pad.q_dest,), out_packed)  # in place: no copy of the zeros (autograd records it alike)
    return out[:rows].view(batch, len_q, *out_packed.shape[1:])


def _target_dtype(q: torch.Tensor) -> Optional[torch.dtype]:
    if q.dtype == torch.float32 and q.device.type != "cpu" and torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                      scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None, is_causal: Optional[bool] = None,
                      s_aux: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                      cu_seq_lens_q: Optional[torch.Tensor] = None, cu_seq_lens_k: Optional[torch.Tensor] = None,
                      max_length_q: Optional[int] = None, max_length_k: Optional[int] = None,
                      output_attentions: bool = False, **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention-interface entry (see the module docstring).

    query (batch, heads_q, seqlen_q, head_dim), key/value (batch, heads_kv, seqlen_k, head_dim[_v]);
    ``attention_mask`` as :func:`attention_mask` builds it (None or 2-D bool). Returns
    ``(out, None)`` with out (batch, seqlen_q, heads_q, head_dim_v) in query's dtype.
    """
    if dropout:
        raise NotImplementedError(
            f"attention dropout {dropout}: flashcpp runs no dropout; set the config's attention_dropout to 0 "
            "(or use attn_implementation='sdpa' for training with attention dropout)")
    if s_aux is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by flashcpp; use attn_implementation='eager'")
    if output_attentions:
        warnings.warn("flashcpp computes no attention weights: output_attentions gives None for them", stacklevel=2)

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "is_causal", True) is False:
        causal = False
    window = (-1, -1)
    if sliding_window is not None and sliding_window > 0:
        w = int(sliding_window)
        window = (w - 1, 0) if causal else (w, w)
    cap = float(softcap) if softcap else 0.0
    opts = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=cap)

    dtype = _target_dtype(query)
    if dtype is not None:
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)

    batch, _, len_q, _ = query.shape
    # (batch, seqlen, heads, dim) views of transformers' (batch, heads, seqlen, dim) tensors
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
            raise NotImplementedError(
                f"flashcpp's attention takes a 2-D padding mask (batch, seqlen_k) or None; got {shape}. "
                f"Build the model with the name register() returned so that transformers asks flashcpp's "
                f"mask entry for its masks, or use attn_implementation='sdpa' for custom masks")
        len_k = attention_mask.shape[-1]
        if k.shape[1] < len_k or len_k < len_q:
            raise ValueError(f"attention_mask covers {len_k} keys but the layer has {k.shape[1]} keys and "
                             f"{len_q} queries")
        # A decode step reads the cache in place (a plan cannot be made while a CUDA graph is
        # captured, and the decode has no backward); anything else packs the real tokens.
        if (len_q == 1 and len_k > 1 and not torch.compiler.is_compiling() and not _core.capturing(query.device)
                and not _core.grad_needed(query, key, value)):
            out = _padded_decode(query, key, value, attention_mask, opts)
            if out is not None:
                return out, None
        return _packed_attention(q, k, v, attention_mask, opts), None

    if cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        # padding-free batches: the caller packed the sequences back to back
        mq = int(max_length_q) if max_length_q is not None else int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max().item())
        mk = int(max_length_k) if max_length_k is not None else int((cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]).max().item())
        out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                     v.reshape(-1, *v.shape[2:]), cu_seq_lens_q.to(torch.int32),
                                     cu_seq_lens_k.to(torch.int32), mq, mk, **opts)
        return out.view(batch, -1, *out.shape[1:]), None

    if k.shape[1] == len_q:
        packed = _packed_from_positions(position_ids, batch, len_q)
        if packed is not None:
            cu, longest = packed
            out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                         v.reshape(-1, *v.shape[2:]), cu, cu, longest, longest, **opts)
            return out.view(batch, len_q, *out.shape[1:]), None

    return flash_attn_func(q, k, v, **opts), None
