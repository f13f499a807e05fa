"""Prometheus metrics (prometheus_client): one registry per process, names under `kvseal:` with vLLM's meanings
where vLLM has a counterpart. `engine.py`: a worker's (or the unified engine's) figures, read at scrape time;
`router.py`: the router's request histograms, HTTP outcomes and fleet standings. docs/grafana-kvseal.json is a
dashboard over both."""
