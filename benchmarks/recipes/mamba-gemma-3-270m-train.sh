#!/bin/sh
# Train the Mamba drafter (method mamba) for Gemma 3 270M: 8 Mamba layers, d_model 256,
# state 16 (11.9M parameters, as many as the small transformer drafter's 11.5M), over the
# 32k most frequent corpus tokens, self-distilled from the target's greedy tokens, its
# selective scan in the native CPU kernel. The same 1200 rows as the transformer drafter
# (same seed), whose target labels it reads from the shared label cache (computed there
# if missing). Rerun the same command to resume while RUNS (default: runs/ in the
# repository) holds the run. The shared data sets are expected at ../shared next to the
# repository.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
exec longspec train mamba \
  --stdlib --corpus ../shared/data/books \
  --exclude test --exclude tests --exclude idlelib --exclude tkinter --exclude turtledemo --exclude lib2to3 --exclude ensurepip \
  --shards "$RUNS"/external-drafter-shards \
  --out "$RUNS"/mamba-gemma270m --label-cache "$RUNS"/external-drafter-labels \
  --max-rows 1200 --steps 480 --seq-len 512 --batch-size 8 --lr 1e-3 --warmup 50 --save-every 10 \
  --labels target --threads 1 --max-minutes 85 "$@"
