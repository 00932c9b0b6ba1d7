#!/bin/sh
# Reproduce / resume the shipped LongSpec draft for Gemma 3 270M (rerun the same command to resume).
# Run from anywhere; RUNS (default: runs/ in the repository) holds shards, cached target
# features and checkpoints. The shared data sets are expected at ../shared next to the repository.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
PYTHONPATH=src exec python3 -m longspec.cli.main train longspec \
  --stdlib --corpus ../shared/data/books \
  --exclude test --exclude tests --exclude idlelib --exclude tkinter --exclude turtledemo --exclude lib2to3 --exclude ensurepip \
  --shards "$RUNS"/longspec-gemma270m/shards \
  --out "$RUNS"/longspec-gemma270m-v2 --feature-cache "$RUNS"/longspec-gemma270m/features \
  --steps 280 --seq-len 512 --batch-size 2 --lr 2e-3 --warmup 10 --save-every 10 \
  --draft-vocab 32768 --window 512 --gamma 5 --noisy --anchor-offset --labels target \
  --threads 1 --max-minutes 32 "$@"
