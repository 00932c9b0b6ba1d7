#!/bin/sh
# Reproduce / resume the shipped LongSpec draft for Gemma 3 270M (rerun the same command to resume).
# Shards and target features are shared with the first (aborted) run directory and reused.
cd /work/main && PYTHONPATH=src exec python3 -m longspec.cli.main train longspec \
  --stdlib --corpus /work/shared/data/books \
  --exclude test --exclude tests --exclude idlelib --exclude tkinter --exclude turtledemo --exclude lib2to3 --exclude ensurepip \
  --shards /work/runs/longspec-gemma270m/shards \
  --out /work/runs/longspec-gemma270m-v2 --feature-cache /work/runs/longspec-gemma270m/features \
  --steps 280 --seq-len 512 --batch-size 2 --lr 2e-3 --warmup 10 --save-every 10 \
  --draft-vocab 32768 --window 512 --gamma 5 --noisy --anchor-offset --labels target \
  --threads 1 --max-minutes 32 "$@"
