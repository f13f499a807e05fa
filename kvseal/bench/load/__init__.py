"""`kvseal bench`: a load generator and latency/throughput report for any OpenAI-compatible server."""
