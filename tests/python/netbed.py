"""Hosts on one machine: Linux network namespaces joined by a bridge, for the scale-out tests and
scripts/scale_out.py.

Every host is a namespace with one interface, eth0, whose other end is a port of the bridge br0
in a switch namespace of its own; nothing is added to the namespace this program runs in. The
addresses are 198.18.0.0/24, from the range reserved for benchmarking (RFC 2544), and exist only
inside these namespaces: a packet from a host can reach the other hosts and nothing else (there is
no default route). Namespaces are named `<prefix>-<host>`, the prefix holding this process's pid,
so that a later run removes what a killed run left behind.

    bed = NetBed()
    r = bed.host("R")                      # 198.18.0.1
    p = bed.run("R", ["redis-server", ...])  # the process runs inside R
    bed.link("R", up=False)                 # R's cable pulled out of the switch
    bed.close()                             # every process killed, every namespace removed

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and `ip` from iproute2.
"""
import os
import re
import signal
import subprocess
import time

PREFIX = "qnb"
SUBNET = "198.18.0"


def _ip(*args, check=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def available():
    """Why this machine cannot build hosts, or None when it can."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    try:
        name = f"{PREFIX}probe{os.getpid()}"
        _ip("netns", "add", name)
        _ip("netns", "del", name)
    except (OSError, RuntimeError) as e:
        return f"network namespaces are not available: {e}"
    return None


def remove_leftovers():
    """Namespaces of runs whose process is gone (a run killed before its clean-up)."""
    for line in _ip("netns", "list").stdout.splitlines():
        m = re.match(rf"({PREFIX}(\d+)-\S+)", line)
        if not m:
            continue
        pid = int(m.group(2))
        try:
            os.kill(pid, 0)
            continue  # that run is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _kill_namespace_processes(m.group(1))
        _ip("netns", "del", m.group(1), check=False)


def _kill_namespace_processes(ns):
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class NetBed:
    def __init__(self):
        remove_leftovers()
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = {}  # name -> address
        self.procs = []
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def ns(self, host):
        return f"{self.prefix}-{host}"

    def port(self, host):
        """The switch's port for `host` (interface names are at most 15 characters)."""
        return f"p-{host}"[:15]

    def host(self, name):
        """Adds host `name` with the next address; returns the address."""
        assert name not in self.hosts and re.fullmatch(r"[A-Za-z0-9]{1,8}", name), name
        addr = f"{SUBNET}.{len(self.hosts) + 1}"
        ns = self.ns(name)
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        # Both ends are made in the switch's namespace and one is moved at once: the namespace
        # this program runs in never holds either.
        _ip("-n", self.switch, "link", "add", self.port(name), "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.switch, "link", "set", self.port(name), "master", "br0")
        _ip("-n", self.switch, "link", "set", self.port(name), "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        self.hosts[name] = addr
        return addr

    def addr(self, host):
        return self.hosts[host]

    def run(self, host, argv, **popen):
        """Starts `argv` inside `host` (ip netns exec replaces itself with it: the Popen's pid is
        the program's, so signals reach it directly)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], **popen)
        self.procs.append(p)
        return p

    def call(self, host, argv, timeout=60):
        """Runs `argv` inside `host` to its end: (returncode, stdout, stderr) as text."""
        r = subprocess.run(["ip", "netns", "exec", self.ns(host), *argv], capture_output=True, text=True,
                           timeout=timeout)
        return r.returncode, r.stdout, r.stderr

    def link(self, host, up):
        """Plugs `host`'s cable into the switch or pulls it out (the host keeps its address; what
        it sends meanwhile is lost, and its connections time out or resume)."""
        _ip("-n", self.switch, "link", "set", self.port(host), "up" if up else "down")

    def rate_limit(self, host, kbit):
        """Slows `host`'s link both ways to `kbit` (a token bucket: packets wait their turn, so
        a slow link also delays); None removes the limit."""
        for ns, dev in ((self.ns(host), "eth0"), (self.switch, self.port(host))):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)
            if kbit is not None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                f"{kbit}kbit", "burst", "16kb", "latency", "2s"], check=True, capture_output=True)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for host in list(self.hosts) + ["sw"]:
            ns = self.ns(host)
            _kill_namespace_processes(ns)
            _ip("netns", "del", ns, check=False)
        self.hosts.clear()
        # The namespaces' interfaces go with them; wait until the kernel has let them go so that a
        # next bed starting at once finds nothing of this one.
        deadline = time.time() + 10
        while time.time() < deadline and any(
                line.startswith(self.prefix) for line in _ip("netns", "list").stdout.splitlines()):
            time.sleep(0.05)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
