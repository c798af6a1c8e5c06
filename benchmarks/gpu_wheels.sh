#!/usr/bin/env bash
# Downloads into .whl/ the wheels the GPU suite (benchmarks/gpu_suite.py) needs on a GPU
# machine that has PyTorch, torchvision, timm and transformers but may lack vramctl's other
# dependencies. The wheels travel with the checkout; on the GPU machine, from the repo root:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:src python benchmarks/gpu_suite.py --quick --out OUT/gpu
#
# Never torch, torchvision, triton or the nvidia-* CUDA packages: the machine has its own,
# and they weigh gigabytes. Nor what transformers and timm bring (numpy, pyyaml,
# safetensors, huggingface_hub, tqdm, regex, tokenizers). The versions are those of the
# development environment; the compiled wheels are for CPython 3.12 on x86-64 Linux
# (PYTHON_VERSION=3.13 benchmarks/gpu_wheels.sh for another Python). About 20 MiB in all.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
rm -rf .whl
mkdir -p .whl

get() {
    python3 -m pip download -q --no-deps --only-binary=:all: \
        --python-version "$PYTHON_VERSION" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$@"
}

# vramctl's core: NVML and host memory.
get nvidia-ml-py==13.615.71 psutil==7.2.2
# The command line (vramctl calibrate).
get typer==0.29.2 click==8.5.1 shellingham==1.5.4 annotated-doc==0.0.7 \
    rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
# The cuda tests: pytest and its timeout, and what collecting every test module imports
# (the server extra: FastAPI, uvicorn, prometheus-client, pydantic).
get pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pytest-timeout==2.4.0
get prometheus-client==0.26.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
    h11==0.16.0 anyio==4.16.0 idna==3.20 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
    opentelemetry-api==1.45.2
# The peers the benchmarks compare with: Accelerate, Lightning, Lhotse.
get accelerate==1.15.0 lightning==2.6.6 lightning-utilities==0.15.3 torchmetrics==1.9.0
get lhotse==1.33.0 cytoolz==1.2.0 toolz==1.2.0 intervaltree==3.2.1 sortedcontainers==2.4.0 \
    tabulate==0.10.0 audioread==3.1.0 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 \
    urllib3==2.8.0
# Audio manifests (orjson) and the tensor cache's compression (zstd).
get orjson==3.13.0 zstandard==0.25.0

ls .whl | wc -l | xargs printf '%s wheels in .whl/, '
du -sh .whl | cut -f1
