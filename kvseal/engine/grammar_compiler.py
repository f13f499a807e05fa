"""One grammar compiler process: compiles response formats for one vocabulary, away from the engine's loop.

engine/grammar_pool.py starts it as `python -m kvseal.engine.grammar_compiler`. Its stdin and stdout carry frames
(a 4-byte big-endian length, then a msgpack struct below): a CompilerInit first (the vocabulary, once), then a
CompileJob in and its CompileResult out, one at a time. It answers CompileResult(job_id=0) once it is ready, so
the pool's time limit counts compiling only, never the start-up (importing xgrammar imports torch).

It lowers its own priority before anything else: a compile is background work, the engine's steps come first.
It exits when its stdin closes or its parent goes away; a compile past the time limit is ended by the pool with
SIGKILL (xgrammar cannot be interrupted).
"""

from __future__ import annotations

import os
import re
import struct
import sys
import threading
import time
from typing import IO, TypeVar

import msgspec

PROTOCOL_VERSION = 1
_LEN = struct.Struct(">I")
_T = TypeVar("_T")


class CompilerInit(msgspec.Struct, frozen=True):
    vocab: list[str]  # token id -> its text as the tokenizer stores it ("" for ids the tokenizer lacks), V entries
    vocab_type: int  # xgrammar.VocabType's value
    stop_ids: list[int]
    add_prefix_space: bool
    v: int = PROTOCOL_VERSION


class CompileJob(msgspec.Struct, frozen=True):
    job_id: int  # > 0
    kind: str  # "json_object" | "json_schema"
    schema: str | None = None


class CompileResult(msgspec.Struct, frozen=True):
    job_id: int  # 0: the process is ready for jobs
    grammar: str | None = None  # CompiledGrammar.serialize_json()
    error: str | None = None  # why the format cannot be enforced (xgrammar's words, less its source location)


def frame(msg: msgspec.Struct) -> bytes:
    body = msgspec.msgpack.encode(msg)
    return _LEN.pack(len(body)) + body


def read_frame(stream: IO[bytes], kind: type[_T]) -> _T | None:
    """The next frame off a blocking stream; None at its end."""
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    body = stream.read(_LEN.unpack(head)[0])
    return msgspec.msgpack.decode(body, type=kind)


def compile_one(compiler: object, job: CompileJob) -> CompileResult:
    import xgrammar as xgr

    assert isinstance(compiler, xgr.GrammarCompiler)
    if job.kind == "json_object":  # OpenAI's json_object is an object, not any JSON value
        schema = '{"type": "object"}'
    elif job.kind == "json_schema" and job.schema is not None:
        schema = job.schema
    else:
        return CompileResult(job.job_id, error=f"response_format type {job.kind!r} is not one this compiler knows")
    try:
        compiled = compiler.compile_json_schema(schema, any_whitespace=False)
    except Exception as exc:  # noqa: BLE001 (xgrammar's errors are untyped; a tenant's schema is untrusted)
        return CompileResult(job.job_id, error=re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc)).strip())
    return CompileResult(job.job_id, grammar=compiled.serialize_json())


def _orphan_watch(parent: int) -> None:
    """End this process when its parent is gone, even in the middle of a compile (xgrammar drops the GIL)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


def main() -> int:
    try:
        os.nice(10)
    except OSError:
        pass
    out = os.fdopen(os.dup(1), "wb", buffering=0)  # the protocol's stream; stray prints go to stderr
    os.dup2(2, 1)
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    init = read_frame(sys.stdin.buffer, CompilerInit)
    if init is None or init.v != PROTOCOL_VERSION:
        print("kvseal grammar compiler: no CompilerInit of this version on stdin", file=sys.stderr)
        return 2
    import xgrammar as xgr

    info = xgr.TokenizerInfo(init.vocab, xgr.VocabType(init.vocab_type), vocab_size=len(init.vocab),
                             stop_token_ids=init.stop_ids, add_prefix_space=init.add_prefix_space)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the engine keeps the cache
    out.write(frame(CompileResult(0)))
    while (job := read_frame(sys.stdin.buffer, CompileJob)) is not None:
        out.write(frame(compile_one(compiler, job)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
