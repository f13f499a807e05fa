"""Loading a Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 (text) folder of safetensors into a Checkpoint.

Weights of any floating dtype are converted to float32 (exact for bf16/fp16). The folder must hold
config.json, tokenizer.json and one `model.safetensors` or several shards (with or without
`model.safetensors.index.json`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from kvseal.model.arch import ModelArch
from kvseal.model.checkpoint import Checkpoint
from kvseal.model.layout import check_weights
from kvseal.model.tokenizer import Tokenizer

# config.json model_type -> ModelArch.family
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                         "gemma3_text": "gemma3"}
_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Non-persistent buffers some older checkpoints saved; they are recomputed by the model.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _hashable(value: Any) -> Any:
    """Nested dicts/lists -> sorted tuples of items / tuples, so ModelArch stays hashable."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def _rope(cfg: dict[str, Any], default_theta: float = 10000.0) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, rope_scaling) from either transformers 4's rope_theta + rope_scaling keys or
    transformers 5's `rope_parameters` (which carries rope_theta and rope_type inside)."""
    raw_params = cfg.get("rope_parameters")
    params: dict[str, Any] = raw_params if isinstance(raw_params, dict) else {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", default_theta)))
    raw_scaling = cfg.get("rope_scaling")
    scaling: dict[str, Any] = (
        dict(raw_scaling) if isinstance(raw_scaling, dict) else {k: v for k, v in params.items() if k != "rope_theta"}
    )
    if "type" in scaling and "rope_type" not in scaling:  # legacy spelling
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"}:
        return theta, None
    return theta, _hashable(scaling)


def _layer_windows(cfg: dict[str, Any], model_type: str, layers: int, source: str) -> tuple[int, ...]:
    """Per layer, the sliding window transformers applies (0: full attention), from layer_types or the older keys."""
    window = cfg.get("sliding_window")
    if model_type == "gemma3_text":
        types = cfg.get("layer_types")
        if not types:  # transformers 4's spelling: every pattern-th layer is global
            pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    elif model_type == "mistral":  # transformers' Mistral slides every layer whenever sliding_window is set
        types = ["sliding_attention"] * layers
    elif cfg.get("use_sliding_window"):  # Qwen2/3: the layers from max_window_layers on
        types = cfg.get("layer_types") or ["sliding_attention" if i >= int(cfg.get("max_window_layers", layers))
                                           else "full_attention" for i in range(layers)]
    else:
        types = ["full_attention"] * layers
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"{source}: layer_types {types} is not one of sliding_attention/full_attention per layer "
                         f"for {layers} layers")
    if window is None or "sliding_attention" not in types:
        return ()
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def _gemma3(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelArch fields a Gemma 3 text config adds to a Llama layer."""
    if cfg.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 attention never applies it (Gemma 2's does); released Gemma 3 configs leave it null
        raise ValueError(f"{source}: attn_logit_softcapping={cfg['attn_logit_softcapping']} is set; transformers' "
                         "Gemma 3 ignores it, so kvseal refuses rather than guess. Fix: set it to null")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention=true (an encoder) is not supported")
    raw = cfg.get("rope_parameters")
    params: dict[str, Any] = raw if isinstance(raw, dict) else {}
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: the sliding layers' rope_type {local.get('rope_type')!r} is not supported")
    glob = params.get("full_attention")
    rope_cfg = dict(cfg, rope_parameters=glob) if isinstance(glob, dict) else cfg
    theta, scaling = _rope(rope_cfg, default_theta=1_000_000.0)
    hidden = int(cfg["hidden_size"])
    final = cfg.get("final_logit_softcapping")
    return {"rope_theta": theta, "rope_scaling": scaling, "qk_norm": True, "sandwich_norms": True,
            "local_rope_theta": float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
            "embed_scale": hidden**0.5, "attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
            "final_softcap": None if final is None else float(final)}


def arch_from_hf_config(cfg: dict[str, Any], source: str) -> ModelArch:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: config.json model_type={model_type!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    family = SUPPORTED_MODEL_TYPES[model_type]
    act = cfg.get("hidden_activation" if family == "gemma3" else "hidden_act") or cfg.get("hidden_act", "silu")
    if act not in _ACTS:
        raise ValueError(f"{source}: hidden_act={act!r} is not supported; supported: {', '.join(_ACTS)}")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported (the MLP projections must have no bias)")
    if family != "qwen2" and cfg.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true on a {model_type} model is not supported")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"{source}: config.json lacks {missing}")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg)
    extra: dict[str, Any] = {"qk_norm": family == "qwen3"}
    if family == "gemma3":
        extra = _gemma3(cfg, source)
        theta, scaling = extra.pop("rope_theta"), extra.pop("rope_scaling")
    return ModelArch(
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=theta,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2",
        rope_scaling=scaling,
        layer_windows=_layer_windows(cfg, model_type, int(cfg["num_hidden_layers"]), source),
        mlp_act=_ACTS[act],
        **extra,
    )


def _shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors files (pytorch .bin checkpoints are not supported)")
    for f in files:
        if not f.is_file():
            raise ValueError(f"{folder}: shard {f.name} named in model.safetensors.index.json is missing")
    return files


def _hf_name(name: str) -> str:
    # Checkpoints of the bare LlamaModel omit the "model." prefix.
    return name if name.startswith(("model.", "lm_head.")) else "model." + name


def load_hf_folder(path: str, progress: bool = True) -> Checkpoint:
    """Load config.json, every safetensors shard (as float32) and the tokenizer of a HF model folder."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} has no config.json; it is not a Hugging Face model folder")
    cfg = json.loads(config_file.read_text(encoding="utf-8"))
    arch = arch_from_hf_config(cfg, str(folder))
    weights: dict[str, torch.Tensor] = {}
    files = _shard_files(folder)
    for file in tqdm(files, desc=f"loading {folder.name}", unit="shard", file=sys.stderr, disable=not progress):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                name = _hf_name(key)
                if name in weights:
                    raise ValueError(f"{folder}: weight {name} appears in more than one shard")
                t = f.get_tensor(key)
                if not t.is_floating_point():
                    raise ValueError(f"{folder}: weight {name} has non-float dtype {t.dtype}")
                weights[name] = t.to(torch.float32).contiguous()
    if arch.tie_embeddings:
        weights.pop("lm_head.weight", None)  # tied: the embedding is the head, as transformers ties it
    if arch.family == "gemma3":  # its norms multiply by (1 + w): fold the 1 in (float32, as transformers adds it)
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = 1.0 + weights[name]
    check_weights(weights, arch, str(folder))
    return Checkpoint(
        arch=arch,
        weights=weights,
        tokenizer=Tokenizer.from_hf_folder(folder),
        name=folder.resolve().name,
        source=str(folder),
    )
