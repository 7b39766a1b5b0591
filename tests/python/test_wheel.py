"""The built wheel in a fresh virtual environment, with no compiler (docs/wheel.md).

python/ci_test.sh builds the CPU wheel (scripts/build_wheel.sh) and names it in FLASHCPP_WHEEL;
this test makes a venv without the system's packages (so no torch and no flashcpp but the wheel's),
installs the wheel there with that venv's pip, binary wheels only (numpy and ml_dtypes come as its
declared dependencies), and, from a directory outside the checkout, imports flashcpp and calls
flash_attn_func on numpy arrays (CPU backend) in fp32 and bf16 against a numpy softmax attention.

No compiler can run meanwhile: every compiler name (cc, gcc, c++, g++, clang, nvcc, ...) on PATH
is a trap that records its call and fails, and CC/CXX/CUDACXX name the trap; the test fails if
anything called it. Skips when FLASHCPP_WHEEL is not set. A CUDA wheel passes here too: on a
machine without a driver the numpy path runs all the same.
"""
import json
import os
import stat
import subprocess
import sys

import pytest

WHEEL = os.environ.get("FLASHCPP_WHEEL")
COMPILERS = ("cc", "c++", "gcc", "g++", "clang", "clang++", "nvcc", "ld", "x86_64-linux-gnu-gcc",
             "x86_64-linux-gnu-g++", "aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++")

CHECK = r"""
import json, shutil, sys
import ml_dtypes
import numpy as np
import flashcpp

trapped = {c: shutil.which(c) for c in sys.argv[2].split(",")}
assert all(p and p.startswith(sys.argv[1]) for p in trapped.values()), trapped

rng = np.random.default_rng(0)
b, n, h, d = 2, 37, 4, 64
q, k, v = (rng.standard_normal((b, n, h, d)).astype(np.float32) for _ in range(3))

def reference(q, k, v):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)

ref = reference(q, k, v)
o = flashcpp.flash_attn_func(q, k, v, causal=True)
assert o.shape == q.shape and o.dtype == np.float32, (o.shape, o.dtype)
err32 = float(np.abs(o - ref).max())
assert err32 < 1e-4, err32
bf = ml_dtypes.bfloat16
ob = flashcpp.flash_attn_func(q.astype(bf), k.astype(bf), v.astype(bf), causal=True)
assert ob.dtype == bf, ob.dtype
errbf = float(np.abs(ob.astype(np.float64) - ref).max())
assert errbf < 5e-2, errbf
print(json.dumps({"file": flashcpp.__file__, "version": flashcpp.__version__,
                  "with_cuda": flashcpp.WITH_CUDA, "torch_loaded": "torch" in sys.modules,
                  "numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__,
                  "err_fp32": err32, "err_bf16": errbf}))
"""


def run(cmd, **kw):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stdout[-4000:]}"
    return r.stdout


def compiler_trap(d):
    """A folder of compiler names that each append their call to d/calls.log and exit 1."""
    d.mkdir()
    log = d / "calls.log"
    for name in COMPILERS:
        p = d / name
        p.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexit 1\n')
        p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return log


@pytest.mark.skipif(not WHEEL, reason="FLASHCPP_WHEEL names no wheel (python/ci_test.sh sets it)")
def test_wheel_installs_and_runs_in_a_fresh_venv_without_a_compiler(tmp_path):
    assert os.path.isfile(WHEEL), f"FLASHCPP_WHEEL={WHEEL} is not a file"
    assert "manylinux" in os.path.basename(WHEEL), f"{WHEEL} is not a repaired (manylinux) wheel"
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    vpy = venv / "bin" / "python"
    trap = tmp_path / "no-compiler"
    log = compiler_trap(trap)
    env = {k: val for k, val in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{trap}{os.pathsep}{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               CC=str(trap / "cc"), CXX=str(trap / "c++"), CUDACXX=str(trap / "nvcc"),
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_ROOT_USER_ACTION="ignore")
    run([str(vpy), "-m", "pip", "install", "--quiet", "--only-binary=:all:", WHEEL], env=env, timeout=600)
    out = run([str(vpy), "-c", CHECK, str(trap), ",".join(COMPILERS)], env=env, cwd=str(tmp_path), timeout=300)
    got = json.loads(out.strip().splitlines()[-1])
    print("fresh venv:", got)
    assert got["file"].startswith(str(venv)), got["file"]  # the installed wheel, not the checkout
    assert not got["torch_loaded"]
    assert not log.exists(), f"a compiler was called:\n{log.read_text()}"
