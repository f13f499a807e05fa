"""Fleet keys: one CURVE keypair per fleet member, and an allow-list of the members' public keys.

A key set folder (`kvseal keys DIR`):

    DIR/public/NAME.key             the public key of member NAME (every host of the fleet holds this folder:
                                    it is the allow-list; deleting one file revokes that member)
    DIR/private/NAME.key_secret     NAME's keypair (only the host that runs NAME needs it)

Both are ZeroMQ certificate files (zmq.auth reads them), written 0600 in folders made 0700. A member's keys reach
the processes of `kvseal serve` in their WorkerSpec (stdin), never in argv or the environment.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec
import zmq
import zmq.auth

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_Z85_KEY = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
PUBLIC, PRIVATE = "public", "private"


class MemberKeys(msgspec.Struct, frozen=True, kw_only=True):
    """One fleet member's keypair (Z85 text) and whom it lets connect: `allowed` public keys, plus every key in
    the folder `allowed_dir` (re-read at each handshake, so deleting a file revokes a member for new
    connections). Never logged: repr hides the secret."""

    public: str
    secret: str
    allowed: tuple[str, ...] = ()
    allowed_dir: str | None = None

    def __post_init__(self) -> None:
        for what, key in (("public", self.public), ("secret", self.secret), *(("allowed", k) for k in self.allowed)):
            if not _Z85_KEY.fullmatch(key):
                raise ValueError(f"invalid fleet key ({what}): expected 40 characters of Z85 text; make keys with "
                                 f"`kvseal keys DIR`")
        if zmq.curve_public(self.secret.encode()).decode() != self.public:
            raise ValueError("invalid fleet keys: the public key is not the secret key's; regenerate them with "
                             "`kvseal keys DIR`")

    def __repr__(self) -> str:
        return f"MemberKeys(public={self.public!r}, allowed={len(self.allowed)}, allowed_dir={self.allowed_dir!r})"

    __str__ = __repr__

    def admits(self, public: str) -> bool:
        """Whether `public` is on the allow-list (the folder re-read now: a deleted file revokes at once)."""
        if public in self.allowed:
            return True
        if self.allowed_dir is None:
            return False
        return public in read_allowed(self.allowed_dir)

    def with_allowed(self, keys: tuple[str, ...]) -> MemberKeys:
        return msgspec.structs.replace(self, allowed=tuple(dict.fromkeys((*self.allowed, *keys))))


def fresh_member() -> MemberKeys:
    """A new keypair that lets nobody in yet (in memory: `kvseal serve`'s own processes)."""
    public, secret = zmq.curve_keypair()
    return MemberKeys(public=public.decode(), secret=secret.decode())


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"invalid fleet member name {name!r}: use letters, digits and _.- (up to 64), e.g. "
                         f"prefill-2")
    return name


def write_key_set(folder: str, names: list[str]) -> list[Path]:
    """Write a keypair per name into `folder` (created 0700); refuses to overwrite a member that exists."""
    root = Path(folder)
    for name in names:
        check_name(name)
        for p in (root / PUBLIC / f"{name}.key", root / PRIVATE / f"{name}.key_secret"):
            if p.exists():
                raise ValueError(f"invalid kvseal keys {folder} {name}: {p} exists; delete {name}'s two files first "
                                 f"to replace its keys, or choose another name")
    for sub in (root, root / PUBLIC, root / PRIVATE):
        sub.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(sub, 0o700)
    written = []
    for name in names:
        public, secret = zmq.curve_keypair()
        for path, sec in ((root / PUBLIC / f"{name}.key", None), (root / PRIVATE / f"{name}.key_secret", secret)):
            _write_0600(path, name, public, sec)
            written.append(path)
    return written


def _write_0600(path: Path, name: str, public: bytes, secret: bytes | None) -> None:
    what = "keypair (SECRET: only the host that runs it)" if secret else "public key (the fleet's allow-list)"
    text = (f"#   kvseal fleet member {name}: {what}\n#   ZeroMQ CURVE certificate\n\nmetadata\n    name = \"{name}\"\n"
            f"curve\n    public-key = \"{public.decode()}\"\n")
    if secret is not None:
        text += f"    secret-key = \"{secret.decode()}\"\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 from the first byte
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def public_key(folder: str, name: str) -> str:
    """The public key of member `name` from the key set `folder` (a peer this process connects to)."""
    path = Path(folder) / PUBLIC / f"{check_name(name)}.key"
    try:
        key, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"invalid fleet member {name!r}: no public key at {path} ({exc}); make it with "
                         f"`kvseal keys {folder} {name}`, or name a member that exists") from None
    return key.decode()


def load_member(folder: str, name: str) -> MemberKeys:
    """This process's own keys from the key set `folder`; everyone in `folder/public` may connect."""
    path = Path(folder) / PRIVATE / f"{check_name(name)}.key_secret"
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"invalid --fleet-keys={folder!r} --fleet-member={name!r}: cannot read {path} ({exc}); "
                         f"make it with `kvseal keys {folder} {name}` and copy it to this host") from None
    if secret is None:
        raise ValueError(f"invalid --fleet-keys={folder!r}: {path} holds no secret key; it must be the file that "
                         f"`kvseal keys` wrote under {PRIVATE}/")
    if os.stat(path).st_mode & 0o077:
        raise ValueError(f"invalid --fleet-keys={folder!r}: {path} may be read by other users; chmod 600 it")
    allowed_dir = str(Path(folder) / PUBLIC)
    read_allowed(allowed_dir)  # an unreadable allow-list stops the start, not the first handshake
    return MemberKeys(public=public.decode(), secret=secret.decode(), allowed_dir=allowed_dir)


def read_allowed(folder: str) -> frozenset[str]:
    """The public keys (Z85) of every `*.key` file in `folder`."""
    try:
        files = sorted(p for p in Path(folder).iterdir() if p.suffix == ".key")
    except OSError as exc:
        raise ValueError(f"invalid fleet allow-list {folder!r}: cannot list it ({exc}); it is the public/ "
                         f"folder of a `kvseal keys` set") from None
    keys = set()
    for p in files:
        try:
            keys.add(zmq.auth.load_certificate(p)[0].decode())
        except (OSError, ValueError):
            continue  # a file being replaced, or not a key: it lets nobody in
    return frozenset(keys)
