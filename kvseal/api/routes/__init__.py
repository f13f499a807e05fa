"""The HTTP routes, one module per concern; api/app.py mounts them."""
