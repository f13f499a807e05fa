.PHONY: setup serve test lint bench

setup:
	bash scripts/setup.sh

serve: setup
	.venv/bin/kvseal serve

test: setup
	bash scripts/test.sh

lint:
	.venv/bin/ruff check kvseal tests
	.venv/bin/mypy kvseal

bench: setup
	.venv/bin/python -m kvseal.bench.engine_vs_hf
