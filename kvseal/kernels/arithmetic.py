"""Which arithmetic a worker runs, chosen once at start-up from what was asked and what this CPU can do.

  exact  float32 throughout: kvseal's native C kernels (or torch's ops with --kernels torch). Greedy output
         equals transformers' float32 reference token for token (tests/e2e/test_correctness.py).
  fast   every matrix product takes int8 activations (per 32 inputs, scale max|x| / 127) against the weights'
         own GGUF blocks (Q4_0, Q4_1, Q5_0, Q8_0, and the K-quants Q4_K, Q5_K, Q6_K with their integer sub-block
         scales), repacked once into tiles, with integer dot products: AMX int8 tiles (from 16 rows), AVX-512-VNNI,
         AVX-VNNI or AVX2, picked per CPU, the same bits on each. Float weights (F32, F16, BF16, and every
         weight of a safetensors checkpoint) are multiplied as they are, in float32 FMA. Attention reads
         float32 or bfloat16 KV in place through the page tables, keys stored transposed per page. Both are
         batch invariant: a request's tokens do not depend on what shares its steps or how its prompt was
         chunked. Agreement with the exact set is measured by `python -m benchmarks.agreement`.
         Qwen3, Gemma 3 and Mistral layers run op by op (model/llama.py: q/k norms, sandwich norms and GeGLU in the
         native float32 ops); a sliding-window layer's attention is a per-sequence torch softmax over its window's
         pages (model/attention.py, window_attention_kt: the C attention has no window), not the C kernel's fixed
         order, so those layers do not promise the same bits under another chunking of the prompt.
  auto   fast where it can run, else exact (the default; the reason is logged).

The resolved name ("fast/int8", "exact/native" or "exact/torch") and the instruction set are reported in /info
and the start-up log; the fleet check refuses workers whose names differ, since they would compute different
KV for one prompt. The instruction set is not part of the check: the fast paths give the same bits on every
one of them (tests/unit/test_fast_kernels.py), so a fleet may mix AVX-512 and AVX2 hosts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvseal.kernels.build import ArchShape

CHOICES = ("auto", "exact", "fast")


@dataclass(frozen=True)
class Arithmetic:
    kind: str  # "exact" | "fast"
    kernels: str  # "native" | "torch": the kernel set the exact arithmetic runs on
    isa: str  # fast: the integer dot-product path (amx-int8 | avx512-vnni | avx-vnni | avx2); exact: ""
    why: str  # how it was chosen, for the start-up log

    @property
    def fast(self) -> bool:
        return self.kind == "fast"

    @property
    def name(self) -> str:
        return "fast/int8" if self.fast else f"exact/{self.kernels}"


def fast_blockers(kernels: str, arch: ArchShape, page_size: int, block_types: dict[int, str] | None = None
                  ) -> list[str]:
    """Why the fast arithmetic cannot run here (empty when it can). block_types: the GGML types (id -> name) the
    checkpoint keeps as blocks (Checkpoint.block_types). Every architecture's layers run (model/llama.py)."""
    reasons = []
    from kvseal.kernels.weights import BLOCKS

    missing = sorted(name for t, name in (block_types or {}).items() if t not in BLOCKS)
    if missing:
        reasons.append(f"the kernels take no {', '.join(missing)} blocks")
    if kernels != "native":
        reasons.append(f"it needs kvseal's native kernels (kernels resolved to {kernels})")
    if arch.head_dim % 16 or arch.head_dim > 256:
        reasons.append(f"head_dim {arch.head_dim} is not a multiple of 16 up to 256")
    if arch.hidden_size % 32 or arch.intermediate_size % 32 or (arch.num_heads * arch.head_dim) % 32:
        reasons.append(f"hidden {arch.hidden_size} / intermediate {arch.intermediate_size} are not multiples of 32")
    if page_size % 16:
        reasons.append(f"page size {page_size} is not a multiple of 16")
    return reasons


def resolve_arithmetic(requested: str, kernels: str, kernels_why: str, arch: ArchShape,
                       page_size: int, block_types: dict[int, str] | None = None) -> Arithmetic:
    """The arithmetic for --arithmetic `requested`, given the resolved kernel set. An explicit "fast" that cannot
    run is a ValueError naming why; "auto" falls back to exact and says why."""
    if requested not in CHOICES:
        raise ValueError(f"invalid arithmetic={requested!r}: use one of {', '.join(CHOICES)}")
    if requested == "exact":
        return Arithmetic("exact", kernels, "", f"--arithmetic exact ({kernels_why})")
    reasons = fast_blockers(kernels, arch, page_size, block_types)
    if not reasons:
        from kvseal.kernels.ops import qisa

        isa = qisa()
        return Arithmetic("fast", kernels, isa, f"--arithmetic {requested}: int8 dot products on {isa}")
    if requested == "fast":
        raise ValueError(f"--arithmetic fast cannot run here: {'; '.join(reasons)}. Fix: use --arithmetic exact "
                         "or auto")
    return Arithmetic("exact", kernels, "", f"--arithmetic auto chose exact: {'; '.join(reasons)} ({kernels_why})")
