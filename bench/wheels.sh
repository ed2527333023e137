#!/usr/bin/env bash
# Wheels for the GPU machine: it has python3 (CPython 3.12) with torch and triton but no pydantic, and no package
# registry. This collects pydantic and what it imports (pydantic-core, annotated-types, typing-extensions,
# typing-inspection) as manylinux x86_64 wheels into .whl/ (ignored by git). A GPU run carries .whl/ with the work
# tree and installs from it offline; bench/gpu_session.sh does that first:
#     pip install --no-index --find-links .whl pydantic
# Usage: bash bench/wheels.sh            (PYTHON_VERSION=3.12 and PYDANTIC="pydantic>=2.10" by default)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --only-binary=:all: --implementation cp \
  --python-version "${PYTHON_VERSION:-3.12}" --platform manylinux2014_x86_64 \
  --dest .whl "${PYDANTIC:-pydantic>=2.10}"
ls -1 .whl
