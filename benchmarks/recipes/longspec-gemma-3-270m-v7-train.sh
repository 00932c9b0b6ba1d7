#!/bin/sh
# The shipped LongSpec draft for Gemma 3 270M (v7): v3 continued on a mix of the target's own
# responses: to LongBench Multi-News and LCC prompts (in-domain for the long-context
# benchmarks; benchmarks/recipes/responses-longbench-gemma-3-270m.sh, every measured item
# left out) and to standard-library and book prompts (general text;
# benchmarks/recipes/responses-gemma-3-270m.sh), so the draft learns the benchmarks'
# domains without forgetting the text it served before (v6 trained on the first kind alone).
# One epoch over a seeded sample of 2200 rows of BOS + 511 tokens (~1.1M tokens, about a
# third in-domain); labels are the target's own greedy tokens. Rerun the same command to
# resume while RUNS (default: runs/ in the repository) holds the run; then
# `python benchmarks/ship_draft.py RUNS/longspec-gemma270m-v7/draft.safetensors
# src/longspec/weights/longspec-gemma-3-270m.safetensors` writes the shipped file.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
V3=$(benchmarks/recipes/longspec-gemma-3-270m-v3-weights.sh "$RUNS") || exit 1  # the draft this run continues
TASK_RESPONSES="${TASK_RESPONSES:-benchmarks/results/2026-11-26-responses-longbench-gemma-3-270m/responses.jsonl}"
GENERAL_RESPONSES="${GENERAL_RESPONSES:-benchmarks/results/2026-11-26-responses-gemma-3-270m/responses.jsonl}"
exec longspec train longspec \
  --corpus "$TASK_RESPONSES" --corpus "$GENERAL_RESPONSES" --heldout 0.05 \
  --shards "$RUNS"/longspec-gemma270m-v7/shards \
  --out "$RUNS"/longspec-gemma270m-v7 --feature-cache "$RUNS"/longspec-gemma270m-v7/features \
  --init-from "$V3" \
  --max-rows 2200 --steps 1100 --seq-len 512 --batch-size 2 --lr 5e-4 --warmup 20 --save-every 25 \
  --gamma 5 --noisy --anchor-offset --labels target --bos --seed 0 --threads 2 --max-minutes 62 "$@"
