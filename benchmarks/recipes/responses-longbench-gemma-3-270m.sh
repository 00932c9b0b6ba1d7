#!/bin/sh
# In-domain training data for the drafters: the target's own responses (Gemma 3 270M,
# bf16) to LongBench Multi-News and LCC prompts, served exactly as `longspec bench`
# serves them (the task's template, middle cut to 1k, 2k or 4k tokens), half greedy and
# half sampled (T = 1, top-p 0.95), up to 256 new tokens as the full preset, in batches
# of 8 rows. Every item that the committed full-preset run measured is left out, so the
# drafters trained on these rows are measured on unseen items (tests/test_responses.py
# checks the committed rows). Rerun the same command to resume while RUNS (default: runs/
# in the repository) holds the file; adding `--out
# benchmarks/results/2026-11-26-responses-longbench-gemma-3-270m` (the last --out wins) resumes the committed rows.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
exec longspec train responses \
  --task multi_news --task lcc --data-dir ../shared/data \
  --exclude-items-of benchmarks/results/2026-11-26-bench-full-preset-repeats/results.jsonl \
  --context-lengths 1024 2048 4096 --out "$RUNS"/responses-longbench-gemma-3-270m \
  --prompts 400 --max-new-tokens 256 --sampled-share 0.5 \
  --batch-rows 8 --seed 0 --threads 2 "$@"
