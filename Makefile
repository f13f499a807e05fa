.PHONY: setup serve test lint bench

setup:
	bash scripts/setup.sh

serve: setup
	.venv/bin/kvseal serve

test: setup
	bash scripts/test.sh

lint:
	.venv/bin/ruff check kvseal tests benchmarks
	.venv/bin/mypy kvseal

bench: setup
	.venv/bin/python -m benchmarks.engine_vs_hf
