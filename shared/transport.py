"""Who may talk to a backend over ZeroMQ: CURVE keys that the backend and its frontends derive from a shared secret.

Both ends read the same secret (``zmq_secret_file``) and derive the same two CURVE key pairs from it, the backend's
and the frontends'. The backend's socket is a CURVE server that accepts, through a ZAP handler, only peers that show
the frontends' public key (:func:`authenticate`, :func:`secure_server`); a frontend's socket is a CURVE client that
knows the backend's public key (:func:`secure_client`). A peer without the secret completes no handshake, so none of
its messages reaches the backend, and the traffic is encrypted. ZeroMQ does the work (libzmq's CURVE, pyzmq's ZAP
authenticator); this module only derives the keys and sets the sockets up.
"""

import hashlib
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

MIN_SECRET_LENGTH = 32
"""The fewest characters a secret may have (``head -c 32 /dev/urandom | base64`` gives 44)."""

_LOOPBACK_NAMES = ("localhost", "lo")


@dataclass(frozen=True)
class CurveKeys:
    """The two key pairs one secret gives, each key in Z85 (as ZeroMQ's socket options take them)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def load_keys(secret_file: str | None) -> CurveKeys | None:
    """The keys of the secret in ``secret_file`` (surrounding whitespace ignored); ``None`` without a file.

    Raises:
        ValueError: the secret is shorter than :data:`MIN_SECRET_LENGTH`, or this libzmq has no CURVE.
        OSError: the file cannot be read.

    """
    if secret_file is None:
        return None
    secret = Path(secret_file).read_bytes().strip()
    if len(secret) < MIN_SECRET_LENGTH:
        raise ValueError(
            f"zmq_secret_file={secret_file!r} holds {len(secret)} characters, fewer than {MIN_SECRET_LENGTH}: "
            "write a random one, e.g. `head -c 32 /dev/urandom | base64`"
        )
    if not zmq.has("curve"):
        raise ValueError(f"zmq_secret_file is set, but this libzmq ({zmq.zmq_version()}) was built without CURVE")
    server_secret, client_secret = (_secret_key(secret, role) for role in (b"backend", b"frontend"))
    return CurveKeys(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)


def _secret_key(secret: bytes, role: bytes) -> bytes:
    """A CURVE secret key (Z85) for ``role``, derived from the shared secret (any 32 bytes are a Curve25519 key)."""
    return zmq.utils.z85.encode(hashlib.sha256(b"spindle zmq curve key\0" + role + b"\0" + secret).digest())


class _FrontendKey:
    """The ZAP handler's test: a peer is a frontend when it shows the frontends' public key."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        """Whether the peer with the public key ``client_key`` (Z85) holds the secret."""
        return client_key == self.client_public


def authenticate(context: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """Start the ZAP handler of ``context``, which admits the peers that hold the secret; stop it before the context."""
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback(credentials_provider=_FrontendKey(keys.client_public))
    return authenticator


def secure_server(socket: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``socket`` (before it binds) a CURVE server with the backend's keys."""
    socket.curve_secretkey = keys.server_secret
    socket.curve_publickey = keys.server_public
    socket.curve_server = True


def secure_client(socket: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make ``socket`` (before it connects) a CURVE client of the backend; nothing without keys."""
    if keys is not None:
        socket.curve_secretkey = keys.client_secret
        socket.curve_publickey = keys.client_public
        socket.curve_serverkey = keys.server_public


def is_loopback(address: str) -> bool:
    """Whether the ``tcp://`` address ``address`` is reachable from this machine only (``127.0.0.1``, ``[::1]``)."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].removeprefix("[").removesuffix("]")
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host or interface name: it may reach other machines
        return False
