"""Structured output under speculation: a grammar every generated token must follow
(a JSON schema, any JSON object, a regex, a Lark or GBNF grammar, a choice of strings),
matched by llguidance.

Why llguidance (measured against xgrammar in
docs/lab-notes/structured-output.md#choosing-the-grammar-library-mask-cost-on-a-262k-vocabulary):
its mask is a small share of a decode step on a 262k-token vocabulary, it is one
dependency-free wheel, and it reads every format users send (OpenAI's JSON schemas,
llama.cpp's GBNF, Lark, regexes).

Each round, one sequence's matcher (at its committed tokens) walks the proposed tree
depth first: at every node whose path the grammar allows it fills that node's mask,
and it descends only into children whose token the mask allows. Drafts the grammar
forbids are pruned before the target sees them (counted in `GenerationStats`); the
masks reach verification as a processor (`NodeHistories.allowed`), so each node's
decision is the constrained distribution's, and the committed tokens advance the
matcher. The output is exactly constrained plain decoding's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from longspec.runtime.device import HOST
from longspec.speculation.grammar_limits import check_not_empty, check_size
from longspec.speculation.tree import Tree

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask helpers; llguidance.torch's pull in torch._dynamo: seconds)
    except ImportError:
        raise ImportError("structured output needs llguidance: pip install 'longspec[structured]'") from None
    return llguidance


def warm_grammar_library() -> None:
    """Import the matcher's library now, where a server starts rather than inside its
    first structured request; nothing if absent."""
    try:
        _llguidance()
    except ImportError:  # structured requests will be refused with the reason
        pass


@dataclass(frozen=True)
class OutputConstraint:
    """What the output must be. kind: "json_schema" (spec: the schema, a dict or JSON
    text), "json_object" (any JSON object), "regex", "grammar" (Lark or GBNF text), or
    "choice" (spec: the list of allowed strings)."""

    kind: str
    spec: object = None
    _compiled: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.kind == "json_object":
            return
        if self.kind == "choice":
            if (not isinstance(self.spec, (list, tuple)) or not self.spec
                    or not all(isinstance(c, str) and c for c in self.spec)):
                raise ValueError(f"a choice constraint takes a non-empty list of non-empty strings, got {self.spec!r}")
        elif self.kind == "json_schema":
            if not isinstance(self.spec, (dict, str, bool)):
                raise ValueError(f"a JSON schema is an object (or its JSON text), got {type(self.spec).__name__}")
        elif not isinstance(self.spec, str) or not self.spec:
            raise ValueError(f"a {self.kind} constraint takes non-empty text, got {self.spec!r}")

    def grammar(self) -> str:
        """The llguidance grammar; a spec that does not compile, is too large to follow
        (`grammar_limits`) or accepts no text raises ValueError naming why. Compiled once."""
        if self._compiled is None:
            object.__setattr__(self, "_compiled", self._compile())
        return self._compiled

    def _compile(self) -> str:
        if self.kind != "json_object":  # before importing the matcher: a refusal costs nothing
            check_size(self.kind, self._schema() if self.kind == "json_schema" else self.spec)
        llguidance = _llguidance()
        if self.kind == "json_object":
            fmt, text = "json_schema", json.dumps(_bounded_whitespace({"type": "object"}))
        elif self.kind == "json_schema":
            fmt, text = "json_schema", json.dumps(_bounded_whitespace(self._schema()))
        elif self.kind == "choice":
            fmt, text = "choice", json.dumps(list(self.spec))
        else:
            fmt, text = ("regex", self.spec) if self.kind == "regex" else ("grammar", self.spec)
        try:
            grammar = llguidance.grammar_from(fmt, text)
        except (ValueError, TypeError) as error:
            raise ValueError(f"the {self.kind.replace('_', ' ')} does not compile: {error}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            reason = _first_line(messages[0]) if messages else "(no reason given)"
            raise ValueError(f"the {self.kind.replace('_', ' ')} does not compile: {reason}")
        check_not_empty(self.kind, grammar)
        return grammar

    def _schema(self):
        if not isinstance(self.spec, str):
            return self.spec
        try:
            return json.loads(self.spec)
        except json.JSONDecodeError as error:
            raise ValueError(f"the json schema is not JSON: {error}") from None


# Whitespace between JSON tokens: nothing, one space, or a newline and up to 20 spaces or
# tabs of indentation (llama.cpp's server allows the same). Unbounded, a greedy small
# model can fill the token limit with whitespace inside a valid document.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"


def _bounded_whitespace(schema):
    """The schema with JSON_WHITESPACE between tokens, unless it sets llguidance's own
    "x-guidance" options (a boolean schema stays as it is)."""
    if not isinstance(schema, dict) or "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "(no reason given)"


class GrammarGaveUp(ValueError):
    """The matcher hit a limit (llguidance's parser rows, its lexer) mid-generation."""


class GrammarVocabulary:
    """The model's tokens as llguidance reads them (their bytes, the EOS tokens), built
    once per model: seconds for a 262k-token vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        if not eos_token_ids:
            raise ValueError("structured output needs the model's EOS token (its config names none): a finished "
                             "grammar ends the output with it")
        llguidance = _llguidance()
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)
        try:  # fast tokenizers of the usual kinds: exact token bytes
            self.tokenizer = _from_rust_pipeline(llguidance, tokenizer, vocab_size, list(eos_token_ids))
        except ValueError:  # others (a word-level vocabulary, say): each token's text alone
            self.tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_DecodedTokens(tokenizer, vocab_size, eos_token_ids)), n_vocab=vocab_size)

    def matcher(self, constraint: OutputConstraint) -> GrammarState:
        return GrammarState(self, constraint)


def _from_rust_pipeline(llguidance, tokenizer, vocab_size: int, eos: list[int]):
    """llguidance's vocabulary from the tokenizer's Rust pipeline: ours handed over as
    `llguidance.hf` hands over `transformers`' (whose module imports `transformers`)."""
    from longspec.runtime.tokenizer import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size, eos_token=eos)
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)


class _DecodedTokens:
    """llguidance's tokenizer protocol from a tokenizer's per-token decoding."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        size = min(len(tokenizer), vocab_size)
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(set(tokenizer.all_special_ids) | set(eos_token_ids))
        special = set(self.special_token_ids)
        self.tokens = [b"" if i in special or i >= size else tokenizer.decode([i]).encode() for i in range(vocab_size)]
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarState:
    """One sequence's grammar, matched up to its committed tokens."""

    def __init__(self, vocabulary: GrammarVocabulary, constraint: OutputConstraint) -> None:
        llguidance = _llguidance()
        self.vocab_size = vocabulary.vocab_size
        self.eos_token_ids = vocabulary.eos_token_ids
        self._eos = frozenset(vocabulary.eos_token_ids)
        self._matcher = llguidance.LLMatcher(vocabulary.tokenizer, constraint.grammar(), log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"the {constraint.kind.replace('_', ' ')} does not compile: "
                             f"{_first_line(self._matcher.get_error())}")
        self._fill = llguidance.numpy.fill_next_token_bitmask
        self._allocate = llguidance.numpy.allocate_token_bitmask

    def constrain(self, tree: Tree, prune: bool = True) -> tuple[Tree, torch.Tensor, int]:
        """(the tree without the drafts the grammar forbids, its nodes' allowed tokens
        [n, V] bool, how many nodes were pruned). A node whose parent's path the grammar
        allows but whose token it forbids stays as a leaf in a tree of sampled children
        (its rejection updates the residual the next sibling is tested against); in other
        trees it goes. Nodes below a forbidden one always go. Without `prune`, the tree
        stays whole (a forbidden node's parent's mask rejects it)."""
        n = tree.size
        bits = self._allocate(n, self.vocab_size)  # the matcher writes the NumPy array; torch reads it in place
        bitmask = torch.from_numpy(bits)
        reachable = [False] * n
        reachable[0] = True
        children: list[list[int]] = [[] for _ in range(n)]
        for node, parent in enumerate(tree.parents.tolist()[1:], start=1):
            children[parent].append(node)
        tokens = tree.tokens.tolist()
        # Depth first from the committed state: enter a node by consuming its token, fill
        # its mask, queue the children it allows, roll the matcher back on leaving.
        stack: list[tuple[int, bool]] = [(0, True)]
        while stack:
            node, entering = stack.pop()
            if not entering:
                self._matcher.rollback(1)
                continue
            if node:
                self._consume(tokens[node])
                stack.append((node, False))
            self._fill(self._matcher, bits, node)
            if self._matcher.is_error() or (not node and not bitmask[0].any()):
                raise GrammarGaveUp(self._stuck())
            for child in reversed(children[node]):
                if _allows(bitmask, node, tokens[child]):
                    reachable[child] = True
                    # A round ends at EOS: nothing below it is committed, and the matcher
                    # never consumes it (a rollback over it does not restore a finished state).
                    if tokens[child] not in self._eos:
                        stack.append((child, True))
        allowed = _unpack(bitmask, self.vocab_size)
        kept = torch.tensor(reachable, device=HOST)
        if tree.children_sampled:
            parent_reached = torch.tensor([True] + [reachable[p] for p in tree.parents.tolist()[1:]], device=HOST)
            kept = parent_reached
        pruned = n - int(kept.sum())
        if pruned and prune:
            keep = torch.nonzero(kept).flatten()
            return tree.restricted(keep), allowed[keep], pruned
        return tree, allowed, 0

    def advance(self, tokens: torch.Tensor) -> None:
        """The committed tokens (each one the grammar allowed, as verification chose it)."""
        for token in tokens.tolist():
            if token in self._eos:
                return  # the output ends here
            self._consume(token)

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarGaveUp(self._stuck())

    def _stuck(self) -> str:
        # Past its limits the matcher allows only EOS: going on would end the output
        # where the constraint does not, so the request fails instead.
        reason = _first_line(self._matcher.get_error()) if self._matcher.is_error() else "it allows no token here"
        return (f"the output constraint cannot be followed ({reason}); nothing that breaks it is returned: "
                "simplify the constraint (fewer optional properties or alternatives in one place)")



def _allows(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


_BITS = torch.arange(32, dtype=torch.int32)


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, ceil(V/32)] int32 bitmasks as [n, V] bool; a row that allows nothing (a node
    past the grammar's end, whose draws are discarded) allows everything, so that its
    distribution stays defined."""
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().flatten(1)[:, :vocab_size]
    empty = ~allowed.any(dim=1)
    if empty.any():
        allowed[empty] = True
    return allowed
