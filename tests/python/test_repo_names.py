"""The repository names a run by its commit and date, never by a private run counter.

Reports, docs, raw file names and source comments once numbered runs by a counter: prose that
put the counter's number after the word for a round of work, and file names such as
bench_decode_<s + NN>.txt or a table column headed <s + NN>. A reader outside the project cannot
resolve such a number; a commit hash and a date they can (the run at 4685969 (2026-11-30),
raw/bench_decode_4685969_2026-11-30.txt). This test reads every tracked file (`git ls-files`; the
tree itself when git is not there) and fails on any line or path that numbers runs that way. It
needs only the standard library. Its own examples are spelled with placeholders (W for the word,
_S for the name part) so that a plain grep of the tree for the counter finds nothing here either.
"""

import os
import re
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
THIS = os.path.relpath(os.path.abspath(__file__), ROOT).replace(os.sep, "/")

# Each pattern, with what it catches (W = the word, _S = "_s"). Case-insensitive.
COUNTER_PATTERNS = {
    # "W 22", "W 18 (H200)", "Ws 16-18", "W-16", "W22", the number on the next line
    "numbered session": r"(?<![a-z])sessions?[\s_-]?[0-9]",
    # "bench_decode(S)22.txt", "raw_full(S)23/", "bench_decode(S)19_merge.txt" (S = _s)
    "_sNN in a name": r"_s[0-9]{2}(?![0-9a-z])",
    # "s22_splits/", "s21_call4" at the start of a name
    "sNN_ in a name": r"(?<![0-9a-z])s[0-9]{2}_",
    # a bare label such as the column "s22" or "(2.5x at s20)", in the counter's range; checked
    # in prose only (reports, docs, *.md), where code names such as `s12` do not occur
    "bare sNN label": r"(?<![0-9a-z_])s(?:1[6-9]|2[0-9])(?![0-9a-z_])",
    # "next W's A/B", "this W", "earlier Ws", "W logs"
    "session as a round of work": (
        r"\b(?:next|this|previous|last|earlier|later|same|several|two|three|four|five|"
        r"the first)\s+sessions?\b"
        r"|\bsession(?:'s)? (?:logs?|budget|runs?)\b"
    ),
}

# (path, pattern name) pairs where the match is not a run counter.
ALLOWED = {
    # forced split counts of the decode sweep: "s8 43.8 s12 59.5 s16 52.2" (s<N> = N splits)
    ("reports/decode/raw/splits_sweep.txt", "bare sNN label"),
}

COMPILED = {name: re.compile(rx, re.IGNORECASE) for name, rx in COUNTER_PATTERNS.items()}
PROSE_ONLY = {"bare sNN label"}


def is_prose(path):
    return path.startswith(("reports/", "docs/")) or path.endswith((".md", ".txt", ".rst"))


def tracked_files():
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], check=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
        paths = [p for p in out.decode("utf-8", "replace").split("\0") if p]
        if paths:
            return paths
    except (OSError, subprocess.CalledProcessError):
        pass
    paths = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = os.path.relpath(dirpath, ROOT)
        dirnames[:] = [d for d in dirnames
                       if not (d.startswith(".") or (rel == "." and d.startswith("build"))
                               or d == "__pycache__")]
        for f in filenames:
            paths.append(os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/"))
    return paths


def findings(path, text):
    """Every (path, line number, pattern name, line) in `text` that numbers runs."""
    hits = []
    prose = is_prose(path)
    lines = text.splitlines()
    for name, rx in COMPILED.items():
        if (name in PROSE_ONLY and not prose) or (path, name) in ALLOWED:
            continue
        # on the whole text, so that "session\n22" across a line break is caught too
        for m in rx.finditer(text):
            lineno = text.count("\n", 0, m.start()) + 1
            hits.append((path, lineno, name, lines[lineno - 1].strip()[:160]))
    return hits


def scan():
    hits = []
    for path in tracked_files():
        if path == THIS or path.startswith("build"):
            continue
        for name, rx in COMPILED.items():
            if (path, name) not in ALLOWED and rx.search(path):
                hits.append((path, 0, name + " (file name)", path))
        full = os.path.join(ROOT, path)
        try:
            with open(full, "rb") as f:
                data = f.read()
        except OSError:
            continue  # a tracked file deleted in the work tree
        if b"\0" in data[:8192]:
            continue  # binary (plots)
        hits.extend(findings(path, data.decode("utf-8", "replace")))
    return hits


W = "sess" + "ion"   # the word, spelled apart so that this file does not match itself
S = "_" + "s"        # the name part


@pytest.mark.parametrize("text", [
    W + " 22's run at 4685969",
    W.capitalize() + " 18 (H200): flashcpp bench",
    W + "s 16-18 without the step following",
    "reports/decode/raw/bench_decode" + S + "22.txt",
    "`raw_quick" + S + "24/`",
    "bench_decode" + S + "19_merge.txt",
    "engine/raw/" + S[1:] + "22_splits/README.md",
    "| case | ours us | " + S[1:] + "22 us |",
    "what ncu separates us from cuDNN by (2.5x at " + S[1:] + "20)",
    "the causal side of next " + W + "'s A/B",
    "the GPU budget of this " + W + " was spent",
    "bench_fused" + S[:1] + W + "16.txt",
    "in " + W + "\n20 its GQA rows had used the tensor-core path",
])
def test_patterns_catch_the_counter(text):
    assert findings("x.md", text), text


@pytest.mark.parametrize("text", [
    "the run at 4685969 (2026-11-30)",
    "reports/decode/raw/bench_decode_4685969_2026-11-30.txt",
    "paged_b16_h32kv8_n8192_d128_ps16_bf16,flashinfer,136.9",
    "a `Session` (paged KV cache, rotary tables)",
    "sm90_m128n128s4p and m128n176s2p",
    "const std::vector<float> s16 = alibi_slopes(16);",
    "src/engine/model.cc: the KV-cache " + W + " and the forward passes",
    "each " + W + " owns its paged KV cache",
])
def test_patterns_leave_other_names_alone(text):
    path = "x.cc" if text.startswith("const") else "x.md"
    assert not findings(path, text), text


def test_no_tracked_file_numbers_runs_by_a_counter():
    hits = scan()
    assert len(tracked_files()) > 100, "the scan found too few files to mean anything"
    msg = "\n".join(f"{p}:{n}: [{name}] {line}" for p, n, name, line in hits)
    assert not hits, ("runs are named by commit and date (e.g. 'the run at 4685969 "
                      "(2026-11-30)', raw/bench_decode_4685969_2026-11-30.txt), not by a "
                      "counter:\n" + msg)
