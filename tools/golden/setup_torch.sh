#!/usr/bin/env bash
# Purpose: (re)create the CPU-only PyTorch virtual environment that tools/golden/make_golden.py
# runs in, from PyPI only, and the `py` wrapper that sets the library path torch needs.
#
# Idempotent: an existing venv, an installed torch of the wanted version and an up-to-date
# wrapper are left as they are; pip skips requirements that are already satisfied.
#
# Environment (all optional):
#   STEPCORE_TORCH_VENV     venv directory                 (default /opt/torchenv)
#   STEPCORE_TORCH_VERSION  torch version to install       (default 2.15.0, the golden files' version)
#   STEPCORE_TORCH_DL       where the torch wheel is saved (default /tmp/torchdl)
#   STEPCORE_TORCHAO_VERSION  torchao version               (default 0.18.0, the golden files')
#   STEPCORE_BITSANDBYTES_VERSION  bitsandbytes version     (default 0.50.0, the one compared)
#   STEPCORE_TRANSFORMERS_VERSION  transformers version     (default 4.57.1: the Llama example)
#   PYTHON                  interpreter that creates the venv (default python3; 3.11 was used)
#
# Afterwards run Python as "$STEPCORE_TORCH_VENV/py" (e.g. /opt/torchenv/py); the plain
# venv python cannot import torch because the libraries below are not on the loader path.
set -euo pipefail

VENV="${STEPCORE_TORCH_VENV:-/opt/torchenv}"
TORCH_VERSION="${STEPCORE_TORCH_VERSION:-2.15.0}"
DL="${STEPCORE_TORCH_DL:-/tmp/torchdl}"
PYTHON="${PYTHON:-python3}"

# 1. The venv.
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip)

# 2. torch itself, without its dependency list (which would pull the whole CUDA stack).
have_torch="$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
if [ "$have_torch" != "$TORCH_VERSION" ]; then
  mkdir -p "$DL"
  "${PIP[@]}" download --no-deps --only-binary=:all: -d "$DL" "torch==$TORCH_VERSION"
  wheel="$(ls -1 "$DL"/torch-"$TORCH_VERSION"-*.whl | head -n 1)"
  "${PIP[@]}" install --no-deps "$wheel"
fi

# 3. The pure-Python packages torch imports, and numpy for the golden script.
"${PIP[@]}" install numpy filelock typing_extensions sympy networkx jinja2 fsspec

# 3b. torchao (pure Python for the CPU; without its dependency list, which would replace
# torch): the golden files of the torchao formula and the 8-bit maps' test.
TORCHAO_VERSION="${STEPCORE_TORCHAO_VERSION:-0.18.0}"
have_torchao="$("$VPY" -c 'import importlib.metadata as m; print(m.version("torchao"))' 2>/dev/null || true)"
if [ "$have_torchao" != "$TORCHAO_VERSION" ]; then
  "${PIP[@]}" install --no-deps "torchao==$TORCHAO_VERSION"
fi

# 3c. bitsandbytes (its CPU 8-bit optimizers; without its dependency list, as torchao): the
# 8-bit drop-ins' state_dict import test and the 8-bit peer benchmark.
BNB_VERSION="${STEPCORE_BITSANDBYTES_VERSION:-0.50.0}"
have_bnb="$("$VPY" -c 'import importlib.metadata as m; print(m.version("bitsandbytes"))' 2>/dev/null || true)"
if [ "$have_bnb" != "$BNB_VERSION" ]; then
  "${PIP[@]}" install --no-deps "bitsandbytes==$BNB_VERSION"
fi

# 3d. transformers (with its own pure-Python and tokenizer dependencies; it does not
# depend on torch): the Hugging Face Llama of examples/train_tiny_lm_8bit.py --model llama.
TRANSFORMERS_VERSION="${STEPCORE_TRANSFORMERS_VERSION:-4.57.1}"
have_transformers="$("$VPY" -c 'import importlib.metadata as m; print(m.version("transformers"))' 2>/dev/null || true)"
if [ "$have_transformers" != "$TRANSFORMERS_VERSION" ]; then
  "${PIP[@]}" install "transformers==$TRANSFORMERS_VERSION"
fi

# 4. Shared libraries torch's wheel links against even when only the CPU is used.
"${PIP[@]}" install --no-deps nvidia-cusparselt-cu13 nvidia-nvshmem-cu13 nvidia-cufile nvidia-nccl-cu13

# 5. The wrapper: those libraries on LD_LIBRARY_PATH, then the venv's python.
pyver="$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
sp="$VENV/lib/python$pyver/site-packages"
wrapper="$(mktemp)"
cat >"$wrapper" <<EOF
#!/bin/sh
export LD_LIBRARY_PATH=$sp/nvidia/cu13/lib:$sp/nvidia/nvshmem/lib:$sp/nvidia/nccl/lib:/usr/local/cuda/lib64
exec $VPY "\$@"
EOF
if ! cmp -s "$wrapper" "$VENV/py"; then
  install -m 0755 "$wrapper" "$VENV/py"
fi
rm -f "$wrapper"

# 6. Check: torch imports and reports its CPU capability (the golden files need AVX2).
"$VENV/py" -c 'import torch; print("torch", torch.__version__, "CPU capability", torch.backends.cpu.get_cpu_capability())'
