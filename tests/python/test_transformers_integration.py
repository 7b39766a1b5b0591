"""flashcpp as a Hugging Face transformers attention implementation
(flashcpp.integrations.transformers, docs/integrations.md).

Tiny random models built from configs in code (nothing is downloaded), fp32 on the CPU: Llama
(GQA), Mistral (sliding window), Qwen2 (q/k/v bias), Gemma-2 (logit softcap, sliding window on
alternate layers, query_pre_attn_scalar) and Phi-3 (head_dim 96). Each is checked against
transformers' own eager and sdpa attention on the same weights: forward logits (with a
left-padded row), greedy generate (prefill, then decode steps with seqlen_q < seqlen_k through a
KV cache, padded rows through varlen), and the parameter gradients of a training step. sdpa
refuses a softcap, so Gemma-2 is compared with eager only.

The weights are drawn with a larger spread than the configs' default (std 0.02 makes every
attention row nearly uniform, where a wrong mask hardly shows); test_window_and_softcap_matter
checks that, on these inputs, dropping the window or the softcap moves the logits by far more
than the tolerance, so the comparisons would catch either being lost.

Needs torch and transformers 5.x (pip install "transformers>=5,<6"); skipped with that reason
where they are missing.
"""
import pytest

torch = pytest.importorskip("torch", reason="the transformers integration tests need torch")
transformers = pytest.importorskip("transformers", reason="the transformers integration tests need "
                                   "Hugging Face transformers 5.x (pip install 'transformers>=5,<6')")

import flashcpp.integrations.transformers as fcpp_hf  # noqa: E402

VOCAB = 100
INIT_STD = 0.15
# fp32: the implementations differ by summation order only; through two layers that reaches
# ~1e-5 of the largest logit (Phi-3's 192-wide layers: 1.1e-5 at logits up to 6.6)
RTOL = 1e-5


def tol(ref):
    """The allowed max |dlogit| against the reference logits `ref`."""
    return RTOL * max(1.0, ref.abs().max().item())
# near-ties in greedy decoding: two logits this close can swap under any reordering of sums
NEAR_TIE = 1e-4


def _llama():
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)


def _mistral():
    return transformers.MistralForCausalLM, transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
        sliding_window=5)


def _qwen2():
    return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)


def _gemma2():
    return transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, vocab_size=VOCAB,
        max_position_embeddings=128, sliding_window=5, attn_logit_softcapping=1.0,
        final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0, bos_token_id=2, eos_token_id=1)


def _phi3():
    return transformers.Phi3ForCausalLM, transformers.Phi3Config(
        hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)


ARCHS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "gemma2": _gemma2, "phi3": _phi3}
# transformers' own implementations each architecture is compared with
REFERENCES = {a: ("eager",) if a == "gemma2" else ("eager", "sdpa") for a in ARCHS}


@pytest.fixture(scope="module")
def name():
    return fcpp_hf.register()


def build(arch, impl, seed=0, **overrides):
    cls, config = ARCHS[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config.initializer_range = INIT_STD
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=impl, dtype=torch.float32)
    return model.eval()


def batch(seed, b=2, n=12, pad=(0, 4), side="left"):
    """Token ids (b, n) and a padding mask: row r has pad[r] padding tokens in front (or at the end)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    for r, p in enumerate(pad):
        cols = slice(0, p) if side == "left" else slice(n - p, n)
        mask[r, cols] = 0
        ids[r, cols] = 0
    return ids, mask


def logits(model, impl, ids, mask=None, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kw).logits


def real(x, mask):
    """The logits of the real (unpadded) tokens, packed: padded rows have no defined logits."""
    return x[mask.bool()]


def test_register_names(name):
    assert name == fcpp_hf.NAME
    assert fcpp_hf.register() == name  # again: harmless
    assert name in transformers.AttentionInterface().valid_keys()
    assert name in transformers.AttentionMaskInterface()
    with pytest.raises(ValueError, match="contains 'flash'"):
        fcpp_hf.register("flashcpp")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_forward_logits_match(name, arch):
    model = build(arch, "eager")
    ids, mask = batch(1)
    diffs = {}
    for impl in REFERENCES[arch]:
        for what, m in (("padded", mask), ("full", None)):
            ref, ours = logits(model, impl, ids, m), logits(model, name, ids, m)
            keep = mask if m is not None else torch.ones_like(mask)
            d = (real(ref, keep) - real(ours, keep)).abs().max().item()
            diffs[f"{impl}/{what}"] = d
            assert d <= tol(ref), f"{arch} {what} batch: flashcpp vs {impl} max |dlogit| {d:.3g} (logits up to {ref.abs().max():.3g})"
    print(arch, {k: f"{v:.2e}" for k, v in diffs.items()})


def first_divergence(ref_tokens, ours_tokens):
    """(row, step) of the first generated token that differs, or None."""
    diff = (ref_tokens != ours_tokens).nonzero()
    if diff.numel() == 0:
        return None
    steps = diff[:, 1]
    i = int(steps.argmin())
    return int(diff[i, 0]), int(steps[i])


def margin(step_logits, row):
    top = step_logits[row].topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_matches(name, arch):
    model = build(arch, "eager", seed=2)
    ids, mask = batch(3, n=9, pad=(0, 3))  # Mistral/Gemma-2: prompt and cache longer than the window
    impl = REFERENCES[arch][-1]
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, min_new_tokens=10,
              return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    outs = {}
    for which in (impl, name):
        model.set_attn_implementation(which)
        with torch.no_grad():
            outs[which] = model.generate(ids, **kw)
    ref, ours = outs[impl], outs[name]
    n = ids.shape[1]
    where = first_divergence(ref.sequences[:, n:], ours.sequences[:, n:])
    upto = len(ref.logits) if where is None else where[1] + 1
    # logits of each step, prefill then decode, as long as the inputs agree (rows of real tokens)
    dl = max((ref.logits[t] - ours.logits[t]).abs().max().item() for t in range(upto))
    bound = max(tol(ref.logits[t]) for t in range(upto))
    print(f"{arch}: generate vs {impl}: max |dlogit| over {upto} steps {dl:.2e}")
    assert dl <= bound, f"{arch}: step logits differ from {impl} by {dl:.3g}"
    if where is not None:
        row, step = where
        m_ref, m_ours = margin(ref.logits[step], row), margin(ours.logits[step], row)
        msg = (f"{arch}: greedy tokens differ from {impl} at row {row}, step {step}: "
               f"{ref.sequences[row, n + step].item()} vs {ours.sequences[row, n + step].item()}; "
               f"top-2 logit margin {m_ref:.3g} ({impl}), {m_ours:.3g} (flashcpp)")
        assert min(m_ref, m_ours) < NEAR_TIE, msg
        print("near-tie (accepted):", msg)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_generate_static_cache(name, arch):
    """A static cache hands the layers key slots past the tokens seen so far (Mistral's a
    window-sized ring): the mask entry leaves them out."""
    model = build(arch, "eager", seed=4)
    ids, mask = batch(5, n=7, pad=(2, 0))
    toks = {}
    for which in ("sdpa", name):
        model.set_attn_implementation(which)
        with torch.no_grad():
            toks[which] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                         cache_implementation="static", pad_token_id=0)
    assert torch.equal(toks["sdpa"], toks[name])


def train_grads(model, impl, ids, mask, **kw):
    model.set_attn_implementation(impl)
    model.train()
    model.zero_grad(set_to_none=True)
    labels = ids.masked_fill(mask == 0, -100) if mask is not None else ids
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, **kw).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    return loss.item(), grads


def grad_diff(ref, ours):
    """max |dgrad| over all parameters, relative to the largest |grad|."""
    assert ref.keys() == ours.keys()
    scale = max(g.abs().max().item() for g in ref.values())
    return max((ref[k] - ours[k]).abs().max().item() for k in ref) / scale


@pytest.mark.parametrize("arch", list(ARCHS))
def test_training_step_gradients(name, arch):
    model = build(arch, "eager", seed=6)
    # right padding, as training batches have it (with left padding the logit of the last pad
    # position predicts the first real token and enters the loss, and no implementation defines it)
    ids, mask = batch(7, n=11, pad=(0, 3), side="right")
    impl = REFERENCES[arch][-1]
    loss_ref, g_ref = train_grads(model, impl, ids, mask)
    loss_ours, g_ours = train_grads(model, name, ids, mask)
    d = grad_diff(g_ref, g_ours)
    print(f"{arch}: loss {loss_ours:.6f} vs {impl} {loss_ref:.6f}; max |dgrad| / max |grad| {d:.2e} "
          f"over {len(g_ref)} tensors")
    assert abs(loss_ref - loss_ours) <= 1e-5
    assert d <= 1e-4, f"{arch}: gradients differ from {impl}: {d:.3g} relative"


def test_packed_sequences(name):
    """Sequences packed in one row without a mask: position_ids restart at each sequence (and
    padding-free kwargs cu_seq_lens_q/k); each sequence attends only to itself, as sdpa does."""
    model = build("llama", "eager", seed=8)
    lens = [5, 7, 4]
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, VOCAB, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    # no cache: transformers' own masks look for packed sequences only without one
    ref = logits(model, "sdpa", ids, position_ids=pos, use_cache=False)
    ours = logits(model, name, ids, position_ids=pos, use_cache=False)
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    ours_cu = logits(model, name, ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu,
                     cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    # each sequence alone
    alone = torch.cat([logits(model, "sdpa", ids[:, a:b]) for a, b in zip(cu[:-1], cu[1:])], dim=1)
    for what, x in (("position_ids", ours), ("cu_seq_lens", ours_cu)):
        assert (x - ref).abs().max().item() <= tol(ref), what
        assert (x - alone).abs().max().item() <= tol(alone), what
    _, g_ref = train_grads(model, "sdpa", ids, None, position_ids=pos)
    _, g_ours = train_grads(model, name, ids, None, position_ids=pos)
    assert grad_diff(g_ref, g_ours) <= 1e-4


def test_window_and_softcap_matter(name):
    """Mistral's window, and Gemma-2's window and softcap, change these logits by far more than
    the tolerance (sequences longer than the window), and flashcpp's logits follow the model that has them:
    with the feature off in the config, flashcpp moves exactly as eager does."""
    ids, mask = batch(11, n=16, pad=(0, 5))
    cases = [("mistral", dict(sliding_window=None)),
             ("gemma2", dict(sliding_window=10_000)),
             ("gemma2", dict(attn_logit_softcapping=None))]
    for arch, off in cases:
        on_model, off_model = build(arch, "eager", seed=12), build(arch, "eager", seed=12, **off)
        eager_on, eager_off = real(logits(on_model, "eager", ids, mask), mask), real(logits(off_model, "eager", ids, mask), mask)
        ours_on, ours_off = real(logits(on_model, name, ids, mask), mask), real(logits(off_model, name, ids, mask), mask)
        effect = (eager_on - eager_off).abs().max().item()
        print(f"{arch} {off}: the feature moves logits by {effect:.3g}; flashcpp within "
              f"{(ours_on - eager_on).abs().max().item():.2e} / {(ours_off - eager_off).abs().max().item():.2e}")
        assert effect > 1000 * tol(eager_on), f"{arch} {off}: the test inputs do not exercise the feature ({effect:.3g})"
        assert (ours_on - eager_on).abs().max().item() <= tol(eager_on)
        assert (ours_off - eager_off).abs().max().item() <= tol(eager_off)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_bidirectional_config(name, arch):
    """config.is_causal=False (transformers' switch to bidirectional attention in a decoder):
    no causal mask, and Mistral's window on both sides (|i - j| <= w), as eager and sdpa do."""
    model = build(arch, "eager", seed=15, is_causal=False)
    ids, mask = batch(16)
    ours = real(logits(model, name, ids, mask, use_cache=False), mask)
    for impl in ("eager", "sdpa"):
        ref = real(logits(model, impl, ids, mask, use_cache=False), mask)
        assert (ours - ref).abs().max().item() <= tol(ref), impl


def test_refusals(name):
    model = build("llama", "eager", seed=13, attention_dropout=0.1)
    ids, mask = batch(14)
    model.set_attn_implementation(name)
    model.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        model(input_ids=ids, attention_mask=mask)
    model.eval()
    custom = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    with pytest.raises(NotImplementedError, match="2-D"):
        model(input_ids=ids, attention_mask=custom)


def test_packed_positions_are_computed_once_per_tensor():
    """Every layer of a forward pass gets the same position_ids tensor: the packed-sequence answer
    (a few launches and a device-to-host sync) is computed for the first layer and reused, but a
    new tensor, an in-place change, another batch and inference tensors are computed afresh."""
    f = fcpp_hf._packed_from_positions
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    first = f(pos, 1, 9)
    cu, longest = first
    assert cu.tolist() == [0, 3, 5, 9] and longest == 4
    assert f(pos, 1, 9) is first  # the memo
    assert f(pos.clone(), 1, 9) is not first and f(pos.clone(), 1, 9)[0].tolist() == [0, 3, 5, 9]
    two = f(pos, 2, 9)  # expanded over a batch of 2: another answer
    assert two[0].tolist() == [0, 3, 5, 9, 12, 14, 18] and two[1] == 4
    pos[0, 3] = 3  # in place: the version counter moves
    assert f(pos, 1, 9)[0].tolist() == [0, 4, 5, 9]  # positions 0 1 2 3 1 0 1 2 3
    pos[0] = torch.arange(9)
    assert f(pos, 1, 9) is None
    with torch.inference_mode():
        pi = torch.tensor([[0, 1, 0, 1]])
        assert f(pi, 1, 4)[0].tolist() == [0, 2, 4]
        pi[0, 2:] = torch.tensor([2, 3])  # no version counter on inference tensors: never memoized
        assert f(pi, 1, 4) is None


def test_padding_layout_is_computed_once_per_mask():
    """Every layer gets the same padding mask: where its real tokens are (gather indices and
    cu_seqlens, found without a sync) is computed for the first layer and reused, but a new mask,
    an in-place change and another query count are computed afresh, and a non-bool mask means
    what its bool conversion means. Fillers repeat the last slot; their outputs go to a spare row."""
    f = fcpp_hf._padding
    mask = torch.tensor([[True, True, True, True], [False, False, True, True]])
    first = f(mask, 1)
    assert first.q_rows.tolist() == [0, 1] and first.q_pos.tolist() == [0, 0] and first.q_dest.tolist() == [0, 1]
    assert first.k_rows.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert first.k_pos.tolist() == [0, 1, 2, 3, 2, 3, 3, 3]  # two fillers: the last slot
    assert first.cu_q.tolist() == [0, 1, 2] and first.cu_k.tolist() == [0, 4, 6]
    assert (first.max_q, first.max_k) == (1, 4)  # the padded lengths bound every sequence
    assert f(mask, 1) is first  # the memo
    assert f(mask.clone(), 1) is not first
    two = f(mask, 2)  # the last two positions are the queries
    assert two.q_pos.tolist() == [0, 1, 0, 1] and two.cu_q.tolist() == [0, 2, 4] and two.max_q == 2
    mask[0, 0] = False  # in place: the version counter moves
    again = f(mask, 1)
    assert again.cu_k.tolist() == [0, 3, 5] and again.k_pos.tolist()[:5] == [1, 2, 3, 2, 3]
    longs = torch.tensor([[0, 1, 1], [1, 1, 1]])
    got = f(longs, 3)
    assert got.cu_q.tolist() == [0, 2, 5] and got.q_dest.tolist() == [1, 2, 3, 4, 5, 6]  # 6: the spare row
    assert got.q_rows.tolist() == [0, 0, 1, 1, 1, 1] and got.q_pos.tolist() == [1, 2, 0, 1, 2, 2]
    with torch.inference_mode():
        mi = torch.tensor([[True, False, True]])
        assert f(mi, 1).cu_k.tolist() == [0, 2]
        mi[0, 1] = True  # no version counter on inference tensors: never memoized
        assert f(mi, 1).cu_k.tolist() == [0, 3]


def test_memo_keeps_one_answer_per_live_mask():
    """Gemma-2 alternates sliding and full layers, each with its own mask tensor: both packings stay
    memoized through the forward (a one-entry memo recomputed every layer), up to _TensorMemo.SIZE
    masks, the oldest dropped first."""
    memo, calls = fcpp_hf._TensorMemo(), []

    def get(t):
        return memo.get(t, "k", lambda: calls.append(t) or len(calls))
    masks = [torch.ones(2, 3 + i, dtype=torch.bool) for i in range(fcpp_hf._TensorMemo.SIZE + 1)]
    sliding, full = masks[0], masks[1]
    assert [get(m) for m in (sliding, full, sliding, full, sliding)] == [1, 2, 1, 2, 1]
    assert len(calls) == 2
    for m in masks[2:]:
        get(m)
    assert len(calls) == 2 + len(masks) - 2
    get(sliding)  # used most recently before the new ones, so still kept; full was the oldest
    assert len(calls) == len(masks)
    get(full)
    assert len(calls) == len(masks) + 1
    sliding[0, 0] = False  # in place: computed afresh
    assert get(sliding) == len(masks) + 2


def test_more_queries_than_mask_keys_is_refused():
    """The queries are the mask's last positions: more queries than the mask has keys gave rows at
    the wrong positions, and zeros, without a word."""
    mask = torch.ones(3, 6, dtype=torch.bool)
    q, k = torch.randn(3, 8, 2, 32), torch.randn(3, 8, 2, 32)
    opts = dict(softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0)
    with pytest.raises(ValueError, match="8 queries are more than the mask's 6 keys"):
        fcpp_hf._packed_attention(q, k, k, mask, opts)


def test_padding_slots_without_nonzero_static(monkeypatch):
    """A torch whose nonzero_static does not run on the mask's device gets the same slots
    (through nonzero, with its sync)."""
    mask = torch.tensor([[False, True, True], [True, False, True]])
    want = fcpp_hf._real_slots(mask).tolist()
    assert want == [1, 2, 3, 5, 6, 6]

    def missing(*args, **kwargs):
        raise NotImplementedError("nonzero_static: not on this device")
    monkeypatch.setattr(torch, "nonzero_static", missing)
    assert fcpp_hf._real_slots(mask).tolist() == want


def _packed_reference(query, key, value, mask, opts):
    """The packed (varlen) form of a padded step, which the decode form must equal."""
    return fcpp_hf._packed_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask, opts)


@pytest.mark.parametrize("heads_q,heads_kv,dim,dim_v", [(4, 2, 64, 64), (6, 1, 32, 48), (3, 3, 40, 40)])
@pytest.mark.parametrize("opts", [dict(softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0),
                                  dict(softmax_scale=0.3, causal=True, window_size=(3, 0), softcap=5.0),
                                  dict(softmax_scale=None, causal=False, window_size=(2, 2), softcap=0.0)])
def test_padded_decode_reads_the_cache_in_place(heads_q, heads_kv, dim, dim_v, opts):
    """A decode step of a padded batch runs flash_attn_with_kvcache over a paged view of the cache
    (one page per key slot, one sequence per row and KV head) and equals the packed varlen form:
    left padding, holes, a row whose query is padding (zeros), a row with one real key, a cache
    with spare slots past the mask (a static cache) and a query that is a transposed view."""
    g = torch.Generator().manual_seed(heads_q * 100 + dim)
    batch, len_k, spare = 5, 11, 4
    key = torch.randn(batch, heads_kv, len_k + spare, dim, generator=g)
    value = torch.randn(batch, heads_kv, len_k + spare, dim_v, generator=g)
    query = torch.randn(batch, 1, heads_q, dim, generator=g).transpose(1, 2)  # (batch, heads_q, 1, dim), not contiguous
    mask = torch.ones(batch, len_k, dtype=torch.bool)
    mask[1, :4] = False           # left padding
    mask[2, 3:6] = False          # holes
    mask[3, -1] = False           # the query is padding: zeros
    mask[4, :-1] = False          # one real key
    got = fcpp_hf._padded_decode(query, key, value, mask, opts)
    assert got is not None and got.shape == (batch, 1, heads_q, dim_v)
    want = _packed_reference(query, key[:, :, :len_k], value[:, :, :len_k], mask, opts)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    # Poison the padding slots and the spare slots: the step never reads them.
    key2, value2 = key.clone(), value.clone()
    key2[:, :, len_k:] = float("nan")
    value2[:, :, len_k:] = float("nan")
    for b in range(batch):
        key2[b, :, :len_k][:, ~mask[b]] = float("nan")
        value2[b, :, :len_k][:, ~mask[b]] = float("nan")
    torch.testing.assert_close(fcpp_hf._padded_decode(query, key2, value2, mask, opts), got, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_decode_pages_list_the_real_keys_in_order(dtype):
    """The block table of a padded decode step, against a loop over the mask: sequence b * heads_kv
    + h lists the pages of row b's real keys in order (b * p_b + h * p_h + position), its length
    is the row's real keys (0 when the query, the last position, is padding), and every entry past
    the length is still a page of the cache (the kernels may address, never read, them). Random
    masks with holes, left padding and widths on both sides of the table's 256-column quantum."""
    g = torch.Generator().manual_seed(41)
    for trial in range(60):
        batch, len_k, heads_kv = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 5), (1, 600), (1, 4)))
        mask = torch.rand(batch, len_k, generator=g) < 0.7
        if trial % 3 == 0:  # left padding
            mask[:] = True
            for r in range(batch):
                mask[r, :int(torch.randint(0, len_k, (1,), generator=g))] = False
        strides = (heads_kv * (len_k + 3), len_k + 3)
        pages = fcpp_hf._decode_pages(mask.to(dtype), heads_kv, strides)
        assert pages.table.dtype == torch.int32 and pages.lens.dtype == torch.int32
        assert pages.table.shape == (batch * heads_kv, -(-len_k // 256) * 256)
        num_pages = (batch - 1) * strides[0] + (heads_kv - 1) * strides[1] + len_k
        assert 0 <= int(pages.table.min()) and int(pages.table.max()) < num_pages
        for b in range(batch):
            real = [j for j in range(len_k) if mask[b, j]]
            n = len(real) if mask[b, -1] else 0
            for h in range(heads_kv):
                s = b * heads_kv + h
                assert int(pages.lens[s]) == n
                assert pages.table[s, :n].tolist() == [b * strides[0] + h * strides[1] + j for j in real[:n]]


def test_padded_decode_steps_aside_for_layouts_it_cannot_page():
    """Key and value that number their slots differently, a position stride that does not divide
    the others: None, and the caller packs instead. Slots of any width do page."""
    opts = dict(softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    query = torch.randn(2, 2, 1, 16)
    key = torch.randn(2, 2, 6, 16)
    swapped = torch.randn(2, 6, 2, 16).transpose(1, 2)  # (batch, position, head) storage
    assert fcpp_hf._padded_decode(query, key, swapped, mask, opts) is None
    wide = torch.randn(2, 2, 6, 24)[..., :16]  # slots of 24 elements: pages fine
    got = fcpp_hf._padded_decode(query, wide, wide, mask, opts)
    torch.testing.assert_close(got, fcpp_hf._padded_decode(query, wide.contiguous(), wide.contiguous(), mask, opts),
                               atol=0, rtol=0)
    skew = torch.randn(2 * 2 * 6 * 16 + 8)[:2 * 2 * 6 * 16].as_strided((2, 2, 6, 16), (200, 96, 16, 1))
    assert fcpp_hf._padded_decode(query, skew, skew, mask, opts) is None  # 200 % 16 != 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads_q,heads_kv,dim", [(8, 2, 128), (4, 4, 64), (6, 1, 96)])
def test_padded_decode_on_cuda_equals_the_packed_form(heads_q, heads_kv, dim):
    """The paged decode step on the GPU (bf16): the decode kernels with page_size 1 over the cache in
    place, against the packed varlen form of the same step, and NaN in every slot it must not read."""
    import flashcpp
    if not flashcpp.WITH_CUDA:
        pytest.skip("a CPU-only build of flashcpp")
    g = torch.Generator(device="cuda").manual_seed(heads_q * 10 + dim)
    batch, len_k = 4, 300  # more than one 256-wide table quantum
    key = torch.randn(batch, heads_kv, len_k + 5, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(batch, heads_kv, len_k + 5, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    query = torch.randn(batch, heads_q, 1, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(batch, len_k, dtype=torch.bool, device="cuda")
    mask[1, :40] = False
    mask[2, 100:290] = False
    mask[3, -1] = False
    opts = dict(softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0)
    got = fcpp_hf._padded_decode(query, key, value, mask, opts)
    want = _packed_reference(query, key[:, :, :len_k], value[:, :, :len_k], mask, opts)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    key2, value2 = key.clone(), value.clone()
    key2[:, :, len_k:] = float("nan")
    value2[:, :, len_k:] = float("nan")
    pad = ~mask
    key2[:, :, :len_k][pad[:, None, :].expand(-1, heads_kv, -1)] = float("nan")
    value2[:, :, :len_k][pad[:, None, :].expand(-1, heads_kv, -1)] = float("nan")
    assert torch.equal(fcpp_hf._padded_decode(query, key2, value2, mask, opts), got)
