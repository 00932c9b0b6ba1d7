"""Structured output on the embedded model: 20 JSON schemas, greedy, `ar` and `auto`
(and prompt lookup) with the same schema, in one run.

    python benchmarks/suite/structured_output.py --out benchmarks/results/$(date +%F)-structured-output

Per schema: whether each method's output parses and validates against the schema,
whether the methods' tokens are identical (they must be: exact constrained decoding),
tokens/s of each, drafted tokens the grammar pruned. Across schemas: `auto` against AR
with the same schema (total tokens over total decode seconds, and the geometric mean
of per-schema ratios), the grammar's mask cost per token (one matcher replaying each
output: fill the mask, consume the token), and constrained AR against unconstrained AR
producing as many tokens on the same prompt. Each method runs once untimed first
(first-use costs; `auto` measures the forward cost there). Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec  # noqa: E402
from common import machine, write_results  # noqa: E402
from longspec.speculation.grammar import OutputConstraint  # noqa: E402
from longspec.speculation.tree import Tree  # noqa: E402


def obj(properties: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(required or properties),
            "additionalProperties": False, **extra}


# Strings and numbers bounded as a user of a small greedy model bounds them: unbounded,
# Gemma 3 270M greedy repeats a digit or a phrase until the token limit (the lab note).
S, B = {"type": "string", "maxLength": 40}, {"type": "boolean"}
I, N = {"type": "integer", "minimum": 0, "maximum": 100000}, {"type": "number", "minimum": -1000, "maximum": 100000}
SCHEMAS = [
    ("a person", obj({"name": S, "age": I})),
    ("a book", obj({"title": S, "author": S, "year": I})),
    ("a city", obj({"name": S, "country": S, "population": I, "capital": B})),
    ("a product", obj({"name": S, "price": N, "in_stock": B})),
    ("a color", obj({"name": S, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("a weekday", obj({"day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]}, "busy": B})),
    ("a shopping list", obj({"items": {"type": "array", "items": S, "minItems": 2, "maxItems": 4}})),
    ("three prime numbers", obj({"primes": {"type": "array", "items": I, "minItems": 3, "maxItems": 3}})),
    ("a point in 3D", obj({"x": N, "y": N, "z": N})),
    ("an address", obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("a movie with its director", obj({"title": S, "director": obj({"first": S, "last": S})})),
    ("a rating", obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": S})),
    ("a date", obj({"year": I, "month": {"type": "integer", "minimum": 1, "maximum": 12},
                    "day": {"type": "integer", "minimum": 1, "maximum": 31}})),
    ("a user account", obj({"username": {"type": "string", "minLength": 3, "maxLength": 12}, "admin": B,
                            "email": S})),
    ("a recipe", obj({"dish": S, "ingredients": {"type": "array", "items": S, "minItems": 1, "maxItems": 3},
                      "minutes": I})),
    ("a planet", obj({"name": S, "moons": I, "rings": B})),
    ("an HTTP response", obj({"status": {"enum": [200, 404, 500]}, "body": S})),
    ("a task", obj({"title": S, "done": B, "tags": {"type": "array", "items": S, "maxItems": 2}},
                   required=["title", "done"])),
    ("a team of two", obj({"team": {"type": "array", "minItems": 2, "maxItems": 2,
                                    "items": obj({"name": S, "role": S})}})),
    ("a temperature reading", obj({"celsius": N, "unit": {"const": "C"}, "station": S})),
]


def valid(text: str, schema: dict) -> tuple[bool, bool]:
    """(parses, valid against the schema)."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False, False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def mask_cost_us(model, constraint: OutputConstraint, tokens: list[int]) -> list[float]:
    """Microseconds per token of one matcher replaying `tokens`: the mask of the next
    position (what a plain decoding round asks of the grammar), then the token consumed."""
    state = model.grammar_vocabulary().matcher(constraint)
    times = []
    for i, token in enumerate(tokens):
        start = time.perf_counter()
        state.constrain(Tree.chain(tokens[i - 1] if i else 0, []))
        state.advance(torch.tensor([token]))
        times.append(1e6 * (time.perf_counter() - start))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--methods", nargs="+", default=["ar", "auto", "pld"])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--limit", type=int, default=len(SCHEMAS))
    parser.add_argument("--out", type=Path, default=Path("bench-out/structured_output"))
    args = parser.parse_args()

    torch.set_num_threads(torch.get_num_threads())
    model = longspec.load(args.model)
    started = time.perf_counter()
    model.grammar_vocabulary()
    vocabulary_s = time.perf_counter() - started
    first = OutputConstraint("json_schema", SCHEMAS[0][1])
    for method in args.methods:  # first use of each method, outside the timed runs
        model.generate("Warm up:", max_new_tokens=8, method=method, constraint=first)
    rows, ratios, masks = [], [], []
    for what, schema in SCHEMAS[: args.limit]:
        prompt = f"Here is {what} as a JSON object:\n"
        constraint = OutputConstraint("json_schema", schema)
        row = {"schema_of": what}
        outputs = {}
        for method in args.methods:
            result = model.generate(prompt, max_new_tokens=args.max_new_tokens, method=method, constraint=constraint)
            parses, conforms = valid(result.text, schema)
            outputs[method] = result.token_ids
            row[method] = {"tokens": len(result.token_ids), "decode_s": result.stats.decode_s,
                           "tokens_per_s": result.stats.decode_tokens_per_s, "parses": parses, "valid": conforms,
                           "stop": result.stats.stop_reason, "tau": result.stats.tau,
                           "pruned": result.stats.pruned_tokens, "text": result.text}
        row["identical"] = all(outputs[m] == outputs["ar"] for m in outputs)
        tokens = outputs["ar"]
        plain = model.generate(prompt, max_new_tokens=len(tokens), method="ar", ignore_eos=True)
        row["unconstrained_ar_tokens_per_s"] = plain.stats.decode_tokens_per_s
        cost = mask_cost_us(model, constraint, tokens)
        masks += cost
        row["mask_us_median"] = statistics.median(cost)
        if "auto" in row:
            ratios.append(row["auto"]["tokens_per_s"] / row["ar"]["tokens_per_s"])
        rows.append(row)
        print(f"{what:28s} " + " ".join(f"{m} {row[m]['tokens_per_s']:.1f} tok/s valid={row[m]['valid']}"
                                         for m in args.methods) + f" identical={row['identical']}", flush=True)

    def total_rate(method):
        return sum(r[method]["tokens"] for r in rows) / sum(r[method]["decode_s"] for r in rows)

    summary = {
        "schemas": len(rows),
        "valid": {m: sum(r[m]["valid"] for r in rows) for m in args.methods},
        "identical": sum(r["identical"] for r in rows),
        "tokens_per_s": {m: total_rate(m) for m in args.methods},
        "auto_over_ar_total": total_rate("auto") / total_rate("ar") if "auto" in args.methods else None,
        "auto_over_ar_geomean": math.exp(statistics.fmean(math.log(x) for x in ratios)) if ratios else None,
        "constrained_over_unconstrained_ar": statistics.fmean(
            r["ar"]["tokens_per_s"] / r["unconstrained_ar_tokens_per_s"] for r in rows),
        "mask_us_median": statistics.median(masks), "mask_us_mean": statistics.fmean(masks),
        "grammar_vocabulary_s": vocabulary_s,
        "pruned": {m: sum(r[m]["pruned"] for r in rows) for m in args.methods},
    }
    header = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(args.out / "results.jsonl", header, rows)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
