#!/usr/bin/env bash
# Build the suffix-tree peer for python -m benchmarks.replay_peer: ArcticInference's SuffixDecoding
# (the drafter behind vLLM's `suffix` speculative method), C++ core only.
#
# Downloads the arctic-inference 0.3.0 sdist and the nanobind 2.9.2 wheel from PyPI with pip,
# extracts only csrc/suffix_decoding of the sdist, and compiles its nanobind extension `_C` with
# cmake + the host C++ compiler (C++20) into benchmarks/.peer_build/ (git-ignored). Nothing is
# installed into any environment: nanobind is unpacked into the build folder and only put on
# PYTHONPATH for the cmake step.
#
#   bash benchmarks/build_suffix_peer.sh            # PYTHON=/path/to/python to choose the interpreter
#   python -m benchmarks.replay_peer CORPUS.jsonl --tokenizer PATH
#
# Needs: network access to PyPI (pip download), cmake >= 3.18, a C++20 compiler, the Python headers
# of the interpreter (python3.X-dev). Rerunning rebuilds from scratch.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$HERE/.peer_build"
PYTHON="${PYTHON:-$(command -v python3)}"
ARCTIC_VERSION=0.3.0
NANOBIND_VERSION=2.9.2

for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "build_suffix_peer.sh: '$tool' not found" >&2; exit 1; }
done
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' \
  || { echo "build_suffix_peer.sh: $PYTHON must be Python >= 3.10" >&2; exit 1; }

rm -rf "$OUT"
mkdir -p "$OUT/dl" "$OUT/src" "$OUT/nanobind"

# The sdist only (no dependencies, no build isolation: metadata preparation must not pull torch).
"$PYTHON" -m pip download "arctic-inference==$ARCTIC_VERSION" --no-deps --no-binary :all: \
  --no-build-isolation -d "$OUT/dl" -q
tar -xzf "$OUT/dl/arctic_inference-$ARCTIC_VERSION.tar.gz" -C "$OUT/src" --strip-components=1 \
  "arctic_inference-$ARCTIC_VERSION/csrc/suffix_decoding" "arctic_inference-$ARCTIC_VERSION/LICENSE"

# nanobind: the wheel, unpacked (it is pure Python + the C++ sources cmake compiles).
"$PYTHON" -m pip download "nanobind==$NANOBIND_VERSION" --no-deps --only-binary :all: -d "$OUT/dl" -q
"$PYTHON" -m zipfile -e "$OUT"/dl/nanobind-"$NANOBIND_VERSION"-*.whl "$OUT/nanobind"

export PYTHONPATH="$OUT/nanobind${PYTHONPATH:+:$PYTHONPATH}"
cmake -S "$OUT/src/csrc/suffix_decoding" -B "$OUT/cmake" -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$PYTHON" -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$OUT" >"$OUT/cmake.log"
cmake --build "$OUT/cmake" -j "$(nproc 2>/dev/null || echo 2)" >>"$OUT/cmake.log"

ext=$(ls "$OUT"/_C*.so 2>/dev/null | head -1)
[ -n "$ext" ] || { echo "build_suffix_peer.sh: no _C*.so in $OUT (see $OUT/cmake.log)" >&2; exit 1; }
PYTHONPATH="$OUT" "$PYTHON" -c 'import _C; t = _C.SuffixTree(8); t.extend(0, [1, 2, 3, 1, 2]); d = t.speculate([3, 1, 2], 4, 1.0, 0.0, 0.1, False); assert list(d.token_ids) == [3, 1], list(d.token_ids)'
echo "built $ext"
