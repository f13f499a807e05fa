"""Tenants at the router: keys and the tenants file, each tenant's limits and view, and every resource the router
shares between tenants with its partition (seal 11, docs/seals.md)."""
