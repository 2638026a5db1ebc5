"""The RPC group's environment, read without torch: the rendezvous address, the TensorPipe transports and channels,
the interfaces TensorPipe and gloo listen on, and whether anything listens at an address yet.

``persia ps`` and ``persia train`` check it before they import torch, so a mistake is answered at once; the group
itself (:mod:`.ps.group`) reads it when a process joins.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
import time
from collections.abc import Mapping, MutableMapping

from persia_planner.errors import PlannerError, abbreviate

__all__ = [
    "DEFAULT_RPC_TIMEOUT_S",
    "DEFAULT_RPC_TRANSPORTS",
    "MAX_TIMEOUT_S",
    "RPC_CHANNELS_ENV",
    "RPC_TRANSPORTS_ENV",
    "check_rpc_environment",
    "check_timeouts",
    "host_name_problem",
    "interface_with",
    "is_loopback",
    "listen_where_the_rendezvous_is",
    "master_address",
    "port_number",
    "rendezvous_interface",
    "resolve",
    "rpc_channels",
    "rpc_transports",
    "wait_for_listener",
]

# How long a process waits for its RPC group to come together (``persia ps --rpc-timeout``; ``persia train``'s
# processes under torchrun wait as long for torchrun's store).
DEFAULT_RPC_TIMEOUT_S = 60.0
# The longest timeout taken (a week): torch's and Python's waits overflow on an infinite or 1e300-second one.
MAX_TIMEOUT_S = 7 * 24 * 3600.0

# A host name or an address as the resolver takes it: letters, digits, ``.``, ``-``, ``_``; ``:`` and ``%`` for IPv6
# and its zone. Anything else (a space, a control character, a URL) can never be a host of the group.
_HOST = re.compile(r"[A-Za-z0-9_.:%-]+")
_MAX_HOST_CHARS = 253  # the longest DNS name


def host_name_problem(host: str) -> str | None:
    """What makes ``host`` impossible as a host name or address (None if nothing): it is not resolved."""
    if not host:
        return "it is empty"
    if len(host) > _MAX_HOST_CHARS:
        return f"it has {len(host)} characters, more than a host name's {_MAX_HOST_CHARS}"
    if not _HOST.fullmatch(host):
        return "it is not a host name or an IP address (letters, digits, '.', '-', '_', ':' only)"
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)  # a zone (fe80::1%eth0) included
        except ValueError:
            return "it holds ':' but is no IPv6 address"
    return None


def port_number(text: str, *, low: int = 1) -> int | None:
    """``text`` as a TCP port in ``low``..65535 (ASCII digits only: ``int`` would take ``+1``, ``1_0`` or other
    scripts' digits), or None."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 5:
        return None
    number = int(text)
    return number if low <= number <= 65535 else None


def master_address(purpose: str, environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """``MASTER_ADDR`` and ``MASTER_PORT`` (the torchrun convention), the rendezvous of ``purpose``.

    Raises:
        PlannerError: If either variable is unset, ``MASTER_ADDR`` cannot be a host name or address, or
            ``MASTER_PORT`` is not a port number in 1..65535 (one line, naming the variable and ``purpose``).
    """
    env = os.environ if environ is None else environ
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port:
        raise PlannerError(
            f"MASTER_ADDR and MASTER_PORT must be set for {purpose} (got MASTER_ADDR={abbreviate(addr)}, "
            f"MASTER_PORT={abbreviate(port)})",
            fixes=("export MASTER_ADDR=<host of rank 0> MASTER_PORT=<free port>, or launch with torchrun",),
        )
    number = port_number(port)
    if number is None:
        raise PlannerError(
            f"MASTER_PORT must be a port number in 1..65535 for {purpose} (got MASTER_PORT={abbreviate(port)})",
            fixes=("export MASTER_PORT=<free port>, e.g. 29500",),
        )
    problem = host_name_problem(addr.strip())
    if problem is not None:
        raise PlannerError(
            f"MASTER_ADDR={abbreviate(addr)} for {purpose}: {problem}",
            fixes=(
                "export MASTER_ADDR=<host name or IP address of rank 0> (127.0.0.1 on one machine), its port in "
                "MASTER_PORT",
            ),
        )
    return addr.strip(), number


def check_rpc_environment(
    purpose: str, environ: Mapping[str, str] | None = None, *, resolve_address: bool = True
) -> tuple[str, int]:
    """Every check of the RPC group's environment that needs no torch: :func:`master_address`, the transports and
    channels, and (``resolve_address``) that ``MASTER_ADDR`` resolves. Returns ``MASTER_ADDR`` and ``MASTER_PORT``.

    Raises:
        PlannerError: The first problem found (one line, naming the variable).
    """
    addr, port = master_address(purpose, environ)
    rpc_transports(environ)
    rpc_channels(environ)
    if resolve_address:
        problem = resolve(addr, port)
        if problem is not None:
            raise PlannerError(
                f"MASTER_ADDR={abbreviate(addr)} for {purpose} does not resolve ({problem})",
                fixes=("export MASTER_ADDR=<host name or IP address of rank 0>, e.g. 127.0.0.1 on one machine",),
            )
    return addr, port


def check_timeouts(**seconds: float) -> None:
    """Refuse a timeout (keyword: the option's name without ``--``, ``rpc_timeout=60``) that is not a finite number
    of seconds up to :data:`MAX_TIMEOUT_S`.

    Raises:
        PlannerError: One line naming the option.
    """
    for name, value in seconds.items():
        if not (math.isfinite(value) and value <= MAX_TIMEOUT_S):
            option = "--" + name.replace("_", "-")
            raise PlannerError(
                f"{option} {abbreviate(value)} is not a number of seconds up to a week ({MAX_TIMEOUT_S:g})",
                fixes=(f"give {option} N with N at most {MAX_TIMEOUT_S:g}",),
            )


# getaddrinfo's answers that no retry changes: the name does not exist (a temporary failure, EAI_AGAIN, may pass).
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME), socket.EAI_SERVICE}


def resolve(host: str, port: int) -> str | None:
    """None where ``host`` resolves to an address for TCP, else the resolver's reason."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:  # socket.gaierror is an OSError; an over-long label a UnicodeError
        return str(getattr(err, "strerror", None) or err)
    return None


def wait_for_listener(addr: str, port: int, timeout_s: float) -> str | None:
    """None once a TCP connection to ``addr:port`` succeeds (closed at once), else why not after ``timeout_s``
    seconds; at once where ``addr`` names no host at all.

    Refused connections are retried every 0.1 s: the peer that serves ``addr:port`` may start later than this one.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(1.0, left))):
                return None
        except socket.gaierror as err:
            if err.errno in _NO_SUCH_NAME:
                return f"{addr} does not resolve: {err.strerror or err}"
            if left <= 0:
                return str(err.strerror or err)
        except OSError as err:
            if left <= 0:
                return str(err) or type(err).__name__
        time.sleep(0.1)  # the retry interval of a connect loop (as torch's own), not a synchronisation


# TensorPipe transports the group uses unless PERSIA_RPC_TRANSPORTS names others (see rpc_transports).
RPC_TRANSPORTS_ENV = "PERSIA_RPC_TRANSPORTS"
DEFAULT_RPC_TRANSPORTS = ("uv",)
_KNOWN_TRANSPORTS = ("uv", "shm", "ibv")
# TensorPipe channels (how tensors travel) the group restricts itself to where PERSIA_RPC_CHANNELS names them.
RPC_CHANNELS_ENV = "PERSIA_RPC_CHANNELS"
_KNOWN_CHANNELS = ("basic", "mpt_uv", "cma")


def rpc_transports(environ: Mapping[str, str] | None = None) -> list[str]:
    """The TensorPipe transports of this process: ``PERSIA_RPC_TRANSPORTS`` (comma-separated, in order of
    preference) or :data:`DEFAULT_RPC_TRANSPORTS`.

    Why ``uv`` (TCP, epoll) and not TensorPipe's default ``shm`` first: the shm transport's reactor thread polls
    without sleeping, so every PS and trainer process on a host keeps a core busy even when idle; on a 2-core machine
    with a server and a trainer that is the whole machine. Tensors between processes of one host still take
    TensorPipe's ``cma`` channel (one kernel copy) with uv, and lookups cost less CPU with it
    (``docs/decisions/0009-rpc-transport-uv.md``). Hosts with spare cores may prefer ``PERSIA_RPC_TRANSPORTS=shm,uv``
    (a few tens of microseconds less latency per call). Every process of a group must offer at least one transport
    of the others.

    Raises:
        PlannerError: The variable names a transport TensorPipe does not have (one line, naming the variable).
    """
    names = _names(environ, RPC_TRANSPORTS_ENV, "transport", _KNOWN_TRANSPORTS, default="uv")
    return names or list(DEFAULT_RPC_TRANSPORTS)


def rpc_channels(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The TensorPipe channels of this process: ``PERSIA_RPC_CHANNELS`` (comma-separated, in order of preference),
    or None for TensorPipe's own choice.

    Why one would restrict them: TensorPipe's ``cma`` channel copies a tensor straight from one process's memory
    into another's when both run under one kernel, whatever their network. Hosts emulated as network namespaces of
    one machine (``benchmarks/netcluster.py``) would then move every row around their shaped links; with
    ``PERSIA_RPC_CHANNELS=basic`` tensors travel on the transport, as between real machines.

    Raises:
        PlannerError: The variable names a channel TensorPipe does not have here (one line, naming the variable).
    """
    return _names(environ, RPC_CHANNELS_ENV, "channel", _KNOWN_CHANNELS, default="TensorPipe's choice")


def _names(
    environ: Mapping[str, str] | None, variable: str, kind: str, known: tuple[str, ...], *, default: str
) -> list[str] | None:
    """The comma-separated names of ``variable``, checked against ``known``; None where it is unset or blank."""
    environ = os.environ if environ is None else environ
    value = environ.get(variable, "").strip()
    if not value:
        return None
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise PlannerError(
            f"{variable}={abbreviate(value)}: unknown TensorPipe {kind}(s) {abbreviate(unknown or [value])}",
            fixes=(f"use a comma-separated list of {', '.join(known)} (default: {default})",),
        )
    return names


# Linux's loopback interface. TensorPipe and gloo take an interface name, not an address.
_LOOPBACK_INTERFACE = "lo"


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` is ``localhost`` or a loopback address (127.0.0.0/8, ``::1``); a host name is not resolved."""
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def listen_where_the_rendezvous_is(environ: MutableMapping[str, str] | None = None) -> None:
    """Make TensorPipe and gloo listen on the interface this host reaches ``MASTER_ADDR`` through: loopback for a
    job on this machine, the cluster network's interface for one on several (:func:`rendezvous_interface`).

    Call it before the RPC agent or a gloo group starts: they read ``TP_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME``
    then. Unset, both listen on the address the host's name resolves to, which on a machine with several networks
    (or in a network namespace) need not be the one the other hosts reach. A value the user set is kept, and where
    no interface is found (an address that does not resolve) both stay unset.
    """
    environ = os.environ if environ is None else environ
    interface = rendezvous_interface(environ.get("MASTER_ADDR", ""))
    if interface is not None:
        environ.setdefault("TP_SOCKET_IFNAME", interface)
        environ.setdefault("GLOO_SOCKET_IFNAME", interface)


def rendezvous_interface(addr: str) -> str | None:
    """The name of the interface this host sends to ``addr`` through (the kernel's route, looked up with a UDP socket
    that sends nothing), ``lo`` for a loopback address; None where ``addr`` does not resolve or no interface holds
    the local address of that route."""
    if not addr:
        return None
    if is_loopback(addr):
        return _LOOPBACK_INTERFACE
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, None, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((sockaddr[0], 9))  # connect() on UDP only picks the route: no datagram leaves
            local = probe.getsockname()[0]
    except OSError:
        return None
    return interface_with(local)


def interface_with(address: str) -> str | None:
    """The interface that holds ``address`` (IPv4 or IPv6), from ``ip -o addr`` of this network namespace."""
    import subprocess

    try:
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = line.split()  # "2: eth0    inet 198.18.0.1/24 ..."
        if len(fields) > 3 and fields[2] in ("inet", "inet6") and fields[3].split("/")[0] == address:
            return fields[1].split("@")[0]
    return None
