"""Tree attention as one Triton kernel (LongSpec's fused masked attention, for GPUs).

The queries of a speculative tree attend, in one pass with an online softmax:

* the committed prefix of their row, keys 0 .. lengths[b] - 1, all visible (no mask
  is read: the prefix is the long part, and it needs none);
* the tree's own keys 0 .. T - 1 under the row's tree mask.

Grouped-query attention is served without repeating K/V: one program takes a block
of the stacked rows (query head within the group, tree node) of one KV head, so each
K/V block it loads serves the whole group. Rows are ragged: every batch row has its
own prefix length. The kernel returns the output and the log-sum-exp of each query.

Two bugs of the published kernel are absent by construction: K and V each use their
own strides (they were swapped there), and a tree key is visible only when the
query is real AND the key is real AND the mask says so (an OR stood there).

Import this module only after deciding whether Triton runs compiled (a GPU) or
interpreted (`TRITON_INTERPRET=1`, how the tests run it on a CPU): Triton reads that
choice when the kernel is defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Kernel tile sizes: 16 is the smallest tile `tl.dot` takes on GPUs.
BLOCK_M = 16
BLOCK_N = 32
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _online_softmax_step(acc, m_i, l_i, scores, values):
    """Fold a block of scores [M, N] and its values [N, D] into the running state."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row that has seen no visible key yet keeps m = -inf; shift it by 0 instead.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_shift)
    p = tl.exp(scores - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _queries(Q, b, kv, pid_m, sqb, sqh, sqt, sqd, group, T, D,
             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program's block of stacked rows r = g * T + t (query head kv * group + g, tree
    node t): the queries [BLOCK_M, BLOCK_D] and the indices the other steps need."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < group * T
    head = kv * group + rows // T
    node = rows % T
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < D
    q = tl.load(Q + b * sqb + head[:, None] * sqh + node[:, None] * sqt + dims[None, :] * sqd,
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    return q, head, node, row_valid, dims, dim_valid


@triton.jit
def _prefix_keys(acc, m_i, l_i, q, K, V, sks, skd, svs, svd, begin, end, dims, dim_valid, scale,
                 BLOCK_N: tl.constexpr):
    """Fold the prefix keys [begin, end) of one row and K/V head (K, V: their base) into
    the running state; the prefix is all visible."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(begin, end, BLOCK_N):
        keys = start + offs_n
        key_valid = keys < end
        k = tl.load(K + keys[None, :] * sks + dims[:, None] * skd,
                    mask=key_valid[None, :] & dim_valid[:, None], other=0.0)
        scores = tl.dot(q, k, input_precision="ieee") * scale
        scores = tl.where(key_valid[None, :], scores, float("-inf"))
        v = tl.load(V + keys[:, None] * svs + dims[None, :] * svd,
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, scores, v)
    return acc, m_i, l_i


@triton.jit
def _tree_keys(acc, m_i, l_i, q, K, V, MASK, sks, skd, svs, svd, smq, smk, T, node, row_valid, dims, dim_valid,
               scale, BLOCK_N: tl.constexpr):
    """Fold the tree's T keys of one row and K/V head into the running state, each visible
    where the query is real AND the key is real AND the row's mask (MASK: its base) says so."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, T, BLOCK_N):
        keys = start + offs_n
        key_valid = keys < T
        k = tl.load(K + keys[None, :] * sks + dims[:, None] * skd,
                    mask=key_valid[None, :] & dim_valid[:, None], other=0.0)
        both = row_valid[:, None] & key_valid[None, :]
        allowed = tl.load(MASK + node[:, None] * smq + keys[None, :] * smk, mask=both, other=0)
        visible = both & (allowed != 0)
        scores = tl.dot(q, k, input_precision="ieee") * scale
        scores = tl.where(visible, scores, float("-inf"))
        v = tl.load(V + keys[:, None] * svs + dims[None, :] * svd,
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, scores, v)
    return acc, m_i, l_i


@triton.jit
def _normalized(acc, m_i, l_i):
    """(output, log-sum-exp) of the state: 0 and -inf for a query that saw no key."""
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _tree_attention_kernel(
    Q, KP, VP, KT, VT, MASK, LENGTHS, OUT, LSE,
    sqb, sqh, sqt, sqd,
    skpb, skph, skps, skpd,
    svpb, svph, svps, svpd,
    sktb, skth, skts, sktd,
    svtb, svth, svts, svtd,
    smb, smq, smk,
    sob, soh, sot, sod,
    slb, slh, slt,
    num_kv_heads, group, T, D, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bkv = tl.program_id(0)
    b = pid_bkv // num_kv_heads
    kv = pid_bkv % num_kv_heads
    q, head, node, row_valid, dims, dim_valid = _queries(Q, b, kv, tl.program_id(1), sqb, sqh, sqt, sqd, group, T, D,
                                                         BLOCK_M, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, m_i, l_i = _prefix_keys(acc, m_i, l_i, q, KP + b * skpb + kv * skph, VP + b * svpb + kv * svph,
                                 skps, skpd, svps, svpd, 0, tl.load(LENGTHS + b), dims, dim_valid, scale, BLOCK_N)
    acc, m_i, l_i = _tree_keys(acc, m_i, l_i, q, KT + b * sktb + kv * skth, VT + b * svtb + kv * svth, MASK + b * smb,
                               skts, sktd, svts, svtd, smq, smk, T, node, row_valid, dims, dim_valid, scale, BLOCK_N)
    out, lse = _normalized(acc, m_i, l_i)
    tl.store(OUT + b * sob + head[:, None] * soh + node[:, None] * sot + dims[None, :] * sod,
             out.to(OUT.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    tl.store(LSE + b * slb + head * slh + node * slt, lse, mask=row_valid)


def tree_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    prefix_lengths: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D]; k/v_prefix [B, Hkv, P, D] with row b's prefix in its first
    prefix_lengths[b] <= P keys; k/v_tree [B, Hkv, T, D]; tree_mask [T, T] or [B, T, T]
    bool (True = visible). Returns the output [B, Hq, T, D] in q's dtype and the
    log-sum-exp [B, Hq, T] in float32 (-inf where a query sees no key)."""
    B, Hq, T, D = q.shape
    Hkv = k_prefix.shape[1]
    _check(q, k_prefix, prefix_lengths, k_tree, tree_mask)
    mask = tree_mask.to(torch.int8)
    mask_strides = (0, *mask.stride()) if mask.dim() == 2 else mask.stride()
    group = Hq // Hkv
    out = torch.empty_like(q)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    grid = (B * Hkv, triton.cdiv(group * T, BLOCK_M))
    _tree_attention_kernel[grid](
        q, k_prefix, v_prefix, k_tree, v_tree, mask, prefix_lengths.to(torch.int32), out, lse,
        *q.stride(), *k_prefix.stride(), *v_prefix.stride(), *k_tree.stride(), *v_tree.stride(),
        *mask_strides, *out.stride(), *lse.stride(),
        Hkv, group, T, D, scale,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return out, lse


def _check(q, k_prefix, prefix_lengths, k_tree, tree_mask) -> None:
    B, Hq, T, D = q.shape
    Hkv = k_prefix.shape[1]
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"tree_attention computes in {SUPPORTED_DTYPES}, got {q.dtype}")
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not group over {Hkv} K/V heads")
    if k_tree.shape[2] != T or tree_mask.shape[-2:] != (T, T):
        raise ValueError(f"a tree of {T} queries needs {T} tree keys and a [{T}, {T}] mask")
    if prefix_lengths.shape != (B,) or (B and int(prefix_lengths.max()) > k_prefix.shape[2]):
        raise ValueError(f"prefix_lengths must be [{B}] and at most {k_prefix.shape[2]} (the prefix's keys)")


# ---------------------------------------------------------------- split over the prefix
# The kernel above gives each (K/V head, block of stacked rows) one program that walks
# the whole prefix: for a 64-node tree of an 8B model's heads, 128 programs, too few to
# keep a GPU's memory busy over a long prefix
# (docs/lab-notes/gpu.md#the-papers-scale-on-an-h200-issue-gpu-at-the-papers-scale).
# Flash-decoding's answer: cut the prefix into chunks, one program per (head, row block,
# chunk) writing its partial output and log-sum-exp, the tree keys as one more chunk,
# then merge the chunks by log-sum-exp. Not yet the backend's choice: it waits for a
# GPU measurement against the kernel above and SDPA (benchmarks/device/paper_scale.py).

SPLIT_BLOCK_N = 64


@triton.jit
def _tree_attention_split_kernel(
    Q, KP, VP, KT, VT, MASK, LENGTHS, OUT, LSE,
    sqb, sqh, sqt, sqd,
    skpb, skph, skps, skpd,
    svpb, svph, svps, svpd,
    sktb, skth, skts, sktd,
    svtb, svth, svts, svtd,
    smb, smq, smk,
    sos, sob, soh, sot, sod,
    sls, slb, slh, slt,
    num_kv_heads, group, T, D, scale, chunk, splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bkv = tl.program_id(0)
    split = tl.program_id(2)  # < splits: a chunk of the prefix; == splits: the tree's keys
    b = pid_bkv // num_kv_heads
    kv = pid_bkv % num_kv_heads
    q, head, node, row_valid, dims, dim_valid = _queries(Q, b, kv, tl.program_id(1), sqb, sqh, sqt, sqd, group, T, D,
                                                         BLOCK_M, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if split < splits:
        end = tl.minimum(tl.load(LENGTHS + b), (split + 1) * chunk)
        acc, m_i, l_i = _prefix_keys(acc, m_i, l_i, q, KP + b * skpb + kv * skph, VP + b * svpb + kv * svph,
                                     skps, skpd, svps, svpd, split * chunk, end, dims, dim_valid, scale, BLOCK_N)
    else:
        acc, m_i, l_i = _tree_keys(acc, m_i, l_i, q, KT + b * sktb + kv * skth, VT + b * svtb + kv * svth,
                                   MASK + b * smb, skts, sktd, svts, svtd, smq, smk, T, node, row_valid, dims,
                                   dim_valid, scale, BLOCK_N)
    out, lse = _normalized(acc, m_i, l_i)
    tl.store(OUT + split * sos + b * sob + head[:, None] * soh + node[:, None] * sot + dims[None, :] * sod,
             out, mask=row_valid[:, None] & dim_valid[None, :])
    tl.store(LSE + split * sls + b * slb + head * slh + node * slt, lse, mask=row_valid)


def split_count(programs_per_split: int, longest_prefix: int, device: torch.device, min_chunk: int = 256) -> int:
    """Prefix chunks that give the device about two programs per multiprocessor, each
    chunk at least `min_chunk` keys."""
    processors = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = triton.cdiv(2 * processors, max(programs_per_split, 1))
    return max(1, min(wanted, triton.cdiv(longest_prefix, min_chunk)))


def tree_attention_split(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    prefix_lengths: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tree_attention` with the prefix cut into `splits` chunks (None: enough to fill
    the device), each chunk and the tree one program column, merged by log-sum-exp."""
    B, Hq, T, D = q.shape
    Hkv = k_prefix.shape[1]
    _check(q, k_prefix, prefix_lengths, k_tree, tree_mask)
    group = Hq // Hkv
    block_m = 64 if D <= 128 else 32
    row_blocks = triton.cdiv(group * T, block_m)
    longest = int(prefix_lengths.max()) if B else 0
    if splits is None:
        splits = split_count(B * Hkv * row_blocks, longest, q.device)
    chunk = max(1, triton.cdiv(longest, splits))
    mask = tree_mask.to(torch.int8)
    mask_strides = (0, *mask.stride()) if mask.dim() == 2 else mask.stride()
    parts = torch.empty((splits + 1, B, Hq, T, D), dtype=torch.float32, device=q.device)
    lses = torch.empty((splits + 1, B, Hq, T), dtype=torch.float32, device=q.device)
    grid = (B * Hkv, row_blocks, splits + 1)
    _tree_attention_split_kernel[grid](
        q, k_prefix, v_prefix, k_tree, v_tree, mask, prefix_lengths.to(torch.int32), parts, lses,
        *q.stride(), *k_prefix.stride(), *v_prefix.stride(), *k_tree.stride(), *v_tree.stride(),
        *mask_strides, *parts.stride(), *lses.stride(),
        Hkv, group, T, D, scale, chunk, splits,
        BLOCK_M=block_m, BLOCK_N=SPLIT_BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - torch.where(torch.isfinite(lse), lse, 0.0))  # 0 for a part that saw nothing
    out = (weights.unsqueeze(-1) * parts).sum(dim=0)
    return out.to(q.dtype), lse
