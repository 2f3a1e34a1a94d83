#!/usr/bin/env bash
# Issue 39 on a GPU machine, in one go, from the repository root: the card and versions, the GPU test module,
# then benchmarks/gpu.py. Everything it prints is also written under $OUT (default ./gpu-check):
#   info.txt     nvidia-smi -L, python, torch, CUDA, which of our dependencies import
#   pytest.log   python -m pytest -q tests/gpu            (skipped when tests/gpu is absent)
#   gpu.log      python benchmarks/gpu.py --json $OUT/gpu.json   (bounded: timeout 420 s)
#   gpu.json     the benchmark's figures (written after each job, so a cut run keeps the jobs it finished)
#   ps-logs/     each ps process's log
#
#   bash benchmarks/gpu_device_check.sh                      # OUT defaults to ./gpu-check
#   OUT=/some/dir GPU_ARGS="--jobs ctr --repeats 5" bash benchmarks/gpu_device_check.sh
#
# The machine's own `python` runs it (torch with CUDA installed there); tensorfleet comes from this tree
# (PYTHONPATH=src). Our other runtime dependencies that the benchmark and the ps import are grpcio, numba
# (+ llvmlite) and PyYAML (numpy comes with torch); the test module also needs pytest, psutil and safetensors.
# Where one is missing and a folder of wheels was carried ($TF_WHEELS, default ./wheels), they are installed
# from it (no network) into a folder of their own; numba still missing: the ps fall back to their numpy
# kernels (TENSORFLEET_PS_KERNELS=numpy; the click-through figures then do not stand for the default).
# Wall time: about 10 s, the tests (at most $TEST_TIMEOUT s, default 150), the benchmark (its --budget-s
# keeps it near 4-5 minutes; killed at 420 s): give the command a limit of 600 s.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python}
TEST_TIMEOUT=${TEST_TIMEOUT:-150}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/tensorfleet-numba-cache}  # the ps' kernels, compiled once

deps_check() {  # prints one line per module; exit status 1 when one the benchmark needs is missing
  "$PY" - <<'EOF'
import importlib, sys
needed = {"torch": "torch", "numpy": "numpy", "grpc": "grpcio", "numba": "numba", "llvmlite": "llvmlite",
          "yaml": "PyYAML"}
for_tests = {"pytest": "pytest", "psutil": "psutil", "safetensors": "safetensors"}
missing = []
for module, dist in {**needed, **for_tests}.items():
    try:
        m = importlib.import_module(module)
        print(f"  ok       {dist:<12} {getattr(m, '__version__', '')}")
    except Exception as exc:
        print(f"  MISSING  {dist:<12} (import {module}: {type(exc).__name__}: {exc})")
        missing.append(dist)
try:
    import tensorfleet
    from tensorfleet.worker.replica import Replica  # noqa: F401
    print(f"  ok       tensorfleet  from {tensorfleet.__file__}")
except Exception as exc:
    print(f"  BROKEN   tensorfleet: {type(exc).__name__}: {exc}")
    missing.append("tensorfleet")
print("MISSING=" + ",".join(missing))
sys.exit(1 if set(missing) - {"numba", "llvmlite", "pytest", "psutil", "safetensors"} else 0)
EOF
}

{
  echo "== $(date -u +%FT%TZ) on $(hostname), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not found"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', \
torch.version.cuda, '| cuda available', torch.cuda.is_available(), '|', torch.cuda.get_device_name(0) \
if torch.cuda.is_available() else 'no device')" 2>&1
  echo "== dependencies"
  deps_check | tee "$OUT/deps.txt"
} 2>&1 | tee "$OUT/info.txt"

MISSING=$(sed -n 's/^MISSING=//p' "$OUT/deps.txt")
WHEELS=${TF_WHEELS:-$PWD/wheels}
if [ -n "$MISSING" ] && [ -d "$WHEELS" ]; then
  echo "== installing $MISSING from $WHEELS (no index) into /tmp/tensorfleet-deps" | tee -a "$OUT/info.txt"
  # shellcheck disable=SC2046
  "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" --target /tmp/tensorfleet-deps \
      $(echo "$MISSING" | tr ',' ' ' | sed 's/\btensorfleet\b//') 2>&1 | tail -5 | tee -a "$OUT/info.txt"
  export PYTHONPATH="$PYTHONPATH:/tmp/tensorfleet-deps"
  deps_check | tee "$OUT/deps.txt" | tee -a "$OUT/info.txt"
  MISSING=$(sed -n 's/^MISSING=//p' "$OUT/deps.txt")
elif [ -n "$MISSING" ]; then
  echo "no wheels at $WHEELS: carry them, e.g. on a machine with the same python: pip download --only-binary" \
       ":all: -d wheels $(echo "$MISSING" | tr ',' ' ')" | tee -a "$OUT/info.txt"
fi
case ",$MISSING," in
  *,grpcio,*|*,PyYAML,*|*,torch,*|*,numpy,*|*,tensorfleet,*)
    echo "FATAL: the benchmark cannot run without: $MISSING (see $OUT/info.txt)" | tee -a "$OUT/info.txt"
    exit 3;;
  *,numba,*|*,llvmlite,*)
    echo "WARNING: no numba: the ps use their numpy kernels (TENSORFLEET_PS_KERNELS=numpy); the click-through" \
         "figures do not stand for the default install" | tee -a "$OUT/info.txt"
    export TENSORFLEET_PS_KERNELS=numpy;;
esac

if [ -d tests/gpu ]; then
  case ",$MISSING," in
    *,pytest,*|*,psutil,*|*,safetensors,*)
      echo "== tests/gpu SKIPPED: missing $MISSING" | tee "$OUT/pytest.log";;
    *)
      echo "== python -m pytest -q tests/gpu (at most $TEST_TIMEOUT s)"
      timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/pytest.log"
      echo "pytest exit status ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log";;
  esac
else
  echo "== tests/gpu absent: skipped" | tee "$OUT/pytest.log"
fi

echo "== python benchmarks/gpu.py --json $OUT/gpu.json ${GPU_ARGS:-} (killed at 420 s)"
# shellcheck disable=SC2086
timeout -k 10 420 "$PY" benchmarks/gpu.py --json "$OUT/gpu.json" --ps-logs "$OUT/ps-logs" ${GPU_ARGS:-} \
    > "$OUT/gpu.log" 2>&1
status=$?
# The tables and the targets, without the tracebacks above them (those stay in gpu.log).
grep -v '^  File \|^    \|^Traceback' "$OUT/gpu.log" | tail -c 9000
echo "benchmark exit status $status$([ $status -ge 124 ] && echo ' (timed out: gpu.json holds the jobs it finished)')" \
  | tee -a "$OUT/gpu.log"
exit $status
