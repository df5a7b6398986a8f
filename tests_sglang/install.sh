#!/usr/bin/env bash
# A venv of its own for the SGLang tests (SGLang pins a CUDA torch and ~2.2 GB of NVIDIA wheels;
# its model classes need neither): the local CPU torch, SGLang 0.5.23 without its dependencies,
# then the light ones it imports, constrained to that torch. Usage: bash tests_sglang/install.sh V
set -euo pipefail
V=${1:?usage: bash tests_sglang/install.sh VENV_DIR}
cd "$(dirname "$0")/.."
python3 -m venv "$V"
"$V/bin/pip" install -q torch==2.13.0
"$V/bin/pip" install -q --no-deps sglang==0.5.23 triton==3.8.0
echo "torch==2.13.0" > "$V/constraints.txt"
"$V/bin/pip" install -q -c "$V/constraints.txt" "transformers>=5,<6" numpy pydantic safetensors \
  einops psutil pyzmq requests tqdm orjson msgspec aiohttp fastapi uvicorn uvloop pybase64 \
  python-multipart partial_json_parser interegular packaging setproctitle prometheus-client \
  sentencepiece tokenizers tiktoken xxhash zstandard distro easydict gguf watchfiles openai \
  llguidance scipy pillow IPython dill compressed-tensors numba blobfile mistral_common \
  openai-harmony soundfile ninja nvidia-ml-py anthropic py-spy apache-tvm-ffi
# wb itself (no dependencies: numpy, ml_dtypes, rich are there or added here), UCX, the test tools
"$V/bin/pip" install -q --no-deps -e .
"$V/bin/pip" install -q -c "$V/constraints.txt" ml_dtypes rich "crc32c>=2.4" ucxx-cu13 hypothesis pytest \
  pytest-timeout
echo "SGLang venv ready: $V"
