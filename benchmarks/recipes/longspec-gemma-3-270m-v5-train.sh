#!/bin/sh
# Continue the shipped LongSpec draft v3 for Gemma 3 270M on the target's own responses
# (benchmarks/recipes/responses-gemma-3-270m.sh writes them: prompts built from the
# standard library and books, answered greedy and sampled). Rows start with BOS; the
# labels are the target's own greedy tokens; same recipe as v4 (fresh schedule at half
# v3's peak rate). Rerun the same command to resume while RUNS (default: runs/ in the
# repository) holds the run; RESPONSES names the rows (default: the committed ones).
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
V3=$(benchmarks/recipes/longspec-gemma-3-270m-v3-weights.sh "$RUNS") || exit 1  # the draft this run continues
RESPONSES="${RESPONSES:-benchmarks/results/2026-11-26-responses-gemma-3-270m/responses.jsonl}"  # the committed rows
exec longspec train longspec \
  --corpus "$RESPONSES" --heldout 0.05 \
  --shards "$RUNS"/longspec-gemma270m-v5/shards \
  --out "$RUNS"/longspec-gemma270m-v5 --feature-cache "$RUNS"/longspec-gemma270m-v5/features \
  --init-from "$V3" \
  --max-rows 2000 --steps 1200 --seq-len 512 --batch-size 2 --lr 5e-4 --warmup 20 --save-every 25 \
  --gamma 5 --noisy --anchor-offset --labels target --bos --seed 0 --threads 1 --max-minutes 40 "$@"
