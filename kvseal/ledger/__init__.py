"""The forensic ledger: what each request read, whose KV it was, and `kvseal incidents` over it."""
