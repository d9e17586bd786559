#!/usr/bin/env bash
# Installs everything the project needs on a fresh Debian machine. Idempotent: when everything is
# already there it only checks and returns in a few seconds.
set -euo pipefail
BUILD=${BUILD:-build}

# Debian packages: compiler, pkg-config, Open MPI, Check, Graphviz, OpenBLAS, cJSON, PyTorch (oracle);
# clang and LLVM's OpenMP runtime for the second-compiler test (tests/t_clang.sh).
PACKAGES="build-essential pkg-config libopenmpi-dev openmpi-bin check graphviz libopenblas-dev libopenblas-openmp-dev
          libcjson-dev python3-torch python3-numpy python3-venv python3-pip clang libomp-dev"
missing=""
for p in $PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "deps: installing$missing"
    if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
else
    echo "deps: Debian packages present"
fi

# Python environment inside the build folder. It sees Debian's python3-torch (system site packages)
# and adds the PyPI packages the tests use: perfetto (official trace schema) and a recent protobuf;
# transformers for the Hugging Face checks (tests/t_hf.sh), pinned to 4.44.2, a release that runs on
# Debian's torch 1.13 (LlamaForCausalLM forward, backward, save_pretrained, from_pretrained).
VENV="$BUILD/venv"
PY_PACKAGES="perfetto protobuf holistictraceanalysis numpy<2 transformers==4.44.2"
if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$BUILD"
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, hta, transformers, perfetto.protos.perfetto.trace.perfetto_trace_pb2" 2>/dev/null; then
    echo "deps: installing PyPI packages into $VENV: $PY_PACKAGES"
    "$VENV/bin/python" -m pip install -q --upgrade $PY_PACKAGES
else
    echo "deps: Python environment $VENV ready"
fi
