"""Text generation with the flashcpp Llama engine, streamed to stdout:

    python -m flashcpp.generate --model DIR --prompt "Once upon a time" [--max-new-tokens N]
        [--temperature T] [--top-p P] [--seed S] [--device cpu|cuda] [--threads N]

DIR holds a Hugging Face Llama checkpoint (config.json, *.safetensors) and its tokenizer.json (read
with the `tokenizers` package). The prompt is encoded with the tokenizer's special tokens (its
post-processor adds BOS); the text is printed as the tokens arrive (the growing id list is decoded
and its new suffix printed, so a character split over several byte tokens comes out whole) and the
run stops at an EOS id of config.json / generation_config.json. Tokens/s go to stderr at the end.
Exit status 2 with one sentence on stderr for bad input (no model dir, no tokenizer.json, a bad
flag, a checkpoint the engine refuses).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional, Sequence

PROG = "flashcpp.generate"


class _BadInput(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence and exit 2, not argparse's usage block
        raise _BadInput(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"python -m {PROG}", description="Stream text from a Llama checkpoint with the flashcpp engine.")
    p.add_argument("--model", required=True, help="checkpoint dir: config.json, *.safetensors, tokenizer.json")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: all)")
    return p


class TextStream:
    """Prints the decoding of a growing id list as new text: decodes all ids so far and writes
    the part past what was printed. Holds back while the text ends in U+FFFD (a character whose
    bytes have not all arrived)."""

    def __init__(self, tokenizer, out):
        self.tok, self.out = tokenizer, out
        self.ids: List[int] = []
        self.printed = ""

    def _emit(self, final: bool) -> None:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return
        if text.startswith(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text

    def push(self, token: int) -> None:
        self.ids.append(token)
        self._emit(False)

    def close(self) -> str:
        self._emit(True)
        return self.printed


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if not os.path.isdir(args.model):
            raise _BadInput(f"--model {args.model}: no such directory")
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise _BadInput(f"--model {args.model} has no config.json (a Hugging Face checkpoint dir)")
        if not os.path.isfile(os.path.join(args.model, "tokenizer.json")):
            raise _BadInput(f"--model {args.model} has no tokenizer.json (the Hugging Face tokenizers file)")
        if args.max_new_tokens < 1:
            raise _BadInput(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
        if not args.temperature >= 0.0:
            raise _BadInput(f"--temperature {args.temperature} must be >= 0 (0 is greedy)")
        if not 0.0 < args.top_p <= 1.0:
            raise _BadInput(f"--top-p {args.top_p} must be in (0, 1]")
        if args.threads < 0:
            raise _BadInput(f"--threads {args.threads} must be >= 0 (0: all cores)")
        if not 0 <= args.seed < 2 ** 64:
            raise _BadInput(f"--seed {args.seed} must be in [0, 2^64)")
        try:
            from .engine import Engine, load_tokenizer
        except ImportError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 1
        try:
            tok = load_tokenizer(args.model)
        except Exception as e:  # a malformed tokenizer.json
            raise _BadInput(f"{args.model}/tokenizer.json could not be read ({e})")
        ids = tok.encode(args.prompt).ids
        if not ids:
            raise _BadInput("the prompt encodes to no tokens (empty, and the tokenizer adds no BOS)")
        try:
            eng = Engine.cuda() if args.device == "cuda" else Engine.cpu(args.threads)
            eng.load(args.model)
        except (ValueError, NotImplementedError, RuntimeError) as e:
            raise _BadInput(str(e))
        vocab = eng.model()["vocab_size"]
        if max(ids) >= vocab:
            raise _BadInput(f"the tokenizer gave id {max(ids)}, outside the model's vocabulary of {vocab} "
                            "(tokenizer.json does not belong to this checkpoint)")
    except _BadInput as e:
        msg = str(e)
        print(f"{PROG}: {msg[:1].lower() + msg[1:]}", file=sys.stderr)
        return 2

    stream = TextStream(tok, sys.stdout)
    t0 = time.perf_counter()
    first = [None]

    def on_token(step, toks):
        if first[0] is None:
            first[0] = time.perf_counter()
        stream.push(toks[0])

    try:
        r = eng.generate([ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                         seed=args.seed, stop_ids=eng.eos_ids, on_token=on_token)
    except ValueError as e:
        print(f"\n{PROG}: {e}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    stream.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    n = len(r.tokens[0])
    stopped = "EOS" if n and r.tokens[0][-1] in eng.eos_ids else f"max {args.max_new_tokens} tokens"
    decode_s = t1 - (first[0] or t1)
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
    print(f"{n} tokens ({len(ids)} prompt, stopped at {stopped}) in {t1 - t0:.2f} s on {eng.describe()}: "
          f"{rate:.1f} tokens/s decode, first token after {1e3 * ((first[0] or t1) - t0):.0f} ms",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
