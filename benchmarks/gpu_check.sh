#!/usr/bin/env bash
# Every CUDA path of hpctrain, checked unattended in one short run on a lent GPU machine, every
# figure written to one file: `pytest -m gpu` (tests/test_gpu.py, the CUDA profiler test; with the MoE
# grouped GEMM in bf16 and the all-to-all over NCCL, torch's context_parallel ring over CUDA's SDPA and the
# document-masked attention, LoRA in bf16, gradients reduced in bf16 over NCCL, FP8 through torchao on SM90+,
# FP16 with loss scaling, Liger-Kernel's fused loss), then benchmarks/gpu_1b.py (the bf16 matmul peak, the 1B
# model with FSDP2 + compile: tokens/s and MFU against that peak and against the planner's prediction for
# the same shape; then the whole logits, fp16 and fp8 beside it). About 11 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh --fetch      # here, with the package registry: the wheels to carry (.whl/)
#   bash benchmarks/gpu_check.sh              # there (from the repository root; .whl/ carried along)
#   bash benchmarks/gpu_check.sh --rehearse   # here, without a GPU: every step that can run on a CPU
#
# The GPU machine reaches no network. Its image has CUDA's torch, pytest and numpy but not Hydra,
# OmegaConf or their parser runtime: those travel as pure-Python wheels in .whl/ and are installed
# with --no-index into a private directory. hpctrain itself runs from the checkout (PYTHONPATH).
# Results: $OUT (default outputs/gpu_check): gpu_check.log (everything printed), figures.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu_check}
WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3)  # as pyproject installs here
# fp8 (torchao: an abi3 wheel for x86_64 Linux) and the fused loss (Liger-Kernel: pure Python over the image's
# Triton); the tests that need them skip, naming the package, where they do not import
EXTRA=(torchao==0.18.0 liger-kernel==0.8.5)
PY=${PYTHON:-python3}

if [ "${1:-}" = "--fetch" ]; then
  mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  # Pure-Python packages: one wheel fits every Python 3 (antlr4's 4.9.3 exists only as a source archive,
  # built into a wheel here).
  "$PY" -m pip wheel -q --no-deps -w .whl "${WHEELS[@]}" || exit 1
  "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.10 \
    -d .whl "${EXTRA[@]}" || echo "(no fp8 / fused-loss wheels: those checks will skip)"
  ls -l .whl
  exit 0
fi

rehearse=""
[ "${1:-}" = "--rehearse" ] && rehearse=1
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1

step() { echo; echo "=== $* ($(date +%T))"; }

step "packages"
if [ -z "$rehearse" ]; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run 'bash benchmarks/gpu_check.sh --fetch' first and carry .whl"; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/hpctrain-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/hpctrain-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" - <<'EOF' || exit 1
import torch, hydra, omegaconf, hpctrain.core.compose
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "(no GPU)")
print("hydra", hydra.__version__, "omegaconf", omegaconf.__version__)
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

step "pytest -m gpu"
# -o addopts=: one process, not pyproject's two xdist workers (the image may lack pytest-xdist; one GPU)
timeout 360 "$PY" -m pytest -q -o addopts= -m gpu -rs -p no:cacheprovider tests/test_gpu.py tests/test_profile.py 2>&1 | tee "$OUT/pytest.log"
pytest_rc=${PIPESTATUS[0]}

step "benchmarks/gpu_1b.py"
if [ -z "$rehearse" ]; then
  timeout 400 "$PY" benchmarks/gpu_1b.py --steps 20 --variant-steps 10 --out "$OUT/gpu_1b"
  bench_rc=$?
else
  "$PY" benchmarks/gpu_1b.py --steps 20 --variant-steps 10 --out "$OUT/gpu_1b"
  bench_rc=$?  # 2 without a GPU: refused before anything starts
fi

step "figures"
PYTEST_RC=$pytest_rc BENCH_RC=$bench_rc OUTDIR=$OUT "$PY" - <<'EOF'
import json, os, re
out = os.environ["OUTDIR"]
fig = {"pytest_rc": int(os.environ["PYTEST_RC"]), "gpu_1b_rc": int(os.environ["BENCH_RC"])}
log = open(os.path.join(out, "pytest.log")).read() if os.path.exists(os.path.join(out, "pytest.log")) else ""
m = re.findall(r"(\d+) (passed|failed|skipped|error)", log)
fig["pytest"] = {k: int(v) for v, k in m}
res = os.path.join(out, "gpu_1b", "results.json")
if os.path.exists(res):
    fig["gpu_1b"] = json.load(open(res))
json.dump(fig, open(os.path.join(out, "figures.json"), "w"), indent=1)
print(json.dumps(fig, indent=1))
EOF
[ "$pytest_rc" = 0 ] && [ "$bench_rc" = 0 ]
