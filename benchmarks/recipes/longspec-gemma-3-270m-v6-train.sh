#!/bin/sh
# Continue the shipped LongSpec draft v3 for Gemma 3 270M on in-domain data: the target's
# own responses to LongBench Multi-News and LCC prompts
# (benchmarks/recipes/responses-longbench-gemma-3-270m.sh writes them, with every item of
# the committed full-preset run left out). Rows start with BOS; the labels are the
# target's own greedy tokens; the v5 recipe otherwise. Rerun the same command to resume
# while RUNS (default: runs/ in the repository) holds the run; RESPONSES names the rows
# (default: the committed ones). The v6 measured in BENCHMARKS.md trained on the file's first
# 240 rows (`head -n 240` of it as RESPONSES reproduces that run); the committed file has 371.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
V3=$(benchmarks/recipes/longspec-gemma-3-270m-v3-weights.sh "$RUNS") || exit 1  # the draft this run continues
RESPONSES="${RESPONSES:-benchmarks/results/2026-11-26-responses-longbench-gemma-3-270m/responses.jsonl}"  # the committed rows
exec longspec train longspec \
  --corpus "$RESPONSES" --heldout 0.05 \
  --shards "$RUNS"/longspec-gemma270m-v6/shards \
  --out "$RUNS"/longspec-gemma270m-v6 --feature-cache "$RUNS"/longspec-gemma270m-v6/features \
  --init-from "$V3" \
  --max-rows 2000 --steps 1200 --seq-len 512 --batch-size 2 --lr 5e-4 --warmup 20 --save-every 25 \
  --gamma 5 --noisy --anchor-offset --labels target --bos --seed 0 --threads 1 --max-minutes 40 "$@"
