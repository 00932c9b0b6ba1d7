"""`longspec train responses`: prompts built from a corpus (seeded, held-out documents
never used, code asked as code), answered with the target's own tokens (each row equals
a single `generate` with the same settings), appended as JSONL that trainers read, and
resumable."""

from __future__ import annotations

import json

import pytest
import torch

import longspec
from longspec.cli.main import main
from longspec.training.data import Document, is_held_out, iter_documents
from longspec.training.tokenswift.data import tokenize_files
from longspec.training.responses import CODE_INSTRUCTIONS, PROSE_INSTRUCTIONS, build_prompts
from tiny_models import save_checkpoint
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
HELDOUT = 0.3


def documents(count: int = 24) -> list[Document]:
    prose = [Document(f"books/{i}.txt", "".join(f"Line {i}.{j} of a story.\n" for j in range(8))) for i in range(count)]
    code = [Document(f"lib/{i}.py", "".join(f"def f{j}(x):\n    return x + {j}\n" for j in range(6)))
            for i in range(count)]
    return prose + code + [Document("short.txt", "tiny")]


def line_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, newlines included (the tiny models' tokenizer has none)."""
    vocab = {"<unk>": 0, "\n": 1, **{chr(32 + i): i + 2 for i in range(95)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def test_prompts_are_seeded_skip_held_out_documents_and_ask_code_as_code():
    tokenizer = line_tokenizer()
    assert tokenizer.decode(tokenizer("a\nb", add_special_tokens=False).input_ids) == "a\nb"
    build = lambda seed, **kw: build_prompts(documents(), tokenizer, **({"count": 40, "excerpt_tokens": [40, 80],  # noqa: E731
                                             "sampled_share": 0.5, "prose_share": 0.5, "heldout_fraction": HELDOUT,
                                             "seed": seed} | kw))
    prompts = build(0)
    assert prompts == build(0) and prompts != build(1)
    assert len(prompts) == 40 and len({p.id for p in prompts}) == 40
    assert not any(is_held_out(p.source, HELDOUT) for p in prompts)
    assert any(is_held_out(d.name, HELDOUT) for d in documents())  # the split did hold some out
    assert "short.txt" not in {p.source for p in prompts}  # shorter than half an excerpt
    assert {p.sampled for p in prompts} == {False, True} and {p.kind for p in prompts} == {"prose", "code"}
    assert {p.kind for p in build(0, prose_share=1.0)} == {"prose"}
    for p in prompts:
        instructions = CODE_INSTRUCTIONS if p.kind == "code" else PROSE_INSTRUCTIONS
        heads = sorted((i.template.split("{excerpt}")[0] for i in instructions), key=len, reverse=True)
        assert p.kind == ("code" if p.source.endswith(".py") else "prose")
        head = next(h for h in heads if p.prompt.startswith(h))
        if int(p.id.split("@")[1].split("+")[0]) > 0:  # excerpts begin on a whole line
            assert p.prompt[len(head):].startswith(("Line", "def", "    return"))
    only_code = [d for d in documents() if d.name.endswith(".py")]
    assert {p.kind for p in build_prompts(only_code, tokenizer, count=5, excerpt_tokens=[40], sampled_share=0.5,
                                          prose_share=1.0, heldout_fraction=0.0, seed=0)} == {"code"}
    for bad in (dict(count=0), dict(excerpt_tokens=[8]), dict(sampled_share=1.5), dict(prose_share=-0.1),
                dict(heldout_fraction=1.0)):
        with pytest.raises(ValueError):
            build(0, **bad)


def test_cli_writes_the_targets_own_responses_and_resumes(tmp_path, capsys):
    checkpoint = save_checkpoint(tmp_path / "tiny", chat_template=TEMPLATE)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for d in documents(4):
        (corpus / d.name.replace("/", "-")).write_text(d.text)
    out = tmp_path / "out"
    argv = ["train", "responses", "--model", str(checkpoint), "--dtype", "float64", "--corpus", str(corpus),
            "--out", str(out), "--prompts", "8", "--excerpt-tokens", "40", "--max-new-tokens", "12",
            "--batch-rows", "2", "--heldout", "0", "--seed", "3", "--threads", "1"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {r["sampled"] for r in rows} == {False, True}
    assert {r["chat"] for r in rows} == {False, True}  # code completions are raw text
    model = longspec.load(checkpoint, dtype="float64")
    prompt_order = [p.id for p in build_prompts(iter_documents([corpus]), model.tokenizer, count=8,
                                                excerpt_tokens=[40], sampled_share=0.5, prose_share=0.5,
                                                heldout_fraction=0.0, seed=3)]
    for r in rows:
        sampling = dict(temperature=1.0, top_p=0.95, seed=3 + prompt_order.index(r["id"])) if r["sampled"] else {}
        alone = model.generate(r["prompt"], chat=r["chat"], max_new_tokens=12, method="ar", **sampling)
        assert r["response"] == alone.text and r["response_tokens"] == len(alone.token_ids)  # the target's own
        prompt_ids = model.encode(r["prompt"], chat=r["chat"]).tolist()
        assert r["text"] == model.tokenizer.decode(prompt_ids + alone.token_ids)
        assert r["prompt_tokens"] == len(prompt_ids)
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        model.generate_batch(["ab"], seed=[1, 2])

    # Trainers read the file as a corpus, one document per row (TokenSwift's heads too).
    assert [d.text for d in iter_documents([out / "responses.jsonl"])] == [r["text"] for r in rows]
    heads_tokens = tokenize_files(model.tokenizer, [out / "responses.jsonl"]).tolist()
    assert heads_tokens == [t for r in rows for t in model.tokenizer(r["text"]).input_ids]

    # A rerun answers nothing again; a row cut off by a killed run is answered again.
    lines = (out / "responses.jsonl").read_text().splitlines()
    (out / "responses.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    assert main(argv) == 0
    again = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in again) == sorted(r["id"] for r in rows) and again[-1] == rows[-1]
    assert "1 responses written now" in capsys.readouterr().err

    assert main(argv + ["--method", "nope"]) == 2  # before loading anything
    assert "unknown method" in capsys.readouterr().err
    missing = argv[:argv.index("--model") + 1] + [str(tmp_path / "no-model")] + argv[argv.index("--model") + 2:]
    assert main(missing + ["--prompts", "0"]) == 2 and "count must be >= 1" in capsys.readouterr().err
    assert main(missing + ["--heldout", "1"]) == 2 and "heldout_fraction" in capsys.readouterr().err


def test_task_prompts_are_served_as_bench_serves_them_and_skip_measured_items(tmp_path, capsys):
    """`--task`: a benchmark task's items, each fitted to one of the context lengths it
    reaches exactly as `longspec bench` fits it, answered with the target's own tokens;
    items that a benchmark results file measured are never used."""
    from longspec.bench.tasks import PromptFilter, load_longbench
    from longspec.bench.tasks import build_prompts as bench_prompts
    from longspec.cli.train_responses import task_prompts
    from longspec.training.data import served_prefix

    checkpoint = save_checkpoint(tmp_path / "tiny")
    rows = [{"_id": f"news{i}", "input": "", "context": "".join(f"Story {i}, line {j}.\n" for j in range(2 + 3 * i))}
            for i in range(6)]
    task_file = tmp_path / "multi_news.jsonl"
    task_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    measured = tmp_path / "results.jsonl"
    measured.write_text(json.dumps({"kind": "header"}) + "\n" + "".join(
        json.dumps({"kind": "run", "task": "multi_news", "item": item, "method": "ar"}) + "\n"
        for item in ("news2", "news4", "news4")))
    out = tmp_path / "out"
    argv = ["train", "responses", "--model", str(checkpoint), "--dtype", "float64", "--task",
            f"multi_news={task_file}", "--exclude-items-of", str(measured), "--context-lengths", "160", "220",
            "--out", str(out), "--prompts", "10", "--max-new-tokens", "6", "--batch-rows", "2", "--seed", "1",
            "--threads", "1"]
    assert main(argv) == 0
    written = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    model = longspec.load(checkpoint, dtype="float64")
    items = {item.item_id: item for item in load_longbench(task_file, "multi_news")}
    lengths = {i: len(model.tokenizer(item.text).input_ids) for i, item in items.items()}
    expected = {i for i, n in lengths.items() if n >= 160} - {"news2", "news4"}
    assert len(expected) >= 2 and {r["source"] for r in written} == {f"multi_news:{i}" for i in expected}
    assert {r["sampled"] for r in written} == {False, True}
    kept = [item for i, item in items.items() if i not in ("news2", "news4")]
    order = [p.id for p in task_prompts(kept, model.tokenizer, lengths=[160, 220], count=10, sampled_share=0.5, seed=1)]
    prefix = len(served_prefix(model.tokenizer))
    for r in written:
        item_id, length = r["id"].removeprefix("multi_news:").split("@")
        assert lengths[item_id] >= int(length) and r["prompt_tokens"] == int(length)
        served = bench_prompts([items[item_id]], model.tokenizer, PromptFilter(buckets=(int(length),)))[0].ids
        sampling = dict(temperature=1.0, top_p=0.95, seed=1 + order.index(r["id"])) if r["sampled"] else {}
        alone = model.generate(served, max_new_tokens=6, method="ar", **sampling)
        assert r["response"] == alone.text  # the target's own tokens on exactly the prompt bench serves
        assert r["text"] == model.tokenizer.decode(served.tolist()[prefix:] + alone.token_ids)
    assert "2 items measured by the benchmark runs are left out" in capsys.readouterr().err

    for bad, message in ((["--corpus", str(task_file)], "not both"),
                         (["--exclude-items-of", str(tmp_path / "none.jsonl")], "not found"),
                         (["--context-lengths", "0"], "positive token counts")):
        assert main(argv + bad) == 2 and message in capsys.readouterr().err
    measured.write_text(json.dumps({"kind": "header"}) + "\n")
    assert main(argv) == 2 and "holds no benchmark runs" in capsys.readouterr().err


def test_committed_longbench_responses_use_no_item_a_committed_benchmark_measured():
    """The in-domain training rows (the target's responses to LongBench prompts) must
    leave out every Multi-News and LCC item that a committed benchmark run measured, so
    drafters trained on them are measured on unseen items."""
    from pathlib import Path

    from longspec.bench.runner import load_rows

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    rows = [json.loads(line) for line in
            (results / "2026-11-26-responses-longbench-gemma-3-270m" / "responses.jsonl").read_text().splitlines()]
    used = {tuple(r["source"].split(":", 1)) for r in rows}
    measured = {(r["task"], str(r["item"])) for path in results.glob("**/results*.jsonl")
                for r in load_rows(path) if r.get("kind") == "run"}
    longbench = {m for m in measured if m[0] in ("multi_news", "lcc")}
    assert len(rows) >= 100 and {task for task, _ in used} == {"multi_news", "lcc"}
    assert len(longbench) >= 6 and not used & longbench
