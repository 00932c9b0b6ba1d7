#!/bin/sh
# Train the LongSpec draft for Gemma 3 270M from scratch with the fixed pipeline: rows
# that start with BOS, the recency bias on the cross-attention, the EAGLE-style hidden
# input, a warm start from target layer 17, anchor offsets, noisy shifts, self-distilled
# labels. Epochs visit 1400 rows (about 0.7M tokens) whose target features are computed
# once into the feature cache; later epochs cost only the draft's steps. Rerun the same
# command to resume while RUNS (default: runs/ in the repository) holds the run. The
# shared data sets are expected at ../shared next to the repository.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
exec longspec train longspec \
  --stdlib --corpus ../shared/data/books \
  --exclude test --exclude tests --exclude idlelib --exclude tkinter --exclude turtledemo --exclude lib2to3 --exclude ensurepip \
  --shards "$RUNS"/longspec-gemma270m-v3/shards \
  --out "$RUNS"/longspec-gemma270m-v3 --feature-cache "$RUNS"/longspec-gemma270m-v3/features \
  --max-rows 1400 --steps 2500 --seq-len 512 --batch-size 2 --lr 1e-3 --warmup 50 --save-every 25 \
  --window 512 --gamma 5 --draft-vocab 32768 --noisy --anchor-offset --recency-bias --hidden-input --warm-start \
  --labels target --bos --threads 1 --max-minutes 125 "$@"
