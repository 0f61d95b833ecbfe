"""Where the engine may connect on a tenant's behalf: the one outbound policy.

A tenant names URLs (an MCP server's, and through its OAuth metadata the
authorization server's endpoints); the engine connects to them from inside the
deployment, next to Redis, PostgreSQL and the cloud's metadata service. Without
a policy a tenant reads those through the engine's answers, or maps them by its
errors (issue #23). So every connection made for a tenant goes through
:class:`OutboundPolicy`:

* the host is normalised the way resolvers read it (``127.1``, ``0x7f000001``,
  ``2130706433``, ``0177.0.0.1``, ``[::ffff:127.0.0.1]``, trailing dots, case),
  a name is resolved once, and every address it gives must be public: not
  loopback, private, shared (CGNAT), link-local, unique-local, multicast,
  unspecified, reserved, nor a known metadata address; an IPv6 address that
  embeds an IPv4 one (mapped, compatible, 6to4, NAT64) is judged by that one;
* the connection goes to the address that was checked (:class:`PinnedBackend`
  under httpx's own transport): a name is never resolved a second time, so a
  DNS answer that changes between the check and the connect (rebinding) changes
  nothing. TLS keeps the URL's host name for SNI and certificate checks, and the
  ``Host`` header is the URL's, because only the dialled address changes;
* every connection of a client is checked, so redirects and URLs found in
  metadata are judged as they are dialled, whoever follows them.

The operator opens holes with ``HOLDFAST_OUTBOUND_ALLOW``: host names (matched
after normalisation; their addresses are then not judged) and CIDRs (an
address inside one is allowed), e.g. ``127.0.0.1/32,localhost`` for a local MCP
server in development.

A refusal is :class:`DestinationNotAllowed`, raised before any packet goes to
the destination; the gateway answers it as 422 ``DESTINATION_NOT_ALLOWED``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import httpcore2
import httpx2

if TYPE_CHECKING:
    from holdfast_shared.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Loc = tuple[str, ...]
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``(host, port) -> addresses`` as text: the system's resolver unless a test passes another."""

# Names that lead to a cloud's instance metadata wherever they resolve.
METADATA_HOSTS = frozenset(
    {"metadata.google.internal", "metadata.goog", "metadata", "instance-data"}
)
# Metadata services on addresses the general rules below do not all catch
# (192.0.0.192: Oracle; 100.100.100.200: Alibaba; fd00:ec2::254: AWS over IPv6).
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "192.0.0.192", "fd00:ec2::254")
)
_SHARED = ipaddress.ip_network("100.64.0.0/10")
_IETF = ipaddress.ip_network("192.0.0.0/24")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")
_COMPATIBLE = ipaddress.ip_network("::/96")


class DestinationNotAllowed(Exception):
    """A destination the policy refuses; ``loc`` names the field that led there."""

    def __init__(self, loc: Loc, reason: str) -> None:
        super().__init__(f"{'.'.join(loc)}: {reason}")
        self.loc = loc
        self.reason = reason

    def at(self, loc: Loc) -> DestinationNotAllowed:
        """The same refusal, naming another field (the caller knows better which)."""
        return DestinationNotAllowed(loc, self.reason)


@dataclass(frozen=True)
class Destination:
    """A URL that passed: its host as written (normalised) and the addresses checked."""

    url: str
    host: str
    port: int
    addresses: tuple[IPAddress, ...]


def normalise_host(host: str) -> str:
    """The host as a resolver compares it: no brackets, lower case, no trailing dots."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host.lower().rstrip(".")


def _ipv4_number(part: str) -> int | None:
    """One part of an inet_aton spelling: decimal, ``0x`` hex or ``0``-led octal."""
    try:
        if part[:2] in ("0x", "0X"):
            return int(part[2:] or "0", 16)
        if len(part) > 1 and part.startswith("0"):
            return int(part[1:], 8)
        return int(part, 10) if part.isdigit() else None
    except ValueError:
        return None


def _inet_aton(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address the C resolver reads in ``host`` (``127.1``, ``0x7f000001``,
    ``2130706433``, ``0177.0.0.1``), or None if it is a name."""
    parts = host.split(".")
    if not 1 <= len(parts) <= 4 or not all(parts):
        return None
    numbers = [_ipv4_number(p) for p in parts]
    if any(n is None for n in numbers):
        return None
    values = [n for n in numbers if n is not None]
    *head, last = values
    if any(n > 255 for n in head) or last >= 256 ** (5 - len(values)):
        return None
    number = 0
    for n in head:
        number = number * 256 + n
    number = number * 256 ** (5 - len(values)) + last
    return ipaddress.IPv4Address(number)


def literal_address(host: str) -> IPAddress | None:
    """The address ``host`` spells (in any spelling a resolver accepts), or None for a name."""
    host = normalise_host(host)
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return _inet_aton(host)


def _canonical(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one stands for when it embeds one, else itself."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if address.sixtofour is not None:
            return address.sixtofour
        if address in _COMPATIBLE and int(address) > 1:  # ::a.b.c.d, deprecated
            return ipaddress.IPv4Address(int(address))
    return address


def refusal(address: IPAddress) -> str | None:
    """Why ``address`` is not a public destination, or None if it is one."""
    address = _canonical(address)
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if address.is_unspecified:
        return "the unspecified address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_multicast:
        return "a multicast address"
    if isinstance(address, ipaddress.IPv6Address) and (
        address.is_site_local or address in _LOCAL_NAT64
    ):
        return "a site-local address"
    if address.is_private:
        return "a private address"
    if address in _SHARED:
        return "a shared (carrier-grade NAT) address"
    if address in _IETF or address.is_reserved or not address.is_global:
        return "a reserved address"
    return None


async def system_resolver(host: str, port: int) -> Sequence[str]:
    """The system's answer for ``host`` (every address, in its order)."""
    found = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in found]


class OutboundPolicy:
    """Which destinations the engine may connect to for a tenant (module docstring).

    ``allow``: the operator's holes (host names and CIDRs); ``resolver``: how
    names become addresses (the system's unless a test passes its own).
    """

    def __init__(self, allow: Iterable[str] = (), *, resolver: Resolver | None = None) -> None:
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for entry in allow:
            entry = entry.strip()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(normalise_host(entry), strict=False))
            except ValueError:
                hosts.add(normalise_host(entry))
        self.hosts = frozenset(hosts)
        self.networks = tuple(networks)
        self.resolver = resolver or system_resolver

    @classmethod
    def from_settings(
        cls, settings: Settings, *, resolver: Resolver | None = None
    ) -> OutboundPolicy:
        """The policy of ``HOLDFAST_OUTBOUND_ALLOW`` (comma-separated hosts and CIDRs)."""
        return cls(settings.outbound_allow.split(","), resolver=resolver)

    def _allowed(self, address: IPAddress) -> bool:
        return any(
            a in network for a in {address, _canonical(address)} for network in self.networks
        )

    def judge(self, address: IPAddress) -> str | None:
        """Why ``address`` is refused here, or None (public, or inside an allowed CIDR)."""
        return None if self._allowed(address) else refusal(address)

    async def addresses(self, host: str, port: int, loc: Loc) -> tuple[IPAddress, ...]:
        """The addresses to dial for ``host``: resolved once, every one checked.

        Raises :class:`DestinationNotAllowed` if any address is refused (a name
        that resolves to one public and one internal address is refused: which
        one a client would dial is not ours to guess).
        """
        name = normalise_host(host)
        literal = literal_address(name)
        if literal is not None:
            found: tuple[IPAddress, ...] = (literal,)
        else:
            if not name:
                raise DestinationNotAllowed(loc, "the URL names no host")
            if name in METADATA_HOSTS and name not in self.hosts:
                raise DestinationNotAllowed(loc, f"{name!r} is a cloud metadata host")
            try:
                answers = await self.resolver(name, port)
            except OSError:
                # Not a refusal: nothing can be dialled, as a client would find.
                raise httpcore2.ConnectError(f"cannot resolve {name!r}") from None
            found = tuple(ipaddress.ip_address(a.split("%", 1)[0]) for a in answers)
            if not found:
                raise httpcore2.ConnectError(f"cannot resolve {name!r}")
            if name in self.hosts:
                return found
        for address in found:
            reason = self.judge(address)
            if reason is not None:
                where = (
                    f"{host!r} is" if literal is not None else f"{name!r} resolves to {address},"
                )
                raise DestinationNotAllowed(loc, f"{where} {reason}")
        # Dialled as found (a NAT64 or 6to4 address routes otherwise than the one it embeds).
        return found

    async def check_url(self, url: str, loc: Loc) -> Destination:
        """Check ``url`` as a client would dial it: http(s), and its host allowed.

        The host is read both as httpx reads it and as ``urllib`` does, and
        both must pass, so no difference between URL parsers lets one through.
        A URL neither can read passes with no address: no client can dial it.
        """
        hosts: list[str] = []
        port = 0
        try:
            split = urlsplit(url)
            if split.scheme not in ("http", "https"):
                raise DestinationNotAllowed(loc, "only http and https URLs are allowed")
            port = split.port or (443 if split.scheme == "https" else 80)
            hosts.append(split.hostname or "")
        except ValueError:
            pass
        try:
            parsed = httpx2.URL(url)
            if parsed.scheme not in ("http", "https"):
                raise DestinationNotAllowed(loc, "only http and https URLs are allowed")
            port = port or parsed.port or (443 if parsed.scheme == "https" else 80)
            hosts.append(parsed.host)
        except httpx2.InvalidURL:
            pass
        checked: tuple[IPAddress, ...] = ()
        for host in dict.fromkeys(hosts):
            try:
                checked = await self.addresses(host, port, loc)
            except httpcore2.ConnectError:
                checked = ()  # no address: the client will find it unreachable, not refused
        host = normalise_host(hosts[0]) if hosts else ""
        return Destination(url=url, host=host, port=port, addresses=checked)

    def transport(
        self, loc: Loc = ("url",), *, backend: httpcore2.AsyncNetworkBackend | None = None
    ) -> httpx2.AsyncHTTPTransport:
        """An httpx transport whose every connection is checked and pinned; a refused
        one raises :class:`DestinationNotAllowed` naming ``loc``."""
        return PinnedTransport(self, loc, backend=backend)


class PinnedBackend(httpcore2.AsyncNetworkBackend):
    """httpcore's network backend, dialling only addresses the policy checked.

    httpcore hands ``connect_tcp`` the URL's host and later starts TLS with that
    same host as ``server_hostname``; this backend resolves and checks the host
    here, once, and dials one of the checked addresses.
    """

    def __init__(
        self, policy: OutboundPolicy, loc: Loc, inner: httpcore2.AsyncNetworkBackend | None = None
    ) -> None:
        self.policy = policy
        self.loc = loc
        self.inner = inner or httpcore2.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        try:
            with anyio.fail_after(timeout):
                addresses = await self.policy.addresses(host, port, self.loc)
        except TimeoutError:
            raise httpcore2.ConnectTimeout(f"resolving {host!r} took too long") from None
        failure: Exception | None = None
        for address in addresses:
            try:
                return await self.inner.connect_tcp(
                    str(address), port, timeout, local_address, socket_options
                )
            except (httpcore2.ConnectError, httpcore2.ConnectTimeout) as exc:
                failure = exc
        assert failure is not None
        raise failure

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        raise DestinationNotAllowed(self.loc, "unix sockets are not a destination")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class PinnedTransport(httpx2.AsyncHTTPTransport):
    """:class:`httpx2.AsyncHTTPTransport` over a :class:`PinnedBackend` (``backend``:
    what dials the checked address, httpcore's own unless a test passes one)."""

    def __init__(
        self,
        policy: OutboundPolicy,
        loc: Loc,
        *,
        limits: httpx2.Limits | None = None,
        backend: httpcore2.AsyncNetworkBackend | None = None,
    ) -> None:
        # No environment: a proxy from HTTP(S)_PROXY would dial names we did not check.
        super().__init__(trust_env=False)
        limits = limits or httpx2.Limits(max_connections=100, max_keepalive_connections=20)
        # httpx builds its pool with no way to hand it a backend: build it again with one.
        self._pool = httpcore2.AsyncConnectionPool(
            ssl_context=httpx2.create_ssl_context(trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=PinnedBackend(policy, loc, backend),
        )


__all__ = [
    "Destination",
    "DestinationNotAllowed",
    "OutboundPolicy",
    "PinnedBackend",
    "PinnedTransport",
    "literal_address",
    "normalise_host",
    "refusal",
    "system_resolver",
]
