#!/usr/bin/env python3
"""The include-direction check of docs/ARCHITECTURE.md (a stage of `make test`).

Scans every `#include "..."` line under include/, src/, tools/ and python/src/ and checks its
first path component against what the including file's layer may include:

  include/flashcpp/  flashcpp/
  src/common/        common/, flashcpp/                 (host/device shared math: no backend)
  src/cpu/           common/, core/, cpu/, flashcpp/     (never cuda/ or engine/)
  src/core/          common/, core/, cpu/, cuda/, flashcpp/
  src/cuda/          common/, core/, cuda/, flashcpp/    (never cpu/ or engine/)
  src/engine/        common/, cpu/parallel.h, cuda/, engine/, flashcpp/
  tools/             flashcpp/ and tools' own headers (a path that names a file under tools/)
  python/src/        flashcpp/ and its own headers

tests/ may include anything. A bare name that names a file in the including file's folder is
that layer's own header. KNOWN lists the includes from tools/ and python/src into src/ that are
still to move behind include/ (empty since issue 26 item 4 moved the last ones); it applies to
this tree only, and a listed include that is gone fails too, so the list only shrinks.

  scripts/check_includes.py [ROOT]     exit 0: "N files checked, 0 violations"; exit 1: one line
                                       per violation "file:line: what rule", then the count.
"""
import os
import re
import sys

EXTS = (".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh", ".inc")
SCANNED = ("include", "src", "tools", "python/src")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')

# Layer (a folder prefix of the including file) -> the first path components it may include, or
# single headers by their whole path.
LAYERS = [
    ("include/", {"flashcpp"}),
    ("src/common/", {"common", "flashcpp"}),
    ("src/cpu/", {"common", "core", "cpu", "flashcpp"}),
    ("src/core/", {"common", "core", "cpu", "cuda", "flashcpp"}),
    ("src/cuda/", {"common", "core", "cuda", "flashcpp"}),
    ("src/engine/", {"common", "cpu/parallel.h", "cuda", "engine", "flashcpp"}),  # the CPU ops share the pool
    ("tools/", {"flashcpp"}),
    ("python/src/", {"flashcpp"}),
]

# Headers the build writes (CMakeLists.txt: build/generated/), which any layer may include.
GENERATED = {"flashcpp_git_commit.h"}

# Includes from tools/ and python/src into src/ that still wait for a public header, as
# (file, included path) pairs. Empty: every one has moved behind include/. An include that has to
# cross for a while is listed here (and leaves the list when it moves), never left unchecked.
KNOWN = set()


def layer_of(rel):
    for prefix, allowed in LAYERS:
        if rel.startswith(prefix):
            return prefix, allowed
    return None, None


def own_header(root, rel, inc, prefix):
    """An include that names a file of the including layer: beside the file or under the layer root."""
    here = os.path.dirname(os.path.join(root, rel))
    bases = [here]
    if prefix in ("tools/", "python/src/"):
        bases.append(os.path.join(root, prefix))
    return any(os.path.isfile(os.path.normpath(os.path.join(b, inc))) for b in bases)


def check(root, known):
    """Returns (files checked, violations as 'file:line: rule', KNOWN entries seen)."""
    files = 0
    violations = []
    seen = set()
    for top in SCANNED:
        base = os.path.join(root, top)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for name in sorted(filenames):
                if not name.endswith(EXTS):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                prefix, allowed = layer_of(rel)
                if prefix is None:
                    continue
                files += 1
                with open(path, encoding="utf-8", errors="replace") as f:
                    lines = f.read().splitlines()
                for lineno, line in enumerate(lines, 1):
                    m = INCLUDE_RE.match(line)
                    if not m:
                        continue
                    inc = m.group(1)
                    first = inc.split("/", 1)[0]
                    if first in allowed or inc in allowed or inc in GENERATED:
                        continue
                    if prefix.startswith("src/") or prefix == "include/":
                        # A bare name beside the file is the layer's own header.
                        if "/" not in inc and own_header(root, rel, inc, prefix):
                            continue
                    elif first not in {"common", "core", "cpu", "cuda", "engine"} and own_header(root, rel, inc, prefix):
                        continue
                    if (rel, inc) in known:
                        seen.add((rel, inc))
                        continue
                    layer = prefix.rstrip("/")
                    ok = ", ".join(sorted(a if a.endswith(".h") else a + "/" for a in allowed))
                    extra = " and its own headers" if prefix in ("tools/", "python/src/") else ""
                    violations.append(f'{rel}:{lineno}: {layer} may include only {ok}{extra}, not "{inc}"')
    return files, violations, seen


def stale(known, seen):
    """A KNOWN include that was moved behind include/ leaves the list too: one line per entry not seen."""
    return [f'{rel}: listed in KNOWN (scripts/check_includes.py) but no longer includes "{inc}": remove the entry'
            for rel, inc in sorted(set(known) - set(seen))]


def main(argv):
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    root = os.path.abspath(argv[1] if len(argv) > 1 else here)
    # KNOWN is this tree's list; another tree (the test's scratch trees) gets no exceptions.
    real = os.path.samefile(root, here)
    files, violations, seen = check(root, KNOWN if real else set())
    if real:
        violations += stale(KNOWN, seen)
    for v in violations:
        print(v)
    print(f"{files} files checked, {len(violations)} violations")
    if seen:
        print(f"{len(seen)} known includes from tools/ and python/src into src/ still to move behind include/")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
