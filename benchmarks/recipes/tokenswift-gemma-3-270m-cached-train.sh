#!/bin/sh
# TokenSwift heads for Gemma 3 270M trained on the target features the LongSpec draft runs
# v5, v6 and v7 cached (benchmarks/recipes/longspec-gemma-3-270m-v{5,6,7}-train.sh: BOS-first
# rows of 512 tokens of the target's own responses to standard-library, book and LongBench
# prompts, at Anchor-Offset positions), with the target's own greedy labels, so the target
# never runs during training. Every position of every row trains (the on-the-fly trainer
# decoded 16 per window). Held-out top-1 over the full vocabulary on the 55 held-out
# responses of runs/eval-{task,general}-shards, which none of those runs trained on.
# Rerun with --resume to continue while RUNS (default: runs/) holds the run and the caches.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
exec longspec train tokenswift \
  --feature-cache "$RUNS"/longspec-gemma270m-v5/features \
  --feature-cache "$RUNS"/longspec-gemma270m-v6/features \
  --feature-cache "$RUNS"/longspec-gemma270m-v7/features \
  --labels self --loss-vocab 16384 \
  --heldout-shards "$RUNS"/eval-task-shards --heldout-shards "$RUNS"/eval-general-shards \
  --out "$RUNS"/tokenswift-heads-cached --steps 1000 --batch-size 8 --lr 1e-3 --warmup-steps 20 \
  --eval-every 250 --max-minutes 80 "$@"
