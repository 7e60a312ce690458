"""Where a link may listen, and the CURVE keys that let it listen anywhere else.

ZeroMQ encrypts nothing by default and authenticates nobody: whoever reaches an
engine's port can submit work and read outputs. So an engine binds loopback TCP
(``tcp://127.0.0.1:...``, ``tcp://[::1]:...``, ``tcp://localhost:...``), ``ipc://``
or ``inproc://`` unless it holds CURVE keys (pyzmq's ``zmq.auth`` makes them) or
the caller says ``insecure=True`` in so many words.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Final

import zmq
import zmq.asyncio

__all__ = ["CurveClient", "CurveServer", "InsecureAddress", "check_bind", "is_local"]

_LOCAL_NAMES: Final = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


class InsecureAddress(ValueError):
    """Raised when an engine would listen beyond this host without CURVE keys."""

    def __init__(self, address: str) -> None:
        super().__init__(
            f"refusing to bind {address!r} without encryption: anyone who reaches it could "
            "submit work and read outputs. Bind tcp://127.0.0.1 or ipc://, pass "
            "curve=CurveServer(...) (keys from zmq.auth.create_certificates), or pass "
            "insecure=True if the network is trusted"
        )
        self.address = address


def is_local(address: str) -> bool:
    """Whether ``address`` can only be reached from this host (ipc, inproc, loopback TCP)."""
    transport, _, rest = address.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = rest.rpartition(":")[0]
    if host in _LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # an interface name or a host name: not provably local
        return False


def check_bind(address: str, *, curve: CurveServer | None, insecure: bool) -> None:
    """Refuse to bind a non-local address without CURVE keys or ``insecure=True``.

    :raises InsecureAddress: the address is not local and neither was given.
    """
    if curve is None and not insecure and not is_local(address):
        raise InsecureAddress(address)


@dataclasses.dataclass(frozen=True, slots=True)
class CurveServer:
    """The engine's CURVE keys (Z85 ``bytes``, as ``zmq.auth.load_certificate`` returns).

    :param public_key: the engine's public key; fronts need it.
    :param secret_key: the engine's secret key.
    """

    public_key: bytes
    secret_key: bytes

    def apply(self, socket: zmq.asyncio.Socket) -> None:
        """Make ``socket`` a CURVE server (encrypted; clients must know our public key)."""
        socket.curve_secretkey = self.secret_key
        socket.curve_publickey = self.public_key
        socket.curve_server = True


@dataclasses.dataclass(frozen=True, slots=True)
class CurveClient:
    """A front's CURVE keys and the engine's public key (Z85 ``bytes``)."""

    server_key: bytes
    public_key: bytes
    secret_key: bytes

    def apply(self, socket: zmq.asyncio.Socket) -> None:
        """Make ``socket`` a CURVE client of the engine whose public key we hold."""
        socket.curve_serverkey = self.server_key
        socket.curve_publickey = self.public_key
        socket.curve_secretkey = self.secret_key
