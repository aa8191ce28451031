#!/usr/bin/env bash
# The rollout engine's GPU checks, prepared to run in one go on a lent GPU machine (no network there).
#
#   here:   make device-wheels            # .whl/: what the machine's image lacks, pinned to .venv's versions
#           make device-cache             # .device-cache/: the spec-decode bench's trained models
#   there:  bash bench/device_check.sh [tests|bench|all]     (from the repository root; default: all)
#
# The device tool runs it with: carry [".whl", ".device-cache"], command "bash bench/device_check.sh".
# tests: every test marked gpu (pytest -m gpu: the device-discipline cases on the real GPU, greedy parity
#        with transformers there, tether generate --device cuda, the benches' smoke tests with
#        --device cuda) -> $OUT/tests.txt
# bench: bench/engine_throughput.py --device cuda in fp32 and bf16, bench/spec_decode.py --device cuda
#        -> $OUT/engine_fp32.txt, $OUT/engine_bf16.txt, $OUT/spec_decode.txt
# Each part has its own time limit (tests 180 s, bench 330 s), so one that hangs still leaves the
# others' output; the engine bench prints transformers' continuous batching last. With the wheels'
# install and the interpreters' start-up a whole run can near the device tool's 600 s a command and
# most of a session's 15 device minutes: run `tests` and `bench` as two calls where time allows a
# rerun. The exit status is the number of parts that failed.
set -u
part=${1:-all}
case "$part" in tests|bench|all) ;; *) echo "usage: bash bench/device_check.sh [tests|bench|all]" >&2; exit 2 ;; esac
OUT=${OUT:-device-out}
mkdir -p "$OUT"
# fp32 stays fp32 (the parity tests hold log-probs to 1e-4): no TF32 forced on by the environment
export PYTHONUNBUFFERED=1 NVIDIA_TF32_OVERRIDE=0 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "error: no wheels in .whl/: run make device-wheels here and name .whl in the device call's carry" >&2
    exit 1
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: installing the carried wheels in .whl/ failed" >&2; exit 1; }
export PYTHONPATH="$PYTHONPATH:/tmp/site"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available(), '| transformers', transformers.__version__,
'| fp32 matmul precision', torch.get_float32_matmul_precision())"
    ls .device-cache/spec 2>&1
    "$PY" - <<'PYEOF'
# Which SDPA kernel the engine's calls get here (it changes with torch and cuDNN versions).
import torch
from torch.nn.attention import SDPBackend
names = {int(member): name for name, member in SDPBackend.__members__.items()}
for dtype in (torch.float32, torch.bfloat16):
    for what, num_queries in (("decode", 3), ("prefill chunk", 64)):
        q = torch.randn(32, 2, num_queries, 64, device="cuda", dtype=dtype)  # [S, Hkv, G or Tq, D]
        k, v = (torch.randn(32, 2, 200, 64, device="cuda", dtype=dtype) for _ in range(2))
        mask = torch.zeros(32, 1, num_queries, 200, device="cuda", dtype=dtype)  # additive, as the engine's
        choice = torch._fused_sdp_choice(q, k, v, attn_mask=mask)
        print(f"SDPA for a masked {what} in {dtype}: {names.get(int(choice), choice)}")
PYEOF
} 2>&1 | tee "$OUT/env.txt"
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'error: torch sees no CUDA device')" || exit 1

failed=0
run() {  # run NAME LIMIT_S COMMAND...: output to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local status=$?
    tail -n 25 "$OUT/$name.txt"
    echo "== $name: exit status $status"
    [ "$status" -eq 0 ] || failed=$((failed + 1))
}

if [ "$part" != bench ]; then
    run tests 180 "$PY" -m pytest -q -p no:cacheprovider -n 4 -m gpu tests
fi
if [ "$part" != tests ]; then
    run engine_fp32 120 "$PY" bench/engine_throughput.py --device cuda --threads 0
    run engine_bf16 120 "$PY" bench/engine_throughput.py --device cuda --threads 0 --dtype bfloat16
    run spec_decode 90 "$PY" bench/spec_decode.py --device cuda --cache-dir .device-cache/spec --require-cache
fi
exit "$failed"
