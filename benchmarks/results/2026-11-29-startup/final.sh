set -u
cd /tmp
echo "== commit $(git -C /work/main rev-parse --short HEAD); $(uptime)"
echo "== warm: longspec generate 'def fib(n):' --max-new-tokens 1, wall"
for i in 1 2 3; do /usr/bin/time -f "%e s wall" longspec generate "def fib(n):" --max-new-tokens 1 --quiet > /dev/null; done 2>&1
echo "== load parts ($(uptime))"
for i in 1 2 3; do python3 /tmp/m65/load_parts.py 2>&1 | grep -v Warn; done
echo "== AR --json on a 1k prompt: fresh processes and one process ($(uptime))"
bash /tmp/m65/ar_honest.sh
echo "== server start to first token, curves cached ($(uptime))"
PREWAIT=0 python3 /tmp/m65/serve_probe.py 0
echo "== RSS ($(uptime))"
python3 /tmp/m65/rss.py 2>&1 | grep -v Warn
echo "== end $(uptime)"
