"""A GGUF (the bundled one by default) as a bfloat16 Hugging Face checkpoint (safetensors, config, tokenizer) for
vLLM's CPU build.

    python -m benchmarks.gguf_to_safetensors --out-root ~/.cache/kvseal-peers/models   # -> .../<name>/
    python -m benchmarks.gguf_to_safetensors --gguf FILE --out-root ~/.cache/kvseal-peers/models  # -> .../<stem>/
    python -m benchmarks.gguf_to_safetensors --print-dir --out-root DIR                # where it would go

Checked on Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, Q4_K and Q6_K): every weight equals kvseal's dequantization
of the same blocks rounded to bfloat16 (about 6 minutes and 3.6 GB here). `python -m benchmarks.baselines --model
FILE` runs vLLM on <out-root>/<the file's stem>.

transformers dequantizes the GGUF (`from_pretrained(dir, gguf_file=...)`), but the model it returns refuses
`save_pretrained` (its config carries a quantization_config), so a fresh model is built from the config without
it and given the dequantized weights. The tokenizer comes from the same GGUF, so token ids are the GGUF's.
Used by scripts/setup_baselines.sh; needs transformers and gguf (the test extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def output_dir(out_root: str, gguf_path: str, name: str | None = None) -> Path:
    """<out_root>/<name, default: the GGUF file's stem>."""
    return Path(out_root).expanduser() / (name or Path(gguf_path).stem)


def convert(gguf_path: str, out: Path, dtype: str = "bfloat16") -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, file = str(Path(gguf_path).parent), Path(gguf_path).name
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=file, dtype=getattr(torch, dtype))
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"the GGUF's weights do not fit: missing {missing}, unexpected {unexpected}")
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src, gguf_file=file).save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)  # a half-written folder never looks converted
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gguf_to_safetensors", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="a .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--out-root", required=True, help="the checkpoint goes to OUT_ROOT/<name>")
    p.add_argument("--name", default=None, help="folder name (default: the bundled model's name or the file stem)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--print-dir", action="store_true", help="print the output folder and exit")
    a = p.parse_args(argv)
    from kvseal.model.locate import DEFAULT_MODEL_NAME, default_model_path

    gguf = a.gguf or default_model_path()
    out = output_dir(a.out_root, gguf, a.name or (None if a.gguf else DEFAULT_MODEL_NAME))
    if not a.print_dir:
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(gguf, out, a.dtype)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
