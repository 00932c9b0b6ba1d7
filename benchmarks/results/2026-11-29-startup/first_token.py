"""Run a longspec command; print wall time to its first stdout byte and in all, and its stderr's last line."""
import os, subprocess, sys, time
start = time.perf_counter()
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
first = None
out = b""
while True:
    b = p.stdout.read(1)
    if not b:
        break
    if first is None and b.strip():
        first = time.perf_counter() - start
    out += b
err = p.stderr.read().decode()
p.wait()
total = time.perf_counter() - start
lines = [l for l in err.splitlines() if l.startswith("[") or l.startswith("note") or l.startswith("longspec:")]
print(f"first token {first if first is None else round(first, 2)} s, wall {total:.2f} s, rc {p.returncode}")
print("\n".join(lines))
