"""Vanilla draft-model speculation: a smaller model that shares the target's tokenizer
drafts a chain of γ tokens with a KV cache of its own; the target verifies the chain
in one forward (Leviathan et al.; Chen et al.).

Greedy: the draft's argmax chain, verified by the greedy rule. Sampled
(`sample=True`): each token is drawn from the draft's q = softmax(logits / T) and the
chain carries q, so verification applies speculative sampling (accept min(1, p/q),
else resample from the residual) and the output is distributed exactly as the
target's. The draft runs in our runtime (any family it loads: Llama, Mistral,
Qwen2/2.5/3, Gemma 3), in the target's dtype.

Its cache holds every committed token (a transformer draft's memory grows with the
context, unlike the LongSpec draft's window or a state-space drafter's state); it is
allocated for the prompt with room to spare and doubled when the sequence outgrows it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from longspec.runtime.device import HOST
from longspec.runtime.model import Decoder
from longspec.speculation.drafters.base import DraftContext
from longspec.speculation.drafters.shared.own_cache import OwnCacheDrafter
from longspec.speculation.drafters.shared.errors import DraftMismatchError
from longspec.speculation.drafters.shared.vocab_map import VocabMap
from longspec.speculation.processors import sample
from longspec.speculation.tree import Tree

# Room the cache leaves beyond the prompt before it has to grow (tokens).
INITIAL_HEADROOM = 1024
SHIPPED_DRAFTER = "draft-model-gemma-3-270m"  # in longspec/weights, for the embedded target


def shipped_drafter_path() -> Path:
    return Path(str(resources.files("longspec") / "weights" / SHIPPED_DRAFTER))


class DraftModelDrafter(OwnCacheDrafter):
    runs_model = True  # each proposal runs the draft network (see drafters.base)

    def __init__(
        self,
        model: Decoder | str | Path | None = None,
        *,
        length: int = 5,
        sample: bool = False,
        temperature: float = 1.0,
        prefill_chunk: int = 256,
        generator: torch.Generator | None = None,
        vocab: VocabMap | None = None,
    ) -> None:
        """model: the draft (a loaded `Decoder`, or a checkpoint directory / .gguf /
        local model id, loaded in the target's dtype when generation begins); default:
        the small transformer drafter shipped for the embedded Gemma 3 270M.
        length: γ, draft tokens per round. sample: draw the chain from q (for sampled
        decoding; greedy decoding accepts either). temperature: the draft's own
        sampling temperature for q. generator: a fixed random stream for the sampled
        chain (default: the one the engine derives from the request's seed). vocab: the
        reduced vocabulary of a model passed as an object (a checkpoint directory brings
        its own `longspec-vocab.json`; None: the draft speaks the target's ids)."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"length must be an int >= 1, got {length!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if model is None:
            model = shipped_drafter_path()
            if not model.is_dir():
                raise FileNotFoundError(f"no draft model at {model}: this installation lacks the shipped one; pass "
                                        "model=PATH (train one with `longspec train draft-model --model ... --out DIR`)")
        if isinstance(model, (str, Path)):
            from longspec.runtime.loading import load_target

            if vocab is None and Path(model).is_dir():
                vocab = VocabMap.load(model)
            model = load_target(model, dtype=torch.float32).model
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a longspec Decoder or a checkpoint path, got {type(model).__name__}")
        self.model = model
        self.vocab = vocab
        self.length = length
        self.sample = bool(sample)
        self.temperature = float(temperature)
        self.prefill_chunk = prefill_chunk
        self.generator = generator
        self.cache = None
        self._root_logits: torch.Tensor | None = None  # the draft's logits after the root, kept for a repeated propose
        self._vocab_size: int | None = None  # the target's

    # --------------------------------------------------------------- protocol
    def check_target(self, config) -> None:
        """The draft must speak the target's vocabulary: its ids a prefix of the
        target's (same tokenizer; a target may pad its embedding) and the same EOS."""
        draft = self.model.config
        if self.vocab is not None:
            self.vocab.check_fits("draft model", draft.vocab_size, config)
            return
        problems = []
        if draft.vocab_size > config.vocab_size:
            problems.append(f"vocabulary: draft {draft.vocab_size} ids vs target {config.vocab_size}")
        if set(draft.eos_token_ids) != set(config.eos_token_ids):
            problems.append(f"end-of-sequence ids: draft {sorted(draft.eos_token_ids)} vs target {sorted(config.eos_token_ids)}")
        if problems:
            raise DraftMismatchError("the draft model does not share the target's tokenizer (" + "; ".join(problems)
                                     + "); pick a draft from the target's family, trained with its tokenizer")

    def begin(self, context: DraftContext) -> None:
        view = context.target
        if view is not None:
            self.check_target(view.config)
            self._vocab_size = view.config.vocab_size
            if self.model.dtype != view.dtype or self.model.device != view.device:
                self.model = self.model.to(view.dtype).place(view.device)
            if self.vocab is not None:
                self.vocab = self.vocab.to(view.device)
        else:
            self._vocab_size = self.model.config.vocab_size
        self._allocate(context.tokens.numel() + INITIAL_HEADROOM)

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Tree:
        self.begun_cache()
        tokens, root = context.tokens, context.root
        n = tokens.numel()
        budget = min(self.length, int(context.max_nodes), self.model.config.max_position_embeddings - n)
        if budget <= 0:
            return Tree.chain(root, [])
        if self.cache.length > n:  # another sequence than the one begun
            raise RuntimeError("the draft cache holds more tokens than the sequence: call begin() for a new sequence")
        if n + budget > self.cache.capacity:
            self._allocate(2 * (n + budget))  # the new cache catches up over the whole sequence
        if self.cache.length < n:  # the committed tokens it has not seen, root last
            self._root_logits = self._run(self._draft_ids(tokens[self.cache.length :]))
        logits = self._root_logits
        chain, rows = [], []
        for depth in range(budget):
            candidates = self.vocab.hide_other(logits) if self.vocab is not None else logits
            if self.sample:
                q = torch.softmax(candidates.double() / self.temperature, dim=-1)
                token = int(sample(q.unsqueeze(0), self.generator if self.generator is not None else context.generator)[0])
                rows.append(q)
            else:
                token = int(torch.argmax(candidates))
            chain.append(token)  # the draft's id
            if depth + 1 < budget:
                logits = self._run(torch.tensor([token], device=HOST))
        self.cache.rollback(n)  # drafted tokens leave; the committed ones stay cached
        target_chain = self.vocab.to_target(torch.tensor(chain, device=HOST)).tolist() if self.vocab is not None else chain
        tree = Tree.chain(root, target_chain)
        if not self.sample:
            return tree
        q = torch.zeros((tree.size, self._vocab_size), dtype=torch.float64, device=rows[0].device)
        if self.vocab is not None:
            q[:budget, self.vocab.target_ids] = torch.stack(rows)
        else:
            q[:budget, : rows[0].numel()] = torch.stack(rows)
        return Tree.from_parents(tree.tokens, tree.parents, draft_probs=q, children_sampled=True)

    # ---------------------------------------------------------------- internals
    def _draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        return self.vocab.to_draft(target_ids) if self.vocab is not None else target_ids

    def _allocate(self, capacity: int) -> None:
        capacity = min(capacity, self.model.config.max_position_embeddings)
        self.cache = self.model.new_cache(capacity, max_forward_tokens=self.prefill_chunk)

    def _run(self, new: torch.Tensor) -> torch.Tensor:
        """Append `new` to the draft's cache (in chunks); the next-token logits after it."""
        logits = None
        for begin in range(0, new.numel(), self.prefill_chunk):
            piece = new[begin : begin + self.prefill_chunk]
            out = self.model(piece.unsqueeze(0), self.cache, logits_rows=slice(-1, None))
            self.cache.commit()
            logits = out.logits[0, -1]
        return logits
