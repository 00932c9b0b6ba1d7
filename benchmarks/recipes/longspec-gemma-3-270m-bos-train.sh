#!/bin/sh
# Continue the LongSpec draft for Gemma 3 270M on rows that start with BOS, as served
# prompts do. The draft shipped now is this run at step 480 (from the earlier draft trained
# without BOS). Rerun the same command to resume while RUNS (default: runs/ in the
# repository) holds the run; on a machine without it, the command starts a new schedule
# from the shipped weights. The shared data sets are expected at ../shared next to the
# repository.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
PYTHONPATH=src exec python3 -m longspec.cli.main train longspec \
  --stdlib --corpus ../shared/data/books \
  --exclude test --exclude tests --exclude idlelib --exclude tkinter --exclude turtledemo --exclude lib2to3 --exclude ensurepip \
  --shards "$RUNS"/longspec-gemma270m-bos/shards \
  --out "$RUNS"/longspec-gemma270m-bos --feature-cache "$RUNS"/longspec-gemma270m-bos/features-v2 \
  --init-from src/longspec/weights/longspec-gemma-3-270m.safetensors \
  --steps 2000 --seq-len 512 --batch-size 2 --lr 1e-3 --warmup 10 --save-every 10 \
  --window 512 --gamma 5 --noisy --anchor-offset --labels target --bos \
  --threads 1 --max-minutes 70 "$@"
