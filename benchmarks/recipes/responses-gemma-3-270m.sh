#!/bin/sh
# The target's own responses (Gemma 3 270M, bf16) to prompts built from the Python
# standard library and ../shared/data/books, with the excludes and the 5 % held-out split
# of the LongSpec draft's recipe (documents it holds out are never used): half prose and
# half code, half greedy and half sampled (T = 1, top-p 0.95), up to 384 new tokens, in
# batches of 8 rows. Training data for every drafter: --corpus RUNS/responses-gemma-3-270m/responses.jsonl.
# Rerun the same command to resume while RUNS (default: runs/ in the repository) holds the file;
# the rows made so far are committed in benchmarks/results/2026-11-26-responses-gemma-3-270m/:
# adding `--out benchmarks/results/2026-11-26-responses-gemma-3-270m` (the last --out wins) resumes them in place.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
exec longspec train responses \
  --stdlib --corpus ../shared/data/books \
  --exclude test --exclude tests --exclude idlelib --exclude tkinter --exclude turtledemo --exclude lib2to3 --exclude ensurepip \
  --heldout 0.05 --out "$RUNS"/responses-gemma-3-270m \
  --prompts 1500 --excerpt-tokens 512 1024 --max-new-tokens 384 --prose-share 0.5 --sampled-share 0.5 \
  --batch-rows 8 --seed 0 --threads 2 "$@"
