#!/bin/sh
# Train TokenSwift heads for Gemma 3 270M on windows that start with BOS, as served
# sequences do (the shipped heads of 42 steps predate this). Same data as the shipped
# run (the books of ../shared/data plus 30 standard-library modules and the pydoc
# topics). Rerun with --resume to continue while RUNS (default: runs/) holds the run.
cd "$(dirname "$0")/../.." || exit 1
RUNS="${RUNS:-runs}"
exec longspec train tokenswift --data ../shared/data/books --stdlib-files 30 \
  --out "$RUNS"/tokenswift-heads-bos --steps 1500 --lr 1e-3 --warmup-steps 20 --eval-every 50 \
  --max-minutes 42 "$@"
