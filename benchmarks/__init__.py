"""kvseal's studies and side-by-sides, outside the package (not in the wheel): run them from the repository root,
e.g. `python -m benchmarks.baselines` (docs/baselines.md), `python -m benchmarks.engine_vs_hf`. The load
generator they drive, `kvseal bench`, stays in the package (kvseal/bench/load/)."""
