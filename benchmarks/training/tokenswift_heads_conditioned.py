"""Do TokenSwift heads gain from seeing the tokens they draft after? Measured on cached features.

The shipped heads read the target's state h at the last accepted position t alone and
guess the tokens 2..γ+1 ahead; they never see the bonus token (t + 1), which the
target has just chosen when the next round is drafted, nor the tokens of the path
they extend. Two variants read them (the idea of Hydra's sequential heads and of
EAGLE's token input), trained beside the shipped architecture on the same rows, steps
and seed:

* `linear` — the shipped heads: h_i = h_(i-1) + W_i h_(i-1) (TokenSwift's chain).
* `bonus` — the bonus token's embedding joins the state once: s = h + A [h; e(x_(t+1))],
  then the shipped chain on s. Still one evaluation per head, so the drafter's
  Cartesian tree is unchanged.
* `path` — a recurrent head: s_i = s_(i-1) + W_i [s_(i-1); e(x_(t+i))], s_0 = h;
  head i reads the bonus and the path's tokens. In a tree, one evaluation per node.

e(x) is the target's input embedding of x, RMS-normalised like h. Training is teacher
forced on the rows' own tokens (their shards give them: `read_feature_caches(...,
shards)`), with the self-distilled labels the shipped heads learn or (`:data`) the
rows' next tokens, the issue's comparison of the two. Reported, on
held-out rows whose features are computed here: each head's top-1 agreement with the
target's greedy token, and the chain's expected accepted tokens per position (the mean
number of leading heads that are right, which is what a greedy chain of these heads
adds to a round). For the path variant teacher forcing is exact: a head is only
reached in a chain when every earlier one was right, i.e. when the path is the true one.

    python benchmarks/training/tokenswift_heads_conditioned.py \
        --feature-cache runs/longspec-gemma270m-v5/features --cache-shards runs/longspec-gemma270m-v5/shards \
        ... --heldout-shards runs/eval-task-shards --steps 150 --threads 2 \
        --runs linear:self bonus:self path:self linear:data
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

from common import machine, write_results
from longspec.runtime.device import HOST
from longspec.runtime.loading import load_target
from longspec.speculation.drafters.longspec.model import chunked_cross_entropy
from longspec.speculation.drafters.tokenswift.heads import norm_scale
from longspec.training.data import load_split, most_frequent_ids, prefixed_rows, served_prefix
from longspec.training.longspec.features import IGNORE
from longspec.training.tokenswift.heads import lr_factor
from longspec.training.tokenswift.heads_cached import (
    CachedHeadsConfig, features_of_rows, head_labels, map_labels, next_token_labels, read_feature_caches)


def rms_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LinearHeads(nn.Module):
    """The shipped architecture (zero-initialised: every head starts as the target's head)."""

    def __init__(self, hidden: int, gamma: int) -> None:
        super().__init__()
        self.gamma = gamma
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(gamma))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def chain(self, h: torch.Tensor) -> torch.Tensor:
        out = []
        for layer in self.layers:
            h = h + layer(h)
            out.append(h)
        return torch.stack(out, dim=-2)

    def forward(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """h [B, P, H] normalised states; tokens [B, P, γ, H] normalised embeddings of the
        bonus and the path (unused here) -> [B, P, γ, H] head states."""
        return self.chain(h)


class BonusHeads(LinearHeads):
    def __init__(self, hidden: int, gamma: int) -> None:
        super().__init__(hidden, gamma)
        self.bonus = nn.Linear(2 * hidden, hidden)
        nn.init.zeros_(self.bonus.weight)
        nn.init.zeros_(self.bonus.bias)

    def forward(self, h, tokens):
        return self.chain(h + self.bonus(torch.cat([h, tokens[..., 0, :]], dim=-1)))


class PathHeads(nn.Module):
    def __init__(self, hidden: int, gamma: int) -> None:
        super().__init__()
        self.gamma = gamma
        self.layers = nn.ModuleList(nn.Linear(2 * hidden, hidden) for _ in range(gamma))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, h, tokens):
        out = []
        for i, layer in enumerate(self.layers):
            h = h + layer(torch.cat([h, tokens[..., i, :]], dim=-1))
            out.append(h)
        return torch.stack(out, dim=-2)


VARIANTS = {"linear": LinearHeads, "bonus": BonusHeads, "path": PathHeads}


def inputs(target, hidden: torch.Tensor, ids: torch.Tensor, first: int, gamma: int, dtype):
    """Normalised states h at positions first .. T - γ - 1 and the normalised embeddings
    of the tokens t + 1 .. t + γ (the bonus, then the path) at each."""
    T = hidden.shape[1]
    h = (hidden[:, first : T - gamma].to(torch.float64) / norm_scale(target)).to(dtype)
    following = torch.stack([ids[:, first + i : T - gamma + i] for i in range(1, gamma + 1)], dim=-1)  # [B, P, γ]
    tokens = rms_normalised(target.embed(following.to(target.device)).to(dtype))
    return h, tokens


def head_states(target, heads, hidden, ids, first: int, dtype) -> torch.Tensor:
    h, tokens = inputs(target, hidden, ids, first, heads.gamma, dtype)
    return target.final_norm(heads(h, tokens).to(target.dtype))


@torch.no_grad()
def evaluate(target, heads, rows, dtype, batch: int = 4) -> dict:
    """Per head top-1 against the greedy labels (full vocabulary) and the mean number of
    leading heads that are right."""
    gamma = heads.gamma
    right = torch.zeros(gamma, dtype=torch.float64)
    leading, positions = 0.0, 0
    for begin in range(0, len(rows), batch):
        hidden, ids, labels = (x[begin : begin + batch] for x in (rows.hidden, rows.ids, rows.labels))
        predicted = target.greedy_tokens(head_states(target, heads, hidden, ids, rows.prefix_tokens, dtype)).to(HOST)
        wanted = head_labels(labels, rows.prefix_tokens, gamma)
        valid = (wanted != IGNORE).all(dim=-1)
        hits = (predicted == wanted) & valid[..., None]
        right += hits.sum(dim=(0, 1)).double()
        leading += float(hits.long().cumprod(dim=-1).sum())
        positions += int(valid.sum())
    return {"top1": [round(x, 4) for x in (right / max(positions, 1)).tolist()],
            "chain_tokens_per_position": round(leading / max(positions, 1), 4), "positions": positions}


def train(target, rows, variant: str, config: CachedHeadsConfig, dtype, log) -> nn.Module:
    torch.manual_seed(config.seed)
    heads = VARIANTS[variant](target.config.hidden_size, config.num_heads).to(target.device, dtype)
    first, gamma = rows.prefix_tokens, config.num_heads
    all_labels = head_labels(rows.labels, first, gamma)
    eos = [t for t in target.config.eos_token_ids if t < target.config.vocab_size]
    vocab = most_frequent_ids(all_labels[all_labels != IGNORE], target.config.vocab_size, config.loss_vocab, eos)
    label_map = torch.full((target.config.vocab_size,), IGNORE, dtype=torch.long, device=HOST)
    label_map[vocab] = torch.arange(vocab.numel(), device=HOST)
    head_rows = target.head_weight[vocab.to(target.device)]
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(config.seed), device=HOST)
    started = time.perf_counter()
    for step in range(config.steps):
        batch = order[(step * config.batch_size + torch.arange(config.batch_size)) % len(rows)]
        states = head_states(target, heads, rows.hidden[batch], rows.ids[batch], first, dtype)
        mapped = map_labels(label_map, head_labels(rows.labels[batch], first, gamma))
        losses = []
        for i in range(gamma):
            y = mapped[..., i].reshape(-1)
            losses.append(chunked_cross_entropy(states[..., i, :].reshape(-1, states.shape[-1]), head_rows, y,
                                                chunk=1024, cap=target.config.final_logit_softcapping)
                          / max(int((y != IGNORE).sum()), 1))
        loss = torch.stack(losses).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if (step + 1) % 10 == 0:
            log(f"{variant} step {step + 1}/{config.steps} {time.perf_counter() - started:.0f}s loss "
                f"{[round(x.item(), 3) for x in losses]}")
    return heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--feature-cache", type=Path, action="append", required=True)
    parser.add_argument("--cache-shards", type=Path, action="append", required=True)
    parser.add_argument("--heldout-shards", type=Path, action="append", required=True)
    parser.add_argument("--runs", nargs="+", default=[f"{v}:self" for v in VARIANTS], metavar="VARIANT:LABELS",
                        help=f"variant ({', '.join(VARIANTS)}) and training labels (self: the target's greedy "
                             "tokens; data: the rows' next tokens); held-out agreement is always the greedy one")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--loss-vocab", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-out/tokenswift_heads_conditioned.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_target(None, dtype=torch.bfloat16)
    target = loaded.model
    dtype = torch.float32  # the heads train in float32 over the bf16 target, as the heads trainer does
    rows = read_feature_caches(args.feature_cache, target, "self", args.cache_shards)
    prefix = served_prefix(loaded.tokenizer)
    heldout = {}  # per held-out set: its rows' features, computed here
    for directory in args.heldout_shards:
        ids = prefixed_rows(load_split(directory, "heldout"), rows.labels.shape[1], prefix)
        heldout[directory.name] = dataclasses.replace(features_of_rows(target, ids, len(prefix), "self"), ids=ids)
    print(f"{len(rows)} training rows; held-out rows {({k: len(v) for k, v in heldout.items()})}", flush=True)
    config = CachedHeadsConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, num_heads=args.heads,
                               loss_vocab=args.loss_vocab, seed=args.seed)
    runs = [run.split(":") for run in args.runs]
    bad = [":".join(r) for r in runs if len(r) != 2 or r[0] not in VARIANTS or r[1] not in ("self", "data")]
    if bad:
        parser.error(f"--runs takes VARIANT:LABELS, a variant of {list(VARIANTS)} and labels self or data; got {bad}")
    labels = {"self": rows.labels, "data": next_token_labels(rows.ids)}
    header = {"benchmark": "tokenswift_heads_conditioned", "machine": machine(), "threads": args.threads,
              "caches": [str(c) for c in args.feature_cache], "heldout": [str(h) for h in args.heldout_shards],
              "training_rows": len(rows), "heldout_rows": {k: len(v) for k, v in heldout.items()},
              "loss_vocab": args.loss_vocab, "time": time.ctime()}
    results = []
    for variant, label_kind in runs:
        started = time.perf_counter()
        training_rows = dataclasses.replace(rows, labels=labels[label_kind], label_kind=label_kind)
        heads = train(target, training_rows, variant, config, dtype, lambda line: print(line, flush=True))
        seconds = time.perf_counter() - started
        measured = {name: evaluate(target, heads, held, dtype) for name, held in heldout.items()}
        parameters = sum(p.numel() for p in heads.parameters())
        results.append({"variant": variant, "labels": label_kind, "steps": args.steps, "batch_size": args.batch_size,
                        "train_seconds": round(seconds, 1), "parameters": parameters, "heldout": measured})
        print(json.dumps(results[-1]), flush=True)
        write_results(args.out, header, results)  # after every run: a long sweep keeps what it finished


if __name__ == "__main__":
    main()
