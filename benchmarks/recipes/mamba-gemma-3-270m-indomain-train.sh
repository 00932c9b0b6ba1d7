#!/bin/sh
# Continue the shipped mamba drafter for Gemma 3 270M on in-domain data: the target's own
# responses to LongBench Multi-News and LCC prompts, every item a committed benchmark run
# measured left out (benchmarks/recipes/responses-longbench-gemma-3-270m.sh writes them).
# Labels are the rows' own next tokens (--labels data): in a response they are the
# target's own greedy or sampled tokens, so no target forward is needed. Architecture and
# vocabulary stay the shipped drafter's (--init-from). Rerun the same command to resume
# while RUNS (default: runs/ in the repository) holds the run.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
TASK_RESPONSES="${TASK_RESPONSES:-benchmarks/results/2026-11-26-responses-longbench-gemma-3-270m/responses.jsonl}"
exec longspec train mamba \
  --corpus "$TASK_RESPONSES" --heldout 0.05 \
  --init-from src/longspec/weights/mamba-gemma-3-270m \
  --shards "$RUNS"/mamba-gemma270m-indomain/shards --out "$RUNS"/mamba-gemma270m-indomain \
  --steps 330 --seq-len 512 --batch-size 8 --lr 5e-4 --warmup 20 --save-every 10 \
  --labels data --seed 0 --threads 1 --max-minutes 60 "$@"
