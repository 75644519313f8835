"""Which requests the explorer answers: the Host and Origin checks, as Jupyter's server does them.

A page on another site can make the visitor's browser send requests to ``127.0.0.1``. Two checks
stop it from reading or uploading anything:

* ``Host`` must name this server: ``127.0.0.1``, ``localhost``, ``[::1]``, the bound address, or
  a name given with ``--allow-host``, with the bound port. This defeats DNS rebinding, where an
  attacker's own name is pointed at ``127.0.0.1`` so the browser treats the server as that site.
  Behind a wildcard bind (``0.0.0.0``, ``::``) any IP address is accepted too (an IP address
  cannot be rebound), but no other name.
* ``Origin``, when the browser sends one, must be ``http://`` plus such a host, an IP address
  only if it is the one the request was sent to: a cross-site ``fetch`` or form post carries the
  other site's origin and is refused, one from a page at another IP address too.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

LOCAL_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


class Refused(Exception):
    """A request from somewhere the explorer does not answer (HTTP 403)."""


def split_host(value: str) -> tuple[str, int | None]:
    """``name[:port]`` (IPv6 in brackets) as ``(lower-case name without brackets, port or None)``.

    Raises:
        ValueError: not of that form, or a port that is not 1..65535 in ASCII digits.
    """
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"malformed host {value[:100]!r}")
        port = rest[1:] if rest else None
    else:
        name, colon, port = value.partition(":")
        port = port if colon else None
    if not name or any(c.isspace() or c in "/?#@[]" for c in name):
        raise ValueError(f"malformed host {value[:100]!r}")
    if port is None:
        return name.lower(), None
    if not (port.isascii() and port.isdigit() and 1 <= len(port) <= 5 and 1 <= int(port) <= 65535):
        raise ValueError(f"malformed port in {value[:100]!r}")
    return name.lower(), int(port)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(name: str) -> bool:
    """Whether a host name or address (IPv6 with or without brackets) reaches this machine only:
    ``localhost`` or a loopback address (``127.0.0.0/8``, ``::1``)."""
    name = name.lower().strip("[]")
    return name == "localhost" or (_is_ip(name) and ipaddress.ip_address(name).is_loopback)


@dataclass(frozen=True)
class HostCheck:
    """The names and port under which a server bound to one address may be addressed.

    Args:
        port: the bound port.
        names: lower-case host names and addresses (IPv6 without brackets) that mean this server.
        any_ip: the server listens on every interface, so any IP address means it.
    """

    port: int
    names: frozenset[str]
    any_ip: bool = False

    @classmethod
    def for_address(cls, host: str, port: int, allow: Iterable[str] = ()) -> HostCheck:
        """The check for a server bound to ``(host, port)``, also accepting the names in ``allow``."""
        names = {*LOCAL_NAMES, *(name.lower().strip("[]") for name in allow)}
        if host not in WILDCARDS:
            names.add(host.lower())
        return cls(port, frozenset(names), any_ip=host in WILDCARDS)

    def _names_this_server(self, name: str, port: int | None) -> bool:
        if (80 if port is None else port) != self.port:
            return False
        return name in self.names or is_loopback(name) or (self.any_ip and _is_ip(name))

    def check_host(self, header: str | None, version: str) -> None:
        """Accept a request's ``Host`` header, or say why not.

        Raises:
            ValueError: missing (HTTP/1.1 requires it) or malformed (HTTP 400).
            Refused: another name or port than this server's (HTTP 403).
        """
        if header is None:
            if version == "HTTP/1.0":  # an HTTP/1.0 client without Host is no browser
                return
            raise ValueError("the request has no Host header")
        name, port = split_host(header)
        if not self._names_this_server(name, port):
            raise Refused(
                f"Host {header[:100]!r} is not this server's address; open http://127.0.0.1:{self.port}/ "
                "(or start cgavit explore with --allow-host NAME for a name of this machine)"
            )

    def check_origin(self, header: str | None, host: str | None = None) -> None:
        """Accept a request's ``Origin`` header (none: not a cross-site browser request), or refuse it.

        Args:
            header: the ``Origin`` header.
            host: the request's ``Host`` (checked by :meth:`check_host`). The origin must be a name of
                :attr:`names` or a loopback address, or, behind a wildcard bind, the very address the request
                was sent to: not any IP address.

        Raises:
            Refused: any origin but ``http://`` plus this server's host and port ("null" included): behind a
                wildcard bind, a page at another IP address than the one the request was sent to.
        """
        if header is None:
            return
        scheme, sep, rest = header.partition("://")
        try:
            name, port = split_host(rest)
        except ValueError:
            name = port = None
        ok = bool(sep) and scheme.lower() == "http" and name is not None and self._names_this_server(name, port)
        if ok and not (name in self.names or is_loopback(name)):  # an IP address behind a wildcard bind
            ok = host is not None and _same_place(name, port, *split_host(host))
        if not ok:
            raise Refused(f"cross-origin request from {header[:100]!r} refused: the explorer answers only its own page")


def _same_place(name: str, port: int | None, other_name: str, other_port: int | None) -> bool:
    """Whether two ``(host, port)`` pairs, ports defaulting to 80, name the same place."""
    return (name, 80 if port is None else port) == (other_name, 80 if other_port is None else other_port)
