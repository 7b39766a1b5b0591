"""The Llama decode engine from Python: a thin wrapper over flashcpp::engine::Engine (the C++ engine
that ``flashcpp decode`` drives, bound in python/src/engine_module.cc), with text in and out
through a Hugging Face ``tokenizers`` tokenizer (tokenizer.json) when one is given.

    from flashcpp.engine import Engine, load_tokenizer
    eng = Engine.cpu(threads=0)            # or Engine.cuda()
    eng.load("path/to/llama")              # config.json + *.safetensors
    tok = load_tokenizer("path/to/llama")  # path/to/llama/tokenizer.json
    out = eng.generate("Once upon a time", tokenizer=tok, max_new_tokens=64, stop_ids=eng.eos_ids)
    print(out.text[0], out.decode_tok_s)

``python -m flashcpp.generate`` is the command line over it (streams text, stops at EOS).
The engine runs without the GIL; ``on_token`` is called with the GIL after every token.
A build without the engine (FLASHCPP_WITH_ENGINE=OFF, or the CUDA wheel: FLASHCPP_PYTHON_ENGINE
defaults to OFF there, as the CUDA engine links cuBLASLt) raises ImportError on import, saying so.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Union

import numpy as np

from . import _core
from . import _flashcpp as _C

_E = getattr(_C, "engine", None)
if _E is None or not _E.AVAILABLE:
    raise ImportError("flashcpp.engine: " + (_E.REASON if _E is not None else
                                              "this flashcpp extension was built without the engine binding"))

__all__ = ["Engine", "Generation", "eos_token_ids", "load_tokenizer", "MAX_BATCH"]

MAX_BATCH: int = _E.MAX_BATCH

Prompt = Union[str, Sequence[int], Sequence[Sequence[int]], Sequence[str]]


def load_tokenizer(model_dir: str):
    """tokenizers.Tokenizer.from_file(model_dir/tokenizer.json). Raises FileNotFoundError with a
    sentence when the file is missing, ImportError when ``tokenizers`` is not installed."""
    path = os.path.join(os.fspath(model_dir), "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json (a Hugging Face tokenizers file)")
    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("text in and out needs the Hugging Face `tokenizers` package "
                          "(pip install tokenizers)") from e
    return Tokenizer.from_file(path)


_INT32_MAX = _core._INT32_MAX


def eos_token_ids(model_dir: str) -> List[int]:
    """The end-of-sequence ids of a checkpoint: eos_token_id of config.json and of
    generation_config.json (an int or a list in either), in that order, without repeats. A file
    that is not a JSON object, or an id outside [0, vocab_size) of config.json, is a ValueError
    naming the file (a UTF-8 byte-order mark is allowed, as the C++ loader allows it)."""
    ids: List[int] = []
    vocab_size: Optional[int] = None
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(os.fspath(model_dir), name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8-sig") as f:
                cfg = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: must be a JSON object, not {type(cfg).__name__}")
        if name == "config.json" and isinstance(cfg.get("vocab_size"), int) and not isinstance(cfg["vocab_size"], bool):
            vocab_size = cfg["vocab_size"]
        v = cfg.get("eos_token_id")
        for i in (v if isinstance(v, list) else [v]):
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                if vocab_size is not None and not 0 <= i < vocab_size:
                    raise ValueError(f"{path}: eos_token_id {i} is outside the vocabulary [0, {vocab_size})")
                ids.append(i)
    return ids


def _int_arg(x: Any, name: str, lo: int, hi: int) -> int:
    """_core.check_int, with a TypeError for what is not an int at all (a float is not truncated,
    a bool or a string is not a number)."""
    if not _core._is_int(x):
        raise TypeError(f"{name} must be an int; got {x!r} (a {type(x).__name__} is not truncated or parsed)")
    return _core.check_int(x, name, lo, hi)


def _id_list(ids: Any, what: str) -> List[int]:
    """A list of token ids (ints in [0, 2**31)), from a list, a tuple or a 1-D numpy array."""
    if isinstance(ids, np.ndarray):
        ids = ids.tolist() if ids.ndim == 1 else ids
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"{what} must be a list of token ids; got {type(ids).__name__}")
    return [_int_arg(i, f"{what} id", 0, _INT32_MAX) for i in ids]


@dataclass
class Generation:
    """What generate() returns. tokens: the generated ids per prompt (up to and including a stop
    id); text: their decoding per prompt (special tokens skipped) when a tokenizer was given."""
    tokens: List[List[int]]
    text: Optional[List[str]] = None
    prompt_len: int = 0
    decode_steps: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    decode_tok_s: float = 0.0
    raw: dict = field(default_factory=dict, repr=False)


class Engine:
    """A backend (CPU threads, or one CUDA device) with at most one Llama model loaded on it."""

    def __init__(self, handle):
        self._h = handle
        self._inside = threading.local()  # .generate: this thread is in generate() (its callback may not reenter)
        self.model_dir: Optional[str] = None
        #: EOS ids of the loaded checkpoint (config.json, generation_config.json); see eos_token_ids.
        self.eos_ids: List[int] = []

    @classmethod
    def cpu(cls, threads: int = 0) -> "Engine":
        """The CPU backend (fp32) with `threads` threads (0: all)."""
        return cls(_E.Engine.cpu(_int_arg(threads, "threads", 0, 1024)))

    @classmethod
    def cuda(cls) -> "Engine":
        """The CUDA backend (bf16) on the current device; raises with a sentence when CUDA is not
        built in or no device is usable."""
        return cls(_E.Engine.cuda())

    @property
    def is_cuda(self) -> bool:
        return self._h.is_cuda

    def describe(self) -> str:
        return self._h.describe()

    def load(self, model_dir) -> "Engine":
        """Reads config.json and the safetensors of `model_dir` (ValueError with a sentence for a
        bad checkpoint). Returns self."""
        self._not_busy("load")
        model_dir = os.fspath(model_dir)
        if not model_dir or "\0" in model_dir:
            raise ValueError(f"model_dir must name a checkpoint folder; got {model_dir!r}")
        eos = eos_token_ids(model_dir)  # its files' checks first: a refusal leaves the engine as it was
        self._h.load(model_dir)
        self.model_dir = model_dir
        self.eos_ids = eos
        return self

    def _not_busy(self, what: str) -> None:
        # Another thread waits for the engine (generate runs one call at a time); the thread inside
        # generate can only be here from its own callback, which would wait for itself.
        if getattr(self._inside, "generate", False):
            raise RuntimeError(f"{what}: this engine is running generate(); its on_token callback cannot use the "
                               f"engine (return False from it to end the run, then call {what})")

    def model(self) -> dict:
        """The loaded model's shape (config.json's names) and weight bytes."""
        return self._h.model()

    def generate(self, prompt: Prompt, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, stop_ids: Optional[Sequence[int]] = None,
                 on_token: Optional[Callable[[int, List[int]], Optional[bool]]] = None, tokenizer=None,
                 eager: Optional[bool] = None, kv_dtype: str = "auto", kv_scale: float = 1.0) -> Generation:
        """Generates from one prompt or a batch.

        prompt: a list of ids, a list of such lists (a batch), or, with `tokenizer`, a string or a
        list of strings (encoded with the tokenizer's special tokens, e.g. BOS).
        temperature 0 is greedy; top_p < 1 is nucleus sampling; `seed` fixes the draws.
        stop_ids: a sequence that produces one stops there (the id is kept as its last token); the
        run ends when all have stopped. Pass ``engine.eos_ids`` to stop at EOS.
        on_token(step, ids): called after every token of the batch (step 0 is the prefill's), with
        one id per sequence (-1 for a sequence that stopped earlier); return False to end the run.
        An exception it raises ends the run and propagates.
        eager: CUDA only, launch op by op instead of replaying a CUDA graph (default: graphs).
        kv_dtype: "auto" (the backend's dtype) or "fp8": an e4m3 KV cache holding codes of
        x / kv_scale (both backends; docs/decode.md).
        """
        self._not_busy("generate")
        if self.model_dir is None:
            raise ValueError("generate: no model is loaded (Engine.load first)")
        prompts = self._prompts(prompt, tokenizer)
        if eager is None:
            eager = not self.is_cuda
        stops = [] if stop_ids is None else [_int_arg(stop_ids, "stop_ids", 0, _INT32_MAX)] if isinstance(
            stop_ids, (int, np.integer)) and not isinstance(stop_ids, bool) else _id_list(stop_ids, "stop_ids")
        self._inside.generate = True
        try:
            r = self._h.generate(prompts, max_new_tokens=_int_arg(max_new_tokens, "max_new_tokens", -_INT32_MAX, _INT32_MAX),
                                 temperature=float(temperature), top_p=float(top_p),
                                 seed=_int_arg(seed, "seed", 0, 2**64 - 1), stop_ids=stops,
                                 on_tokens=on_token, eager=bool(eager),
                                 # a CUDA graph is captured after one eager step (lazy cuBLASLt set-up)
                                 warmup_steps=0 if eager else 1, profile=False, kv_dtype=str(kv_dtype),
                                 kv_scale=float(kv_scale))
        finally:
            self._inside.generate = False
        text = None
        if tokenizer is not None:
            text = [tokenizer.decode(t, skip_special_tokens=True) for t in r["tokens"]]
        return Generation(tokens=r["tokens"], text=text, prompt_len=r["prompt_len"], decode_steps=r["decode_steps"],
                          prefill_ms=r["prefill_ms"], decode_ms=r["decode_ms"], decode_tok_s=r["decode_tok_s"], raw=r)

    @staticmethod
    def _prompts(prompt: Prompt, tokenizer) -> List[List[int]]:
        if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt and
                                       all(isinstance(p, str) for p in prompt)):
            if tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (tokenizer=load_tokenizer(model_dir))")
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            out = [tokenizer.encode(t).ids for t in texts]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, (list, tuple, np.ndarray)) for p in prompt):
            out = [_id_list(p, f"prompt {i}") for i, p in enumerate(prompt)]
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            out = [_id_list(prompt, "prompt")]
        else:
            raise TypeError(f"prompt must be ids, a list of id lists, or text; got {type(prompt).__name__}")
        for i, p in enumerate(out):
            if not p:
                raise ValueError(f"prompt {i} has no tokens (an empty prompt; the tokenizer adds no BOS)")
        return out
