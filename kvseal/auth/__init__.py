"""The fleet's authentication: CURVE keys per member (keys.py), the allow-list check (zap.py), and which end of
every ZeroMQ socket authenticates which (curve.py)."""
