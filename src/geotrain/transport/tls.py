"""Optional TLS (stdlib `ssl`, TLS 1.3) under the striped transport's cross-DC connections.

Why: the transport's own frames are authenticated (HMAC, `transport.auth`) but not encrypted; a run
whose activations must not be readable on the wire turns this on (`geotrain train --wan-tls`).

No certificates to distribute: every rank derives the same P-256 key pair from the run's secret
and makes a self-signed certificate for it; a server presents it, and a client accepts a server
only if the certificate's public key is the derived one (pinned; no CA, no host name). So a
listener that does not hold the secret cannot finish the TLS handshake with a rank, and the
`transport.auth` challenge-response inside the TLS channel still binds each connection to the rank that
opened it (a client without the secret fails there). Key exchange is ephemeral (ECDHE): a later
leak of the secret does not decrypt recorded traffic.

OpenSSL forbids using one SSL object from two threads at once, and a striped connection has a
writer thread and an ACK-reader thread: `TLSConnection` serialises every SSL call under a lock
and waits for the socket outside it (non-blocking socket, `select`), so neither side blocks the
other. The certificate needs the `cryptography` package (`pip install geotrain[tls]`).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import select
import socket
import ssl
import tempfile
import threading

from geotrain.errors import GeotrainError

P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
BLOCK = 1 << 20            # bytes per SSL write (one lock hold)
NO_CRYPTOGRAPHY = "--wan-tls needs the 'cryptography' package: pip install 'geotrain[tls]'"


def check_tls_available() -> None:
    """Raise the one-line error a rank would hit, before any rank starts."""
    try:
        # cryptography: an optional dependency (the tls extra), needed only with TLS on
        import cryptography  # noqa: F401
    except ImportError:
        raise GeotrainError(NO_CRYPTOGRAPHY) from None


class TLSError(ConnectionError):
    """A TLS handshake failed, or the server's certificate is not the run's."""


class RunTLS:
    """The TLS contexts of one run, derived from its secret (see module docstring)."""

    def __init__(self, secret: bytes):
        try:
            # cryptography: an optional dependency (the tls extra), needed only with TLS on
            from cryptography import x509
            from cryptography.hazmat.primitives import hashes, serialization
            from cryptography.hazmat.primitives.asymmetric import ec
            from cryptography.x509.oid import NameOID
        except ImportError:
            raise GeotrainError(NO_CRYPTOGRAPHY) from None
        self._x509, self._ser = x509, serialization
        seed = int.from_bytes(hmac.new(secret, b"geotrain tls key", hashlib.sha256).digest(), "big")
        key = ec.derive_private_key(seed % (P256_ORDER - 1) + 1, ec.SECP256R1())
        self.pin = key.public_key().public_bytes(serialization.Encoding.DER,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "geotrain run")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=3650)).sign(key, hashes.SHA256()))
        self.server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server.minimum_version = ssl.TLSVersion.TLSv1_3
        self.server.num_tickets = 0          # no session tickets: nothing arrives after the handshake
        with tempfile.TemporaryDirectory(prefix=f"geotrain-tls-{os.getpid()}-") as tmp:   # 0700 (load_cert_chain
            # wants files); named for this process: swept by process.private_dir if it is killed here
            path = os.path.join(tmp, "run.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
                f.write(cert.public_bytes(serialization.Encoding.PEM))
            self.server.load_cert_chain(path)
        self.client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self.client.minimum_version = ssl.TLSVersion.TLSv1_3
        self.client.check_hostname = False
        self.client.verify_mode = ssl.CERT_NONE      # checked below, against the pinned public key

    def wrap_client(self, sock: socket.socket, timeout_s: float) -> TLSConnection:
        sock.settimeout(timeout_s)
        try:
            tls = self.client.wrap_socket(sock, server_hostname=None)
        except (ssl.SSLError, OSError) as e:
            raise TLSError(f"TLS handshake failed ({e})") from None
        der = tls.getpeercert(binary_form=True)
        got = self._x509.load_der_x509_certificate(der).public_key().public_bytes(
            self._ser.Encoding.DER, self._ser.PublicFormat.SubjectPublicKeyInfo) if der else b""
        if not hmac.compare_digest(got, self.pin):
            tls.close()
            raise TLSError("the listener's TLS certificate is not this run's (it does not hold the run secret)")
        return TLSConnection(tls)

    def wrap_server(self, sock: socket.socket, timeout_s: float) -> TLSConnection:
        sock.settimeout(timeout_s)
        try:
            return TLSConnection(self.server.wrap_socket(sock, server_side=True))
        except (ssl.SSLError, OSError) as e:
            raise TLSError(f"TLS handshake failed ({e})") from None


class TLSConnection:
    """An established TLS socket usable by one writer and one reader thread at once (see module
    docstring); offers what `transport.auth.Channel` and the transport use of a socket."""

    def __init__(self, tls: ssl.SSLSocket):
        self._tls = tls
        self._lock = threading.Lock()
        self._timeout: float | None = None
        tls.setblocking(False)

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def _wait(self, readable: bool) -> None:
        try:
            fd = self._tls.fileno()
            r, w, _ = select.select([fd] if readable else [], [] if readable else [fd], [], self._timeout)
        except (ValueError, OSError):
            raise ConnectionError("connection closed") from None
        if not (r or w):
            raise TimeoutError("timed out")

    def sendall(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            want = None
            with self._lock:
                try:
                    n = self._tls.send(view[:BLOCK])
                except ssl.SSLWantWriteError:
                    n, want = 0, False
                except ssl.SSLWantReadError:
                    n, want = 0, True
                except ssl.SSLError as e:
                    raise ConnectionError(f"TLS: {e}") from None
            view = view[n:]
            if want is not None:
                self._wait(readable=want)

    def recv_into(self, view, nbytes: int = 0) -> int:
        while True:
            with self._lock:
                try:
                    return self._tls.recv_into(view, nbytes)
                except ssl.SSLWantReadError:
                    want = True
                except ssl.SSLWantWriteError:
                    want = False
                except ssl.SSLError as e:
                    raise ConnectionError(f"TLS: {e}") from None
            self._wait(readable=want)

    def setsockopt(self, *args) -> None:
        self._tls.setsockopt(*args)

    def fileno(self) -> int:
        return self._tls.fileno()

    def shutdown(self, how: int) -> None:
        with self._lock:              # the TCP connection (no TLS close_notify: the peer may be gone)
            self._tls.shutdown(how)

    def close(self) -> None:
        self._tls.close()
