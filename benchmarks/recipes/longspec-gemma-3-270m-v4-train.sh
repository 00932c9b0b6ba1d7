#!/bin/sh
# Continue the shipped LongSpec draft v3 for Gemma 3 270M on a fresh seeded sample of rows
# (seed 1, 2400 rows of 512 tokens that start with BOS; v3 saw 1400 rows of seed 0), so
# most of its tokens are new to the draft. Same recipe as v3 (the checkpoint keeps its
# recency bias, hidden input, cross window), a fresh schedule at half v3's peak rate.
# Rerun the same command to resume while RUNS (default: runs/ in the repository) holds
# the run; on a machine without it, the command starts again from the shipped weights.
# The shared data sets are expected at ../shared next to the repository.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
exec longspec train longspec \
  --stdlib --corpus ../shared/data/books \
  --exclude test --exclude tests --exclude idlelib --exclude tkinter --exclude turtledemo --exclude lib2to3 --exclude ensurepip \
  --shards "$RUNS"/longspec-gemma270m-v4/shards \
  --out "$RUNS"/longspec-gemma270m-v4 --feature-cache "$RUNS"/longspec-gemma270m-v4/features \
  --init-from src/longspec/weights/longspec-gemma-3-270m.safetensors \
  --max-rows 2400 --steps 1300 --seq-len 512 --batch-size 2 --lr 5e-4 --warmup 20 --save-every 25 \
  --gamma 5 --noisy --anchor-offset --labels target --bos --seed 1 --threads 1 --max-minutes 120 "$@"
