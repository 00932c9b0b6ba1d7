"""External drafters with a reduced vocabulary (Mamba, small transformer): the
vocabulary map, lossless drafting through it, and their trainer (resumable, its
output loadable by the drafters)."""

from __future__ import annotations

import pytest
import torch

from longspec.speculation.drafters.draft_model import DraftModelDrafter
from longspec.speculation.drafters.shared.errors import DraftMismatchError
from longspec.speculation.drafters.mamba import MambaDrafter
from longspec.speculation.drafters.mamba.sequence import MambaSequenceLM
from longspec.speculation.drafters.shared.vocab_map import VocabMap
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.processors import SamplingParams
from longspec.training.external_drafter import (
    DrafterTrainOptions,
    ExternalDrafterTrainer,
    cut_vocabulary,
    mamba_drafter,
    reduced_vocabulary,
    transformer_drafter,
)
from tiny_models import VOCAB_SIZE, decoder_from_hf, random_ids, tiny_decoder

OPTIONS = EngineOptions(prefill_chunk=8, max_tree_nodes=24, progress=False)


def generate(model, prompt, drafter=None, params=SamplingParams(), seed=None, max_new_tokens=40):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    rounds = SpeculativeEngine(model, OPTIONS).generate(prompt, params=params, max_new_tokens=max_new_tokens,
                                                        drafter=drafter, generator=generator)
    return torch.cat(list(rounds))


def test_vocab_map_round_trip_and_refusals(tmp_path):
    vocab = VocabMap([7, 3, 100], VOCAB_SIZE)
    assert vocab.draft_vocab_size == 4 and vocab.other == 3
    assert vocab.to_draft(torch.tensor([3, 7, 5, 100])).tolist() == [1, 0, 3, 2]
    assert vocab.to_target(torch.tensor([2, 0])).tolist() == [100, 7]
    assert vocab.hide_other(torch.zeros(2, 4)).shape == (2, 3)
    loaded = VocabMap.load(vocab.save(tmp_path).parent)
    assert torch.equal(loaded.target_ids, vocab.target_ids) and loaded.target_vocab_size == VOCAB_SIZE
    assert VocabMap.load(tmp_path / "nowhere") is None
    with pytest.raises(ValueError, match="repeat"):
        VocabMap([1, 1], VOCAB_SIZE)
    with pytest.raises(ValueError, match="must lie in"):
        VocabMap([VOCAB_SIZE], VOCAB_SIZE)
    target = tiny_decoder("llama", eos_token_id=7).config
    vocab.check_fits("drafter", 4, target)
    with pytest.raises(DraftMismatchError, match="outside"):
        vocab.check_fits("drafter", 4, tiny_decoder("llama", eos_token_id=9).config)
    with pytest.raises(DraftMismatchError, match="over 128 target ids, the target has 129"):
        vocab.check_fits("drafter", 4, tiny_decoder("llama", vocab_size=VOCAB_SIZE + 1).config)
    with pytest.raises(DraftMismatchError, match="the model has 3 ids"):
        vocab.check_fits("drafter", 3, target)


def _prompt_and_vocab(size=40):
    prompt = random_ids(40, seed=8)[0] % 48
    return prompt, VocabMap(torch.arange(0, 2 * size, 2), VOCAB_SIZE)  # half the prompt's tokens are "other"


@pytest.mark.parametrize("widths", [(2, 2, 1), (3, 1, 1, 1)])
def test_reduced_vocabulary_mamba_is_lossless(widths):
    target = tiny_decoder("gemma3", dtype=torch.float64)
    prompt, vocab = _prompt_and_vocab()
    drafter = MambaDrafter(mamba_drafter(vocab, hidden_size=32, layers=2, state_size=4).double(), widths=widths,
                           vocab=vocab)
    assert torch.equal(generate(target, prompt, drafter), generate(target, prompt))


@pytest.mark.parametrize("sample", [False, True])
def test_reduced_vocabulary_draft_model_is_lossless(sample):
    target = tiny_decoder("llama", dtype=torch.float64)
    prompt, vocab = _prompt_and_vocab()
    draft = decoder_from_hf(transformer_drafter(vocab, target.config, hidden_size=32, layers=2, heads=2, kv_heads=1,
                                                intermediate_size=64), torch.float64)
    drafter = DraftModelDrafter(draft, length=4, sample=sample, vocab=vocab)
    if not sample:
        assert torch.equal(generate(target, prompt, drafter), generate(target, prompt))
    else:  # sampled chains carry q over the target vocabulary: seeded runs are reproducible and well-formed
        params = SamplingParams(temperature=1.0)
        first = generate(target, prompt, drafter, params=params, seed=3)
        assert torch.equal(first, generate(target, prompt, DraftModelDrafter(draft, length=4, sample=True, vocab=vocab),
                                           params=params, seed=3))


def test_a_map_that_does_not_fit_the_target_is_refused_before_prefill():
    target = tiny_decoder("llama", dtype=torch.float64, eos_token_id=5)
    vocab = VocabMap([1, 2, 3], VOCAB_SIZE)  # EOS 5 is not among them
    drafter = MambaDrafter(mamba_drafter(vocab, hidden_size=16, layers=1, state_size=4), vocab=vocab)
    with pytest.raises(DraftMismatchError, match="end-of-sequence"):
        generate(target, random_ids(10)[0], drafter)


def _tokens():
    return torch.cat([random_ids(12, seed=i)[0].repeat(4) for i in range(12)])


def _train(out, target, vocab, architecture, *, stop_after=None, steps=4, self_distill=True, cache=None):
    model = mamba_drafter(vocab, hidden_size=32, layers=2, state_size=4) if architecture == "mamba" else \
        transformer_drafter(vocab, target.config, hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate_size=64)
    options = DrafterTrainOptions(steps=steps, seq_len=24, batch_size=2, lr=3e-3, warmup=2, save_every=2,
                                  self_distill=self_distill, row_prefix=(1,))
    forward_module = MambaSequenceLM(model) if architecture == "mamba" else None  # as the CLI trains it
    trainer = ExternalDrafterTrainer(model, target, vocab, _tokens(), out, options, label_cache=cache,
                                     forward_module=forward_module, progress=False)
    trainer.train(stop_after=stop_after)
    return trainer


@pytest.mark.parametrize("architecture", ["mamba", "draft-model"])
def test_killed_and_resumed_training_ends_at_the_same_weights(tmp_path, architecture):
    target = tiny_decoder("gemma3", dtype=torch.float32)
    vocab = reduced_vocabulary(_tokens(), target.config, 60)
    whole = _train(tmp_path / "whole", target, vocab, architecture, cache=tmp_path / "labels")
    _train(tmp_path / "split", target, vocab, architecture, stop_after=1, cache=tmp_path / "labels")  # killed
    resumed = _train(tmp_path / "split", target, vocab, architecture, cache=tmp_path / "labels")
    assert resumed.step == 4
    for (name, x), (_, y) in zip(whole.drafter.state_dict().items(), resumed.drafter.state_dict().items()):
        assert torch.equal(x, y), name
    rows = (tmp_path / "split" / "loss.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3", "4"]


def test_trained_drafters_load_from_their_directory_and_stay_lossless(tmp_path):
    target = tiny_decoder("llama", dtype=torch.float32)
    vocab = reduced_vocabulary(_tokens(), target.config, 50)
    _train(tmp_path / "mamba", target, vocab, "mamba", self_distill=False)
    _train(tmp_path / "small", target, vocab, "draft-model")
    prompt = _tokens()[:30]
    expected = generate(target, prompt)
    mamba = MambaDrafter(tmp_path / "mamba", widths=(2, 1, 1))
    assert mamba.vocab is not None and torch.equal(generate(target, prompt, mamba), expected)
    small = DraftModelDrafter(tmp_path / "small", length=3)
    assert small.vocab is not None and torch.equal(generate(target, prompt, small), expected)


def test_resuming_with_another_vocabulary_is_refused(tmp_path):
    target = tiny_decoder("gemma3", dtype=torch.float32)
    _train(tmp_path / "run", target, reduced_vocabulary(_tokens(), target.config, 60), "mamba", steps=2)
    with pytest.raises(ValueError, match="vocab changed"):
        _train(tmp_path / "run", target, reduced_vocabulary(_tokens(), target.config, 50), "mamba", steps=2)


@pytest.mark.parametrize("kind", ["mamba", "draft-model"])
def test_cli_trains_resumes_and_generates_with_the_drafter(tmp_path, capsys, kind):
    from longspec.cli.main import main
    from tiny_models import save_checkpoint

    checkpoint = save_checkpoint(tmp_path / "target", family="llama", max_position_embeddings=512)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / kind
    # One corpus file: --heldout 0 keeps it in the training split whatever its (hashed) path.
    argv = ["train", kind, "--model", str(checkpoint), "--corpus", str(corpus), "--heldout", "0", "--out", str(out),
            "--dtype", "float32",
            "--hidden-size", "32", "--layers", "2", "--draft-vocab", "40", "--seq-len", "32", "--batch-size", "2",
            "--save-every", "2", "--threads", "1"]
    assert main(argv + ["--steps", "2"]) == 0
    assert main(argv + ["--steps", "3"]) == 0  # resumes at step 2
    assert "resuming at step 2" in capsys.readouterr().out
    assert main(["generate", "the quick", "--model", str(checkpoint), "--dtype", "float32", "--method", kind,
                 "--option", f"model={out}", "--max-new-tokens", "8", "--json"]) == 0
    assert '"text"' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", kind, "--out", str(out), "--layers"])  # argparse names the missing value


def test_a_corpus_held_out_whole_names_the_fix(tmp_path):
    from longspec.training.data import Document, build_shards
    from tiny_models import char_tokenizer

    from longspec.training.data import is_held_out

    name = next(f"doc{i}.txt" for i in range(10_000) if is_held_out(f"doc{i}.txt", 0.05))  # hashes into the 5 %
    with pytest.raises(ValueError, match="held-out split .*--heldout 0"):
        build_shards([Document(name, "some text " * 20)], char_tokenizer(), tmp_path, heldout_fraction=0.05)


def test_reduced_vocabulary_sampled_chains_follow_the_target_distribution():
    """Sampled chains carry q scattered from the draft's reduced vocabulary onto the
    target's: speculative sampling through it must keep the target's distribution."""
    from sampling_checks import PROMPT, SAMPLING, K, N, exact_distribution, goodness_of_fit

    target = tiny_decoder("qwen3", dtype=torch.float64, vocab_size=4, seed=7, initializer_range=0.5)
    vocab = VocabMap([0, 2, 3], 4)  # token 1 is "other" to the draft: never proposed, still sampled by the target
    draft = decoder_from_hf(transformer_drafter(vocab, target.config, hidden_size=32, layers=1, heads=2, kv_heads=1,
                                                intermediate_size=64), torch.float64)
    engine = SpeculativeEngine(target, EngineOptions(max_tree_nodes=8, progress=False))
    generator = torch.Generator().manual_seed(0)
    draft_stream = torch.Generator().manual_seed(1)  # one running stream: draws independent across requests
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(N):
        drafter = DraftModelDrafter(draft, length=2, sample=True, vocab=vocab, generator=draft_stream)
        rounds = engine.generate(PROMPT, params=SAMPLING, max_new_tokens=K, drafter=drafter, generator=generator)
        key = tuple(torch.cat(list(rounds)).tolist())
        counts[key] = counts.get(key, 0) + 1
    assert goodness_of_fit(exact_distribution(target, SAMPLING), counts) > 1e-3


@pytest.mark.parametrize("architecture", ["mamba", "draft-model"])
def test_a_cut_vocabulary_keeps_the_drafters_function_on_the_kept_tokens(architecture):
    """Shipping cuts a drafter to its most frequent tokens: on inputs among them, its
    logits over them are the uncut drafter's; EOS stays; the rest read as "other"."""
    target = tiny_decoder("gemma3", dtype=torch.float32)
    tokens = _tokens()
    vocab = reduced_vocabulary(tokens, target.config, 60)
    build = (lambda v: mamba_drafter(v, hidden_size=32, layers=2, state_size=4)) if architecture == "mamba" else \
        (lambda v: transformer_drafter(v, target.config, hidden_size=32, layers=2, heads=2, kv_heads=1,
                                       intermediate_size=64))
    model = build(vocab).double().eval()
    cut = build(vocab).double().eval()
    cut.load_state_dict(model.state_dict())
    frequencies = torch.bincount(tokens, minlength=target.config.vocab_size)
    eos = list(target.config.eos_token_ids)
    small = cut_vocabulary(cut, vocab, frequencies, 20, eos)
    assert small.draft_vocab_size == 21 and cut.config.vocab_size == 21
    assert cut.get_output_embeddings().weight.data_ptr() == cut.get_input_embeddings().weight.data_ptr()
    in_vocab = [t for t in eos if t < target.config.vocab_size and int(vocab.to_draft(torch.tensor([t]))) != vocab.other]
    assert all(int(small.to_draft(torch.tensor([t]))) != small.other for t in in_vocab)
    ids = small.target_ids[torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        full = model(input_ids=vocab.to_draft(ids)).logits[..., vocab.to_draft(small.target_ids)]
        reduced = cut(input_ids=small.to_draft(ids)).logits[..., :20]
    torch.testing.assert_close(reduced, full)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mamba", "draft-model"])
def test_shipped_external_drafters_fit_the_embedded_gemma_and_stay_lossless(method):
    from longspec.runtime.default_model import default_model_available

    if not default_model_available():
        pytest.skip("the embedded Gemma 3 270M package is not installed")
    import longspec

    from longspec.runtime.native import bf16_speculation_is_exact

    # bf16 (fast) where the native kernels make it exact; elsewhere bf16 near-ties may differ.
    model = longspec.load(None, dtype="bfloat16" if bf16_speculation_is_exact() else "float32")
    prompt = model.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 4)
    greedy = model.generate(prompt, max_new_tokens=24, ignore_eos=True)
    drafted = model.generate(prompt, max_new_tokens=24, ignore_eos=True, method=method)
    assert drafted.token_ids == greedy.token_ids
    assert drafted.stats.tau > 1.0  # the shipped drafter's tokens were accepted at least once


def _cli_training(tmp_path, kind):
    from tiny_models import save_checkpoint

    checkpoint = save_checkpoint(tmp_path / "target", family="llama", max_position_embeddings=512)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return checkpoint, ["train", kind, "--model", str(checkpoint), "--corpus", str(corpus), "--heldout", "0",
                        "--dtype", "float32", "--seq-len", "32", "--batch-size", "2", "--save-every", "2", "--threads", "1"]


@pytest.mark.parametrize("kind", ["mamba", "draft-model"])
def test_init_from_continues_a_trained_drafter_with_its_architecture_and_vocabulary(tmp_path, kind):
    from safetensors.torch import load_file

    from longspec.cli.main import main

    _, argv = _cli_training(tmp_path, kind)
    first = tmp_path / "first"
    assert main(argv + ["--out", str(first), "--hidden-size", "32", "--layers", "2", "--draft-vocab", "40",
                        "--steps", "2"]) == 0
    # Zero steps: the continued run's weights are the drafter it started from.
    same = tmp_path / "same"
    assert main(argv + ["--out", str(same), "--init-from", str(first), "--steps", "1", "--lr", "0"]) == 0
    before, after = load_file(str(first / "model.safetensors")), load_file(str(same / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(VocabMap.load(same).target_ids, VocabMap.load(first).target_ids)
    # Trained further, it moves, and resumes like any run.
    further = tmp_path / "further"
    assert main(argv + ["--out", str(further), "--init-from", str(first), "--steps", "2"]) == 0
    moved = load_file(str(further / "model.safetensors"))
    assert any(not torch.equal(before[k], moved[k]) for k in before)
    assert main(argv + ["--out", str(further), "--init-from", str(first), "--steps", "3"]) == 0
    assert len((further / "loss.csv").read_text().splitlines()) == 1 + 3


def test_init_from_refusals_name_the_fix(tmp_path, capsys):
    from longspec.cli.main import main

    _, argv = _cli_training(tmp_path, "mamba")
    mamba = tmp_path / "mamba"
    assert main(argv + ["--out", str(mamba), "--hidden-size", "32", "--layers", "2", "--draft-vocab", "40",
                        "--steps", "1"]) == 0
    capsys.readouterr()
    refusals = [
        (argv + ["--out", str(tmp_path / "b"), "--init-from", str(mamba), "--layers", "3"],
         "keeps the drafter's architecture and vocabulary: drop --layers"),
        (argv + ["--out", str(tmp_path / "c"), "--init-from", str(tmp_path / "target")],
         "is not a trained drafter (no longspec-vocab.json)"),
        (["train", "draft-model"] + argv[2:] + ["--out", str(tmp_path / "d"), "--init-from", str(mamba)],
         "holds a mamba model: continue it with `longspec train mamba`"),
    ]
    for command, message in refusals:
        # A target that does not exist: each refusal comes before the target would load.
        assert main(command + ["--model", str(tmp_path / "no-target")]) == 2
        assert message in capsys.readouterr().err
    assert not any((tmp_path / name / "model.safetensors").exists() for name in "bcd")
