"""The probes of `kvseal audit --tenant-keys` (kvseal/audit/tenants.py runs them), one module a shared resource."""
