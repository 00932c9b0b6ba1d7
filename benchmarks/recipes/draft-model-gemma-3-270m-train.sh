#!/bin/sh
# Train the small transformer drafter (method draft-model) for Gemma 3 270M: a 4-layer
# Llama, d_model 256, over the 32k most frequent corpus tokens, self-distilled from the
# target's greedy tokens. Epochs visit 1200 rows (about 0.6M tokens) whose target labels
# are computed once into the label cache; later epochs cost only the drafter's steps.
# Rerun the same command to resume while RUNS (default: runs/ in the repository) holds
# the run. The shared data sets are expected at ../shared next to the repository.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
exec longspec train draft-model \
  --stdlib --corpus ../shared/data/books \
  --exclude test --exclude tests --exclude idlelib --exclude tkinter --exclude turtledemo --exclude lib2to3 --exclude ensurepip \
  --shards "$RUNS"/external-drafter-shards \
  --out "$RUNS"/draft-model-gemma270m --label-cache "$RUNS"/external-drafter-labels \
  --max-rows 1200 --steps 520 --seq-len 512 --batch-size 8 --lr 1e-3 --warmup 50 --save-every 10 \
  --labels target --threads 1 --max-minutes 115 "$@"
