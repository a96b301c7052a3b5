"""The network interface of a job's sockets: gloo's (PS pushes and replies, host collectives)
and NCCL's (its bootstrap, and its data where there is no InfiniBand verbs transport).

cluster.ifname names it. Left empty, it is chosen as NCCL chooses its own: an InfiniBand
interface (ib*, IP over InfiniBand) with an IPv4 address first, so that ~100 MB PS pushes
cross the fast fabric rather than the Ethernet the host name usually resolves to; loopback for
a job whose processes all run on this machine; otherwise nothing is set and gloo uses the
address the host name resolves to. GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME set by the user
win over all of this.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

from ..errors import LaunchError

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
ENV_KEYS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interfaces() -> dict[str, str]:
    """This host's interfaces that have an IPv4 address: name -> address."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                out[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address, or down
                continue
    return out


def choose(ifname: str, available: dict[str, str], loopback_job: bool) -> str | None:
    """The interface for gloo's and NCCL's sockets, or None to leave the choice to them.
    Raises LaunchError naming the interfaces there are when cluster.ifname names none of them."""
    if ifname:
        if ifname not in available:
            have = ", ".join(f"{n} ({a})" for n, a in available.items()) or "none with an IPv4 address"
            raise LaunchError(f"cluster.ifname = {ifname!r}: no such interface with an IPv4 address on "
                              f"{socket.gethostname()}; it has {have}")
        return ifname
    if loopback_job:
        return "lo" if "lo" in available else None
    return next((n for n in sorted(available) if n.startswith("ib")), None)


def hostname_interface(available: dict[str, str], host: str | None = None) -> str | None:
    """The interface gloo uses when none is set: the one holding the address the host name
    resolves to (None when it resolves to none of them)."""
    try:
        addr = socket.gethostbyname(host or socket.gethostname())
    except OSError:
        return None
    return next((n for n, a in available.items() if a == addr), None)


def socket_env(ifname: str, loopback_job: bool, env=os.environ) -> dict[str, str]:
    """The variables to set for gloo and NCCL (empty where the user set them, or where the
    choice is left to the libraries)."""
    chosen = choose(ifname, interfaces(), loopback_job)
    if chosen is None:
        return {}
    return {k: chosen for k in ENV_KEYS if k not in env}
