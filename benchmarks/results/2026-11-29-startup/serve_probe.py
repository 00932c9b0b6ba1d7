"""Start `longspec serve`, time readiness, first token, and an n=8 request beside a neighbour."""
import json, subprocess, sys, time, threading, urllib.request, os, signal
PORT = 8765
t0 = time.perf_counter()
server = subprocess.Popen(["longspec", "serve", "--port", str(PORT)], stdout=subprocess.DEVNULL, stderr=open("/tmp/m65/serve.err", "w"))
def get(path):
    return urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=300).read()
def post(body):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600)
while True:
    try:
        get("/health"); break
    except Exception:
        time.sleep(0.1)
ready = time.perf_counter() - t0
time.sleep(float(os.environ.get('PREWAIT', '0')))
t = time.perf_counter()
resp = post({"model": "gemma-3-270m", "prompt": "def fib(n):", "max_tokens": 8, "stream": True})
first = None
for line in resp:
    if line.startswith(b"data:") and first is None:
        first = time.perf_counter() - t
resp.read()
print(f"ready {ready:.2f} s after start; first token of the first request {first:.2f} s; start to first token {ready + first:.2f} s")
out = {}
def neighbour():
    t = time.perf_counter(); r = post({"model": "gemma-3-270m", "prompt": "class Stack:", "max_tokens": 32}); r.read(); out["neighbour"] = time.perf_counter() - t
th = threading.Thread(target=neighbour); th.start()
t = time.perf_counter(); r = post({"model": "gemma-3-270m", "prompt": "def sort(xs):", "max_tokens": 8, "n": 8}); r.read(); n8 = time.perf_counter() - t
th.join()
print(f"n=8, max_tokens=8: {n8:.2f} s; its neighbour (32 tokens): {out['neighbour']:.2f} s")
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
metrics = get("/metrics").decode()
print("\n".join(l for l in metrics.splitlines() if "setup_seconds" in l and not l.startswith("#")))
server.send_signal(signal.SIGTERM); server.wait(30)
