"""The Python API: `longspec.load(...)` returns a model whose `generate` and
`stream` take text or token ids, shaped like the ecosystem's generate calls."""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from longspec import content_tokens
from longspec.runtime import setup_time
from longspec.runtime.device import HOST
from longspec.runtime.loading import LoadedTarget, load_target
from longspec.runtime.tokenizer import Tokenizer
from longspec.speculation.batch_engine import BatchEngine, BatchOptions, RequestHandle
from longspec.speculation.decoding_request import DecodingRequest
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.grammar import GrammarVocabulary
from longspec.speculation.logprobs import LogprobRecorder, PromptScorer, TokenLogprob
from longspec.speculation.methods import make_drafter
from longspec.speculation.drafters.suffix_cache.index import DEFAULT_MEGABYTES, SuffixCache
from longspec.speculation.metrics import GenerationStats
from longspec.request import MAX_SEED, GenerationRequest, check_int
from longspec.text import IncrementalDecoder

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float64": torch.float64, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _request(request: GenerationRequest | None, keywords: dict) -> GenerationRequest:
    """The request a call describes: an object, or flat keywords (not both)."""
    if request is None:
        return GenerationRequest.of(**keywords)
    if not isinstance(request, GenerationRequest):
        raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
    if keywords:
        raise TypeError(f"give a GenerationRequest or keywords, not both (got {', '.join(sorted(keywords))} too)")
    return request


def _prompt_ids(prompt: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Token ids as a 1-D int64 tensor; anything that is not a list of integer ids
    (floats, bools, several prompts at once) is refused rather than coerced."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dtype == torch.bool or prompt.is_floating_point() or prompt.is_complex():
            raise TypeError(f"prompt token ids must be an integer tensor, got {prompt.dtype}")
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]  # one row of a [1, T] batch, as tokenizers return it
        if prompt.dim() != 1:
            raise ValueError(
                f"prompt token ids must be 1-D [T] (or [1, T]), got shape {tuple(prompt.shape)}; for "
                "several prompts call generate_batch with a list of prompts"
            )
        return prompt.to(torch.long)
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise TypeError(f"prompt must be text, a list of token ids or an integer tensor, got {type(prompt).__name__}")
    bad = next((x for x in prompt if isinstance(x, bool) or not isinstance(x, (int, np.integer))), None)
    if bad is not None:
        hint = "; for several prompts call generate_batch with a list of prompts" if isinstance(bad, (list, tuple)) else ""
        raise TypeError(f"prompt token ids must be integers, got {type(bad).__name__} {bad!r}{hint}")
    return torch.tensor([int(x) for x in prompt], dtype=torch.long, device=HOST)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked (`logprobs=`)


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk (may be empty while a character is incomplete)
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # of `token_ids`, when asked


@dataclass
class TokenStream:
    """Iterate for chunks; `text`, `token_ids` and `stats` are complete afterwards."""

    _chunks: Iterator[StreamChunk]
    stats: GenerationStats
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None

    def __iter__(self) -> Iterator[StreamChunk]:
        for chunk in self._chunks:
            self.text += chunk.text
            self.token_ids.extend(chunk.token_ids)
            if chunk.logprobs is not None:
                self.logprobs = (self.logprobs or []) + chunk.logprobs
            yield chunk
        self.stats.record_output(self.token_ids)


@dataclass
class PreparedRequest:
    """A validated request, ready for an engine: token ids, stop strings and what both
    engines take (`decoding`: processors, a fresh drafter, EOS, its own random stream,
    stats, log-probabilities, grammar). Made by `LongSpecModel.prepare`."""

    ids: torch.Tensor
    stops: tuple[str, ...]
    decoding: DecodingRequest

    @property
    def stats(self) -> GenerationStats:
        return self.decoding.stats


def _rounds_of(handle: RequestHandle) -> Iterator[torch.Tensor]:
    """A row's committed rounds as they arrive. `RowStream` advances it only while a
    round is pending or after the row has left, so it never waits: no pending round
    means the row is over."""
    while handle.pending_rounds:
        yield handle.pop_round()


class RowStream:
    """One row of a `BatchEngine` seen as text: runs the row's text pipeline
    (detokenizing, stop strings — the same as `LongSpecModel.stream`) as its rounds
    commit, on the thread that steps the engine. `text`, `token_ids` and `stats`
    grow as `pump` is called; `ended` is set when nothing more will come."""

    def __init__(self, handle: RequestHandle, chunks: Iterator[StreamChunk]) -> None:
        self.handle = handle
        self.stats = handle.stats
        self._chunks = chunks
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.ended = False  # the row left and its text is flushed, or a stop string ended it
        self.stopped = False  # a stop string ended it: the caller cancels the row to free its cache

    def pump(self) -> list[StreamChunk]:
        """The chunks of every round committed since the last call."""
        out = []
        while not self.ended and (self.handle.pending_rounds or self.handle.finished):
            try:
                chunk = next(self._chunks)
            except StopIteration:
                self.ended = True
                break
            self.text += chunk.text
            self.token_ids.extend(chunk.token_ids)
            if chunk.logprobs is not None:
                self.logprobs = (self.logprobs or []) + chunk.logprobs
            out.append(chunk)
            if self.stats.stop_reason == "stop":
                self.ended = self.stopped = True
        return out

    def result(self) -> GenerationResult:
        """The whole output, once `ended`."""
        self.stats.record_output(self.token_ids)
        return GenerationResult(self.text, self.token_ids, self.stats, self.logprobs)


def load(
    model: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    engine: EngineOptions = EngineOptions(),
    device: str | torch.device | None = None,
    compile: bool = False,
    suffix_cache_mb: float = DEFAULT_MEGABYTES,
) -> "LongSpecModel":
    """Load a target: None for the embedded Gemma 3 270M, an HF checkpoint
    directory, a .gguf file, or a model id already in the local HF cache.
    dtype: None (default) computes in bfloat16 and keeps a .gguf file's quantization for
    the layer weights on the CPU (outputs are then plain decoding's of that quantized
    model); a dtype given dequantizes every tensor to it.
    device: "cpu" (default), "cuda" or "cuda:N"; the model, its caches, the drafters'
    weights and state and the sampling streams all live there.
    compile: run single-sequence decode steps and verification trees through
    compiled static-shape steps (CUDA graphs on a GPU; `runtime.static_step`).
    suffix_cache_mb: memory of the cache of earlier requests that `auto` drafts from
    (`LongSpecModel.suffix_cache`); 0 turns it off."""
    suffix_cache = SuffixCache.of_megabytes(suffix_cache_mb)  # a bad size fails before the load
    mark = setup_time.snapshot()
    target = load_target(model, dtype=None if dtype is None else parse_dtype(dtype), device=device)
    # Built now (memory-mapped from the model cache, or derived once per machine), not in the first decision.
    _ = target.model.certified_head
    choose_certified_head(target.model)
    if compile:
        # Compiled now, against a cache shaped like the engine's (its rings hold the
        # window plus the largest forward a request makes), not inside a request.
        with setup_time.one_time("compile"):
            target.model.compile_steps().static_steps.warm_up(max(engine.prefill_chunk, engine.max_tree_nodes + 1))
    loaded = LongSpecModel(target, engine, suffix_cache=suffix_cache)
    loaded.load_setup = setup_time.since(mark)
    return loaded


def choose_certified_head(model) -> None:
    """Turn the certified head off where `longspec doctor` measured the full head faster on this
    machine (both give the same tokens); LONGSPEC_CERTIFIED_HEAD=1 keeps it on regardless."""
    from longspec.runtime.certified_head import DISABLE_VARIABLE
    from longspec.speculation.cost_model import HEAD_OFF_BELOW, certified_head_gain

    if os.environ.get(DISABLE_VARIABLE) == "1":
        return
    gain = certified_head_gain(model)
    if gain is not None and gain < HEAD_OFF_BELOW:
        logging.getLogger("longspec").info("certified head off: the full head measured %.2fx faster here", 1 / gain)
        model._certified_head = None


class LongSpecModel:
    def __init__(self, target: LoadedTarget, engine: EngineOptions = EngineOptions(),
                 suffix_cache: SuffixCache | None | str = "default") -> None:
        self.target = target
        self.model = target.model
        self.tokenizer = target.tokenizer
        self.engine = SpeculativeEngine(target.model, engine)
        self._max_token_bytes: int | None = None  # longest vocabulary entry, computed on first use
        # A fast tokenizer's Rust core refuses concurrent use ("Already borrowed"): a
        # server encodes new prompts while other requests' tokens are decoded.
        self._tokenizer_lock = threading.Lock()
        self._encoder, self._encoding_lock = self.tokenizer, self._tokenizer_lock  # `separate_encoding`
        self._grammar_vocabulary: GrammarVocabulary | None = None  # built on the first constrained request
        # One-time work `load` paid, by part (runtime/setup_time.py); the first request's stats report it too.
        self.load_setup: dict[str, float] = {}
        self._load_setup_reported = False
        self._grammar_lock = threading.Lock()
        # Earlier requests' prompt tails and outputs, which `auto` and `suffix` draft from
        # (one per model, so one per server process or replica); None: off.
        self.suffix_cache = SuffixCache.of_megabytes(DEFAULT_MEGABYTES) if suffix_cache == "default" else suffix_cache

    def grammar_vocabulary(self) -> GrammarVocabulary:
        """The vocabulary as the grammar matcher reads it (seconds to build for a large
        vocabulary: once, on first use, by a server's first structured request)."""
        with self._grammar_lock:
            if self._grammar_vocabulary is None:
                if self.tokenizer is None:
                    raise ValueError(f"{self.target.source} has no tokenizer files; structured output needs the "
                                     "tokenizer to know what text each token spells")
                with self._encoding_lock:
                    self._grammar_vocabulary = GrammarVocabulary(self._encoder, self.config.vocab_size,
                                                                 self.config.eos_token_ids)
            return self._grammar_vocabulary

    def set_chat_template(self, template: str) -> None:
        """Use this Jinja chat template (vLLM's `--chat-template`), for a model whose
        tokenizer has none (a base model) or a different one."""
        if self.tokenizer is None:
            raise ValueError(f"{self.target.source} has no tokenizer files; a chat template needs its tokenizer")
        if not template.strip():
            raise ValueError("the chat template is empty")
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:  # compiled now: a broken template fails at startup, not in a request
            ImmutableSandboxedEnvironment().from_string(template)
        except TemplateSyntaxError as error:
            raise ValueError(f"the chat template does not compile (line {error.lineno}: {error.message})") from None
        for tokenizer in {id(t): t for t in (self.tokenizer, self._encoder)}.values():
            tokenizer.chat_template = template

    def separate_encoding(self) -> None:
        """Tokenize prompts with a copy of the tokenizer under a lock of its own, so that
        a long prompt being tokenized never holds up the detokenizing of streams (a
        server's generation thread). A `transformers` tokenizer is copied for it (seconds for
        Gemma's); ours encodes beside its own decoding and is shared."""
        if isinstance(self.tokenizer, Tokenizer):  # encodes beside its own decoding: no copy needed
            self._encoding_lock = threading.Lock()
        elif self.tokenizer is not None and self._encoder is self.tokenizer:
            self._encoder, self._encoding_lock = copy.deepcopy(self.tokenizer), threading.Lock()

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token's text alone (as log-probability listings show tokens), or
        `token_id:N` without a tokenizer. Decoded with the prompt tokenizer, so streams'
        detokenizing is not held up."""
        if self._encoder is None:
            return [f"token_id:{token}" for token in ids]
        with self._encoding_lock:
            return [self._encoder.decode([token]) for token in ids]

    def text_of(self, ids: Sequence[int]) -> str:
        """The text of token ids as a whole (what `echo` returns for a prompt given as ids),
        special tokens included; `token_id:N` pieces without a tokenizer."""
        if self._encoder is None:
            return "".join(f"token_id:{token}" for token in ids)
        with self._encoding_lock:
            return self._encoder.decode(list(ids))

    def prompt_scorer(self, ids: torch.Tensor, top: int = 0) -> PromptScorer:
        """Scores the prompt's tokens under the model, a piece per `step` (the log-probabilities
        `echo` with `logprobs` reports); run it where the model's forwards run."""
        return PromptScorer(self.model, ids.to(self.device), top=top)

    def encode(self, prompt: str | Sequence[int] | torch.Tensor, *, chat: bool = False,
               limit: int | None = None, special_tokens: bool = True) -> torch.Tensor:
        """Token ids of a prompt. `limit` (default: the model's context): text that cannot
        fit it is refused before it is tokenized, token ids that exceed it before a tensor
        is built. `special_tokens`: control-token strings in the text (`<eos>`,
        `<start_of_turn>`) are read as control tokens, as a trusted caller writing the
        model's own format wants; False reads them as plain text (a server's clients:
        `content_tokens`). The BOS the tokenizer adds is added either way."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.target.source} has no tokenizer files: pass the prompt as token ids, or add the "
                    "tokenizer to the checkpoint directory (AutoTokenizer.from_pretrained(ORIGINAL).save_pretrained(DIR))"
                )
            self._check_text_fits(prompt, limit)
            if chat:
                return self.encode_chat([{"role": "user", "content": prompt}], limit=limit,
                                        special_tokens=special_tokens)
            with self._encoding_lock:
                ids = content_tokens.encode_text(self._encoder, prompt, special_tokens=special_tokens)
            return torch.tensor(ids, dtype=torch.long, device=HOST)
        limit = self.config.max_position_embeddings if limit is None else limit
        if not isinstance(prompt, torch.Tensor) and isinstance(prompt, Sequence) and len(prompt) > limit:
            raise ValueError(f"the prompt has {len(prompt):,} token ids, more than the limit of {limit:,}")
        ids = _prompt_ids(prompt)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}); got {int(ids.min())}..{int(ids.max())}")
        return ids

    def encode_chat(self, messages: Sequence[dict], *, limit: int | None = None,
                    special_tokens: bool = True) -> torch.Tensor:
        """Token ids of a conversation in the model's chat template, ending where the
        assistant's reply begins; refused before tokenizing when its text cannot fit
        `limit` tokens (default: the model's context). `special_tokens` False: control-
        token strings inside the messages are plain text, so a message cannot end its
        turn and forge another (the template's own control tokens stay; `encode`)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.target.source} has no tokenizer files; a chat needs its tokenizer and template")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template (a base model): write the prompt in the "
                             "model's own format instead — drop --chat, chat=False in Python, /v1/completions over "
                             "HTTP (its control tokens as token ids there, or to a server started with "
                             "--allow-special-tokens)")
        self._check_text_fits("".join(str(message.get("content", "")) for message in messages), limit)
        with self._encoding_lock:
            ids = content_tokens.encode_chat(self._encoder, messages, special_tokens=special_tokens)
        return torch.tensor(ids, dtype=torch.long, device=HOST)

    def _check_text_fits(self, text: str, limit: int | None = None) -> None:
        """Refuse text that cannot fit `limit` tokens (default: the context) before
        tokenizing it (a 20 MB file would take seconds and gigabytes to tokenize): no
        token spells more bytes than the longest vocabulary entry, so bytes / that length
        is a lower bound on the token count."""
        context = self.config.max_position_embeddings
        limit = context if limit is None else limit
        size = len(text.encode("utf-8"))
        if size <= limit:  # the bound, bytes / longest entry, cannot pass the limit: no scan of the vocabulary
            return
        if self._max_token_bytes is None:
            with self._encoding_lock:
                vocabulary = self._encoder.get_vocab()
            self._max_token_bytes = max((len(t.encode("utf-8")) for t in vocabulary), default=1)
        at_least = -(-size // self._max_token_bytes)
        if at_least > limit:
            what = f"the model's context of {context:,}" if limit == context else f"the limit of {limit:,}"
            raise ValueError(
                f"the prompt ({size:,} bytes) is at least {at_least:,} tokens long, beyond {what} tokens; "
                "shorten it (keep the last part that matters)"
            )

    def stream(self, prompt: str | Sequence[int] | torch.Tensor, request: GenerationRequest | None = None,
               **keywords) -> TokenStream:
        """As `generate`, token by token."""
        prepared = self.prepare(prompt, request, **keywords)
        rounds = self.engine.generate(prepared.ids, prepared.decoding)
        return TokenStream(self._chunks(rounds, prepared.stops, prepared.stats, prepared.decoding.logprobs, prepared.ids),
                           prepared.stats)

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int] | torch.Tensor],
        request: GenerationRequest | None = None,
        *,
        max_rows: int = 8,
        seed: int | Sequence[int] | None = None,
        **keywords,
    ) -> list[GenerationResult]:
        """Generate for many prompts at once (continuous batching: up to ``max_rows``
        rows share each target forward; the others join as rows finish). Each
        result equals ``generate(prompts[i], seed=seed + i, ...)`` with the same
        options (or ``seed=seed[i]`` for a list of seeds, one per prompt); the method
        is a method name (every row gets its own drafter)."""
        request = _request(request, keywords)
        if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
            raise TypeError("generate_batch takes a list of prompts; for one prompt call generate")
        if not prompts:
            raise ValueError("generate_batch needs at least one prompt")
        if not isinstance(request.method, str):
            raise TypeError("generate_batch takes a method name: every row needs a drafter of its own")
        check_int("max_rows", max_rows, low=1)
        if isinstance(seed, Sequence):
            if len(seed) != len(prompts):
                raise ValueError(f"{len(seed)} seeds for {len(prompts)} prompts: give one seed per prompt, or one "
                                 "integer (prompt i then draws from seed + i)")
            seeds = list(seed)
        else:
            if seed is not None:
                check_int("seed", seed, low=0, high=MAX_SEED - len(prompts) + 1)
            seeds = [None if seed is None else seed + i for i in range(len(prompts))]
        requests = [self.prepare(p, request.but(seed=s)) for p, s in zip(prompts, seeds)]
        engine = self.batch_engine(BatchOptions(max_rows=min(max_rows, len(prompts)),
                                                row_capacity=max(self.row_slots(r) for r in requests)))
        streams = [self.submit(engine, request) for request in requests]
        while engine.has_work:
            engine.step()
            for stream in streams:
                stream.pump()
                if stream.stopped and not stream.handle.finished:
                    engine.cancel(stream.handle)  # a stop string ended it: free its row now
        for stream in streams:
            stream.pump()
        return [stream.result() for stream in streams]

    def batch_engine(self, batch: BatchOptions) -> BatchEngine:
        """A continuous-batching engine over this model (same engine options)."""
        return BatchEngine(self.model, self.engine.options, batch)

    def batch_cache_bytes(self, batch: BatchOptions) -> int:
        """Target KV cache bytes a batch engine of this shape allocates."""
        return BatchEngine.planned_cache_bytes(self.model, self.engine.options, batch)

    def row_slots(self, request: PreparedRequest) -> int:
        """Cache slots a request needs in a row: prompt, output, a tree, the root."""
        budget = self.engine.options.max_tree_nodes if request.decoding.drafter is not None else 0
        return request.ids.numel() + request.decoding.max_new_tokens + budget + 1

    def submit(self, engine: BatchEngine, request: PreparedRequest) -> RowStream:
        """Queue a prepared request on a batch engine; its text arrives through the
        returned stream's `pump` as the engine steps."""
        handle = engine.submit(request.ids, request.decoding)
        return RowStream(handle, self._chunks(_rounds_of(handle), request.stops, request.stats, request.decoding.logprobs,
                                              request.ids))

    def prepare(self, prompt, request: GenerationRequest | None = None, **keywords) -> PreparedRequest:
        """Validate a request against this model without generating: its prompt's ids,
        its drafter, grammar and random stream. `request`, or the flat keywords of
        `GenerationRequest.of` (`temperature=0.8, max_new_tokens=64, ...`)."""
        request = _request(request, keywords)
        params = request.sampling
        beyond = [token for token, _ in params.logit_bias if token >= self.config.vocab_size]
        if beyond:
            raise ValueError(f"logit_bias names token {beyond[0]}, outside the vocabulary [0, {self.config.vocab_size})")
        ids = self.encode(prompt, chat=request.chat)
        self.engine.check_request(ids.numel(), request.max_new_tokens)
        grammar = None if request.constraint is None else self.grammar_vocabulary().matcher(request.constraint)
        if isinstance(request.method, str):
            drafter = make_drafter(request.method, suffix_cache=self.suffix_cache, **(request.method_options or {}))
            name = request.method
        else:
            drafter, name = request.method, type(request.method).__name__
        seed = request.seed if request.seed is not None else int(torch.randint(0, 2**62, (), device=HOST))
        # The verifier draws on the model's device; a seed reproduces a run on one device.
        generator = torch.Generator(device=self.device).manual_seed(seed)
        eos = () if request.ignore_eos else self.config.eos_token_ids
        recorder = None if request.logprobs is None else LogprobRecorder(top=request.logprobs,
                                                                         mode=request.logprobs_mode)
        stats = GenerationStats(method=name)
        if not self._load_setup_reported:  # the load's one-time work, reported once
            self._load_setup_reported = True
            stats.add_setup(self.load_setup)
        return PreparedRequest(ids, request.stop, DecodingRequest(params, request.max_new_tokens, drafter, eos, generator,
                                                                  stats, recorder, grammar))

    def generate(self, prompt, request: GenerationRequest | None = None, **keywords) -> GenerationResult:
        """Generate a continuation of `prompt` (text or token ids) as `request` asks, or the
        flat keywords of `GenerationRequest.of`: `max_new_tokens`, `method` (default
        "auto") with its `method_options`, sampling (`temperature`, `top_k`, `top_p`,
        `min_p`, `eta`, penalties, `logit_bias`), `seed`, `stop`, `chat`, `ignore_eos`,
        `logprobs` (the log-probability of every generated token and of the `logprobs`
        most likely ones; `logprobs_mode` "raw" or "processed") and `constraint` (a
        grammar the output follows, exactly as constrained plain decoding would)."""
        stream = self.stream(prompt, request, **keywords)
        for _ in stream:
            pass
        return GenerationResult(stream.text, stream.token_ids, stream.stats, stream.logprobs)

    def _chunks(self, rounds, stop: Sequence[str], stats: GenerationStats,
                recorder: LogprobRecorder | None = None, prompt: torch.Tensor | None = None) -> Iterator[StreamChunk]:
        """Text pieces per round. With stop strings, the last len(longest)-1
        characters are held back until they cannot begin a stop string, so text
        that is later cut never reaches the caller."""
        decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
        holdback = max((len(s) for s in stop), default=1) - 1
        text, emitted, recorded = "", 0, 0
        output: list[int] = []  # for the suffix cache, once the request finished

        def logprobs_of(kept: list[int]) -> list[TokenLogprob] | None:
            nonlocal recorded
            if recorder is None:
                return None
            entries = recorder.entries[recorded : recorded + len(kept)]
            recorded += len(kept)
            return entries

        for new in rounds:
            kept: list[int] = []
            for token in new.tolist():
                kept.append(token)
                if decoder is None:
                    continue
                before = len(text)
                with self._tokenizer_lock:
                    text += decoder.push(token)
                if stop and len(text) > before:
                    search_from = max(0, before - holdback)
                    hits = [i for i in (text.find(s, search_from) for s in stop) if i >= 0]
                    if hits:
                        stats.stop_reason = "stop"
                        self._remember(prompt, output + kept)  # before the yield: a consumer stops at it
                        yield StreamChunk(text[emitted : min(hits)], kept, logprobs_of(kept))
                        rounds.close()
                        return
            output += kept
            safe = max(emitted, len(text) - holdback)
            yield StreamChunk(text[emitted:safe], kept, logprobs_of(kept))
            emitted = safe
        self._remember(prompt, output)
        if emitted < len(text):
            yield StreamChunk(text[emitted:], [], logprobs_of([]))

    def _remember(self, prompt: torch.Tensor | None, output: list[int]) -> None:
        """A finished request's tokens into the suffix cache (a failed or cancelled one
        never gets here)."""
        if self.suffix_cache is not None and prompt is not None:
            self.suffix_cache.insert(prompt.tolist(), output)
