"""Namespace hosts: emulated hosts that each have their own network stack, address and shaped NIC.

A `Network` of one run is a set of Linux network namespaces named `<prefix><host>` (prefix
`tpx-<id>-`), one more namespace `<prefix>sw` holding the bridge that plays the switch, and per host a
veth pair from the switch to the host's `nic0`. Addresses (10.77.0.0/24) exist only inside namespaces
the run created, and the bridge lives in a namespace of its own, so the machine's own network (and
`ip link` outside) never sees any of it; traffic can only reach this run's hosts. With `gbps`, each
host's egress is shaped on its `nic0` and its ingress on the switch's end of its veth (tbf, with netem
in front for `latency_ms`), so the busiest host's link is the bottleneck, as on a real cluster.

Everything goes through iproute2's `ip` and `tc` commands. Teardown kills every process still in a
namespace and deletes the namespaces (a veth dies with its namespace); `cleanup(prefix)` does the same
for the leftovers of a killed run, and `python -m tenplex.runtime.netns cleanup` for all of tenplex's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..ptc import TenplexError
from ..store.client import DEFAULT_PORT
from ..store.process import logged_stores
from ..util import logger

ROOT_PREFIX = "tpx-"  # every namespace tenplex creates starts with this
SUBNET = "10.77.0"  # private; each run's bridge is isolated in its own namespace, so runs may reuse it
NIC = "nic0"  # the host's interface, the same name in every host (GLOO_SOCKET_IFNAME)
MAX_HOSTS = 250
# the shaper's token bucket (tc-tbf), settings chosen rather than measured: a burst of at least one GSO
# packet and of TBF_BURST_S of line rate, packets queued up to TBF_LATENCY_MS (tc's usual) before they drop
TBF_MIN_BURST = 256 << 10
TBF_BURST_S = 0.002
TBF_LATENCY_MS = 50


class NetnsError(TenplexError):
    """Namespace hosts cannot be created or used here (not root, no permission, no iproute2)."""


@dataclass(frozen=True)
class Host:
    """One namespace host: its name in the run (h0, h1, ...), namespace, address and interface."""

    name: str
    ns: str
    addr: str
    veth: str  # the switch's end of the host's link (shaped for the host's ingress)
    ifname: str = NIC

    def argv(self, command: list[str]) -> list[str]:
        """`command` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *command]


def prefix_for(key: str) -> str:
    """The namespace prefix of a run: the same key (a run directory) always gives the same prefix, so a
    rerun finds a killed predecessor's leftovers."""
    return f"{ROOT_PREFIX}{hashlib.sha1(key.encode()).hexdigest()[:6]}-"


def unavailable() -> str | None:
    """Why namespace hosts cannot run here, in one line; None when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or use the default loopback hosts)"
    for tool in ("ip", "tc"):
        if not any(os.access(os.path.join(d, tool), os.X_OK) for d in os.environ.get("PATH", "").split(":")):
            return f"network namespaces need iproute2's `{tool}` on PATH"
    probe = f"{ROOT_PREFIX}probe-{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or 'permission denied'}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def namespaces(prefix: str = ROOT_PREFIX) -> list[str]:
    """Names of the namespaces that start with `prefix`."""
    out = _run(["ip", "-j", "netns", "list"], check=False).stdout.strip()
    try:
        names = [n["name"] for n in json.loads(out)] if out else []
    except (ValueError, KeyError, TypeError):
        names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def pids_in(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace(ns: str, grace: float = 0.0) -> None:
    """Kill every process in `ns` (SIGTERM first when `grace` > 0, then SIGKILL) and delete it."""
    if grace > 0:
        _signal_all(pids_in(ns), signal.SIGTERM)
        deadline = time.monotonic() + grace
        while pids_in(ns) and time.monotonic() < deadline:
            time.sleep(0.05)
    for _ in range(50):
        left = pids_in(ns)
        if not left:
            break
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.02)
    _run(["ip", "netns", "del", ns], check=False)


def cleanup(prefix: str = ROOT_PREFIX, grace: float = 0.0) -> list[str]:
    """Remove every namespace with `prefix` and its processes (a killed run's leftovers); the names."""
    gone = namespaces(prefix)
    for ns in gone:  # hosts first, the switch last (a veth dies with either end's namespace)
        if not ns.endswith("-sw"):
            kill_namespace(ns, grace)
    for ns in gone:
        if ns.endswith("-sw"):
            kill_namespace(ns, grace)
    if gone:
        logger.info("removed network namespaces %s", ", ".join(gone))
    return gone


class Network:
    """The namespace hosts of one run. Use as a context manager, or call `close()`."""

    def __init__(self, prefix: str, gbps: float | None = None, latency_ms: float | None = None) -> None:
        if not prefix.startswith(ROOT_PREFIX) or len(prefix) > 20:
            raise ValueError(f"prefix must start with {ROOT_PREFIX!r} and be short, got {prefix!r}")
        if gbps is not None and not gbps > 0:
            raise ValueError(f"--nic-gbps must be > 0, got {gbps}")
        if latency_ms is not None and not latency_ms >= 0:
            raise ValueError(f"--nic-latency-ms must be >= 0, got {latency_ms}")
        why = unavailable()
        if why:
            raise NetnsError(why)
        self.prefix, self.gbps, self.latency_ms = prefix, gbps, latency_ms
        self.hosts: dict[str, Host] = {}
        self._made = 0  # hosts ever added: a deleted host's address and veth name are never reused
        self.switch = f"{prefix}sw"
        cleanup(prefix)  # a killed run of the same prefix
        try:
            self._ip("netns", "add", self.switch)
            self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.switch, "link", "set", "br0", "up")
        except NetnsError:
            self.close()
            raise

    # -- hosts -------------------------------------------------------------------------------------------
    def add_host(self, name: str, shaped: bool = True) -> Host:
        """A new namespace host `name` on the bridge, with the next free address; shaped as the run says
        unless `shaped` is off (a controller's namespace)."""
        if name in self.hosts:
            return self.hosts[name]
        if not name.replace("_", "").isalnum() or len(name) > 8:
            raise ValueError(f"host names are short and alphanumeric, got {name!r}")
        index = self._made + 1
        if index > MAX_HOSTS:
            raise NetnsError(f"at most {MAX_HOSTS} namespace hosts")
        host = Host(name, f"{self.prefix}{name}", f"{SUBNET}.{index}", f"v{index}")
        self._made = index
        try:
            self._ip("netns", "add", host.ns)
            veth = ["type", "veth", "peer", "name", NIC, "netns", host.ns]
            self._ip("-n", self.switch, "link", "add", host.veth, *veth)
            self._ip("-n", self.switch, "link", "set", host.veth, "master", "br0", "up")
            self._ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", NIC)
            self._ip("-n", host.ns, "link", "set", NIC, "up")
            self._ip("-n", host.ns, "link", "set", "lo", "up")
            if shaped:
                self._shape(host.ns, NIC)  # the host's egress
                self._shape(self.switch, host.veth)  # the host's ingress
        except NetnsError:
            kill_namespace(host.ns)
            raise
        self.hosts[name] = host
        return host

    def _shape(self, ns: str, dev: str) -> None:
        parent = ["root"]
        if self.latency_ms:
            try:
                self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                         f"{self.latency_ms}ms", "limit", "100000")  # fmt: skip
            except NetnsError as e:
                if "unknown" in str(e):
                    raise NetnsError(
                        "--nic-latency-ms needs the kernel's netem qdisc, which this one lacks"
                    ) from None
                raise
            parent = ["parent", "1:1"]
        if self.gbps:
            rate = self.gbps * 1e9 / 8  # bytes/s
            burst, latency = max(TBF_MIN_BURST, int(rate * TBF_BURST_S)), f"{TBF_LATENCY_MS}ms"
            self._tc(ns, "qdisc", "add", "dev", dev, *parent, "handle", "2:", "tbf", "rate",
                     f"{int(self.gbps * 1e9)}bit", "burst", str(burst), "latency", latency)  # fmt: skip

    def popen(self, name: str, command: list[str], **kw) -> subprocess.Popen:
        """Start `command` inside host `name` (its own network; the machine's files and shared memory).
        Returns once the process is inside the namespace, so a host failure right after it kills it."""
        ns = self.hosts[name].ns
        proc = subprocess.Popen(self.hosts[name].argv(command), **kw)
        want = os.stat(f"/run/netns/{ns}").st_ino
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if os.stat(f"/proc/{proc.pid}/ns/net").st_ino == want:
                    break
            except FileNotFoundError:
                break
            time.sleep(0.002)
        return proc

    def run(self, name: str, command: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.hosts[name].argv(command), capture_output=True, text=True, timeout=timeout)

    def start_store(
        self,
        name: str,
        token_file: str,
        log: str,
        memory_limit: str = "8GiB",
        extra: list[str] | None = None,
        timeout: float = 30.0,
    ) -> tuple[str, subprocess.Popen]:
        """A tensor store inside host `name`, bound to the host's address (so a token is required), on
        the default port (every host has its own ports); (URL, process) once it announced itself."""
        host = self.hosts[name]
        cmd = [sys.executable, "-m", "tenplex.store", "--host", host.addr, "--port", str(DEFAULT_PORT),
               "--memory-limit", memory_limit, "--token-file", token_file, *(extra or [])]  # fmt: skip
        start = len(logged_stores(log))
        with open(log, "a") as out:
            proc = self.popen(name, cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            ready = logged_stores(log)[start:]
            if ready:
                return ready[0][0], proc
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        tail = (Path(log).read_text()[-300:].strip().splitlines() or [""])[-1]
        raise NetnsError(f"the store on {name} did not start (exit {proc.returncode}): {tail}")

    def counters(self, name: str) -> dict[str, int]:
        """The host's bytes in and out, from its interface's counters."""
        ns = self.hosts[name].ns
        out = self._ip("-n", ns, "-j", "-s", "link", "show", "dev", NIC)
        stats = json.loads(out)[0]["stats64"]
        return {"bytes_in": int(stats["rx"]["bytes"]), "bytes_out": int(stats["tx"]["bytes"])}

    def partition(self, name: str) -> None:
        """Cut host `name` off (its switch port down); its processes keep running."""
        self._ip("-n", self.switch, "link", "set", self.hosts[name].veth, "down")

    def heal(self, name: str) -> None:
        """Bring a cut-off host's link back."""
        self._ip("-n", self.switch, "link", "set", self.hosts[name].veth, "up")

    def kill_host(self, name: str) -> None:
        """A host failure: every process in its namespace is killed and the namespace deleted. The other
        hosts then get "unreachable" for its address at once, as from a router that withdrew its route
        (on one bridge, each connection attempt would otherwise wait out ARP: about 3 s)."""
        host = self.hosts.pop(name, None)
        if host is None:
            return
        kill_namespace(host.ns)
        for other in self.hosts.values():
            _run(["ip", "-n", other.ns, "route", "add", "unreachable", f"{host.addr}/32"], check=False)

    def describe(self) -> dict[str, dict]:
        return {n: {"addr": h.addr, "ns": h.ns, "ifname": h.ifname} for n, h in self.hosts.items()}

    def close(self, grace: float = 2.0) -> None:
        """Stop every process in the run's namespaces and delete them."""
        for name in list(self.hosts):
            kill_namespace(self.hosts.pop(name).ns, grace)
        cleanup(self.prefix)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- iproute2 ----------------------------------------------------------------------------------------
    @staticmethod
    def _ip(*args: str) -> str:
        return _run(["ip", *args]).stdout

    @staticmethod
    def _tc(ns: str, *args: str) -> str:
        return _run(["tc", "-n", ns, *args]).stdout


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(argv)}: {e}") from None
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tenplex.runtime.netns", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cleanup", help="remove tenplex's namespaces and their processes")
    c.add_argument("--run-dir", help="only this run directory's (default: every tenplex namespace)")
    sub.add_parser("list", help="list tenplex's namespaces")
    sub.add_parser("check", help="say whether namespace hosts can run here")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"tenplex: {why}", file=sys.stderr)
        return 2
    if args.cmd == "check":
        print("network namespaces: available")
    elif args.cmd == "list":
        print("\n".join(namespaces()) or "(none)")
    else:
        prefix = prefix_for(str(Path(args.run_dir).resolve())) if args.run_dir else ROOT_PREFIX
        gone = cleanup(prefix, grace=1.0)
        print(f"removed {len(gone)} namespace(s)" + (f": {', '.join(gone)}" if gone else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
