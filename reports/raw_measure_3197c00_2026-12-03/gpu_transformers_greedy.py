"""flashcpp as transformers' attn_implementation on CUDA: greedy tokens and logits against sdpa.

    python3 gpu_transformers_greedy.py [cpu|cuda]

Tiny random Llama / Mistral / Qwen2 models (head_dim 64, a size the CUDA kernels take), bf16 on
the GPU, a left-padded batch of 2: forward logits of the real tokens (max |diff| against sdpa) and
24 greedy new tokens (prefill through varlen, then decode steps through the KV cache). Prints one
line per architecture and exits 1 if any greedy sequence differs from sdpa's at a step whose top-2
margin (under sdpa) is more than twice the logit difference between the two implementations
(otherwise a tie under bf16 rounding).
"""
import sys

import torch
import transformers

import flashcpp.integrations.transformers as fcpp_hf

DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
DT = torch.bfloat16
NEW = 24
common = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, vocab_size=128, max_position_embeddings=256,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.15)
ARCHS = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)),
         "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(sliding_window=7, **common)),
         "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common))}
name = fcpp_hf.register()
g = torch.Generator().manual_seed(0)
ids = torch.randint(3, 128, (2, 16), generator=g)
mask = torch.ones(2, 16, dtype=torch.long)
mask[1, :5] = 0
ids[1, :5] = 0
ids, mask = ids.to(DEV), mask.to(DEV)
bad = 0
for arch, (cls, cfg) in ARCHS.items():
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation="sdpa", dtype=DT).to(DEV).eval()
    out = {}
    for impl in ("sdpa", name):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            lg = model(input_ids=ids, attention_mask=mask).logits[mask.bool()].float()
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        out[impl] = (lg, gen.sequences[:, 16:], torch.stack(gen.scores, 1).float())
    (lr, tr, sr), (lo, to, so) = out["sdpa"], out[name]
    dlogit = (lo - lr).abs().max().item()
    same = bool(torch.equal(tr, to))
    note = ""
    if not same:
        row, step = [int(x) for x in (tr != to).nonzero()[0]]
        top2 = sr[row, step].topk(2).values
        margin = (top2[0] - top2[1]).item()
        step_diff = (so[row, step] - sr[row, step]).abs().max().item()  # same prefix up to this step
        tie = margin <= 2 * max(dlogit, step_diff)  # within what the two implementations' rounding moves
        note = f" first diff row {row} step {step}, sdpa top-2 margin {margin:.3e}, logit diff there {step_diff:.3e} ({'near-tie' if tie else 'NOT a tie'})"
        bad += 0 if tie else 1
    print(f"{arch:8s} {DEV} bf16: forward max|dlogit| {dlogit:.3e} (max|logit| {lr.abs().max().item():.2f}); "
          f"greedy {NEW} tokens x 2 rows equal to sdpa: {same}{note}", flush=True)
print("RESULT", "PASS" if bad == 0 else f"FAIL ({bad})")
sys.exit(1 if bad else 0)
