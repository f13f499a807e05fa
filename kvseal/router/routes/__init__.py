"""The HTTP routes, one module per concern; router/api.py mounts them."""
