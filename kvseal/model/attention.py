"""Paged attention: every key/value a query sees is read through its own request's page table.

Cache layout per layer: (num_pages, page_size, kv_heads, head_dim). A token at absolute position p of a
request with page table `pages` lives at page pages[p // page_size], offset p % page_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvseal.kernels.ops import paged_decode_attention


@dataclass
class PrefillSpan:
    """One sequence with several query tokens in this step (a prompt chunk)."""

    q_start: int  # first row of this sequence in the flattened batch
    q_len: int
    kv_len: int  # context length after this step, including the q_len new tokens
    pages: torch.Tensor  # (ceil(kv_len / page_size),) int64
    mask: torch.Tensor | None  # (q_len, kv_len) bool, None when q_len == kv_len (plain causal)


@dataclass
class AttentionMeta:
    slot_mapping: torch.Tensor  # (T,) int64: page * page_size + offset for each new token
    decode_rows: torch.Tensor | None  # (Bd,) int64 rows of single-query sequences
    decode_pages: torch.Tensor | None  # (Bd, max_pages) int64, padded with the row's own last page
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, max_pages * page_size) bool: key position < kv_len
    decode_kv_lens: torch.Tensor | None  # (Bd,) int64 keys each decode row sees (its context incl. this token)
    prefills: list[PrefillSpan]
    # the fast arithmetic's attention (kvseal/kernels/attention.c) takes every row of the step at once:
    spans: torch.Tensor | None = None  # (n, 5) int64: first row, rows, first position, offset in tables, pages
    tables: torch.Tensor | None = None  # (sum of pages,) int64: each span's page table, concatenated
    # the sliding layers' own slots and tables when they keep only their window in a pool of their own (kv/window.py)
    window: AttentionMeta | None = None


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache (P, S, KVH, D), pages (...,) int64 -> (..., S * KVH * D): whole pages copied as contiguous rows
    (index_select on page-sized rows is about twice as fast on CPU as advanced indexing of the 4-D pool)."""
    num_pages = cache.shape[0]
    return cache.view(num_pages, -1).index_select(0, pages.reshape(-1)).view(*pages.shape, -1)


def paged_attention(
    q: torch.Tensor,  # (T, H, D)
    k: torch.Tensor,  # (T, KVH, D) new keys, already rotated
    v: torch.Tensor,  # (T, KVH, D)
    k_cache: torch.Tensor,  # (P, S, KVH, D) this layer's pool
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    native: bool = False,  # decode rows through kvseal's C kernel, which reads the pool via the page table
    window: int = 0,  # a sliding window (ModelArch.layer_windows): a query at p sees keys p - window + 1 .. p
) -> torch.Tensor:  # (T, H, D)
    num_pages, page_size, kvh, d = k_cache.shape
    # a KV dtype other than the compute dtype (--kv-dtype) is rounded on write and widened on read
    k_cache.view(num_pages * page_size, kvh, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_pages * page_size, kvh, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    out = torch.empty_like(q)

    # the C kernel reads every key up to kv_len: it runs a windowed layer only while no row is past its window
    in_window = window == 0 or (meta.decode_kv_lens is not None and int(meta.decode_kv_lens.max()) <= window)
    if meta.decode_rows is not None and native and in_window:
        assert meta.decode_pages is not None and meta.decode_kv_lens is not None
        out[meta.decode_rows] = paged_decode_attention(q[meta.decode_rows], k_cache, v_cache, meta.decode_pages,
                                                       meta.decode_kv_lens, scale)
    elif meta.decode_rows is not None:
        out[meta.decode_rows] = _decode_rows(q[meta.decode_rows], k_cache, v_cache, meta, scale, window)
    for span in meta.prefills:
        out[span.q_start : span.q_start + span.q_len] = _span(q, k_cache, v_cache, span, scale, window)
    return out


def _decode_rows(qd: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float,
                 window: int) -> torch.Tensor:
    """qd (Bd, H, D), the single-query rows, through torch: each row's pages gathered, keys past its length (and
    before its window) masked. -> (Bd, H, D)"""
    assert meta.decode_pages is not None and meta.decode_mask is not None
    _, page_size, kvh, d = k_cache.shape
    bd, max_pages = meta.decode_pages.shape
    ctx = max_pages * page_size
    kd = gather_pages(k_cache, meta.decode_pages).view(bd, ctx, kvh, d).transpose(1, 2)  # (Bd, KVH, ctx, D)
    vd = gather_pages(v_cache, meta.decode_pages).view(bd, ctx, kvh, d).transpose(1, 2)
    kd, vd = kd.to(qd.dtype), vd.to(qd.dtype)
    mask: torch.Tensor = meta.decode_mask
    if window:  # keys at kv_len - window .. kv_len - 1 only
        assert meta.decode_kv_lens is not None
        first = (meta.decode_kv_lens - window)[:, None, None, None]
        mask = mask & (torch.arange(ctx, device=mask.device) >= first)
    od = F.scaled_dot_product_attention(qd.unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=True, scale=scale)
    return od.squeeze(2)  # (Bd, H, 1, D) -> (Bd, H, D)


def _span(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: PrefillSpan, scale: float,
          window: int) -> torch.Tensor:
    """One prompt chunk's rows of q (T, H, D): causal over its context, within the window if any. -> (q_len, H, D)"""
    _, page_size, kvh, d = k_cache.shape
    first_q = span.kv_len - span.q_len  # the position of the span's first query
    span_mask = span.mask
    # keys from `lo` (page aligned) on: with a window, the earlier ones no query of the span sees
    lo = 0 if window == 0 else max(0, first_q - window + 1) // page_size * page_size
    pages = span.pages[lo // page_size :]
    n = pages.shape[0]
    # (KVH, kv_len - lo, D) each
    ks = gather_pages(k_cache, pages).view(n * page_size, kvh, d)[: span.kv_len - lo].transpose(0, 1)
    vs = gather_pages(v_cache, pages).view(n * page_size, kvh, d)[: span.kv_len - lo].transpose(0, 1)
    ks, vs = ks.to(q.dtype), vs.to(q.dtype)
    qs = q[span.q_start : span.q_start + span.q_len].transpose(0, 1)  # (H, q_len, D)
    if window and span.kv_len > window:  # (q_len, kv_len - lo): causal, and within the window
        qpos = torch.arange(first_q, span.kv_len, device=q.device)[:, None]
        kpos = torch.arange(lo, span.kv_len, device=q.device)[None, :]
        span_mask = (kpos <= qpos) & (kpos > qpos - window)
    elif span_mask is not None:
        span_mask = span_mask[:, lo:]
    if span_mask is None:
        os_ = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True, scale=scale)
    else:
        os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span_mask, enable_gqa=True, scale=scale)
    return os_.transpose(0, 1)


def window_attention_kt(
    q: torch.Tensor,  # (T, H, D) float32
    k_pool: torch.Tensor,  # (P, KVH, D, S) one layer's "kt" key pages, float32 or bfloat16
    v_pool: torch.Tensor,  # (P, S, KVH, D)
    spans: torch.Tensor,  # (n, 5) int64 as for ops.paged_attention_kt
    tables: torch.Tensor,  # (sum of pages,) int64
    scale: float,
    window: int,  # a query at p sees keys p - window + 1 .. p
) -> torch.Tensor:  # (T, H, D)
    """The fast arithmetic's attention for a sliding-window layer (its C kernel has no window): per span, only the
    pages its queries can see, gathered from the "kt" pool and widened to float32, then one masked softmax. Each
    span alone, so a row's result does not depend on the rows beside it."""
    _, kvh, d, s = k_pool.shape
    out = torch.empty_like(q)
    for row0, n, pos0, off, npages in spans.tolist():
        kv_len = pos0 + n
        first = max(0, pos0 - window + 1) // s  # the first page any query of the span sees
        pages = tables[off + first : off + npages]
        lo = first * s
        ks = k_pool.index_select(0, pages).permute(1, 0, 3, 2).reshape(kvh, -1, d)[:, : kv_len - lo].float()
        vs = v_pool.index_select(0, pages).permute(2, 0, 1, 3).reshape(kvh, -1, d)[:, : kv_len - lo].float()
        qpos = torch.arange(pos0, kv_len)[:, None]
        kpos = torch.arange(lo, kv_len)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - window)  # (n, kv_len - lo)
        qs = q[row0 : row0 + n].transpose(0, 1)  # (H, n, D)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True, scale=scale)
        out[row0 : row0 + n] = o.transpose(0, 1)
    return out
