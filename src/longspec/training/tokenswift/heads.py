"""Training TokenSwift heads on a frozen target.

Loss: for each row t of a window, head i (1..γ) reads the target's final-norm
hidden state h_0 at t and is scored by cross-entropy against the token i + 1
positions ahead (the target's own head predicts t + 1; head 1 predicts t + 2).
Only the heads' linear layers train (AdamW, linear warm-up then cosine decay);
the target runs in inference mode. A random subset of rows per window is decoded,
which keeps the 3 x vocabulary-sized logits affordable on a CPU.

Checkpoints (heads safetensors + optimizer/scheduler/step) are written every
``save_every`` steps and at the end; ``resume=True`` continues from one and sees
the same batches an uninterrupted run would.
"""

from __future__ import annotations

import csv
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from longspec.runtime.atomic_files import Checkpoint, CheckpointError, trim_torn_tail, write_atomically
from longspec.runtime.device import HOST
from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.training.tokenswift.data import batches, split_heldout

HEADS_FILE = "heads.safetensors"
STATE_FILE = "trainer_state.pt"
CURVE_FILE = "curve.csv"


@dataclass(frozen=True)
class HeadsTrainingConfig:
    steps: int = 400
    batch_size: int = 4
    seq_len: int = 256
    rows_per_window: int = 16  # rows decoded per window (of seq_len - γ - 1 usable)
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    num_heads: int = 3
    chained: bool = True  # False: Medusa-style independent heads (see HeadsConfig)
    # Positions at the start of every window holding the served prefix (BOS): never
    # drafted from when serving (a prompt has content), so never trained on.
    prefix_tokens: int = 0
    heldout_windows: int = 32  # windows held out for evaluation
    eval_every: int = 50
    save_every: int = 50
    max_minutes: float | None = None  # stop (and save) after this much wall time
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < self.prefix_tokens + self.num_heads + 3:
            raise ValueError(f"seq_len must be >= prefix tokens + num_heads + 3, got {self.seq_len}")
        for name in ("steps", "batch_size", "rows_per_window", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _run_defining(config: dict) -> dict:
    """The settings a resumed run must share (the wall-time limit may change; runs from
    before independent heads existed trained chained ones)."""
    return {"chained": True, "prefix_tokens": 0, **{k: v for k, v in config.items() if k != "max_minutes"}}


def training_dtype(target) -> torch.dtype:
    """The heads' weights and the loss: float32, or the target's dtype where it is wider."""
    return torch.promote_types(target.dtype, torch.float32)


def has_committed_run(out_dir: Path, state_path: Path) -> bool:
    """Whether --resume finds a checkpoint in `out_dir`. A directory without one (a run
    killed before its first checkpoint) starts from step 0, said on stderr; a directory
    that does not exist is refused (most likely a mistyped --out)."""
    if not out_dir.is_dir():
        raise FileNotFoundError(f"cannot resume: {out_dir} does not exist (run without --resume first)")
    Checkpoint(out_dir).recover()
    if state_path.is_file():
        return True
    print(f"longspec: {out_dir} holds no checkpoint yet (a run stopped before its first one): starting at step 0",
          file=sys.stderr)
    return False


def verify_committed(out_dir: Path) -> None:
    """Refuse to resume from heads and state that are not a committed checkpoint's."""
    checkpoint = Checkpoint(out_dir)
    manifest = checkpoint.manifest()
    if manifest is None:
        raise CheckpointError(f"{out_dir} holds a run without a checkpoint manifest (written by an older version, "
                              "or damaged): start a new --out")
    checkpoint.verify(manifest["inputs"])  # every file as committed


def keep_curve_until(path: Path, step: int) -> None:
    """A resumed run's curve: the rows up to its checkpoint's step (later rows, and a row a
    kill cut off, are written again), rewritten atomically."""
    trim_torn_tail(path)
    lines = path.read_text().splitlines(keepends=True)
    kept = lines[:1] + [line for line in lines[1:] if line.split(",")[0].isdigit() and int(line.split(",")[0]) <= step]
    if len(kept) != len(lines):
        write_atomically(path, "".join(kept))


def lr_factor(step: int, config: HeadsTrainingConfig) -> float:
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def decode_logits(target, hidden: torch.Tensor) -> torch.Tensor:
    """The target's final norm + LM head (+ soft-capping), differentiable (the
    runtime's prepacked inference matmul has no backward)."""
    logits = F.linear(target.final_norm(hidden.to(target.dtype)), target.head_weight)
    cap = target.config.final_logit_softcapping
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def target_hidden(target, windows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states [B, R, H] of the frozen target at the given rows."""
    B, T = windows.shape
    cache = target.new_cache(T, batch_size=B, max_forward_tokens=T)
    out = target(windows, cache, logits_rows=rows)
    return out.hidden.clone()  # leaves inference mode: usable by autograd


def heads_loss(target, heads: TokenSwiftHeads, windows: torch.Tensor, rows: torch.Tensor):
    """Mean cross-entropy over heads, per-head loss and top-1 accuracy (windows and rows
    are host bookkeeping; the loss is computed on the target's device)."""
    windows, rows = windows.to(target.device), rows.to(target.device)
    hidden = heads.hidden_states(target, target_hidden(target, windows, rows))  # [B, R, γ, H]
    losses, accuracies = [], []
    for i in range(hidden.shape[2]):
        labels = windows[:, rows + i + 2]  # head i+1 predicts the token i+2 ahead
        logits = decode_logits(target, hidden[:, :, i]).to(training_dtype(target))
        losses.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
        accuracies.append((logits.argmax(-1) == labels).float().mean().item())
    return torch.stack(losses).mean(), [l.item() for l in losses], accuracies


def restore_run(state: dict, heads: TokenSwiftHeads, optimizer, scheduler) -> int:
    """Load a checkpoint's heads, optimizer and schedule; return its step."""
    heads.load_state_dict(state["heads"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"]


def sample_rows(T: int, count: int, gamma: int, generator: torch.Generator, first: int = 0) -> torch.Tensor:
    """`count` distinct positions in [first, T - gamma - 1): each has γ + 1 tokens after it."""
    usable = T - gamma - 1 - first
    return first + torch.randperm(usable, generator=generator, device=HOST)[: min(count, usable)].sort().values


@torch.no_grad()
def evaluate(target, heads, heldout: torch.Tensor, config: HeadsTrainingConfig):
    generator = torch.Generator().manual_seed(config.seed + 12345)
    losses, accs = [], []
    for begin in range(0, heldout.shape[0], config.batch_size):
        windows = heldout[begin : begin + config.batch_size]
        rows = sample_rows(windows.shape[1], config.rows_per_window, config.num_heads, generator, config.prefix_tokens)
        _, per_head, acc = heads_loss(target, heads, windows, rows)
        losses.append(per_head)
        accs.append(acc)
    mean = lambda table: [sum(col) / len(col) for col in zip(*table)]  # noqa: E731
    return mean(losses), mean(accs)


def train_heads(target, data: torch.Tensor, out_dir: Path, config: HeadsTrainingConfig, *,
                resume: bool = False, target_name: str = "", log=print, data_key: str | None = None) -> TokenSwiftHeads:
    """Train heads on windows ``data`` [N, seq_len]; write checkpoints to ``out_dir``.
    data_key: a fingerprint of the files and tokenizer the windows came from; a
    resumed run must have the same one (its data order depends on them)."""
    if data.shape[1] != config.seq_len:
        raise ValueError(f"data windows have length {data.shape[1]}, config.seq_len is {config.seq_len}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, heldout = split_heldout(data, config.heldout_windows, config.seed)
    if train.shape[0] < config.batch_size:
        raise ValueError(f"only {train.shape[0]} training windows for batch size {config.batch_size}; add data")
    torch.manual_seed(config.seed)
    # Heads train in float32 at least (a bf16 target's heads keep float32 weights) and in
    # float64 for a float64 target, whose runs are then equal across devices to rounding.
    heads = TokenSwiftHeads.for_target(target.config, config.num_heads, target_name, config.chained).to(
        target.device, training_dtype(target))
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    start_step = 0
    state_path = out_dir / STATE_FILE
    resume = resume and has_committed_run(out_dir, state_path)
    if resume:
        verify_committed(out_dir)
        state = torch.load(state_path, weights_only=True, map_location=target.device)
        if _run_defining(state["config"]) != _run_defining(asdict(config)):
            raise ValueError(f"cannot resume: {state_path} was written with a different configuration {state['config']}")
        if data_key is not None and state.get("data_key") != data_key:
            raise ValueError(f"cannot resume: {state_path} was trained on other data files or another tokenizer; "
                             "resume with the same --data/--stdlib-files and model, or start a new --out")
        start_step = restore_run(state, heads, optimizer, scheduler)
    elif state_path.exists():
        raise ValueError(f"{out_dir} already holds a training run; pass --resume or choose another --out")

    curve_path = out_dir / CURVE_FILE
    new_curve = not (resume and curve_path.exists())
    if not new_curve:
        keep_curve_until(curve_path, start_step)
    curve = curve_path.open("w" if new_curve else "a", newline="")
    writer = csv.writer(curve)
    if new_curve:
        writer.writerow(["step", "tokens", "elapsed_s", "lr", "train_loss", "eval_loss", "eval_acc_head1",
                         "eval_acc_head2", "eval_acc_head3"])

    def save(step: int) -> None:  # the heads and the run's state commit as one
        state = {"config": asdict(config), "heads": heads.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "step": step, "data_key": data_key}
        Checkpoint(out_dir).commit({HEADS_FILE: heads.save, STATE_FILE: lambda path: torch.save(state, path)},
                                   {"config": _run_defining(asdict(config)), "data_key": data_key}, step)

    started = time.perf_counter()
    step = start_step
    stream = batches(train, config.batch_size, config.seed, start_step)
    tokens_per_step = config.batch_size * min(config.rows_per_window, config.seq_len - config.num_heads - 1)
    for step in range(start_step, config.steps):
        windows = next(stream)
        # Rows seeded per step: a resumed run draws what an uninterrupted one would.
        rng = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        rows = sample_rows(config.seq_len, config.rows_per_window, config.num_heads, rng, config.prefix_tokens)
        loss, per_head, acc = heads_loss(target, heads, windows, rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        elapsed = time.perf_counter() - started
        done = step + 1
        timed_out = config.max_minutes is not None and elapsed > 60 * config.max_minutes
        if done % config.eval_every == 0 or done == config.steps or timed_out:
            eval_loss, eval_acc = evaluate(target, heads, heldout, config)
            writer.writerow([done, done * tokens_per_step, f"{elapsed:.1f}", f"{scheduler.get_last_lr()[0]:.2e}",
                             f"{loss.item():.4f}", f"{sum(eval_loss) / len(eval_loss):.4f}",
                             *[f"{a:.4f}" for a in eval_acc]])
            curve.flush()
            log(f"step {done}/{config.steps} {elapsed:.0f}s train {loss.item():.3f} eval {eval_loss} acc {eval_acc}")
        elif done % 10 == 0:
            log(f"step {done}/{config.steps} {elapsed:.0f}s train {loss.item():.3f} per-head {per_head} acc {acc}")
        if done % config.save_every == 0 or done == config.steps or timed_out:
            save(done)
        if timed_out:
            log(f"stopping after {config.max_minutes} minutes at step {done}; continue with --resume")
            break
    curve.close()
    return heads
