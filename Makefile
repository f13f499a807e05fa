.PHONY: setup models serve test test-slow lint bench image

setup:
	bash scripts/setup.sh

# the real GGUF models beyond the 0.5B that setup fetches: Qwen2.5-Coder-1.5B-Instruct and Gemma 3 270M, Q4_K_M
models: setup
	.venv/bin/python scripts/fetch_models.py --all

serve: setup
	.venv/bin/kvseal serve

test: setup
	bash scripts/test.sh

# the opt-in real-model comparisons against transformers (Qwen2.5-Coder 1.5B, Gemma 3 270M; minutes each)
test-slow: models
	bash scripts/test.sh -m slow

lint:
	.venv/bin/ruff check kvseal tests benchmarks
	.venv/bin/mypy kvseal

bench: setup
	.venv/bin/python -m benchmarks.engine_vs_hf

# the OCI image localhost/kvseal:latest, built offline with podman (scripts/image.sh; docs/deploy.md)
image: setup
	bash scripts/image.sh
