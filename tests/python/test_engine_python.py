"""flashcpp.engine (the C++ Llama engine bound with nanobind) and `python -m flashcpp.generate`, on the CPU
backend, with a tiny random Llama checkpoint written here with numpy (safetensors by hand, no torch)
and a tiny byte-level BPE tokenizer trained in memory with `tokenizers` and saved as tokenizer.json.

Checked: greedy ids against an fp64 numpy Llama written here (always), against transformers' fp32
forward on the same checkpoint (when torch and transformers import) and against the C++ CLI
(`build/flashcpp decode`, when it is built); the streaming callback sees every token in order;
stop_ids stop early; `python -m flashcpp.generate` prints the decoding of the engine's ids, stops at
the checkpoint's EOS and exits 0; bad inputs exit 2 with one sentence. Skipped only without
`tokenizers` or without the engine in this build."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="text generation needs the Hugging Face `tokenizers` package")
try:
    from flashcpp import engine as fe
    from flashcpp import generate as fg
except ImportError as e:  # FLASHCPP_WITH_ENGINE=OFF or FLASHCPP_PYTHON_ENGINE=OFF
    pytest.skip(f"the engine is not in this build: {e}", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = ["the quick brown fox jumps over the lazy dog", "héllo wörld, ça va? naïve café",
          "snow ☃ and tea 茶 and sushi 寿司", "a b c d e f g the end", "once upon a time there was a tiny model"] * 4
SHAPE = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16, theta=10000.0, eps=1e-5)
N_NEW = 12


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return tok


def write_safetensors(path, tensors):
    header, off, blobs = {}, 0, []
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def make_checkpoint(d, vocab, bos, eos, seed=0):
    s = SHAPE
    rng = np.random.default_rng(seed)
    Q, KV = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    w = {"model.embed_tokens.weight": rng.normal(0, 1.0, (vocab, s["hidden"])),
         "model.norm.weight": 1 + 0.1 * rng.normal(size=s["hidden"]),
         "lm_head.weight": rng.normal(0, 0.1, (vocab, s["hidden"]))}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        for name, shape, sc in [("self_attn.q_proj", (Q, s["hidden"]), 0.15), ("self_attn.k_proj", (KV, s["hidden"]), 0.15),
                                ("self_attn.v_proj", (KV, s["hidden"]), 0.1), ("self_attn.o_proj", (s["hidden"], Q), 0.1),
                                ("mlp.gate_proj", (s["inter"], s["hidden"]), 0.1), ("mlp.up_proj", (s["inter"], s["hidden"]), 0.1),
                                ("mlp.down_proj", (s["hidden"], s["inter"]), 0.1)]:
            w[p + name + ".weight"] = rng.normal(0, sc, shape)
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.normal(size=s["hidden"])
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.normal(size=s["hidden"])
    w = {k: v.astype(np.float32) for k, v in w.items()}
    os.makedirs(d, exist_ok=True)
    write_safetensors(os.path.join(d, "model.safetensors"), w)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": s["hidden"], "intermediate_size": s["inter"], "num_hidden_layers": s["layers"],
           "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
           "rms_norm_eps": s["eps"], "rope_theta": s["theta"], "max_position_embeddings": 2048,
           "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
           "bos_token_id": bos, "eos_token_id": eos}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return w


def ref_logits(w, seq):
    """fp64 Llama (Hugging Face LlamaForCausalLM semantics, default rotary) over the whole sequence."""
    s = SHAPE
    H, KV, hd = s["heads"], s["kv_heads"], s["head_dim"]
    W = {k: v.astype(np.float64) for k, v in w.items()}
    T = len(seq)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + s["eps"]) * g

    inv = s["theta"] ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]

    def rope(x):
        return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

    x = W["model.embed_tokens.weight"][seq]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])
        q = rope((h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, H, hd))
        k = np.repeat(rope((h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, KV, hd)), H // KV, axis=1)
        v = np.repeat((h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, KV, hd), H // KV, axis=1)
        sc = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", pr, v).reshape(T, H * hd) @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        g, u = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "mlp.down_proj.weight"].T
    return rms(x, W["model.norm.weight"]) @ W["lm_head.weight"].T


def assert_greedy_like(ids, logits_of, prompt, what, rel=1e-3):
    """ids are greedy under logits_of (prefix -> last-position logits), up to a near-tie divergence
    (a gap under `rel` of the logit scale)."""
    seq = list(prompt)
    for step, t in enumerate(ids):
        row = np.asarray(logits_of(seq), dtype=np.float64)
        best = int(row.argmax())
        if t != best:
            gap = row[best] - row[t]
            assert gap < rel * max(1.0, np.abs(row).max()), f"{what}: step {step} token {t} != {best} (gap {gap})"
            return
        seq.append(t)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("engine_text") / "tiny-llama")
    tok = train_tokenizer()
    vocab = tok.get_vocab_size()
    w = make_checkpoint(d, vocab, tok.token_to_id("<s>"), tok.token_to_id("</s>"))
    tok.save(os.path.join(d, "tokenizer.json"))
    eng = fe.Engine.cpu(2).load(d)
    return dict(dir=d, tok=fe.load_tokenizer(d), w=w, eng=eng, vocab=vocab)


PROMPT = "once upon a time, ça va ☃"


def test_greedy_ids_match_fp64_reference_and_text(ckpt):
    eng, tok = ckpt["eng"], ckpt["tok"]
    assert eng.model()["vocab_size"] == ckpt["vocab"] and not eng.is_cuda
    ids = tok.encode(PROMPT).ids
    assert ids[0] == tok.token_to_id("<s>")  # the post-processor's BOS
    out = eng.generate(PROMPT, tokenizer=tok, max_new_tokens=N_NEW)
    assert len(out.tokens) == 1 and len(out.tokens[0]) == N_NEW
    assert out.tokens == eng.generate(ids, max_new_tokens=N_NEW).tokens  # text in = ids in
    assert out.text == [tok.decode(out.tokens[0], skip_special_tokens=True)]
    assert out.decode_steps == N_NEW - 1 and out.decode_tok_s > 0
    assert_greedy_like(out.tokens[0], lambda seq: ref_logits(ckpt["w"], seq)[-1], ids, "fp64 numpy Llama")


def test_cuda_engine_greedy_ids_match_fp64_reference(ckpt):
    """The CUDA engine (bf16) through Python, where a device is present. The prompt's prefill has more
    rows than the GEMV takes, so it runs cuBLASLt, which the engine opens when it starts
    (src/cuda/common/cublas_dl.h); the decode steps run the GEMV. The engine's bf16 logits stay within
    0.05 of the logit scale of fp64's (tests/gpu/test_engine.cc), so two of them may swap within 0.1:
    that is the near-tie band here, where fp32 has 0.001."""
    try:
        eng = fe.Engine.cuda()
    except NotImplementedError as e:  # a CPU-only build, or no usable device: the engine says which
        pytest.skip(f"no CUDA engine here: {e}")
    eng.load(ckpt["dir"])
    assert eng.is_cuda
    ids = ckpt["tok"].encode(PROMPT).ids
    assert len(ids) > 8  # more rows than the GEMV's, so the prefill's GEMMs are cuBLASLt's
    out = eng.generate(ids, max_new_tokens=N_NEW)
    assert len(out.tokens[0]) == N_NEW
    assert_greedy_like(out.tokens[0], lambda seq: ref_logits(ckpt["w"], seq)[-1], ids, "cuda engine", rel=0.1)


def test_greedy_ids_match_transformers_fp32(ckpt):
    torch = pytest.importorskip("torch", reason="the transformers cross-check needs torch")
    transformers = pytest.importorskip("transformers", reason="the transformers cross-check needs transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(ckpt["dir"], dtype=torch.float32).eval()
    ids = ckpt["tok"].encode(PROMPT).ids
    out = ckpt["eng"].generate(ids, max_new_tokens=N_NEW)

    def logits_of(seq):
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0, -1].double().numpy()

    assert_greedy_like(out.tokens[0], logits_of, ids, "transformers fp32")


def test_ids_match_the_cpp_cli(ckpt, tmp_path):
    cli = os.path.join(ROOT, "build", "flashcpp")
    if not os.access(cli, os.X_OK):
        pytest.skip("the C++ CLI (build/flashcpp) is not built")
    ids = ckpt["tok"].encode(PROMPT).ids
    js = str(tmp_path / "decode.json")
    r = subprocess.run([cli, "decode", "--model", ckpt["dir"], "--prompt-ids", ",".join(map(str, ids)),
                        "--max-new-tokens", str(N_NEW), "--backend", "cpu", "--eager", "--threads", "2",
                        "--json", js], capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "leaves out the Llama decode engine" in r.stdout + r.stderr:
        pytest.skip("this CLI was built without the engine")
    assert r.returncode == 0, r.stdout + r.stderr
    with open(js) as f:
        cli_tokens = json.load(f)["tokens"]
    assert ckpt["eng"].generate(ids, max_new_tokens=N_NEW).tokens == cli_tokens


def test_streaming_sees_every_token_in_order_and_stop_ids_stop(ckpt):
    eng, tok = ckpt["eng"], ckpt["tok"]
    prompts = [tok.encode(PROMPT).ids, tok.encode("the lazy dog").ids]
    full = eng.generate(prompts, max_new_tokens=N_NEW, temperature=0.8, top_p=0.9, seed=7)
    seen, steps = [[], []], []

    def on_token(step, toks):
        steps.append(step)
        for b, t in enumerate(toks):
            seen[b].append(t)

    streamed = eng.generate(prompts, max_new_tokens=N_NEW, temperature=0.8, top_p=0.9, seed=7, on_token=on_token)
    assert streamed.tokens == full.tokens and seen == full.tokens and steps == list(range(N_NEW))

    stop = full.tokens[0][3]
    first = full.tokens[0].index(stop)
    cut = [t[:t.index(stop) + 1] if stop in t else t for t in full.tokens]
    r = eng.generate(prompts, max_new_tokens=N_NEW, temperature=0.8, top_p=0.9, seed=7, stop_ids=[stop])
    assert r.tokens == cut and len(r.tokens[0]) == first + 1
    one = eng.generate(prompts[0], max_new_tokens=N_NEW, temperature=0.8, top_p=0.9, seed=7, stop_ids=[stop])
    assert one.tokens == [cut[0]] and one.decode_steps == first
    # the callback ends the run with a false return; an exception it raises propagates
    r = eng.generate(prompts, max_new_tokens=N_NEW, on_token=lambda step, toks: step < 2)
    assert [len(t) for t in r.tokens] == [3, 3]

    def boom(step, toks):
        if step == 1:
            raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        eng.generate(prompts, max_new_tokens=N_NEW, on_token=boom)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate(prompts, stop_ids=[ckpt["vocab"]])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        eng.generate("text without a tokenizer")


def run_generate(*args):
    return subprocess.run([sys.executable, "-m", "flashcpp.generate", *args], capture_output=True, text=True,
                          timeout=120)


def test_generate_cli_streams_text_and_stops_at_eos(ckpt, tmp_path):
    import shutil
    eng, tok = ckpt["eng"], ckpt["tok"]
    ids = tok.encode(PROMPT).ids
    greedy = eng.generate(ids, max_new_tokens=N_NEW).tokens[0]
    # A checkpoint whose EOS (generation_config.json) is the 5th greedy token: the CLI must stop there.
    d = str(tmp_path / "eos")
    shutil.copytree(ckpt["dir"], d)
    eos = greedy[4]
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos]}, f)
    expect = greedy[:greedy.index(eos) + 1]
    r = run_generate("--model", d, "--prompt", PROMPT, "--max-new-tokens", str(N_NEW), "--threads", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(expect, skip_special_tokens=True) + "\n"
    assert "tokens/s" in r.stderr and "stopped at EOS" in r.stderr, r.stderr


def test_text_stream_prints_the_decoding_of_the_ids(ckpt):
    """Multi-byte characters split over byte tokens come out whole (in-process, every prefix)."""
    import io
    tok = ckpt["tok"]
    ids = tok.encode("ça ☃ 茶 寿司 naïve").ids[1:]
    buf = io.StringIO()
    st = fg.TextStream(tok, buf)
    for t in ids:
        st.push(t)
        assert "\ufffd" not in buf.getvalue()
    st.close()
    assert buf.getvalue() == tok.decode(ids) == "ça ☃ 茶 寿司 naïve"


@pytest.mark.parametrize("args,expect", [
    (["--model", "/nonexistent/model", "--prompt", "x"], "no such directory"),
    (["--model", "{tmp}", "--prompt", "x"], "has no config.json"),
    (["--model", "{notok}", "--prompt", "x"], "has no tokenizer.json"),
    (["--model", "{ckpt}", "--prompt", "x", "--max-new-tokens", "0"], "must be >= 1"),
    (["--model", "{ckpt}", "--prompt", "x", "--top-p", "1.5"], "must be in (0, 1]"),
    (["--model", "{ckpt}", "--prompt", "x", "--temperature", "-1"], "must be >= 0"),
    (["--model", "{ckpt}", "--prompt", "x", "--device", "tpu"], "invalid choice"),
    (["--model", "{ckpt}", "--prompt", "x", "--max-new-tokens", "many"], "invalid int value"),
    (["--model", "{ckpt}"], "required"),
])
def test_generate_bad_input_exits_2_with_a_sentence(ckpt, tmp_path, capsys, args, expect):
    import shutil
    notok = str(tmp_path / "notok")
    os.makedirs(notok)
    shutil.copy(os.path.join(ckpt["dir"], "config.json"), notok)
    args = [a.format(tmp=str(tmp_path), notok=notok, ckpt=ckpt["dir"]) for a in args]
    assert fg.main(args) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashcpp.generate: ") and expect in lines[0], cap.err


def test_generate_bad_input_exit_status_through_python_m(tmp_path):
    r = run_generate("--model", str(tmp_path / "missing"), "--prompt", "x")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == f"flashcpp.generate: --model {tmp_path / 'missing'}: no such directory"


def test_two_threads_share_an_engine_while_one_streams(ckpt):
    """generate runs without the GIL, one at a time per Engine; a second thread waiting for the
    engine must not hold the GIL that the streaming callback of the first needs (no deadlock)."""
    import threading
    eng, ids = ckpt["eng"], ckpt["tok"].encode(PROMPT).ids
    want = eng.generate(ids, max_new_tokens=N_NEW).tokens
    got, errors = [], []

    def worker():
        try:
            got.append(eng.generate(ids, max_new_tokens=N_NEW, on_token=lambda step, toks: None).tokens)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "generate deadlocked"
    assert not errors and got == [want] * 3


def test_fp8_kv_cache_through_python(ckpt):
    # kv_dtype="fp8": the C++ engine's fp8 cache (its logits against an fp64 Llama over the same
    # quantized cache are tested in tests/cpu/test_engine_model.cc); here the keywords reach it.
    eng, tok = ckpt["eng"], ckpt["tok"]
    ids = tok.encode(PROMPT).ids
    plain = eng.generate(ids, max_new_tokens=N_NEW)
    q8 = eng.generate(ids, max_new_tokens=N_NEW, kv_dtype="fp8", kv_scale=0.01)
    assert len(q8.tokens[0]) == N_NEW
    assert q8.tokens[0][0] == plain.tokens[0][0]  # the first token comes from the prefill, unquantized
    with pytest.raises(ValueError, match="kv_dtype must be 'auto'"):
        eng.generate(ids, max_new_tokens=2, kv_dtype="int8")
    with pytest.raises(ValueError, match="scale"):
        eng.generate(ids, max_new_tokens=2, kv_dtype="fp8", kv_scale=0.0)


def test_the_callback_cannot_reenter_the_engine(ckpt):
    """generate() or load() from inside generate()'s own on_token callback deadlocked; now a sentence."""
    eng = ckpt["eng"]
    for inner, what in ((lambda: eng.generate([1], max_new_tokens=1), "generate"), (lambda: eng.load(ckpt["dir"]), "load")):
        with pytest.raises(RuntimeError, match=f"{what}: this engine is running generate"):
            eng.generate([1, 2, 3], max_new_tokens=4, on_token=lambda step, ids: inner())
    assert len(eng.generate([1, 2, 3], max_new_tokens=3).tokens[0]) == 3  # and it is usable after


def test_generate_arguments_are_not_coerced(ckpt):
    """Floats, bools and strings used to be truncated or parsed (prompt [1.9, 2.7] ran as [1, 2],
    stop_ids "76" stopped at 7 and 6, stop_ids=0 meant none); ints too wide for the binding came back
    as a nanobind signature dump."""
    eng = ckpt["eng"]
    for kw, err in ((dict(prompt=[1.9, 2.7]), TypeError), (dict(prompt=[True, 2]), TypeError),
                    (dict(prompt=[1, 2**31]), ValueError), (dict(max_new_tokens=2.9), TypeError),
                    (dict(max_new_tokens="3"), TypeError), (dict(max_new_tokens=2**31), ValueError),
                    (dict(seed=-1), ValueError), (dict(seed=1.5), TypeError), (dict(stop_ids="76"), TypeError),
                    (dict(stop_ids=[76.9]), TypeError)):
        args = dict(prompt=[1, 2, 3], max_new_tokens=4)
        args.update(kw)
        with pytest.raises(err):
            eng.generate(args.pop("prompt"), **args)
    free = eng.generate([1, 2, 3], max_new_tokens=6).tokens[0]
    first = free[0]
    assert eng.generate([1, 2, 3], max_new_tokens=6, stop_ids=first).tokens[0] == [first]  # one id
    assert eng.generate([1, 2, 3], max_new_tokens=6, stop_ids=np.array([first])).tokens[0] == [first]
    assert eng.generate(np.array([1, 2, 3]), max_new_tokens=6).tokens[0] == free
    with pytest.raises(TypeError, match="threads"):
        fe.Engine.cpu(1.5)


def test_a_bad_generation_config_is_refused_before_loading(ckpt, tmp_path):
    """A generation_config.json that is not a JSON object (or not JSON) left the engine half-loaded
    (model_dir set, eos_ids stale) with an AttributeError or a bare JSONDecodeError; now a ValueError
    naming the file, before the load, so the engine stays empty and can load the fixed folder. A
    byte-order mark is fine (the C++ loader takes it); an EOS id outside the vocabulary is refused."""
    import shutil
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt["dir"], d)
    for text in ("[1, 2]", "{bad"):
        eng = fe.Engine.cpu(1)
        (d / "generation_config.json").write_text(text)
        with pytest.raises(ValueError, match="generation_config.json"):
            eng.load(d)
        assert eng.model_dir is None
        (d / "generation_config.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"eos_token_id": 1}).encode())
        assert 1 in eng.load(d).eos_ids
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**6}))
    eng = fe.Engine.cpu(1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.load(d)
    assert eng.model_dir is None
    assert eng.load(ckpt["dir"]).model_dir == ckpt["dir"]  # refused before the C++ load: the engine is free
