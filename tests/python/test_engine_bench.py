"""The engine benchmark's PyTorch side on the CPU, with tiny Llama configs: the compact model
(python/flashcpp/bench/engine_model.py) against transformers' LlamaForCausalLM in fp32, and the
driver (python/flashcpp/bench/engine.py) end to end with an in-process stand-in for `flashcpp decode`
(correctness_report.json, benchmark.csv, benchmark.png). Needs torch, transformers and safetensors
(skipped otherwise, as in CI)."""
import csv
import json
import math
import os
import time

import pytest

torch = pytest.importorskip("torch", reason="needs torch")
transformers = pytest.importorskip("transformers", reason="needs transformers")
pytest.importorskip("safetensors", reason="needs safetensors")

from flashcpp.bench import engine, engine_model as em  # noqa: E402

ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}


def tiny(tie=True, kv=2):
    return dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=kv, head_dim=16, vocab_size=300, rope_theta=500000.0,
                rope_scaling=dict(ROPE), tie_word_embeddings=tie, rms_norm_eps=1e-5,
                max_position_embeddings=131072, initializer_range=0.1)


@pytest.mark.parametrize("tie,kv", [(True, 2), (False, 8), (True, 1)])
def test_compact_model_matches_transformers_fp32(tmp_path, tie, kv):
    d = str(tmp_path / "ckpt")
    shape = tiny(tie, kv)
    engine.make_checkpoint(d, device="cpu", shape=shape)
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"
    hf = engine.hf_load(d, torch.float32, "cpu", "eager")
    model = em.Llama.from_pretrained(d, device="cpu", dtype=torch.float32)
    assert torch.equal(model.inv_freq, hf.model.rotary_emb.inv_freq.float())
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 300, (3, 11), generator=g)
    toks, logits = em.greedy(model, prompt, 9)
    hf_toks, hf_logits = engine.hf_greedy(hf, prompt, 9)
    assert logits.shape == (3, 11 + 9 - 1, 300)
    scale = hf_logits.abs().max().item()
    assert (logits - hf_logits).abs().max().item() <= 1e-4 * max(1.0, scale)
    assert torch.equal(toks, hf_toks)
    # the one-token decode step at an arbitrary position against a full forward
    with torch.no_grad():
        full = hf(torch.cat([prompt, toks[:, :-1]], 1)).logits
    assert (logits - full).abs().max().item() <= 1e-4 * max(1.0, scale)


def test_args_from_transformers4_config(tmp_path):
    """The hub's Llama-3.2 config.json spelling (rope_theta + rope_scaling, no rope_parameters)."""
    c = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "rope_scaling": dict(ROPE, rope_type="llama3"), "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(c))
    a = em.LlamaArgs.from_hf_config(str(tmp_path))
    assert a.rope_theta == 500000.0 and a.rope_scaling["factor"] == 32.0 and a.n_kv_heads == 2
    inv = em.rope_inv_freq(a)
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.equal(inv[0], plain[0])  # short wavelengths unscaled
    assert torch.allclose(inv[-1], plain[-1] / 32.0)  # long ones slowed by `factor`


def fake_flashcpp(binary, args, workdir, tag, timeout=600):
    """Stands in for `flashcpp decode` with the compact model (same CLI meaning, same JSON/dump layout)."""
    args = [str(a) for a in args]
    opt = {}
    i = 0
    while i < len(args):
        if args[i] == "--eager":
            opt["eager"] = True
            i += 1
        else:
            opt[args[i]] = args[i + 1]
            i += 2
    m = em.Llama.from_pretrained(opt["--model"], device="cpu", dtype=torch.float32)
    n = int(opt["--max-new-tokens"])
    t0 = time.perf_counter()
    ctx, plen = 0, 0
    if "--prompt-ids" in opt or "--prompt-file" in opt:
        if "--prompt-file" in opt:
            rows = [[int(t) for t in ln.replace(",", " ").split()] for ln in open(opt["--prompt-file"]) if ln.strip()]
        else:
            rows = [[int(t) for t in opt["--prompt-ids"].split(",")]] * int(opt.get("--batch", 1))
        prompt = torch.tensor(rows)
        toks, lg = em.greedy(m, prompt, n)
        if "--dump-logits" in opt:
            lg[0].numpy().astype("<f4").tofile(opt["--dump-logits"])
        plen, b = prompt.shape[1], prompt.shape[0]
    else:
        b, ctx = int(opt["--batch"]), int(opt["--context"])
        tok0, kv_pos = engine.setup_case(m, b, ctx, n, engine.cache_len_for([(b, ctx)], b, n))
        toks = torch.zeros(b, 0, dtype=torch.long)
        with torch.no_grad():
            d = engine.TorchDecoder("torch_eager", m, tok0, kv_pos, ctx, {})
            d.run(n)
    dt = time.perf_counter() - t0
    return {"tokens": toks.tolist(), "batch": b, "prompt_len": plen, "context": ctx, "max_new_tokens": n,
            "mode": "eager" if opt.get("eager") else "graph", "prefill_ms": 0.1, "decode_ms": 1e3 * dt,
            "decode_tok_s": b * n / dt, "wall_us_per_step": 1e6 * dt / n, "kernel_us_per_step": 0.5e6 * dt / n,
            "gpu": "cpu", "git_commit": "test", "vocab": m.args.vocab_size}


def stand_in_binary(tmp_path, monkeypatch):
    """An executable path for --flashcpp-bin whose runs go to fake_flashcpp (needs matplotlib for the plot)."""
    pytest.importorskip("matplotlib")
    binary = tmp_path / "flashcpp"
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(0o755)
    monkeypatch.setattr(engine, "run_flashcpp", fake_flashcpp)
    return binary


def test_driver_end_to_end_cpu(tmp_path, monkeypatch):
    binary = stand_in_binary(tmp_path, monkeypatch)
    monkeypatch.setattr(engine, "cases_for", lambda quick, spec=None: [(1, 512), (2, 64)])
    monkeypatch.setattr(engine, "NEW_TOKENS", 8)
    out = tmp_path / "out"
    rc = engine.run(quick=True, out=str(out), flashcpp_bin=str(binary), model_dir=str(tmp_path / "ckpt"), steps=3,
                    repeats=2, modes=["torch_eager"], device="cpu", shape=tiny())
    assert rc == 0
    rep = json.load(open(out / "correctness_report.json"))
    assert {"device", "backend", "git_commit"} <= set(rep["environment"])
    names = [c["name"] for c in rep["cases"]]
    assert "flashcpp_graph_vs_transformers" in names and "flashcpp_graph_batch4_prompts" in names
    for c in rep["cases"]:
        assert c["pass"], c
        assert {"name", "pass", "max_abs_err", "tolerance"} <= set(c)
    rows = list(csv.DictReader(open(out / "benchmark.csv")))
    assert {r["peer"] for r in rows} == {"torch_eager", "flashcpp_eager"}
    for k in ("case", "peer", "ours_tok_s", "peer_tok_s", "speedup", "batch", "context", "floor_tok_s",
              "meets_bar", "gpu", "git_commit", "ours_kernel_us_per_step", "ours_wall_us_per_step"):
        assert k in rows[0]
    r = [r for r in rows if r["case"] == "b1_ctx512" and r["peer"] == "torch_eager"][0]
    assert r["meets_bar"] in ("yes", "no")
    sp = float(r["ours_tok_s"]) / float(r["peer_tok_s"])
    assert abs(float(r["speedup"]) - sp) < 0.01 * sp + 1e-3
    assert os.path.getsize(out / "benchmark.png") > 0


def test_compare_divergence_near_tie():
    """A token divergence is accepted only where the fp32 reference calls the two tokens a near-tie."""
    v, plen, n = 10, 3, 4
    ref = torch.zeros(plen + n - 1, v)
    ref[:, 1] = 1.0
    ref[plen - 1 + 2, 2] = 0.999  # step 3 (0-based 2): tokens 1 and 2 are a near-tie
    hf_toks = [1, 1, 1, 1]
    ok = engine.compare("x", [1, 1, 2, 5], ref.clone(), hf_toks, ref, ref, tol=0.01, plen=plen)
    assert ok["pass"] and ok["first_divergent_step"] == 3 and ok["rows_compared"] == plen + 2
    bad = engine.compare("x", [1, 3, 1, 1], ref.clone(), hf_toks, ref, ref, tol=0.01, plen=plen)
    assert not bad["pass"] and bad["first_divergent_step"] == 2
    short = engine.compare("x", [1, 1, 1, 1], ref[:-1].clone(), hf_toks, ref, ref, tol=0.01, plen=plen)
    assert not short["pass"]  # a dump with too few rows


def test_decode_reads_only_kv_pos_prefix(tmp_path):
    """A cache longer than the case, read through kv_pos = arange(n), gives the logits of a cache of n."""
    d = str(tmp_path / "ckpt")
    engine.make_checkpoint(d, device="cpu", shape=tiny())
    m = em.Llama.from_pretrained(d, device="cpu", dtype=torch.float32)
    cases = [(2, 100), (2, 1000)]
    tok0, kv_pos = engine.setup_case(m, 2, 100, 4, engine.cache_len_for(cases, 2, 4))
    assert m.layers[0].attn.k_cache.shape[2] > kv_pos.shape[0] >= 104
    pos = torch.tensor([100])
    with torch.no_grad():
        caches = [(b.attn.k_cache[:, :, :kv_pos.shape[0]].clone(), b.attn.v_cache[:, :, :kv_pos.shape[0]].clone())
                  for b in m.layers]
        m.layers[0].attn.k_cache[:, :, kv_pos.shape[0]:] = 1e4  # garbage beyond n must not matter
        _, long_logits = em.decode_one(m, tok0, pos, kv_pos)
        for b, (k, v) in zip(m.layers, caches):
            b.attn.k_cache, b.attn.v_cache = k, v
        _, short_logits = em.decode_one(m, tok0, pos)
    assert torch.equal(long_logits, short_logits)


def test_isolated_mode_runs_in_a_child_process(tmp_path):
    """--isolate: a mode timed in a process of its own comes back as the parent's cells (runs and the
    logits check against the child's torch_eager)."""
    d = str(tmp_path / "ckpt")
    engine.make_checkpoint(d, device="cpu", shape=tiny())
    errors = []
    got = engine.run_isolated("torch_eager", d, str(tmp_path), [(1, 64), (2, 32)], 2, 2, "cpu", errors)
    assert errors == []
    assert set(got) == {"b1_ctx64", "b2_ctx32"}
    for runs, diff in got.values():
        assert len(runs) == 2 and all(v > 0 and math.isfinite(v) for v in runs)
        assert diff == 0.0


def test_isolated_mode_that_dies_costs_only_its_cells(tmp_path, monkeypatch):
    """A child killed by a signal (as PyTorch's SIGSEGV was) records an error naming the empty cells."""
    crash = tmp_path / "python"
    crash.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crash.chmod(0o755)
    monkeypatch.setattr(engine.sys, "executable", str(crash))
    errors = []
    got = engine.run_isolated("torch_compile_graph", str(tmp_path), str(tmp_path), [(1, 512)], 2, 1, "cpu", errors)
    assert got == {}
    assert len(errors) == 1 and "signal 11" in errors[0] and "b1_ctx512" in errors[0]


def test_driver_merges_an_isolated_mode_into_its_rows(tmp_path, monkeypatch):
    """The parent's benchmark.csv carries the child's runs for an isolated mode, with ours beside them."""
    binary = stand_in_binary(tmp_path, monkeypatch)
    out = tmp_path / "out"
    rc = engine.run(quick=False, out=str(out), flashcpp_bin=str(binary), model_dir=str(tmp_path / "ckpt"), steps=2,
                    repeats=2, modes=["torch_eager"], device="cpu", shape=tiny(), skip_correctness=True,
                    cases="1x64", isolate=["torch_eager"])
    assert rc == 0
    rows = {r["peer"]: r for r in csv.DictReader(open(out / "benchmark.csv"))}
    r = rows["torch_eager"]
    assert len(r["peer_tok_s_runs"].split()) == 2 and float(r["peer_tok_s"]) > 0
    assert float(r["max_abs_logit_diff_vs_torch_eager"]) == 0.0
    assert float(r["ours_tok_s"]) > 0 and r["speedup"] != ""


def test_quick_skips_the_isolated_modes(tmp_path, monkeypatch):
    """--quick times batch 1 only and leaves out the modes that need a child process (no child runs)."""
    assert engine.cases_for(True) == [(1, 512)]
    binary = stand_in_binary(tmp_path, monkeypatch)
    monkeypatch.setattr(engine, "run_isolated", lambda *a, **k: (_ for _ in ()).throw(AssertionError("child started")))
    out = tmp_path / "out"
    rc = engine.run(quick=True, out=str(out), flashcpp_bin=str(binary), model_dir=str(tmp_path / "ckpt"), steps=2,
                    repeats=1, modes=["torch_eager", "torch_graph"], device="cpu", shape=tiny(),
                    skip_correctness=True, cases="1x64", isolate=["torch_graph"])
    assert rc == 0
    peers = {r["peer"] for r in csv.DictReader(open(out / "benchmark.csv"))}
    assert "torch_eager" in peers and "torch_graph" not in peers
