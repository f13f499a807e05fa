"""The servers of the baseline run (docs/baselines.md) and how each one is started.

`launch(system, port, settings, workload)` is pure: the argv, the extra environment and the path that answers 200
once the server is ready. `unavailable(system, settings)` says, before anything is started, why a peer cannot run
here (not built, not installed); `scripts/setup_baselines.sh` puts the peers under `settings.peers_dir`.

Two workloads: "load" (the concurrency sweep) and "long" (one long prompt, for time to first token). Every
system serves both with the same command except llama-server, whose context is split evenly over its slots:
it gets `-np SLOTS -c SLOTS*SLOT_CTX` for the load and `-np 1 -c N_CTX` for the long prompt.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Workload = Literal["load", "long"]

SYSTEMS: dict[str, str] = {
    "kvseal": "kvseal unified",
    "kvseal-disagg": "kvseal disagg 1P+1D",
    "kvseal-exact": "kvseal unified --arithmetic exact",
    "kvseal-torch": "kvseal unified --kernels torch",
    "kvseal-nospec": "kvseal unified --speculative off",
    "llama-server": "llama.cpp llama-server -cb",
    "vllm": "vLLM CPU bf16 (prefix cache on)",
    "hf": "transformers (static batches)",
    "llama-cpp-python": "llama-cpp-python (1 request at a time)",
    "kvseal-disagg-nokeys": "kvseal disagg 1P+1D --fleet-keys off",
    "kvseal-disagg-curve": "kvseal disagg 1P+1D --kv-channel curve",
    "kvseal-disagg-nolend": "kvseal disagg 1P+1D --no-lend-cores",
}
# llama-cpp-python's server serves one request at a time: not a peer anyone deploys for concurrency, so it
# runs only when named; so do the fleet-key variants of kvseal-disagg (what the keys cost, docs/benchmarks.md) and
# kvseal without drafts (one stream at the bandwidth limit, against a peer that does not draft either), and the
# fleet whose workers keep to their own cores (what lending idle cores gains, docs/benchmarks.md).
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in ("llama-cpp-python", "kvseal-disagg-nokeys",
                                                         "kvseal-disagg-curve", "kvseal-nospec",
                                                         "kvseal-disagg-nolend"))
KVSEAL_MODES = {"kvseal": ("--unified",), "kvseal-disagg": ("--prefill", "1", "--decode", "1"),
                "kvseal-exact": ("--unified", "--arithmetic", "exact"),
                "kvseal-torch": ("--unified", "--kernels", "torch"),
                "kvseal-nospec": ("--unified", "--speculative", "off"),
                "kvseal-disagg-nokeys": ("--prefill", "1", "--decode", "1", "--fleet-keys", "off"),
                "kvseal-disagg-curve": ("--prefill", "1", "--decode", "1", "--kv-channel", "curve"),
                "kvseal-disagg-nolend": ("--prefill", "1", "--decode", "1", "--no-lend-cores")}


def default_peers_dir() -> str:
    """$PEERS, else ~/.cache/kvseal-peers: where scripts/setup_baselines.sh builds and installs the peers."""
    return os.environ.get("PEERS") or str(Path.home() / ".cache" / "kvseal-peers")


@dataclass(frozen=True)
class Settings:
    """What every server gets: the same model, threads and context window; and where the peers live."""

    model_path: str
    served_name: str = "SmolLM2-135M-Instruct"
    dtype: str = "float32"  # kvseal's and transformers' (llama.cpp runs the GGUF's Q4_1 weights)
    threads: int | None = None  # None: each server's own choice; llama.cpp gets os.cpu_count()
    n_ctx: int = 8192
    max_batch: int = 32
    wait_timeout: float = 3600.0
    explicit_model: bool = False  # pass model_path to kvseal/hf too (else they load the bundled default)
    peers_dir: str = field(default_factory=default_peers_dir)
    slots: int = 32  # llama-server -np for the load workload
    slot_ctx: int = 512  # llama-server context per slot for the load workload
    vllm_dtype: str = "bfloat16"
    vllm_kv_space_gb: int = 4

    def __post_init__(self) -> None:
        for name in ("n_ctx", "max_batch", "slots", "slot_ctx", "vllm_kv_space_gb"):
            if getattr(self, name) < 1:
                raise ValueError(f"Settings.{name} must be at least 1, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"Settings.threads must be at least 1 or None, got {self.threads}")

    @property
    def llama_server(self) -> Path:
        return Path(self.peers_dir) / "bin" / "llama-server"

    @property
    def vllm(self) -> Path:
        return Path(self.peers_dir) / "vllm" / "bin" / "vllm"

    @property
    def vllm_model_dir(self) -> Path:
        """The GGUF converted by `python -m benchmarks.gguf_to_safetensors --out-root PEERS/models`."""
        return Path(self.peers_dir) / "models" / self.served_name


# `python -m benchmarks.X` from any working directory: benchmarks/ is a top-level folder, not installed
REPO_ON_PATH = (("PYTHONPATH", str(Path(__file__).resolve().parents[1])),)


@dataclass(frozen=True)
class Launch:
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # added to the runner's own environment
    ready_path: str = "/health"


def slot_ctx_for(input_len: int, output_len: int) -> int:
    """llama-server's context per slot for the load: at least 512, and room for prompt + output, in 256s."""
    need = input_len + output_len + 16
    return max(512, -(-need // 256) * 256)


def long_variant(system: str, s: Settings) -> str | None:
    """How `system`'s server for the long prompt differs from its load server (None: the same server serves
    both, one start)."""
    return f"-np 1 -c {s.n_ctx}" if system == "llama-server" else None


def _llama_server(port: int, s: Settings, workload: Workload) -> Launch:
    n = str(s.threads or os.cpu_count() or 1)
    slots, ctx = (1, s.n_ctx) if workload == "long" else (s.slots, s.slots * s.slot_ctx)
    # -cb: continuous batching (its default too); --no-cache-prompt: no reuse of a slot's previous prompt
    return Launch((str(s.llama_server), "-m", s.model_path, "--alias", s.served_name, "--host", "127.0.0.1",
                   "--port", str(port), "-t", n, "-tb", n, "-np", str(slots), "-c", str(ctx), "-cb",
                   "--no-cache-prompt"))


def _vllm(port: int, s: Settings) -> Launch:
    env = [("VLLM_TARGET_DEVICE", "cpu"), ("VLLM_CPU_KVCACHE_SPACE", str(s.vllm_kv_space_gb)),
           ("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1")]
    if s.threads:
        env.append(("VLLM_CPU_OMP_THREADS_BIND", f"0-{s.threads - 1}"))
    # automatic prefix caching stays on (vLLM's default, what its users run); the runner sends fresh prompts
    return Launch((str(s.vllm), "serve", str(s.vllm_model_dir), "--served-model-name", s.served_name,
                   "--dtype", s.vllm_dtype, "--max-model-len", str(s.n_ctx), "--host", "127.0.0.1",
                   "--port", str(port)), tuple(env))


def launch(system: str, port: int, s: Settings, workload: Workload = "load", python: str = sys.executable) -> Launch:
    """How to start `system` on 127.0.0.1:port for `workload`."""
    model = (s.model_path,) if s.explicit_model else ()
    threads = ("--threads", str(s.threads)) if s.threads else ()
    if system in KVSEAL_MODES:
        return Launch((python, "-m", "kvseal", "serve", *model, *KVSEAL_MODES[system], "--host", "127.0.0.1",
                       "--port", str(port), "--dtype", s.dtype, "--served-model-name", s.served_name,
                       "--wait-timeout", f"{s.wait_timeout:g}", "--log-level", "warning", *threads))
    if system == "llama-server":
        return _llama_server(port, s, workload)
    if system == "vllm":
        return _vllm(port, s)
    if system == "hf":
        return Launch((python, "-m", "benchmarks.hf_server", *model, "--host", "127.0.0.1", "--port", str(port),
                       "--dtype", s.dtype, "--max-batch", str(s.max_batch), "--served-model-name", s.served_name,
                       "--max-model-len", str(s.n_ctx), "--log-level", "warning", *threads), env=REPO_ON_PATH)
    if system == "llama-cpp-python":
        n = str(s.threads or os.cpu_count() or 1)
        # interrupt_requests=false: by default a new request cuts off the one being streamed.
        # logits_all=false: the server's default (true) keeps logits of every prompt position.
        return Launch((python, "-m", "benchmarks.llamacpp_server", "--model", s.model_path,
                       "--model_alias", s.served_name, "--host", "127.0.0.1", "--port", str(port),
                       "--n_ctx", str(s.n_ctx), "--n_threads", n, "--n_threads_batch", n,
                       "--interrupt_requests", "false", "--logits_all", "false", "--verbose", "false"),
                      env=REPO_ON_PATH, ready_path="/v1/models")  # it has no /health
    raise ValueError(f"unknown system {system!r}; one of {', '.join(SYSTEMS)}")


def unavailable(system: str, s: Settings) -> str | None:
    """Why `system` cannot start here (what is missing and the command that installs it), or None."""
    setup = "bash scripts/setup_baselines.sh"
    if system == "llama-server" and not os.access(s.llama_server, os.X_OK):
        return f"not built: no executable {s.llama_server} (run `{setup} llama-server`)"
    if system == "vllm":
        if not os.access(s.vllm, os.X_OK):
            return f"not installed: no executable {s.vllm} (run `{setup} vllm`)"
        if not (s.vllm_model_dir / "config.json").is_file():
            how = (f"python -m benchmarks.gguf_to_safetensors --gguf {s.model_path} --out-root "
                   f"{Path(s.peers_dir) / 'models'}" if s.explicit_model else f"{setup} vllm")
            return f"no converted checkpoint in {s.vllm_model_dir} (run `{how}`)"
    if system == "hf" and importlib.util.find_spec("transformers") is None:
        return f"transformers is not installed in {sys.executable} (run `{setup} hf`)"
    if system == "llama-cpp-python" and importlib.util.find_spec("llama_cpp") is None:
        return f"llama_cpp is not installed in {sys.executable} (run `{setup} llama-cpp-python`)"
    return None
