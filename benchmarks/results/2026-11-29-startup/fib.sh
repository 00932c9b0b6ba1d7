set -u
cd /tmp
export OMP_NUM_THREADS=${THREADS:-1}
echo "== $(uptime) threads $OMP_NUM_THREADS"
for pair in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then pre="env TORCH_EXTENSIONS_DIR=/tmp/base-ext PYTHONPATH=/tmp/base/src"; else pre="env"; fi
    $pre /usr/bin/time -o /tmp/m65/t.txt -f "%e" longspec generate "def fib(n):" --max-new-tokens 1 > /dev/null 2>&1
    l=$($pre python3 -c "
import time; t=time.perf_counter(); import longspec; t1=time.perf_counter(); m=longspec.load(); t2=time.perf_counter()
print(f'import {t1-t:.2f} s, load() {t2-t1:.2f} s')" 2>/dev/null)
    echo "$pair $side | generate 'def fib(n):' --max-new-tokens 1: $(cat /tmp/m65/t.txt) s wall | $l"
  done
done
echo "== $(uptime)"
