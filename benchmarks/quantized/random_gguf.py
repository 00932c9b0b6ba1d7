"""GGUF files of real model shapes (Llama-3.2-1B and 3B, Qwen2.5-1.5B, Llama-3.1-8B)
with random weights, for comparing our quantized decoding with llama.cpp's where no
real checkpoint of that size is at hand (nothing is downloaded).

    python benchmarks/quantized/random_gguf.py --llama-bin /tmp/llama.cpp/build/bin \\
        --work bench-out/random-gguf --shapes llama-3.2-1b qwen2.5-1.5b llama-3.2-3b llama-3.1-8b

writes <work>/<shape>-f16.gguf with the `gguf` package (weights N(0, 1/fan_in), so that
activations stay finite and the logits spread; norms 1; the vocabulary of
`synthetic_vocab`), then `llama-quantize` makes <shape>-q4_k_m.gguf and <shape>-q8_0.gguf
from it and the F16 file is deleted (--keep-f16 keeps it). Files already there are kept.
The tensor types llama-quantize chose are printed per file (our quantized products
read Q8_0, Q5_0, Q4_K and Q6_K; a Q5_K tensor is named).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import SHAPES, Shape
from synthetic_vocab import synthetic_vocabulary

F16_FILE_TYPE = 1  # llama.cpp's LLAMA_FTYPE_MOSTLY_F16
CHUNK = 1 << 26  # elements drawn and written at a time: the 8B embedding never sits in memory whole


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...], float | None]]:
    """(name, numpy shape (rows, columns), std or None for a norm of ones / a zero bias) in llama.cpp's
    tensor names; a product's std is 1/sqrt(its input width)."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    plan = [("token_embd.weight", (shape.vocab, h), h ** -0.5)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), None),
                 (b + "attn_q.weight", (q, h), h ** -0.5), (b + "attn_k.weight", (kv, h), h ** -0.5),
                 (b + "attn_v.weight", (kv, h), h ** -0.5)]
        if shape.qkv_bias:
            plan += [(b + "attn_q.bias", (q,), None), (b + "attn_k.bias", (kv,), None), (b + "attn_v.bias", (kv,), None)]
        plan += [(b + "attn_output.weight", (h, q), q ** -0.5), (b + "ffn_norm.weight", (h,), None),
                 (b + "ffn_gate.weight", (shape.ffn, h), h ** -0.5), (b + "ffn_up.weight", (shape.ffn, h), h ** -0.5),
                 (b + "ffn_down.weight", (h, shape.ffn), shape.ffn ** -0.5)]
    plan.append(("output_norm.weight", (h,), None))
    if not shape.tied:
        plan.append(("output.weight", (shape.vocab, h), h ** -0.5))
    return plan


def add_metadata(writer, shape: Shape) -> None:
    writer.add_name(f"random-{shape.name}")
    writer.add_file_type(F16_FILE_TYPE)
    writer.add_context_length(131072 if shape.architecture == "llama" else 32768)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    vocabulary = synthetic_vocabulary(shape.vocab, shape.special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(shape.pre_tokenizer)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.token_types)
    writer.add_token_merges(vocabulary.merges)
    writer.add_bos_token_id(vocabulary.bos)
    writer.add_eos_token_id(vocabulary.eos)
    writer.add_add_bos_token(shape.add_bos)


def write_f16(shape: Shape, path: Path, seed: int = 0) -> None:
    """The F16 file, each tensor drawn and written in chunks (norms and biases F32, as llama.cpp keeps them)."""
    import gguf

    rng = np.random.default_rng(seed)
    plan = tensor_plan(shape)
    writer = gguf.GGUFWriter(path.with_suffix(".partial"), shape.architecture)
    add_metadata(writer, shape)
    for name, dims, std in plan:
        dtype = np.float16 if std is not None else np.float32
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    out = writer.fout[0]
    for name, dims, std in plan:
        writer.write_padding(out, out.tell())
        count = int(np.prod(dims))
        if std is None:
            values = np.ones(count, np.float32) if name.endswith("norm.weight") else np.zeros(count, np.float32)
            values.tofile(out)
        else:
            for start in range(0, count, CHUNK):
                n = min(CHUNK, count - start)
                (rng.standard_normal(n, dtype=np.float32) * np.float32(std)).astype(np.float16).tofile(out)
        writer.write_padding(out, count * (2 if std is not None else 4))
        writer.tensors[0].pop(name)
    writer.close()
    path.with_suffix(".partial").rename(path)


def quantize(bin_dir: Path, source: Path, target: Path, kind: str, threads: int) -> None:
    partial = target.with_suffix(".partial")
    subprocess.run([str(bin_dir / "llama-quantize"), str(source), str(partial), kind, str(threads)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    partial.rename(target)


def tensor_types(path: Path) -> Counter:
    import gguf

    reader = gguf.GGUFReader(path)
    return Counter(t.tensor_type.name for t in reader.tensors)


def random_gguf(shape: Shape, work: Path, bin_dir: Path, *, kinds=("Q4_K_M", "Q8_0"), threads: int = 2,
                keep_f16: bool = False) -> dict[str, Path]:
    """{kind: path} of the quantized files of `shape` under `work`, made where missing."""
    work.mkdir(parents=True, exist_ok=True)
    paths = {kind: work / f"{shape.name}-{kind.lower()}.gguf" for kind in kinds}
    f16 = work / f"{shape.name}-f16.gguf"
    missing = [kind for kind, path in paths.items() if not path.is_file()]
    if missing and not f16.is_file():
        print(f"writing {f16} ({shape.parameters() / 1e9:.2f}B parameters)", flush=True)
        write_f16(shape, f16)
    for kind in missing:
        print(f"llama-quantize {f16.name} -> {paths[kind].name}", flush=True)
        quantize(bin_dir, f16, paths[kind], kind, threads)
    if f16.is_file() and not keep_f16:
        f16.unlink()
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", type=Path, required=True, help="directory holding llama-quantize")
    parser.add_argument("--work", type=Path, default=Path("bench-out/random-gguf"))
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["llama-3.2-1b"])
    parser.add_argument("--kinds", nargs="+", default=["Q4_K_M", "Q8_0"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-f16", action="store_true")
    args = parser.parse_args()
    if not (args.llama_bin / "llama-quantize").is_file():
        parser.error(f"{args.llama_bin}/llama-quantize is missing: build llama.cpp first (benchmarks/quantized/build_llama_cpp.sh)")
    for name in args.shapes:
        paths = random_gguf(SHAPES[name], args.work, args.llama_bin, kinds=tuple(args.kinds), threads=args.threads,
                            keep_f16=args.keep_f16)
        for path in paths.values():
            types = tensor_types(path)
            note = "  (Q5_K present: our quantized products do not read it)" if "Q5_K" in types else ""
            print(f"{path.name}: {path.stat().st_size / 2**30:.2f} GiB, tensor types {dict(types)}{note}", flush=True)


if __name__ == "__main__":
    main()
