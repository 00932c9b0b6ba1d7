"""Task loaders of `longspec bench` on small fixtures of each format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longspec.bench.tasks import (
    LONGBENCH_TEMPLATES,
    PromptFilter,
    TaskFileError,
    TaskSpec,
    build_prompts,
    middle_truncate,
)

FIXTURES = Path(__file__).parent / "fixtures" / "bench"


class CharTokenizer:
    """One token per character (code point mod 128), with a visible chat template."""

    chat_template = "<user>{}</user><model>"

    def __call__(self, text):
        return type("Encoding", (), {"input_ids": [ord(c) % 128 for c in text]})()

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return self(self.chat_template.format(messages[0]["content"])).input_ids


def load(spec: str):
    return TaskSpec.parse(spec, FIXTURES).load()


def test_longbench_uses_the_task_template_and_chat_rule():
    items = load(f"multi_news={FIXTURES / 'longbench_multi_news.jsonl'}")
    assert [i.item_id for i in items] == ["mn1", "mn2"]
    assert items[0].text.startswith("You are given several news passages.") and "storm" in items[0].text
    assert items[0].chat
    mixed = load(f"longbench={FIXTURES / 'longbench_mixed.jsonl'}")  # template from each row's dataset key
    assert [i.task for i in mixed] == ["qmsum", "lcc"]
    assert "Query: What was decided?" in mixed[0].text
    assert mixed[1].text == LONGBENCH_TEMPLATES["lcc"].format(context="def f(x):\n    return x\n" * 20, input="")
    assert not mixed[1].chat  # LongBench leaves code completion out of the chat template


def test_missing_key_names_file_line_and_key():
    path = FIXTURES / "longbench_missing_key.jsonl"
    with pytest.raises(TaskFileError, match=r"longbench_missing_key\.jsonl:2: missing key 'context'"):
        load(f"multi_news={path}")


def test_malformed_and_missing_files():
    with pytest.raises(TaskFileError, match=r"generic_bad\.jsonl:2: not valid JSON"):
        load(f"jsonl={FIXTURES / 'generic_bad.jsonl'}")
    with pytest.raises(TaskFileError, match="task file not found: .*nope.jsonl"):
        load(f"lcc={FIXTURES / 'nope.jsonl'}")
    with pytest.raises(ValueError, match="unknown task 'bogus'"):
        TaskSpec.parse("bogus", FIXTURES)
    with pytest.raises(ValueError, match="--data-dir"):
        TaskSpec.parse("multi_news", None)
    with pytest.raises(ValueError, match="needs a file"):
        TaskSpec.parse("jsonl", FIXTURES)


def test_spec_bench_aime_book_generic_text():
    questions = load(f"spec_bench={FIXTURES / 'question.jsonl'}")
    assert [q.text for q in questions] == ["Write a poem.", "Write an email.", "What is 2+2?"]
    assert {q.category for q in questions} == {"writing", "math"}
    aime = load(f"aime={FIXTURES / 'aime.jsonl'}")
    assert "step by step" in aime[0].text and "$x+1=3$" in aime[0].text and aime[0].chat
    book = load(f"book={FIXTURES / 'book.txt'}")[0]
    assert book.text.startswith("CHAPTER I") and book.keep == "head"  # Gutenberg header skipped
    generic = load(f"jsonl={FIXTURES / 'generic.jsonl'}")
    assert generic[0].ids[:3] == (1, 2, 3) and generic[0].text is None
    assert generic[1].text == "hello there" and generic[1].chat
    text = load(f"text={FIXTURES / 'prompt.txt'}")[0]
    assert text.text.startswith("A plain text prompt")


def test_buckets_cut_the_middle_and_skip_short_items():
    items = load(f"multi_news={FIXTURES / 'longbench_multi_news.jsonl'}")
    tok = CharTokenizer()
    prompts = build_prompts(items, tok, PromptFilter(buckets=(64, 256)))
    assert [(p.item_id, p.bucket, p.context_tokens) for p in prompts] == [("mn1", 64, 64), ("mn1", 256, 256),
                                                                         ("mn2", 64, 64)]
    full = torch.tensor(tok.apply_chat_template([{"role": "user", "content": items[0].text}], True, True))
    assert torch.equal(prompts[0].ids, torch.cat([full[:32], full[-32:]]))  # chat head and tail kept
    assert torch.equal(middle_truncate(torch.arange(5), 10), torch.arange(5))
    no_chat = build_prompts(items[:1], tok, PromptFilter(use_chat=False))[0]
    assert no_chat.ids[0] == ord("Y")
    book = load(f"book={FIXTURES / 'book.txt'}")
    head = build_prompts(book, tok, PromptFilter(buckets=(16,)))[0]
    assert "".join(chr(t) for t in head.ids.tolist()) == "CHAPTER I\n\nIt wa"


def test_length_filter_limit_and_category_spread():
    tok = CharTokenizer()
    questions = load(f"spec_bench={FIXTURES / 'question.jsonl'}")
    picked = build_prompts(questions, tok, PromptFilter(limit=2))
    assert {p.category for p in picked} == {"writing", "math"}  # round-robin over categories
    short = build_prompts(questions, tok, PromptFilter(max_context=len("<user>Write a poem.</user><model>")))
    assert [p.item_id for p in short] == ["81", "91"]
    generic = load(f"jsonl={FIXTURES / 'generic.jsonl'}")
    only_ids = build_prompts(generic[:1], None, PromptFilter())  # token ids need no tokenizer
    assert only_ids[0].ids.tolist()[:4] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="no tokenizer"):
        build_prompts(generic[1:], None, PromptFilter())
