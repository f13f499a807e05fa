"""What a process tells its fleet about itself beyond its engine: its tokenizer's digest and its instance id.

The router tokenizes every prompt and the workers detokenize every answer: both must use the same tokenizer, so
the fleet check (seal 7) compares this digest with the router's own. The instance id is new with every process
start: a worker answering on a known endpoint with another instance id is a new process and is checked again.
"""

from __future__ import annotations

import hashlib
import json
import secrets

from kvseal.model.tokenizer import Tokenizer


def tokenizer_digest(tok: Tokenizer) -> str:
    """sha256 over the vocabulary, merges and normalizers (the backend's JSON) and special tokens. About 0.1 s
    for a 50k vocabulary: computed once per process. Not the chat template: only the router renders chats, and
    `--chat-template` may replace it there."""
    h = hashlib.sha256(tok.backend.to_str().encode())
    h.update(json.dumps([tok.bos_id, list(tok.eos_ids), tok.add_bos, tok.bos_token, tok.eos_token]).encode())
    return "sha256:" + h.hexdigest()[:32]


def new_instance_id() -> str:
    return secrets.token_hex(8)
