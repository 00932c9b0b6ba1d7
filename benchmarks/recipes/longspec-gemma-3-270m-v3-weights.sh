#!/bin/sh
# Write the LongSpec draft v3 for Gemma 3 270M (shipped from commit c35e978 until v7
# replaced it) to RUNS/longspec-gemma-3-270m-v3.{safetensors,json} once, from git, and
# print the .safetensors path: the v5-v7 recipes continue it. Run from the repository root.
RUNS="${1:-runs}"
V3="$RUNS"/longspec-gemma-3-270m-v3
if [ ! -f "$V3".safetensors ]; then
  mkdir -p "$RUNS" &&
    git show c35e978:src/longspec/weights/longspec-gemma-3-270m.json > "$V3".json &&
    git show c35e978:src/longspec/weights/longspec-gemma-3-270m.safetensors > "$V3".safetensors.tmp &&
    mv "$V3".safetensors.tmp "$V3".safetensors || exit 1
fi
echo "$V3".safetensors
