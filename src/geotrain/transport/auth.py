"""Who may talk to a run's listeners: a per-run secret, a challenge-response handshake, MAC'd frames.

Every listener of the WAN layer (striped transport, turn arbiter) and the local ones (BubbleTea's
executor socket, the emulation's probe) accept a connection only after the opener proved it holds
the run's secret (32 random bytes, `new_secret`, shared as `run_secret` says), then read only
frames with a valid HMAC-SHA256 tag; anything else is logged in one line and dropped.

Handshake (the opener is the client):
    client -> HELLO  (magic, purpose, client rank, server rank, stripe, client nonce)
    server -> CHALLENGE (magic, server rank, server nonce)
    client -> HMAC(secret, "client" + transcript)      server checks it, then
    server -> HMAC(secret, "server" + transcript)      client checks it (mutual).
The transcript (HELLO + CHALLENGE) binds the proof to both ranks, the purpose and two fresh
nonces, so a replayed connection fails; per-direction keys are derived from it. A frame's tag is
HMAC(direction key, implicit counter + header + payload): a frame replayed, dropped or reordered
fails. Payloads are bounded by the caller (`max_payload`), and nothing is acted on before its tag
verified.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path

from geotrain.errors import GeotrainError
from geotrain.transport.sockets import recv_exact

SECRET_BYTES = 32
SECRET_ENV = "GEOTRAIN_SECRET_FILE"
STORE_KEY = "geotrain/run-secret"
TAG_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0
HELLO = struct.Struct("!IBiiH16s")          # magic, purpose, client rank, server rank, stripe, nonce
CHALLENGE = struct.Struct("!Ii16s")         # magic, server rank, nonce
MAGIC = 0x47544155                          # "GTAU"
PURPOSES = {1: "striped transport", 2: "turn arbiter", 3: "BubbleTea executor", 4: "WAN probe"}
STRIPED, TURNS, BUBBLETEA, PROBE = 1, 2, 3, 4
ANY_RANK = -1


class AuthError(ConnectionError):
    """A peer failed the handshake or sent a frame whose tag did not verify."""


class SecretMismatch(AuthError):
    """The listener answered as the right peer but dropped us after our proof, or its own proof did not
    verify: its host holds another secret (a different GEOTRAIN_SECRET_FILE). Retrying cannot mend it."""


class ProtocolError(ConnectionError):
    """An authenticated peer sent something the protocol does not allow (sizes, kinds)."""


# ----------------------------------------------------------------------------- the secret
def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def write_secret_file(path: Path, secret: bytes) -> Path:
    """Create `path` readable by its owner only (0600), failing if it already exists."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret.hex().encode())
    return path


def read_secret_file(path: Path) -> bytes:
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as e:
        raise GeotrainError(f"{SECRET_ENV}={path}: cannot read the run secret ({e.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise GeotrainError(f"{SECRET_ENV}={path}: the run secret must be readable by its owner only "
                            f"(chmod 600), it is {stat.filemode(mode)}")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise GeotrainError(f"{SECRET_ENV}={path}: expected at least 32 hex digits of secret")
    return secret


def run_secret(store=None) -> bytes:
    """This run's secret: from the 0600 file named by GEOTRAIN_SECRET_FILE (the launcher writes it;
    never on a command line), else through `store`: the first rank to ask generates it
    (compare-and-set), every other rank reads the same one -- and anyone who can reach the store
    can read it, so rank 0 warns (give every host the same 0600 file instead)."""
    path = os.environ.get(SECRET_ENV)
    if path:
        return read_secret_file(Path(path))
    if store is None:
        raise RuntimeError(f"no run secret: set {SECRET_ENV} or pass the rendezvous store")
    _warn_secret_in_store()
    raw = store.compare_set(STORE_KEY, "", new_secret().hex())
    return bytes.fromhex(raw.decode() if isinstance(raw, bytes) else str(raw))


_warned: list[bool] = []


def _warn_secret_in_store() -> None:
    """Once per process, on the first rank only: say that the secret travels through the store."""
    if _warned or os.environ.get("RANK", "0") != "0":
        return
    _warned.append(True)
    print(f"geotrain wan: warning: no {SECRET_ENV}, so the run secret is shared through the rendezvous store: "
          f"anyone who can reach MASTER_ADDR:MASTER_PORT can read it and join the WAN transport; give every host "
          f"the same 0600 secret file ({SECRET_ENV}) to keep it private", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- one-line drop log
class DropLog:
    """Logs each dropped connection in one line on stderr, at most `burst` lines per minute (a flood
    of forged connections must not flood the training log); counts the rest."""

    def __init__(self, who: str, burst: int = 20, prefix: str = "geotrain wan"):
        self.who, self.burst, self.prefix = who, burst, prefix
        self.dropped = 0
        self._window = (0.0, 0)
        self._lock = threading.Lock()
        self.lines: list[str] = []          # the last lines logged (tests read them)

    def __call__(self, what: str) -> None:
        with self._lock:
            self.dropped += 1
            start, n = self._window
            now = time.monotonic()
            if now - start > 60:
                start, n = now, 0
            n += 1
            self._window = (start, n)
            if n > self.burst:
                return
            line = f"{self.prefix}: {self.who}: {what}" + (" (further drops this minute not logged)"
                                                          if n == self.burst else "")
            self.lines = [*self.lines[-99:], line]
        print(line + "\n", end="", file=sys.stderr, flush=True)     # one write: ranks share a terminal


# ----------------------------------------------------------------------------- handshake
def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _channel(sock: socket.socket, secret: bytes, transcript: bytes, client: bool) -> Channel:
    c2s, s2c = _mac(secret, b"geotrain key c2s", transcript), _mac(secret, b"geotrain key s2c", transcript)
    return Channel(sock, send_key=c2s if client else s2c, recv_key=s2c if client else c2s)


def client_handshake(sock: socket.socket, secret: bytes, purpose: int, my_rank: int, server_rank: int,
                     stripe: int = 0) -> Channel:
    """Prove to the listener that we hold the secret and are `my_rank`; check it holds it too."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    hello = HELLO.pack(MAGIC, purpose, my_rank, server_rank, stripe, secrets.token_bytes(16))
    try:
        sock.sendall(hello)
        challenge = bytearray(CHALLENGE.size)
        recv_exact(sock, memoryview(challenge))
        magic, rank, _nonce = CHALLENGE.unpack(challenge)
        if magic != MAGIC or (server_rank != ANY_RANK and rank != server_rank):
            raise AuthError(f"the listener is not rank {server_rank}'s {PURPOSES[purpose]}")
        transcript = hello + bytes(challenge)
        sock.sendall(_mac(secret, b"geotrain client", transcript))
    except AuthError:
        raise
    except (OSError, ConnectionError) as e:
        raise AuthError(f"the {PURPOSES[purpose]} refused or dropped our handshake ({e})") from None
    try:
        proof = bytearray(TAG_BYTES)
        recv_exact(sock, memoryview(proof))
    except (OSError, ConnectionError) as e:     # it heard our proof and hung up: it did not accept it
        raise SecretMismatch(f"the {PURPOSES[purpose]} dropped us after our proof of the secret ({e}): its host "
                             f"holds another secret (every host needs the same {SECRET_ENV} contents)") from None
    if not hmac.compare_digest(bytes(proof), _mac(secret, b"geotrain server", transcript)):
        raise SecretMismatch(f"the {PURPOSES[purpose]} does not hold this run's secret (every host needs the same "
                             f"{SECRET_ENV} contents)")
    sock.settimeout(None)
    return _channel(sock, secret, transcript, client=True)


def server_handshake(sock: socket.socket, secret: bytes, purpose: int, my_rank: int) -> tuple[int, int, Channel]:
    """Challenge a new connection; returns (client rank, stripe, channel) or raises AuthError."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    hello = bytearray(HELLO.size)
    rank = None
    try:
        recv_exact(sock, memoryview(hello))
        magic, got_purpose, rank, server_rank, stripe, _nonce = HELLO.unpack(hello)
        if magic != MAGIC or got_purpose != purpose:
            raise AuthError("not a geotrain peer (bad hello)")
        if server_rank not in (my_rank, ANY_RANK) and my_rank != ANY_RANK:
            raise AuthError(f"hello for rank {server_rank}, but this is rank {my_rank}")
        challenge = CHALLENGE.pack(MAGIC, my_rank, secrets.token_bytes(16))
        sock.sendall(challenge)
        transcript = bytes(hello) + challenge
        proof = bytearray(TAG_BYTES)
        recv_exact(sock, memoryview(proof))
    except AuthError:
        raise
    except TimeoutError:
        raise AuthError(f"handshake not finished within {HANDSHAKE_TIMEOUT_S:g} s") from None
    except (OSError, ConnectionError) as e:
        claim = "" if rank is None else f"claimed rank {rank}, then "
        raise AuthError(f"{claim}closed during the handshake ({e})") from None
    if not hmac.compare_digest(bytes(proof), _mac(secret, b"geotrain client", transcript)):
        raise AuthError(f"claims rank {rank} but failed the challenge (wrong secret or a replay)")
    sock.sendall(_mac(secret, b"geotrain server", transcript))
    sock.settimeout(None)
    return rank, stripe, _channel(sock, secret, transcript, client=False)


# ----------------------------------------------------------------------------- frames
class Channel:
    """Authenticated frames over one connected socket (one writer and one reader thread at most).

    send: header (fixed size, the caller's struct) + payload + tag. recv: header, then the payload
    length the caller derives from it (bounded by `max_payload`), then the tag; the payload lands in
    a reusable scratch buffer and is returned only after its tag verified."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes):
        self.sock = sock
        self._send_key, self._recv_key = send_key, recv_key
        self._sent = 0
        self._received = 0
        self._scratch = bytearray(0)

    def send(self, header: bytes, payload=b"", block: int = 1 << 20, pace=None) -> None:
        """Write one frame; `pace(nbytes)` (optional) is called before each block of payload."""
        h = hmac.new(self._send_key, struct.pack("!Q", self._sent) + header, hashlib.sha256)
        self._sent += 1
        view = memoryview(payload)
        if len(view) <= 64 << 10 and pace is None:
            h.update(view)
            self.sock.sendall(b"".join((header, view, h.digest())))
            return
        self.sock.sendall(header)
        for off in range(0, len(view), block):
            piece = view[off:off + block]
            h.update(piece)
            if pace is not None:
                pace(len(piece))
            self.sock.sendall(piece)
        self.sock.sendall(h.digest())

    def recv(self, header: struct.Struct, payload_len, max_payload: int) -> tuple[tuple, memoryview]:
        """Read one frame; `payload_len(fields)` says how many payload bytes follow the header.
        Returns (header fields, payload view valid until the next recv)."""
        raw = bytearray(header.size)
        recv_exact(self.sock, memoryview(raw))
        fields = header.unpack(raw)
        n = payload_len(fields)
        if not 0 <= n <= max_payload:
            raise ProtocolError(f"frame announces {n} payload bytes (at most {max_payload} allowed)")
        if len(self._scratch) < n:
            self._scratch = bytearray(n)
        body = memoryview(self._scratch)[:n]
        recv_exact(self.sock, body)
        tag = bytearray(TAG_BYTES)
        recv_exact(self.sock, memoryview(tag))
        h = hmac.new(self._recv_key, struct.pack("!Q", self._received) + bytes(raw), hashlib.sha256)
        h.update(body)
        if not hmac.compare_digest(h.digest(), bytes(tag)):
            raise AuthError(f"frame {self._received} failed authentication (altered, injected or replayed bytes)")
        self._received += 1
        return fields, body
