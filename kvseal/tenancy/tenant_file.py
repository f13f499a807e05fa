"""The --api-keys file: one line per key, `TENANT KEY [admin] [SETTING=VALUE ...]`, `#` comments.

    alice  sk-alice-1  weight=3 max_concurrent=8 rpm=600 tpm=200000
    alice  sk-alice-2                       # a second key of the same tenant
    bob    sk-bob      weight=1 priority_class=1 kv_share=0.5
    ops    sk-ops      admin

The settings (config.TenantPolicy) may stand on any line of their tenant; the same setting given twice with two
values, an unknown setting or a bad value refuses the start, naming the line. The old `TENANT KEY [admin]` lines
are this format without settings. Keys are kept only as SHA-256 digests from the moment the file is read; no
error ever echoes a key or a line of the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

from kvseal.config import TenantPolicy

TENANT = re.compile(r"[A-Za-z0-9_.@:-]{1,64}")
_SETTING = re.compile(r"([a-z_]+)=(\S+)")
_KINDS = {f.name: f.type for f in dataclasses.fields(TenantPolicy)}  # setting name -> "int" | "float" | ...
FORMAT = ("`TENANT KEY [admin] [SETTING=VALUE ...]` (a tenant name of letters, digits and _.@:- up to 64 "
          "characters, a space, the key, `admin` for a key that may see the fleet's internals, then settings: "
          + ", ".join(_KINDS) + ")")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class TenantsFile:
    keys: tuple[tuple[str, str], ...]  # (key digest, tenant) per key
    admins: tuple[str, ...]  # digests of the admin keys
    tenants: tuple[tuple[str, TenantPolicy], ...]  # (tenant, its settings) for each tenant that has any


def read_tenants_file(path: str) -> TenantsFile:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"invalid --api-keys={path!r}: cannot read it as UTF-8 text ({type(exc).__name__}); "
                         f"give a file with one {FORMAT} line per key") from None
    out: dict[str, str] = {}
    admins: list[str] = []
    first_line: dict[str, int] = {}
    settings: dict[str, dict[str, tuple[object, int]]] = {}  # tenant -> setting -> (value, line)
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"invalid --api-keys={path!r} line {n}"
        parts = line.split()
        rest = parts[2:]
        admin = rest[:1] == ["admin"]
        rest = rest[1:] if admin else rest
        if len(parts) < 2 or not TENANT.fullmatch(parts[0]):
            raise ValueError(f"{where}: expected {FORMAT}")
        mine = settings.setdefault(parts[0], {})
        for word in rest:
            name, value = _setting(where, word)
            if name in mine and mine[name][0] != value:
                raise ValueError(f"{where}: {name} has another value on line {mine[name][1]}; give each setting of "
                                 f"a tenant one value")
            mine[name] = (value, n)
        digest = key_digest(parts[1])
        if digest in out:
            raise ValueError(f"{where}: the same key as line {first_line[digest]}; each key names one tenant")
        out[digest], first_line[digest] = parts[0], n
        if admin:
            admins.append(digest)
    if not out:
        raise ValueError(f"invalid --api-keys={path!r}: the file holds no key line; add one {FORMAT} per key, or "
                         f"leave the flag out to serve without keys (one tenant)")
    tenants = []
    for tenant, mine in settings.items():
        if not mine:
            continue
        try:
            tenants.append((tenant, TenantPolicy(**{k: v for k, (v, _) in mine.items()})))  # type: ignore[arg-type]
        except ValueError as exc:
            lines = sorted({ln for _, ln in mine.values()})
            raise ValueError(f"invalid --api-keys={path!r} line {', '.join(map(str, lines))} (tenant {tenant}): "
                             f"{exc}") from None
    return TenantsFile(tuple(out.items()), tuple(admins), tuple(tenants))


def _setting(where: str, word: str) -> tuple[str, object]:
    m = _SETTING.fullmatch(word)
    if m is None:
        raise ValueError(f"{where}: expected {FORMAT}; a word after the key that is neither `admin` nor "
                         f"SETTING=VALUE")
    name, text = m.groups()
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"{where}: unknown setting {name!r}; the settings are {', '.join(_KINDS)}")
    try:
        value: object = float(text) if "float" in str(kind) else int(text)
    except ValueError:
        # the value is not echoed: a key pasted in the wrong place must not reach a log
        raise ValueError(f"{where}: the value of {name} is not {'a number' if 'float' in str(kind) else 'an integer'}"
                         ) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: the value of {name} is not a finite number")
    return name, value
