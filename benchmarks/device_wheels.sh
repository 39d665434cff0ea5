#!/usr/bin/env bash
# The wheels the device image lacks for dsq and its tests (Python 3.12, x86-64), into .whl/ (carry it):
# gguf, the serve stack (starlette, uvicorn), the openai client and their needs, prompt_toolkit,
# diskcache (llama_cpp imports it). Versions: what install.sh put in this venv.
#
#   bash benchmarks/device_wheels.sh        # from the repo root, with dsq's venv active
set -euo pipefail
mkdir -p .whl
for p in gguf starlette uvicorn openai pydantic pydantic_core annotated-types typing-inspection jiter prompt_toolkit \
         wcwidth diskcache httpx2 httpcore2 truststore typing-extensions anyio h11; do
  v=$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$p==$v"
done
ls .whl
