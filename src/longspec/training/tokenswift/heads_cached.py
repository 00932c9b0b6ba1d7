"""Training TokenSwift heads from cached target features, without running the target.

The LongSpec trainer's feature cache (`training.longspec.features.FeatureCache`) holds, for every
BOS-first row it trained on, the target's final-norm hidden state at each position and
its labels (the target's own greedy next token, or the data's). That is all a head
needs: head i (1..γ) at position t reads h_0(t) and is scored against labels[t + i],
the token i + 1 positions ahead (the target's own head predicts t + 1). With
self-distilled labels, head i learns the target's greedy token i + 1 ahead of its
own, given the row's tokens before it.

Reading features instead of computing them removes the target forward (most of the
on-the-fly trainer's step, which therefore decoded only 16 random rows per window),
so every position of every row trains. The loss scores the `loss_vocab` most frequent
labels of the training rows, not the target's whole vocabulary (262k for Gemma: the
full cross-entropy would cost 8x more); positions whose label falls outside are left
out and counted. At inference the heads score the tokens the sequence has used
(`context_vocab`), so they never see the full softmax either. Held-out accuracy is
measured over the full vocabulary.

Checkpoints, curve and resume follow `heads`: the same heads file, a
trainer state with optimizer, scheduler and step; a resumed run sees the batches an
uninterrupted one would.
"""

from __future__ import annotations

import csv
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from longspec.runtime.atomic_files import Checkpoint
from longspec.runtime.device import HOST
from longspec.speculation.drafters.longspec.model import chunked_cross_entropy
from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.training.data import load_split, most_frequent_ids, prefixed_rows
from longspec.training.fingerprint import digest, target_fingerprint, tokens_fingerprint
from longspec.training.longspec.features import FEATURES_VERSION, IGNORE, FeatureCache, target_features
from longspec.training.tokenswift.heads import (
    CURVE_FILE, HEADS_FILE, STATE_FILE, has_committed_run, keep_curve_until, lr_factor, restore_run, training_dtype,
    verify_committed)

_ROW_FILE = re.compile(r"row(\d+)-(self|data)-(aoi|plain)\.safetensors")
# The feature layout that first stored the target's hidden states.
_FIRST_VERSION_WITH_HIDDEN = 2


@dataclass(frozen=True)
class CachedHeadsConfig:
    steps: int = 500
    batch_size: int = 8  # rows per step (every position of each row trains)
    lr: float = 1e-3
    warmup_steps: int = 20
    num_heads: int = 3
    chained: bool = True  # False: Medusa-style independent heads
    loss_vocab: int = 32768  # most frequent training labels the loss scores
    heldout_rows: int = 0  # rows of the caches held out for the curve (0: evaluate on given rows only)
    eval_every: int = 50
    save_every: int = 50
    max_minutes: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "num_heads", "loss_vocab", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.heldout_rows < 0:
            raise ValueError(f"heldout_rows must be >= 0, got {self.heldout_rows}")


@dataclass
class FeatureRows:
    """Rows read from feature caches: hidden [N, T, H] (the cache's dtype), labels [N, T]."""

    hidden: torch.Tensor
    labels: torch.Tensor
    label_kind: str  # "self" (the target's greedy tokens) or "data"
    prefix_tokens: int  # positions at the start of every row holding the served prefix (BOS)
    sources: list[str]  # one digest per cache: what a resumed run must read again
    ids: torch.Tensor | None = None  # [N, T] the rows' tokens, where their shards were given

    def __len__(self) -> int:
        return self.hidden.shape[0]


def read_feature_caches(directories: list[Path], target, label_kind: str = "self",
                        shards: list[Path] | None = None) -> FeatureRows:
    """Every row with `label_kind` labels from the LongSpec feature caches `directories`.

    `shards`: the token shards each cache's rows were cut from (its run's `--shards`), one
    per cache in the same order. With them the rows' tokens are read too, and data labels
    (each position's next token) come from the tokens for every cached row: a row's
    hidden states do not depend on its label kind, so caches of self-distilled rows
    serve both.

    Refused before reading a row: a cache of another target (weights, dtype), one
    without hidden states (an older layout), caches of different row lengths or row
    prefixes, shards that are not a cache's token stream, or no rows of the wanted kind."""
    if label_kind not in ("self", "data"):
        raise ValueError(f"label_kind must be 'self' or 'data', got {label_kind!r}")
    if not directories:
        raise ValueError("no feature caches given")
    if shards is not None and len(shards) != len(directories):
        raise ValueError(f"{len(shards)} shard directories for {len(directories)} feature caches: give each cache "
                         "the --shards of the run that made it, in the same order")
    fingerprint = target_fingerprint(target)
    keys, files = [], []  # files: (row file, index of its cache, row number in its stream)
    streams = []  # per cache: its token stream, where shards were given
    for number, directory in enumerate(directories):
        key_file = Path(directory) / FeatureCache.KEY_FILE
        if not key_file.is_file():
            raise FileNotFoundError(f"{directory} is not a feature cache (no {FeatureCache.KEY_FILE}); give the "
                                    "--feature-cache directory of a `longspec train longspec` run")
        stored = json.loads(key_file.read_text())
        key = stored.get("key") or {}
        if key.get("target") != fingerprint:
            raise ValueError(f"the feature cache {directory} was computed for another target (weights or dtype) "
                             "than this one: load the target it was made with (--model, --dtype), or make a cache "
                             "for this one")
        if key.get("features", 0) < _FIRST_VERSION_WITH_HIDDEN or key.get("features", 0) > FEATURES_VERSION:
            raise ValueError(f"the feature cache {directory} has layout version {key.get('features')}, without the "
                             f"target's hidden states this trainer reads (needs {_FIRST_VERSION_WITH_HIDDEN}.."
                             f"{FEATURES_VERSION}); recompute it with this longspec")
        if shards is not None:
            stream = load_split(shards[number], "train")
            if tokens_fingerprint(stream) != key.get("tokens"):
                raise ValueError(f"the shards {shards[number]} are not the token stream the feature cache {directory} "
                                 "was cut from (another corpus, tokenizer or order): give each cache the --shards of "
                                 "the run that made it, in the same order")
            streams.append(stream)
        # With the tokens at hand, data labels are read off them for rows of either kind.
        kinds = ("self", "data") if shards is not None and label_kind == "data" else (label_kind,)
        mine = {}
        for p in Path(directory).iterdir():
            if (m := _ROW_FILE.fullmatch(p.name)) and m.group(2) in kinds:
                mine.setdefault(int(m.group(1)), p)
        keys.append(key)
        files.extend((path, number, row) for row, path in sorted(mine.items()))
    shapes = {(k.get("seq_len"), tuple(k.get("row_prefix") or ())) for k in keys}
    if len(shapes) > 1:
        raise ValueError(f"the feature caches hold rows of different lengths or prefixes {sorted(shapes)}; "
                         "train on caches of one --seq-len and row prefix")
    if not files:
        hint = (" or give each cache its run's token shards (--cache-shards), which give every row data labels"
                if label_kind == "data" and shards is None else "")
        raise ValueError(f"the feature caches hold no rows with {label_kind!r} labels (their rows are named "
                         f"row<N>-<self|data>-...); pass the other label kind{hint}")
    seq_len, prefix = shapes.pop()
    rows_of = [prefixed_rows(stream, seq_len, prefix) for stream in streams]
    hidden, labels = None, torch.empty((len(files), seq_len), dtype=torch.long, device=HOST)
    ids = torch.empty_like(labels) if shards is not None else None
    for index, (path, number, row_number) in enumerate(files):
        with safe_open(str(path), "pt") as row:
            h = row.get_tensor("hidden")
            if hidden is None:
                hidden = torch.empty((len(files), *h.shape), dtype=h.dtype, device=HOST)
            hidden[index] = h
            if ids is None or label_kind == "self":
                labels[index] = row.get_tensor("labels")
        if ids is not None:
            ids[index] = rows_of[number][row_number]
    if ids is not None and label_kind == "data":
        labels = next_token_labels(ids)
    sources = [stored_digest(d) for d in directories] + (["labels from the shards' tokens"] if shards else [])
    return FeatureRows(hidden, labels, label_kind, len(prefix), sources, ids)


def next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    """[N, T] data labels of rows `ids`: each position's next token, IGNORE at the last."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)


def features_of_rows(target, ids: torch.Tensor, prefix_tokens: int, label_kind: str = "self") -> FeatureRows:
    """Hidden states and labels of rows `ids` [N, T] at their own positions (held-out
    rows the caches never saw), computed by the target as the LongSpec trainer does."""
    hidden, labels = [], []
    positions = torch.arange(ids.shape[1], device=HOST)
    for row in ids:
        features = target_features(target, row, positions, (), label_kind == "self")
        hidden.append(features["hidden"].to(HOST))
        labels.append(features["labels"].to(HOST))
    return FeatureRows(torch.stack(hidden), torch.stack(labels), label_kind, prefix_tokens, [])


def stored_digest(directory: Path) -> str:
    return json.loads((Path(directory) / FeatureCache.KEY_FILE).read_text())["digest"]


def head_labels(labels: torch.Tensor, first: int, num_heads: int) -> torch.Tensor:
    """[B, P, γ] labels of heads 1..γ at positions first .. T - γ - 1 of rows `labels`
    [B, T]: head i at position t is scored against labels[t + i], the token i + 1
    ahead (labels[t] is position t's next token)."""
    T = labels.shape[1]
    last = T - num_heads  # one past the last position whose every head has a label
    if last <= first:
        raise ValueError(f"rows of {T} tokens leave no position after a prefix of {first} for {num_heads} heads")
    return torch.stack([labels[:, first + i : last + i] for i in range(1, num_heads + 1)], dim=-1)


def map_labels(label_map: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token ids -> their index in the loss vocabulary; IGNORE for ignored labels and
    for tokens the loss vocabulary does not hold."""
    return torch.where(labels == IGNORE, IGNORE, label_map[labels.clamp(min=0)])


def heads_normed(target, heads: TokenSwiftHeads, hidden: torch.Tensor) -> torch.Tensor:
    """[..., γ, H] the final-normed states of heads 1..γ (what the target's LM head scores)."""
    return target.final_norm(heads.hidden_states(target, hidden).to(target.dtype))


def loss_over(target, heads, hidden: torch.Tensor, labels: torch.Tensor, first: int, head_rows: torch.Tensor,
              label_map: torch.Tensor) -> tuple[torch.Tensor, list[float], int]:
    """Mean cross-entropy of the heads over the positions whose label the loss
    vocabulary holds; (loss, per-head mean, positions counted per head)."""
    gamma = heads.config.num_heads
    states = heads_normed(target, heads, hidden[:, first : hidden.shape[1] - gamma])  # [B, P, γ, H]
    mapped = map_labels(label_map, head_labels(labels, first, gamma))  # [B, P, γ]
    cap = target.config.final_logit_softcapping
    per_head, counted = [], 0
    for i in range(gamma):
        y = mapped[..., i].reshape(-1)
        n = int((y != IGNORE).sum())
        counted = max(counted, n)
        per_head.append(chunked_cross_entropy(states[..., i, :].reshape(-1, states.shape[-1]), head_rows, y,
                                              chunk=1024, cap=cap) / max(n, 1))
    loss = torch.stack(per_head).mean()
    return loss, [x.item() for x in per_head], counted


@torch.no_grad()
def heldout_accuracy(target, heads, hidden: torch.Tensor, labels: torch.Tensor, first: int,
                     batch: int = 4) -> list[float]:
    """Top-1 accuracy of each head over the target's full vocabulary on rows [N, T]."""
    gamma = heads.config.num_heads
    right = torch.zeros(gamma, dtype=torch.float64)
    total = torch.zeros(gamma, dtype=torch.float64)
    for begin in range(0, hidden.shape[0], batch):
        h, y = hidden[begin : begin + batch], labels[begin : begin + batch]
        states = heads_normed(target, heads, h[:, first : h.shape[1] - gamma].to(target.device))
        predicted = target.greedy_tokens(states).to(HOST)  # [B, P, γ]
        wanted = head_labels(y, first, gamma)
        valid = wanted != IGNORE
        right += ((predicted == wanted) & valid).sum(dim=(0, 1)).double()
        total += valid.sum(dim=(0, 1)).double()
    return (right / total.clamp(min=1)).tolist()


def train_heads_from_features(target, rows: FeatureRows, out_dir: Path, config: CachedHeadsConfig, *,
                              resume: bool = False, target_name: str = "", log=print,
                              heldout: FeatureRows | None = None) -> TokenSwiftHeads:
    """Train heads on cached rows; write heads, trainer state and curve to `out_dir`.
    `heldout`: rows to measure top-1 accuracy on (e.g. features of held-out text);
    else `config.heldout_rows` rows of `rows` are split off by the seed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(config.seed), device=HOST)
    held, train = order[: config.heldout_rows], order[config.heldout_rows :]
    if train.numel() < config.batch_size:
        raise ValueError(f"{train.numel()} training rows for batch size {config.batch_size}; add feature caches")
    if heldout is None and held.numel():
        heldout = FeatureRows(rows.hidden[held], rows.labels[held], rows.label_kind, rows.prefix_tokens, rows.sources)
    first = rows.prefix_tokens  # the served prefix (BOS) is never drafted from
    gamma = config.num_heads
    train_labels = head_labels(rows.labels[train], first, gamma)
    eos = [t for t in target.config.eos_token_ids if t < target.config.vocab_size]
    vocab = most_frequent_ids(train_labels[train_labels != IGNORE], target.config.vocab_size,
                              min(config.loss_vocab, target.config.vocab_size), eos)
    label_map = torch.full((target.config.vocab_size,), IGNORE, dtype=torch.long, device=HOST)
    label_map[vocab] = torch.arange(vocab.numel(), device=HOST)
    covered = float((map_labels(label_map, train_labels) != IGNORE).double().mean())
    head_rows = target.head_weight[vocab.to(target.device)]
    log(f"{train.numel()} training rows ({train_labels[..., 0].numel()} positions per head), loss vocabulary "
        f"{vocab.numel()} tokens covering {covered:.4f} of the labels; {0 if heldout is None else len(heldout)} "
        "held-out rows")

    torch.manual_seed(config.seed)
    heads = TokenSwiftHeads.for_target(target.config, gamma, target_name, config.chained).to(
        target.device, training_dtype(target))
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    defining = {**{k: v for k, v in asdict(config).items() if k != "max_minutes"},
                "data": digest({"caches": rows.sources, "labels": rows.label_kind})}
    state_path = out_dir / STATE_FILE
    start_step = 0
    resume = resume and has_committed_run(out_dir, state_path)
    if resume:
        verify_committed(out_dir)
        state = torch.load(state_path, weights_only=True, map_location=target.device)
        if state.get("defining") != defining:
            raise ValueError(f"cannot resume: {state_path} was written with other settings or feature caches "
                             f"({state.get('defining')}); resume with the same ones or start a new --out")
        start_step = restore_run(state, heads, optimizer, scheduler)
    elif state_path.exists():
        raise ValueError(f"{out_dir} already holds a training run; pass --resume or choose another --out")

    curve_path = out_dir / CURVE_FILE
    new_curve = not (resume and curve_path.exists())
    if not new_curve:
        keep_curve_until(curve_path, start_step)
    with curve_path.open("w" if new_curve else "a", newline="") as curve:
        writer = csv.writer(curve)
        if new_curve:
            writer.writerow(["step", "positions_per_head", "elapsed_s", "lr", "train_loss",
                             *[f"eval_acc_head{i + 1}" for i in range(gamma)]])

        def save(step: int) -> None:  # the heads and the run's state commit as one
            state = {"defining": defining, "config": asdict(config), "heads": heads.state_dict(),
                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step}
            Checkpoint(out_dir).commit({HEADS_FILE: heads.save, STATE_FILE: lambda path: torch.save(state, path)},
                                       {"defining": defining}, step)

        per_epoch = train.numel() // config.batch_size
        started = time.perf_counter()
        positions = 0
        for step in range(start_step, config.steps):
            epoch, index = divmod(step, per_epoch)  # epoch e's order: permutation seed + e (resume-exact)
            shuffled = train[torch.randperm(train.numel(), generator=torch.Generator().manual_seed(config.seed + epoch),
                                            device=HOST)]
            batch = shuffled[index * config.batch_size : (index + 1) * config.batch_size]
            hidden = rows.hidden[batch].to(target.device)
            loss, per_head, counted = loss_over(target, heads, hidden, rows.labels[batch], first, head_rows, label_map)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            positions += counted
            done = step + 1
            elapsed = time.perf_counter() - started
            timed_out = config.max_minutes is not None and elapsed > 60 * config.max_minutes
            if done % config.eval_every == 0 or done == config.steps or timed_out:
                accuracy = (heldout_accuracy(target, heads, heldout.hidden, heldout.labels, heldout.prefix_tokens)
                            if heldout is not None else [float("nan")] * gamma)
                writer.writerow([done, done * train_labels.shape[1] * config.batch_size, f"{elapsed:.1f}",
                                 f"{scheduler.get_last_lr()[0]:.2e}", f"{loss.item():.4f}",
                                 *[f"{a:.4f}" for a in accuracy]])
                curve.flush()
                log(f"step {done}/{config.steps} {elapsed:.0f}s loss {loss.item():.3f} per head "
                    f"{[round(x, 3) for x in per_head]} held-out top-1 {[round(a, 4) for a in accuracy]}")
            elif done % 10 == 0:
                log(f"step {done}/{config.steps} {elapsed:.0f}s loss {loss.item():.3f} per head "
                    f"{[round(x, 3) for x in per_head]} ({positions / elapsed:.0f} positions/s)")
            if done % config.save_every == 0 or done == config.steps or timed_out:
                save(done)
            if timed_out:
                log(f"stopping after {config.max_minutes} minutes at step {done}; continue with --resume")
                break
    return heads

