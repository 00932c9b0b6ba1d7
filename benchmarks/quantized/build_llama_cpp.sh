#!/usr/bin/env bash
# llama.cpp's tools for benchmarks/suite/quantized_peers.py and peers.py, built outside the
# repository from the vendored llama.cpp of the PyPI source distribution of llama-cpp-python
# (llama.cpp is never a dependency of the library or the tests).
#
#   benchmarks/quantized/build_llama_cpp.sh [DEST]         # DEST defaults to /tmp/llama.cpp
#
# The version is pinned (LLAMA_CPP_PYTHON=0.3.36, whose llama.cpp the results were taken with);
# set LLAMA_CPP_PYTHON to another release to compare with a newer llama.cpp.
#
# The tools land in DEST/build/bin. On an AVX-512 VM without AMX (the 2-core Zen 4 EPYC)
# the instruction sets are named, not detected: native builds there die with SIGILL (the
# compiler enables AMX tiles the VM does not run). On another CPU set NATIVE=1 to build
# with -DGGML_NATIVE=ON instead (an AVX2 machine, for one).
set -euo pipefail
DEST=${1:-/tmp/llama.cpp}
VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
WORK=$(mktemp -d)
if [ ! -f "$DEST/CMakeLists.txt" ]; then
  (cd "$WORK" && pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" && tar xzf llama_cpp_python-*.tar.gz)
  cp -r "$WORK"/llama_cpp_python-*/vendor/llama.cpp "$DEST"
  echo "$VERSION" > "$DEST/LLAMA_CPP_PYTHON_VERSION"  # quantized_peers.py records it: the copy has no git commit
fi
if [ "${NATIVE:-0}" = 1 ]; then
  ISA=(-DGGML_NATIVE=ON)
else
  ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
       -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
       -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
cd "$DEST"
nice -n 19 cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
nice -n 19 cmake --build build -j2 --target llama-bench llama-completion llama-lookup llama-lookahead \
  llama-quantize llama-speculative-simple
ls build/bin
