# first-run decode rate of `generate --method ar --json` on a 1k prompt, in fresh processes, beside the steady state in one process
for i in 1 2 3; do
  longspec generate --prompt-file /tmp/m65/prompt1k.txt --method ar --max-new-tokens 128 --json 2>/dev/null | python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(f\"fresh process: decode {s['decode_tokens_per_s']:.1f} tok/s, setup {s['setup_s']:.2f} s {s['setup']}\")"
  python3 - <<'PY' 2>/dev/null
import longspec
m = longspec.load()
text = open("/tmp/m65/prompt1k.txt").read()
rates = [m.generate(text, max_new_tokens=128, method="ar").stats.decode_tokens_per_s for _ in range(4)]
print("one process, runs 1-4:", " ".join(f"{r:.1f}" for r in rates), "tok/s; run 1 / mean of runs 2-4:", round(rates[0] / (sum(rates[1:]) / 3), 3))
PY
done
