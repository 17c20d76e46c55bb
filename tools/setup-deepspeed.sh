#!/usr/bin/env bash
# Purpose: DeepSpeed (CPU ops only) and ninja in the project's torch venv, from PyPI, for the
# peer benchmark bench/bench_peers.py. Not part of the tests: benchmarks only.
#
# DeepSpeed ships as a source distribution whose setup script imports torch, so it is built
# without build isolation (an isolated build would fetch a second torch with its CUDA stack)
# and without dependencies (the resolver would walk the installed torch's CUDA requirements);
# its pure-Python requirements are installed by name first. No op is prebuilt
# (DS_BUILD_OPS=0): with DS_ACCELERATOR=cpu, DeepSpeed compiles cpu_adam, cpu_adagrad and
# cpu_lion with ninja and the host compiler at first use (cached under
# ~/.cache/torch_extensions), no GPU needed. The last step builds and loads them once.
#
# Idempotent: an installed DeepSpeed of the wanted version is left as it is; pip skips
# requirements already satisfied; the op cache makes the check step fast after the first run.
#
# Environment (all optional):
#   STEPCORE_TORCH_VENV      venv directory (default /opt/torchenv, as setup_torch.sh)
#   STEPCORE_DEEPSPEED_VERSION  DeepSpeed version (default 0.19.8, the one benchmarked)
#   MAX_JOBS                 parallel compile jobs of the op build (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${STEPCORE_TORCH_VENV:-/opt/torchenv}"
DS_VERSION="${STEPCORE_DEEPSPEED_VERSION:-0.19.8}"

# 1. The torch venv (and its `py` wrapper) itself.
tools/golden/setup_torch.sh >/dev/null
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install -q)

# 2. DeepSpeed's requirements other than torch, ninja among them; wheel and setuptools for
#    the non-isolated build of its source distribution.
"${PIP[@]}" wheel setuptools ninja einops hjson msgpack numpy "packaging>=20.0" psutil \
  py-cpuinfo "pydantic>=2.0.0" tqdm

# 3. DeepSpeed, unless the wanted version is there.
have="$("$VPY" -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null \
  || true)"
if [ "$have" != "$DS_VERSION" ]; then
  DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "${PIP[@]}" --no-deps --no-build-isolation \
    "deepspeed==$DS_VERSION"
fi

# 4. Check: the three CPU ops build (first time: about a minute each) and load, no GPU.
#    ninja must be on PATH for torch's extension builder: the venv's bin holds it.
MAX_JOBS="${MAX_JOBS:-2}" PATH="$VENV/bin:$PATH" DS_ACCELERATOR=cpu "$VENV/py" - <<'EOF'
import deepspeed, torch
from deepspeed.ops.op_builder import CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder
for b in (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder):
    b().load(verbose=False)
print("deepspeed", deepspeed.__version__, "torch", torch.__version__, "accelerator",
      deepspeed.get_accelerator().device_name(), "CPU ops: cpu_adam cpu_adagrad cpu_lion")
EOF
echo "$VENV"
