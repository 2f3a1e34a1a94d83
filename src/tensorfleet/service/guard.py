"""What slows down password guessing at the sign-in, and what keeps another site from signing a browser in.

**Guessing.** A password check costs ~50 ms and two run at a time, so without more a stranger could try about 3.6
passwords a second, for ever. ``SignInGuard`` counts wrong passwords in a row per account name and per client
address: after ``FREE_FAILURES`` of them (typos), each further one makes the next sign-in of that name, and from
that address, wait ``FIRST_DELAY_S``, then twice as long each time, up to ``MAX_DELAY_S``. While it waits, a
sign-in is answered 429 with ``Retry-After`` and its password is not even checked. A right password resets both
counts. Names that are no account count like names that are, so a delay says nothing of whether an account
exists. Both tables are bounded (``MAX_ENTRIES`` each, the least recently failed forgotten first; an entry unlocked
and idle for ``FORGET_AFTER_S`` goes too): a stranger's many names or addresses cost a fixed amount of memory. A
client is its IP address (an IPv6 address by its /64, what one host usually holds); behind a proxy every client
is the proxy's address.

**Login CSRF.** A page of another site can post the sign-in form with the attacker's own name and password, and
so sign a visitor's browser in as the attacker (who then reads what the visitor submits). ``foreign_origin``
refuses a sign-in that a browser says came from another site (``Origin``, else ``Referer``, else
``Sec-Fetch-Site``); a request with none of them is no browser's form (a program signing in), and is taken.

The counts are exported at the service's ``/metrics`` (``metrics_text``).
"""

from __future__ import annotations

import ipaddress
import math
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

FREE_FAILURES = 3  # wrong passwords in a row (per name, per client) before any delay
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 60.0
MAX_ENTRIES = 10_000  # per table (names, clients); at ~40 checks a second (two at a time, ~50 ms each), a
# locked entry cannot be pushed out by newer ones before its delay (at most MAX_DELAY_S) ends
FORGET_AFTER_S = 3600.0
MAX_NAME_CHARS = 64  # a name longer than any account's is counted by its first characters
KINDS = ("account", "client")
REFUSALS = ("locked", "busy", "origin")
CONTENT_TYPE: str = CONTENT_TYPE_LATEST


@dataclass
class _Failures:
    count: int = 0
    until: float = 0.0  # the clock's time before which a sign-in is refused
    last: float = 0.0


def delay_after(failures: int) -> float:
    """Seconds the next sign-in waits after ``failures`` wrong passwords in a row (0 for the first few)."""
    if failures <= FREE_FAILURES:
        return 0.0
    return min(MAX_DELAY_S, FIRST_DELAY_S * 2.0 ** min(failures - FREE_FAILURES - 1, 32))


def client_key(host: str | None) -> str:
    """The client a request comes from, as counted: its IP address, an IPv6 address by its /64."""
    if not host:
        return "?"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host[:MAX_NAME_CHARS]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


class SignInGuard:
    """The wrong-password counts per account name and per client, and what was refused (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._tables: dict[str, OrderedDict[str, _Failures]] = {kind: OrderedDict() for kind in KINDS}
        self.signed_in = 0
        self.wrong_passwords = 0
        self.refused: Counter[str] = Counter()
        self.lockouts: Counter[str] = Counter()  # by kind: delays begun

    def wait_s(self, name: str, client: str) -> float:
        """Seconds before ``name`` may sign in from ``client`` (0: now), the longer of the two delays."""
        now = self.clock()
        with self._lock:
            entries = [self._tables[kind].get(key) for kind, key in self._keys(name, client)]
        return max([entry.until - now for entry in entries if entry is not None] + [0.0])

    def failed(self, name: str, client: str) -> None:
        """A wrong password for ``name`` from ``client``: both counts grow, and a delay begins past the free ones."""
        now = self.clock()
        with self._lock:
            self.wrong_passwords += 1
            for kind, key in self._keys(name, client):
                table = self._tables[kind]
                entry = table.pop(key, None) or _Failures()
                entry.count += 1
                entry.last = now
                delay = delay_after(entry.count)
                if delay:
                    entry.until = now + delay
                    self.lockouts[kind] += 1
                table[key] = entry  # the most recently failed last: the first forgotten is the oldest
                self._bound(table, now)

    def succeeded(self, name: str, client: str) -> None:
        """The right password: both counts start again."""
        with self._lock:
            self.signed_in += 1
            for kind, key in self._keys(name, client):
                self._tables[kind].pop(key, None)

    def refuse(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] += 1

    def counts(self) -> dict[str, dict[str, int]]:
        """For the metrics: entries held and entries locked now, per kind."""
        now = self.clock()
        with self._lock:
            return {kind: {"tracked": len(table), "locked": sum(entry.until > now for entry in table.values())}
                    for kind, table in self._tables.items()}

    @staticmethod
    def _keys(name: str, client: str) -> list[tuple[str, str]]:
        return [("account", name[:MAX_NAME_CHARS]), ("client", client)]

    @staticmethod
    def _bound(table: OrderedDict[str, _Failures], now: float) -> None:
        while len(table) > MAX_ENTRIES:
            table.popitem(last=False)
        while table:  # the oldest first: stop at the first still worth remembering
            key, entry = next(iter(table.items()))
            if entry.until > now or now - entry.last < FORGET_AFTER_S:
                break
            del table[key]


def retry_after(wait_s: float) -> str:
    """The ``Retry-After`` value (whole seconds, at least 1) for a wait of ``wait_s``."""
    return str(max(1, math.ceil(wait_s)))


def foreign_origin(headers: Mapping[str, str]) -> str | None:
    """The site a browser says a sign-in came from when it is not this service (``Origin``, else ``Referer``,
    else ``Sec-Fetch-Site``), or None: this service's own page, or no browser (none of these headers).

    This service is the ``Host`` the request was sent to (or a proxy's ``X-Forwarded-Host``: a page of another site
    cannot set either on a form it posts)."""
    sent = headers.get("origin") or headers.get("referer")
    if sent is None:
        site = headers.get("sec-fetch-site")
        return site if site in ("cross-site", "same-site") else None
    parts = urlsplit(sent)
    here = {_host_port(host, parts.scheme) for host in _own_hosts(headers)}
    there = _host_port(parts.netloc, parts.scheme) if parts.scheme in ("http", "https") else None
    return None if there is not None and there in here else sent[:200]


def _own_hosts(headers: Mapping[str, str]) -> Iterator[str]:
    yield headers.get("host", "")
    for host in headers.get("x-forwarded-host", "").split(","):
        if host.strip():
            yield host.strip()


def _host_port(netloc: str, scheme: str) -> tuple[str, int] | None:
    """(host, port) of ``netloc`` (``host[:port]``), the scheme's port when none is given; None if unreadable."""
    try:
        parts = urlsplit(f"//{netloc}")
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        return None
    return (parts.hostname, port) if parts.hostname else None


# --- /metrics -------------------------------------------------------------------------------------------------------

class _GuardCollector:
    def __init__(self, guard: SignInGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator[Metric]:
        guard, counts = self.guard, self.guard.counts()
        yield CounterMetricFamily("tensorfleet_service_sign_ins", "Sign-ins with the right password",
                                  value=guard.signed_in)
        yield CounterMetricFamily("tensorfleet_service_sign_in_wrong_passwords", "Sign-ins with a wrong password "
                                  "(or a name that is no account)", value=guard.wrong_passwords)
        refused = CounterMetricFamily("tensorfleet_service_sign_in_refused", "Sign-ins refused unchecked: locked "
                                      "after wrong passwords (429), too many at once (429), from another site (403)",
                                      labels=["reason"])
        for reason in REFUSALS:
            refused.add_metric([reason], guard.refused[reason])
        yield refused
        lockouts = CounterMetricFamily("tensorfleet_service_sign_in_lockouts", "Delays begun after wrong passwords, "
                                       "per account name or per client address", labels=["by"])
        locked = GaugeMetricFamily("tensorfleet_service_sign_in_locked", "Account names or client addresses that "
                                   "must wait now before their next sign-in", labels=["by"])
        tracked = GaugeMetricFamily("tensorfleet_service_sign_in_tracked", "Account names or client addresses "
                                    f"with wrong passwords remembered (at most {MAX_ENTRIES} each)", labels=["by"])
        for kind in KINDS:
            lockouts.add_metric([kind], guard.lockouts[kind])
            locked.add_metric([kind], counts[kind]["locked"])
            tracked.add_metric([kind], counts[kind]["tracked"])
        yield from (lockouts, locked, tracked)


def metrics_text(guard: SignInGuard) -> bytes:
    """The sign-in counts in Prometheus' text format (a fresh registry per scrape, as the dashboard's)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_GuardCollector(guard))
    return generate_latest(registry)
