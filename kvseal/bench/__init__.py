"""`kvseal bench`: the load generator for any OpenAI-compatible server (kvseal/bench/load/). The studies and
baseline servers live outside the package, in the repository's top-level benchmarks/."""
