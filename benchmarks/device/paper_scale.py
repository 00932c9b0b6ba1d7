"""The papers' scale on one GPU: 7-8B shapes at 1k-32k (100k) tokens of context,
against `transformers` and the memory floor, in one call.

    python benchmarks/device/paper_scale.py --out $OUT            # on a CUDA machine (~8 minutes on an H200)
    python benchmarks/device/paper_scale.py --device cpu --shapes tiny --main-shape tiny \
        --dtype float32 --contexts 64 128 --long-context 256 --new-tokens 8 --compile-backend none   # anywhere

Random weights of real models' shapes, built on the device (no hub, no checkpoint);
where a prefill would only spend the budget, random K/V is committed straight into the
cache (a step's cost depends on how many keys it reads, not on their values). Sections,
most important first; each is written to `results.jsonl` the moment it ends, and one
that fails or finds the time budget (`--budget-s`) spent is recorded as such while the
rest go on:

1. the device's copy bandwidth and bf16 matrix rate (the ceilings);
2. attention of a 64-node tree over a long prefix (the main shape's heads): the Triton
   tree kernel, SDPA with one full mask over prefix + tree, and SDPA over the prefix
   and the masked tree merged by log-sum-exp (our GPU fallback), outputs compared;
3. for the main shape (Llama-3.1-8B): the verification cost of k = 1..64 tokens (chain
   and tree) relative to a decode step; AR decode through the engine per context
   against the HBM floor (weights + attended K/V per step / copy bandwidth); a
   self-drafting step over a partial cache (MagicDec's and TokenSwift's budget)
   against a full step at long context; a LongSpec draft round (1 layer of the
   target's width cross-attending its K/V, 32k draft vocabulary) against a target
   step; oracle speculation at a controlled acceptance alpha (chain and tree, B = 1
   and 8);
4. the same shape through the compiled static steps (CUDA graphs): AR per context,
   the verification cost, the oracle chain;
5. `transformers` generate on the same weights: static cache, compiled as its docs
   say (`cache_implementation="static"`, which compiles the decoding step), and eager;
6. the other shapes (Qwen2.5-7B, Gemma 3 270M / 1B / 4B): AR eager against the floor
   and the verification cost of 64 tokens.

Writes results.jsonl, results.md (rewritten after every section) and profile-compiled.txt (the
operators of a few compiled decode steps) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check.py beside this script

from gpu_check import batch_throughput  # noqa: E402
from longspec.runtime.attention import sdpa_attention, tree_kernel_attention  # noqa: E402
from longspec.runtime.device import HOST, device_name, resolve_device, synchronize  # noqa: E402
from longspec.runtime.loading import decoder_from_state_dict  # noqa: E402
from longspec.runtime.static_step import CompileOptions  # noqa: E402
from longspec.speculation.cost_model import binary_tree_parents, commit_random_keys, measure_forward_cost  # noqa: E402
from longspec.speculation.drafters.base import DraftContext, Drafter  # noqa: E402
from longspec.speculation.drafters.longspec.config import DraftConfig  # noqa: E402
from longspec.speculation.drafters.longspec.drafter import LongSpecDrafter  # noqa: E402
from longspec.speculation.drafters.longspec.model import DraftModel  # noqa: E402
from longspec.speculation.drafters.longspec.strategies import ChainStrategy  # noqa: E402
from longspec.speculation.drafters.shared.partial_cache import PartialKVCache  # noqa: E402
from longspec.speculation.engine import EngineOptions, SpeculativeEngine  # noqa: E402
from longspec.speculation.metrics import GenerationStats  # noqa: E402
from longspec.speculation.tree import Tree  # noqa: E402

K, M = 1024, 1024 * 1024


def shape_configs() -> dict:
    """`transformers` configs of real models' shapes. RoPE scaling and context limits
    do not change a step's cost: every shape may address 128k positions here."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    long = 131072
    llama3_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

    def gemma(hidden, intermediate, layers, heads, kv_heads, window, vocab=262144):
        return lambda: Gemma3TextConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256, sliding_window=window,
            query_pre_attn_scalar=256, max_position_embeddings=long, rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0, final_logit_softcapping=None, attn_logit_softcapping=None)

    return {
        "llama-3.1-8b": lambda: LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, max_position_embeddings=long, tie_word_embeddings=False,
            rope_parameters=llama3_rope),
        "qwen2.5-7b": lambda: Qwen2Config(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, max_position_embeddings=long, tie_word_embeddings=False, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
        "gemma3-270m": gemma(640, 2048, 18, 4, 1, 512),
        "gemma3-1b": gemma(1152, 6912, 26, 4, 1, 512),
        "gemma3-4b": gemma(2560, 10240, 34, 8, 4, 1024, vocab=262208),
        "tiny": lambda: LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    }


# ----------------------------------------------------------------------------- models


def build(config, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """(our decoder, the `transformers` model) on random weights of `config`'s shapes,
    built on the device; ours with decisive greedy tokens (`decisive_next_tokens`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        peer = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ours = decoder_from_state_dict(config, peer.state_dict(), dtype).place(device)
    decisive_next_tokens(ours, seed)
    return ours, peer


def decisive_next_tokens(model, seed: int) -> None:
    """Give our copy of the weights a greedy continuation without near-ties: the
    embedding scaled to dominate the residual stream (the layers' outputs are a few
    units; the scaled rows are hundreds), and the head's row of token perm[i] set to
    the embedding of i, so the next token is perm[current] by a wide margin (a tied
    head repeats the current token). With plain random weights, bf16 logits over a
    128k vocabulary tie often, a 9-token forward breaks a tie unlike a 1-token one,
    and a reference continuation stops being the target's after a few tokens (on an
    H200 the oracle's tau was 1.02). A step's cost does not depend on the values."""
    embed = model.embed_weight.data
    if model.lm_head_weight is not None:
        permutation = torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(seed)).to(embed.device)
        model.lm_head_weight.data = embed[torch.argsort(permutation)].clone()
    model.embed_weight.data = embed * 1e4


def step_bytes(model, context: int) -> int:
    """Bytes a decode step must read: every weight once except an untied embedding (one
    row), plus the K/V of the positions each layer attends (sliding layers: their window)."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not c.tie_word_embeddings:
        weights -= model.embed_weight.numel() * model.embed_weight.element_size()
    kv_per_position = 2 * c.num_kv_heads * c.head_dim * model.embed_weight.element_size()
    attended = sum(min(context, c.sliding_window) if sliding else context for sliding in c.layer_is_sliding)
    return weights + kv_per_position * attended


def random_prompt(config, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed), device=HOST)


def seconds(run, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall seconds of run() (the device synchronised around each call)."""
    for _ in range(warmup):
        run()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def generate(model, prompt: torch.Tensor, new_tokens: int, drafter=None) -> tuple[list[int], GenerationStats]:
    engine = SpeculativeEngine(model, EngineOptions(progress=False))
    stats = GenerationStats()
    tokens = [t for piece in engine.generate(prompt, max_new_tokens=new_tokens, drafter=drafter, stats=stats)
              for t in piece.tolist()]
    synchronize(model.device)
    return tokens, stats


# ------------------------------------------------------------ controlled acceptance


class ControlledAcceptanceDrafter(Drafter):
    """An oracle of controlled quality: at each depth it proposes the true next token
    (read from a known greedy continuation) with probability `alpha`, a wrong one
    otherwise. `width=1`: a chain of `length`, whose first wrong token ends what a
    round can accept. `width=2`: at each depth a second candidate, true with
    probability alpha where the first was wrong (a drafter's top-2), and only the true
    candidate is extended: the per-depth acceptance is 1 - (1 - alpha)^2."""

    def __init__(self, reference: list[int], prompt_length: int, alpha: float, length: int, *, width: int = 1,
                 vocab_size: int, seed: int = 0) -> None:
        if not 0 <= alpha <= 1 or width not in (1, 2) or length < 1:
            raise ValueError(f"need 0 <= alpha <= 1, width 1 or 2, length >= 1; got {alpha}, {width}, {length}")
        self.reference, self.prompt_length, self.alpha = reference, prompt_length, alpha
        self.length, self.width, self.vocab_size = length, width, vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.proposed = self.true_proposed = 0  # first candidates proposed / of them true (the statistical test)

    def begin(self, context: DraftContext) -> None:
        pass

    def observe(self, committed: torch.Tensor) -> None:
        pass

    def _hit(self) -> bool:
        return bool(torch.rand((), generator=self.generator) < self.alpha)

    def _wrong(self, true: int, offset: int) -> int:
        return (true + offset) % self.vocab_size

    def propose(self, context: DraftContext) -> Tree:
        done = context.tokens.numel() - self.prompt_length
        truth = self.reference[done : done + min(self.length, context.max_nodes // self.width)]
        tokens, parents, on_path = [context.root], [-1], 0
        for true in truth:
            first_true = self._hit()
            self.proposed += 1
            self.true_proposed += first_true
            candidates = [true if first_true else self._wrong(true, 1)]
            if self.width == 2:
                candidates.append(self._wrong(true, 2) if first_true else (true if self._hit() else self._wrong(true, 2)))
            nodes = []
            for token in candidates:
                tokens.append(token)
                parents.append(on_path)
                nodes.append(len(tokens) - 1)
            if true not in candidates:
                break
            on_path = nodes[candidates.index(true)]
        return Tree.from_parents(torch.tensor(tokens), torch.tensor(parents))


# ------------------------------------------------------------------------ sections


def ceilings(device: torch.device, dtype: torch.dtype, megabytes: int) -> dict:
    """Copy bandwidth (bytes read + written), read bandwidth (a sum) and the matrix rate."""
    data = torch.empty(megabytes * M // 2, dtype=torch.bfloat16, device=device).normal_()
    out = torch.empty_like(data)
    copy_s = seconds(lambda: out.copy_(data), device, 10)
    read_s = seconds(lambda: data.sum(), device, 10)
    size = 8192 if device.type == "cuda" else 512
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    matmul_s = seconds(lambda: a @ b, device, 10)
    nbytes = data.numel() * data.element_size()
    return {"copy_gbs": 2 * nbytes / copy_s / 1e9, "read_gbs": nbytes / read_s / 1e9,
            "matmul_tflops": 2 * size ** 3 / matmul_s / 1e12}


def tree_attention_costs(config, device: torch.device, dtype: torch.dtype, contexts: list[int], nodes: int,
                         repeats: int) -> dict:
    """One layer's attention of a `nodes`-token tree (a binary tree's mask) over a prefix."""
    from longspec.runtime.attention import tree_kernel_fits

    c = config
    Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    mask = Tree.from_parents(torch.zeros(nodes, dtype=torch.long), binary_tree_parents(nodes - 1)).ancestor_mask().to(device)
    scale = D ** -0.5
    generator = torch.Generator(device=device).manual_seed(0)
    result = {}
    for context in contexts:
        def rand(*shape):
            return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
        q, k_prefix, v_prefix = rand(1, Hq, nodes, D), rand(1, Hkv, context, D), rand(1, Hkv, context, D)
        k_tree, v_tree = rand(1, Hkv, nodes, D), rand(1, Hkv, nodes, D)
        keys, values = torch.cat([k_prefix, k_tree], 2), torch.cat([v_prefix, v_tree], 2)
        full_mask = torch.cat([torch.ones(nodes, context, dtype=torch.bool, device=device), mask], 1)

        def full():
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=full_mask, scale=scale, enable_gqa=True)

        def merged():
            return sdpa_attention(q, k_prefix, v_prefix, None, k_tree, v_tree, mask, scale)

        variants = {"sdpa_full_mask": full, "sdpa_prefix_tree_merged": merged}
        # Triton runs compiled on a GPU, or through its interpreter (TRITON_INTERPRET=1, the CPU test)
        if (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") and tree_kernel_fits(q, mask):
            from longspec.runtime.triton_tree_attention import tree_attention_split

            lengths = torch.full((1,), context, dtype=torch.int32, device=device)
            variants["triton_tree_kernel"] = lambda: tree_kernel_attention(q, k_prefix, v_prefix, mask, k_tree, v_tree, scale)
            variants["triton_split_kernel"] = lambda: tree_attention_split(
                q, k_prefix, v_prefix, lengths, k_tree, v_tree, mask, scale)[0]
        reference = full().float()
        row = {}
        for name, run in variants.items():
            row[name + "_ms"] = 1e3 * seconds(run, device, repeats)
            row[name + "_max_abs_error"] = float((run().float() - reference).abs().max())
        result[context] = row
        del q, k_prefix, v_prefix, k_tree, v_tree, keys, values
    return result


def verification_costs(model, contexts: list[int], ks: list[int], repeats: int) -> dict:
    """Seconds of a k-token verification forward (chain and binary tree) per context."""
    chain = lambda n: torch.arange(-1, n)  # noqa: E731  (a root and n nodes)
    return {context: {shape: dict(zip(cost.ks, cost.seconds))
                      for shape, cost in (("chain", measure_forward_cost(model, context=context, ks=ks, repeats=repeats,
                                                                          parents_for=chain)),
                                          ("tree", measure_forward_cost(model, context=context, ks=ks, repeats=repeats)))}
            for context in contexts}


def ar_rates(model, contexts: list[int], new_tokens: int, bandwidth_gbs: float) -> dict:
    """AR decode through the engine per context (a real prefill of a random prompt)
    against the floor: step bytes / copy bandwidth."""
    result = {}
    for context in contexts:
        tokens, stats = generate(model, random_prompt(model.config, context), new_tokens)
        floor = bandwidth_gbs * 1e9 / step_bytes(model, context + new_tokens // 2)
        result[context] = {"tokens_per_s": stats.decode_tokens_per_s, "floor_tokens_per_s": floor,
                           "of_floor": stats.decode_tokens_per_s / floor, "prefill_tokens_per_s": stats.prefill_tokens_per_s,
                           "tokens": tokens}
    return result


def self_drafting_costs(model, contexts: list[int], budget: int, repeats: int) -> dict:
    """A drafting step over a partial cache of `budget` slots (MagicDec's StreamingLLM
    window, TokenSwift's budget) against a full step, both eager, one new token."""
    c = model.config
    result = {}
    for context in contexts:
        full = model.new_cache(context + 2, max_forward_tokens=512)
        partial = PartialKVCache(c, budget, 4, max_forward_tokens=64, dtype=model.dtype, device=model.device)
        with torch.inference_mode():
            commit_random_keys(model, full, context, chunk=512)
            commit_random_keys(model, partial, budget - 64, chunk=64)
        token = torch.zeros((1, 1), dtype=torch.long)

        def step(cache):
            def run():
                model(token, cache, positions=torch.tensor([context]), logits_rows=slice(-1, None))
                cache.drop_pending()
            return run

        full_s, partial_s = seconds(step(full), model.device, repeats), seconds(step(partial), model.device, repeats)
        result[context] = {"full_step_ms": 1e3 * full_s, "partial_step_ms": 1e3 * partial_s, "budget": budget,
                           "partial_over_full": partial_s / full_s}
        del full, partial
    return result


def longspec_draft_cost(model, context: int, new_tokens: int, draft_vocab: int, length: int) -> dict:
    """A LongSpec draft (random weights: nothing is accepted, every round is one draft
    chain of `length` forwards plus its catch-up) against the target's decode step."""
    c = model.config
    config = DraftConfig.for_target(c, draft_vocab_size=min(draft_vocab, c.vocab_size),
                                    intermediate_size=c.intermediate_size, self_num_heads=c.num_heads,
                                    self_head_dim=c.head_dim, cross_window=None)
    drafter = LongSpecDrafter(DraftModel(config).reset_parameters(), ChainStrategy(length))
    prompt = random_prompt(c, context)
    _, ar = generate(model, prompt, new_tokens)
    _, spec = generate(model, prompt, new_tokens, drafter)
    rounds = max(spec.target_forwards, 1)
    step_ms = 1e3 * ar.decode_s / max(ar.target_forwards, 1)
    draft_round_ms = 1e3 * spec.draft_s / rounds
    return {"context": context, "chain_length": length, "draft_vocab": config.draft_vocab_size,
            "draft_parameters": sum(p.numel() for p in drafter.draft.parameters()),
            "target_step_ms": step_ms, "draft_round_ms": draft_round_ms,
            "draft_forward_ms": draft_round_ms / length, "draft_forward_over_target_step": draft_round_ms / length / step_ms}


def oracle_rates(model, context: int, new_tokens: int, alphas: list[float], length: int, batch_sizes: list[int],
                 reference: list[int] | None = None) -> dict:
    """Speed-up of a drafter of per-token acceptance alpha, chain and top-2 tree, over AR
    on the same prompt, per batch size (rows share the prompt, each its own draws)."""
    c = model.config
    prompt = random_prompt(c, context)
    if reference is None:
        reference, _ = generate(model, prompt, new_tokens)
    result = {}
    for rows in batch_sizes:
        def rate(make_drafter) -> tuple[float, float, float]:
            if rows == 1:
                tokens, stats = generate(model, prompt, new_tokens, make_drafter(0))
                return stats.decode_tokens_per_s, stats.tau, float(tokens == reference)
            drafters = [make_drafter(row) for row in range(rows)]
            return batch_throughput(model, prompt, new_tokens, rows, drafters), float("nan"), float("nan")

        ar, _, _ = rate(lambda row: None)
        entry = {"ar_tokens_per_s": ar}
        for alpha in alphas:
            for width, shape in ((1, "chain"), (2, "tree")):
                make = (lambda row, a=alpha, w=width: ControlledAcceptanceDrafter(
                    reference, context, a, length, width=w, vocab_size=c.vocab_size, seed=row))
                tokens_per_s, tau, equal = rate(make)
                entry[f"alpha {alpha} {shape}"] = {"tokens_per_s": tokens_per_s, "over_ar": tokens_per_s / ar,
                                                   "tau": tau, "tokens_equal_ar": equal}
        result[rows] = entry
    return result


def peer_rates(peer, contexts: list[int], new_tokens: int, compiled: bool) -> dict:
    """`transformers` generate's decode rate per context: (N - 1) tokens over the time
    of an N-token call less a 1-token call (its prefill). compiled: the static cache,
    which `generate` compiles for decoding on a GPU (its documented recipe)."""
    kwargs = {"cache_implementation": "static"} if compiled else {}
    if not compiled:
        kwargs["disable_compile"] = True
    result = {}
    for context in contexts:
        ids = random_prompt(peer.config, context).unsqueeze(0).to(peer.device)

        def call(n: int) -> float:
            start = time.perf_counter()
            with torch.inference_mode():
                peer.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, **kwargs)
            synchronize(peer.device)
            return time.perf_counter() - start

        started = time.perf_counter()
        call(new_tokens)  # compiles (first call per cache shape) and warms up
        first_s = time.perf_counter() - started
        one, whole = call(1), call(new_tokens)
        result[context] = {"tokens_per_s": (new_tokens - 1) / (whole - one), "first_call_s": first_s}
    return result


def compiled_rates(model, contexts: list[int], new_tokens: int, ks: list[int], backend, bandwidth_gbs: float,
                   repeats: int, verify_context: int, alphas: list[float], length: int, profile: Path | None) -> dict:
    """Our compiled static steps: compile time, AR per context against the floor, the
    verification cost at `verify_context`, the oracle chain; tokens against eager's."""
    buckets = tuple(sorted({1, length + 1, max(ks)}))
    options = CompileOptions(backend=backend, mode="reduce-overhead" if model.device.type == "cuda" else None,
                             buckets=buckets) if backend is not None else CompileOptions(backend=None, buckets=buckets)
    model.compile_steps(options)
    try:
        started = time.perf_counter()
        model.static_steps.warm_up(max(EngineOptions().prefill_chunk, EngineOptions().max_tree_nodes + 1))
        result = {"buckets": buckets, "compile_s": time.perf_counter() - started}
        result["ar"] = ar_rates(model, contexts, new_tokens, bandwidth_gbs)
        if profile is not None:
            write_profile(model, contexts[0], profile)
        cost = measure_forward_cost(model, context=verify_context, ks=ks, repeats=repeats)
        result["verification_s"] = dict(zip(cost.ks, cost.seconds))
        result["oracle"] = oracle_rates(model, verify_context, new_tokens, alphas, length, [1],
                                        reference=result["ar"].get(verify_context, {}).get("tokens"))
        result["failure"] = model.static_steps.failure
        result["static_calls"] = model.static_steps.calls
    finally:
        model.compile_steps(False)
    return result


def write_profile(model, context: int, path: Path, steps: int = 8) -> None:
    """Where `steps` decode steps at `context` spend their time, by operator (device time
    first where there is a device), as a table in `path`."""
    from torch.profiler import ProfilerActivity, profile

    prompt = random_prompt(model.config, context)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    prof = profile(activities=activities)
    engine = SpeculativeEngine(model, EngineOptions(progress=False))
    for i, _ in enumerate(engine.generate(prompt, max_new_tokens=steps + 1)):
        if i == 0:  # after prefill and the first token
            synchronize(model.device)
            prof.start()
    synchronize(model.device)
    prof.stop()
    averages = prof.key_averages()
    key = "self_device_time_total" if model.device.type == "cuda" else "self_cpu_time_total"
    table = averages.table(sort_by=key, row_limit=30, max_name_column_width=70)
    path.write_text(f"{steps} decode steps at {context} tokens\n{table}")


# ------------------------------------------------------------------------- driver


class Run:
    """Sections in order under one time budget; each result is written as it ends."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.deadline, self.started = out, time.perf_counter() + budget_s, time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, object] = {}
        (out / "results.jsonl").write_text("")

    def section(self, name: str, work, needs_s: float = 0.0):
        left = self.deadline - time.perf_counter()
        if left < needs_s:
            value = {"skipped": f"{left:.0f} s of the budget left, the section needs about {needs_s:.0f} s"}
        else:
            started = time.perf_counter()
            try:
                value = work()
            except Exception as error:  # one failing section must not cost the others
                traceback.print_exc()
                value = {"error": f"{type(error).__name__}: {error}"}
            print(f"[{time.perf_counter() - self.started:.0f} s] {name}: {time.perf_counter() - started:.1f} s",
                  flush=True)
        self.results[name] = value
        with (self.out / "results.jsonl").open("a") as f:
            f.write(json.dumps({"section": name, "value": value}, default=str) + "\n")
        (self.out / "results.md").write_text(markdown(self.results))
        return value


def drop_tokens(value):
    """The results without generated token lists (kept only to compare runs)."""
    if isinstance(value, dict):
        return {k: drop_tokens(v) for k, v in value.items() if k != "tokens"}
    return value


def markdown(results: dict) -> str:
    """The summary tables of what has run so far (sections missing or failed say so)."""
    lines = []

    def failed(name) -> bool:
        value = results.get(name)
        if isinstance(value, dict) and ("error" in value or "skipped" in value):
            lines.append(f"- {name}: {value.get('error') or value.get('skipped')}")
            return True
        return value is None

    def cell(x, fmt="{:.2f}"):
        return "–" if x is None else fmt.format(x)

    machine = results.get("machine") or {}
    lines += [f"Machine: {machine.get('device', '?')}; torch {machine.get('torch', '?')}, transformers "
              f"{machine.get('transformers', '?')}; dtype {machine.get('dtype', '?')}.", ""]
    if not failed("ceilings"):
        c = results["ceilings"]
        lines += [f"Ceilings: copy {c['copy_gbs']:.0f} GB/s (read + written), read {c['read_gbs']:.0f} GB/s, "
                  f"matrix product {c['matmul_tflops']:.0f} TFLOP/s.", ""]
    if not failed("tree attention"):
        lines += ["Attention of a 64-node tree over the prefix (one layer, the main shape's heads), ms:", "",
                  "| context | Triton tree kernel | Triton, split prefix | SDPA, full mask | SDPA prefix + tree merged "
                  "| full mask / Triton (split) |", "|---|---|---|---|---|---|"]
        for context, row in results["tree attention"].items():
            triton, split = row.get("triton_tree_kernel_ms"), row.get("triton_split_kernel_ms")
            lines.append(f"| {context} | {cell(triton, '{:.3f}')} | {cell(split, '{:.3f}')} | "
                         f"{row['sdpa_full_mask_ms']:.3f} | {row['sdpa_prefix_tree_merged_ms']:.3f} | "
                         f"{cell(triton and row['sdpa_full_mask_ms'] / triton)} "
                         f"({cell(split and row['sdpa_full_mask_ms'] / split)}) |")
        lines.append("")
    for label, name in (("eager", "verification"), ):
        if not failed(name):
            lines += [f"Verification of k tokens / a decode step ({label}):", "",
                      "| context | shape | " + " | ".join(f"k={k}" for k in next(iter(
                          next(iter(results[name].values())).values()))) + " |"]
            lines.append("|---|---|" + "---|" * len(next(iter(next(iter(results[name].values())).values()))))
            for context, shapes in results[name].items():
                for shape, costs in shapes.items():
                    one = costs[1] if 1 in costs else costs["1"]
                    lines.append(f"| {context} | {shape} | " + " | ".join(
                        f"{v / one:.2f}× ({1e3 * v:.2f} ms)" for v in costs.values()) + " |")
            lines.append("")
    ar_sections = [(n, results[n]) for n in ("AR eager", "compiled") if not failed(n)]
    if ar_sections:
        lines += ["AR decode, tokens/s (share of the HBM floor):", "", "| steps | context | ours | floor |",
                  "|---|---|---|---|"]
        for name, value in ar_sections:
            rows = value if name == "AR eager" else value.get("ar", {})
            for context, row in rows.items():
                lines.append(f"| {name} | {context} | {row['tokens_per_s']:.1f} ({row['of_floor']:.2f}) | "
                             f"{row['floor_tokens_per_s']:.1f} |")
        lines.append("")
        if "compiled" in results and "compile_s" in results["compiled"]:
            c = results["compiled"]
            one = c["verification_s"].get(1) or c["verification_s"].get("1")
            lines += [f"Compiled: buckets {c['buckets']} in {c['compile_s']:.0f} s; verification " + ", ".join(
                f"k={k}: {v / one:.2f}×" for k, v in c["verification_s"].items()) + f"; failure: {c['failure']}.", ""]
    for name in ("transformers compiled", "transformers eager"):
        if not failed(name):
            lines += [f"{name} (static cache{'' if 'compiled' in name else ' off'}): " + ", ".join(
                f"{context}: {row['tokens_per_s']:.1f} tok/s (first call {row['first_call_s']:.0f} s)"
                for context, row in results[name].items()), ""]
    if not failed("self-drafting"):
        lines += ["Self-drafting step over a partial cache / a full step (eager, ms):", "",
                  "| context | budget | partial | full | partial / full |", "|---|---|---|---|---|"]
        for context, row in results["self-drafting"].items():
            lines.append(f"| {context} | {row['budget']} | {row['partial_step_ms']:.2f} | {row['full_step_ms']:.2f} | "
                         f"{row['partial_over_full']:.2f} |")
        lines.append("")
    if not failed("longspec draft"):
        d = results["longspec draft"]
        lines += [f"LongSpec draft ({d['draft_parameters'] / 1e6:.0f}M parameters, {d['draft_vocab']} draft tokens) at "
                  f"{d['context']} tokens: a round of {d['chain_length']} draft forwards {d['draft_round_ms']:.2f} ms, "
                  f"one forward {d['draft_forward_ms']:.2f} ms = {d['draft_forward_over_target_step']:.2f}× a target "
                  f"step ({d['target_step_ms']:.2f} ms).", ""]
    oracles = [(n, results[n]) for n in ("oracle eager",) if not failed(n)]
    if "compiled" in results and isinstance(results["compiled"], dict) and "oracle" in results["compiled"]:
        oracles.append(("oracle compiled", results["compiled"]["oracle"]))
    if oracles:
        lines += ["Controlled-acceptance oracle (alpha per token) × AR, same prompt and steps:", "",
                  "| steps | rows | AR tok/s | " + " | ".join(k for k in next(iter(oracles[0][1].values())) if k != "ar_tokens_per_s")
                  + " |", "|---|---|---|" + "---|" * (len(next(iter(oracles[0][1].values()))) - 1)]
        for name, value in oracles:
            for rows, entry in value.items():
                lines.append(f"| {name} | {rows} | {entry['ar_tokens_per_s']:.1f} | " + " | ".join(
                    f"{v['over_ar']:.2f}× (τ {v['tau']:.2f})" for k, v in entry.items() if k != "ar_tokens_per_s") + " |")
        lines.append("")
    others = {n: v for n, v in results.items() if n.startswith("shape ")}
    if others:
        lines += ["Other shapes, eager: AR tokens/s (share of the floor) per context; 64-token verification / a step:",
                  "", "| shape | AR | k=64 / k=1 |", "|---|---|---|"]
        for name, value in others.items():
            if "error" in value or "skipped" in value:
                lines.append(f"| {name[6:]} | {value.get('error') or value.get('skipped')} | |")
                continue
            ar = ", ".join(f"{c}: {r['tokens_per_s']:.1f} ({r['of_floor']:.2f})" for c, r in value["ar"].items())
            lines.append(f"| {name[6:]} | {ar} | {value['verify_64_over_1']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--main-shape", default="llama-3.1-8b", choices=sorted(shape_configs()))
    parser.add_argument("--shapes", nargs="*", default=["qwen2.5-7b", "gemma3-270m", "gemma3-1b", "gemma3-4b"],
                        help="the other shapes (AR and the 64-token verification, eager)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1 * K, 8 * K, 32 * K])
    parser.add_argument("--long-context", type=int, default=100 * K, help="self-drafting's longest context")
    parser.add_argument("--verify-context", type=int, default=None, help="default: the middle of --contexts")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.6, 0.8])
    parser.add_argument("--oracle-length", type=int, default=8, help="depth of the oracle's chain and tree")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--partial-budget", type=int, default=4096)
    parser.add_argument("--draft-vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile-backend", default="inductor",
                        help="backend of the compiled static steps; 'none' runs them uncompiled (the CPU test)")
    parser.add_argument("--budget-s", type=float, default=480, help="sections that would start after this are skipped")
    parser.add_argument("--bandwidth-mb", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path("bench-out/paper_scale"))
    args = parser.parse_args(argv)
    import transformers

    device, dtype = resolve_device(args.device), getattr(torch, args.dtype)
    contexts = sorted(args.contexts)
    verify_context = args.verify_context or contexts[len(contexts) // 2]
    ks = sorted({1, *args.ks})
    configs = shape_configs()
    run = Run(args.out, args.budget_s)
    run.section("machine", lambda: {"device": device_name(device), "torch": torch.__version__,
                                    "transformers": transformers.__version__, "dtype": args.dtype, "args": vars(args)})
    ceiling = run.section("ceilings", lambda: ceilings(device, dtype, args.bandwidth_mb))
    bandwidth = ceiling.get("copy_gbs", float("nan"))
    main_config = configs[args.main_shape]()
    run.section("tree attention", lambda: tree_attention_costs(
        main_config, device, dtype, sorted({verify_context, contexts[-1], args.long_context}), max(ks), 20))

    model, peer = build(main_config, dtype, device)
    run.section("verification", lambda: verification_costs(model, [verify_context], ks, args.repeats))
    ar = run.section("AR eager", lambda: ar_rates(model, contexts, args.new_tokens, bandwidth))
    run.section("self-drafting", lambda: self_drafting_costs(model, sorted({contexts[-1], args.long_context}),
                                                             args.partial_budget, args.repeats))
    run.section("longspec draft", lambda: longspec_draft_cost(model, verify_context, min(args.new_tokens, 32),
                                                              args.draft_vocab, 4))
    reference = ar.get(verify_context, {}).get("tokens") if isinstance(ar, dict) else None
    run.section("oracle eager", lambda: oracle_rates(model, verify_context, args.new_tokens, args.alphas,
                                                     args.oracle_length, args.batch_sizes, reference), needs_s=30)
    backend = None if args.compile_backend == "none" else args.compile_backend
    run.section("compiled", lambda: compiled_rates(model, contexts, args.new_tokens, ks, backend, bandwidth,
                                                   args.repeats, verify_context, args.alphas, args.oracle_length,
                                                   args.out / "profile-compiled.txt"),
                needs_s=150 if device.type == "cuda" else 0)
    run.section("transformers compiled", lambda: peer_rates(peer, contexts, args.new_tokens, compiled=True),
                needs_s=120 if device.type == "cuda" else 0)
    run.section("transformers eager", lambda: peer_rates(peer, contexts, min(args.new_tokens, 32), compiled=False),
                needs_s=20 if device.type == "cuda" else 0)
    del model, peer
    for name in args.shapes:
        def other(name=name):
            ours, hf = build(configs[name](), dtype, device)
            del hf
            try:
                cost = measure_forward_cost(ours, context=verify_context, ks=(1, max(ks)), repeats=args.repeats)
                return {"ar": drop_tokens(ar_rates(ours, contexts, args.new_tokens, bandwidth)),
                        "verify_64_over_1": cost.seconds[-1] / cost.seconds[0]}
            finally:
                del ours
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        run.section(f"shape {name}", other, needs_s=25 if device.type == "cuda" else 0)
    print((args.out / "results.md").read_text())
    errors = [n for n, v in run.results.items() if isinstance(v, dict) and "error" in v]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
