import resource, time, sys
t = time.perf_counter()
import longspec
m = longspec.load()
t1 = time.perf_counter()
def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) // 1024
after_load = rss()
r = m.generate("def fib(n):", max_new_tokens=16, method="ar")
print(f"{longspec.__file__}: load {t1 - t:.2f} s, RSS after load {after_load} MiB, after a generation {rss()} MiB, "
      f"peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB")
