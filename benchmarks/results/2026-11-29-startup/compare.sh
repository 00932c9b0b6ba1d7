# before (fe50d1b, /tmp/base) and after (HEAD), alternating; 1 torch thread (the shared machine's other load
# makes 2-thread OpenMP collapse), nice -19.
set -u
cd /tmp
export OMP_NUM_THREADS=1
before() { TORCH_EXTENSIONS_DIR=/tmp/base-ext PYTHONPATH=/tmp/base/src "$@"; }
after() { "$@"; }
echo "== $(uptime)"
for pair in 1 2 3; do
  for side in before after; do
    w=$( { /usr/bin/time -f "%e" $side longspec generate "def fib(n):" --max-new-tokens 1 > /dev/null 2>/dev/null; } 2>&1 | tail -1)
    r=$($side longspec generate --prompt-file /tmp/m65/prompt1k.txt --method ar --max-new-tokens 128 --json 2>/dev/null | python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(round(s['decode_tokens_per_s'],1), round(s.get('setup_s', 0),2))")
    rm -f /tmp/cc/cost-model/*.json
    c=$(LONGSPEC_CACHE=/tmp/cc $side python3 /tmp/m65/first_token.py longspec generate "def quicksort(items):" --max-new-tokens 128 | head -1)
    echo "$pair $side | fib 1 token: ${w} s wall | ar 1k --json: decode, setup_s: $r | auto 128, no cost curve: $c"
  done
done
echo "== $(uptime)"
