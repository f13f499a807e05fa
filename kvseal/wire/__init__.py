"""The vocabulary between processes: every message the router and the workers exchange, reservations, worker cards,
the KV spec, sampling seeds and response formats. Typed, versioned msgspec structs; no torch."""
