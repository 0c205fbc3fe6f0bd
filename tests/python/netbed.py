"""Hosts on one machine: Linux network namespaces joined by a bridge, for the scale-out tests
(tests/python/test_scale_out.py) and bench/scale_out_bench.py.

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
    bed.cpu_limit("R", 0.05)                # R's processes get 5 % of a core
    bed.close()                             # every process killed, every namespace removed

`Cluster` builds the bed the scale-out tests and bench/scale_out_bench.py use: Redis, Quern hosts,
HAProxy and a producer host.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and `ip` from iproute2.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

from quern_testing import wait_until

PREFIX = "qnb"
SUBNET = "198.18.0"
LOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netbed_load.py")
CHECK_INTER_MS = 300  # HAProxy's health check interval; a server is down after 2 failed checks
CLAIM_IDLE_MS = 1500  # a job its consumer left unacknowledged this long is taken over


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
    root, _ = _cpu_cgroups()
    if root:
        for name in os.listdir(root):
            m = re.fullmatch(rf"{PREFIX}(\d+)-\S+", name)
            if m and not os.path.exists(f"/proc/{m.group(1)}"):
                _remove_cgroup(os.path.join(root, name))


def _cpu_cgroups():
    """(directory under which CPU-limited groups are made, "v1" or "v2"), or (None, None)."""
    if os.path.exists("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        return "/sys/fs/cgroup/cpu", "v1"
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        try:
            with open(os.path.join(root, "cgroup.controllers")) as f:
                if "cpu" in f.read().split():
                    return root, "v2"
        except OSError:
            pass
    return None, None


def cpu_limits_available():
    """Why hosts cannot be slowed in CPU here, or None."""
    root, _ = _cpu_cgroups()
    return None if root else "no cgroup CPU controller (cgroup v1 cpu or v2 with cpu)"


def _remove_cgroup(path):
    deadline = time.time() + 5
    while os.path.exists(path):
        try:
            os.rmdir(path)
        except OSError:
            if time.time() > deadline:
                return
            time.sleep(0.05)


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
        self.cgroups = []
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

    def cpu_limit(self, host, fraction):
        """Gives the processes now running in `host` `fraction` of one core between them (a cgroup
        CPU quota over 100 ms periods: past it, they wait for the next period); None lifts it."""
        root, kind = _cpu_cgroups()
        if root is None:
            raise RuntimeError(cpu_limits_available())
        path = os.path.join(root, self.ns(host))
        os.makedirs(path, exist_ok=True)
        if path not in self.cgroups:
            self.cgroups.append(path)
        quota = -1 if fraction is None else max(1000, int(fraction * 100000))
        if kind == "v1":
            with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
                f.write("100000")
            with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(quota))
        else:
            try:
                with open(os.path.join(root, "cgroup.subtree_control"), "w") as f:
                    f.write("+cpu")
            except OSError:
                pass  # enabled already, or by whoever owns the hierarchy
            with open(os.path.join(path, "cpu.max"), "w") as f:
                f.write(f"{'max' if quota < 0 else quota} 100000")
        for pid in _ip("netns", "pids", self.ns(host)).stdout.split():
            try:
                with open(os.path.join(path, "cgroup.procs"), "w") as f:
                    f.write(pid)
            except ProcessLookupError:
                pass

    def cpu_throttled(self, host):
        """How many periods `host`'s processes were stopped at their quota (cpu.stat nr_throttled)."""
        root, _ = _cpu_cgroups()
        with open(os.path.join(root, self.ns(host), "cpu.stat")) as f:
            return int(dict(line.split() for line in f)["nr_throttled"])

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
        for path in self.cgroups:
            _remove_cgroup(path)  # empty once its processes are gone
        self.cgroups.clear()
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


PACKAGING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "packaging")
HAPROXY_CFG = os.path.join(PACKAGING, "haproxy", "haproxy.cfg")
REDIS_CONF = os.path.join(PACKAGING, "redis", "redis.conf")
SENTINEL_CONF = os.path.join(PACKAGING, "redis", "sentinel.conf")


def haproxy_config(path, address, servers, socket_path, check_inter_ms):
    """The HAProxy configuration at `path` for a bed: `bind :PORT` on `address`, each backend's
    `server` lines replaced by one per (name, address) in `servers` (the first line's port and
    options kept), the stats socket at `socket_path`, checks every `check_inter_ms`."""
    out, done = [], set()
    backend = None
    for line in open(path).read().splitlines():
        words = line.split()
        if words[:1] == ["backend"]:
            backend = words[1]
        if words[:2] == ["stats", "socket"]:
            line = f"  stats socket {socket_path} " + " ".join(words[3:])
        elif words[:1] == ["bind"] and words[1].startswith(":"):
            line = f"  bind {address}{words[1]} " + " ".join(words[2:])
        elif words[:1] == ["default-server"]:
            line = re.sub(r"\binter \S+", f"inter {check_inter_ms}ms", line)
        elif words[:1] == ["server"]:
            if backend in done:
                continue
            done.add(backend)
            port = words[2].rsplit(":", 1)[1]
            line = "\n".join(f"  server {name} {addr}:{port} " + " ".join(words[3:]) for name, addr in servers)
        out.append(line)
    return "\n".join(out) + "\n"


class Cluster:
    """Host R runs redis-server (append-only, fsync always), hosts Q1..Qn `quern serve --consume`
    on a repository holding add_sub, host L HAProxy in front of the Qs' HTTP ports (health checks
    on /v2/health/ready), and host P the producers and clients (netbed_load.py). This program
    reaches Redis and HAProxy through Unix sockets (it has no leg in the bed), the rest through P.
    `batch_delay_us`: add_sub's batching delay (with one, every host holds jobs it took and has not
    computed, so a kill is always mid-batch)."""

    def __init__(self, tmp, quern, models, hosts=3, haproxy=True, batch_delay_us=100000, sentinel=False):
        self.tmp = tmp
        self.sentinel = sentinel
        self.quern_bin = quern
        self.repo = tmp / "repo"
        self.repo.mkdir()
        shutil.copytree(os.path.join(models, "add_sub"), self.repo / "add_sub")
        (self.repo / "add_sub" / "config.pbtxt").write_text(
            f"max_batch_size: 16\ndynamic_batching {{ max_queue_delay_microseconds: {batch_delay_us} }}\n")
        self.bed = NetBed()
        self.logs = {}
        self.quern = {}
        try:
            self.r = self.bed.host("R")
            self.p = self.bed.host("P")
            self.l_addr = self.bed.host("L")
            self.start_redis()
            if sentinel:
                self.r2 = self.bed.host("R2")
                self.start_redis("R2", replica_of=self.r)
                wait_until(lambda: self.client().info("replication").get("slave0", {}).get("state") == "online",
                           what="the replica on R2 in sync")
                self.start_sentinels(("R", "R2", "L"))
            for k in range(1, hosts + 1):
                self.add_quern(f"Q{k}")
            if haproxy:
                self.start_haproxy([f"Q{k}" for k in range(1, hosts + 1)])
        except BaseException:
            self.close()
            raise

    # ---- Redis on R (and with sentinels a replica on R2): TCP for the hosts, a Unix socket for
    # this test (it has no leg in the bed)
    def start_redis(self, host="R", replica_of=None):
        """Starts (or starts again) redis-server on `host`; returns its process."""
        sock = self.redis_socket(host)
        data = self.tmp / f"redis-{host}"
        data.mkdir(exist_ok=True)
        if os.path.exists(sock):
            os.unlink(sock)  # left by a killed server
        # A copy of packaging/redis/redis.conf (append-only, fsync always; Redis rewrites the file it
        # was started with when Sentinel changes its role) with this bed's address and files.
        conf = self.tmp / f"redis-{host}.conf"
        if not conf.exists():
            shutil.copyfile(REDIS_CONF, conf)
        argv = ["redis-server", str(conf), "--bind", self.bed.addr(host), "--port", "6379", "--protected-mode", "no",
                "--unixsocket", sock, "--unixsocketperm", "700", "--dir", str(data), "--daemonize", "no",
                "--repl-diskless-sync-delay", "0"]
        if replica_of:
            argv += ["--replicaof", replica_of, "6379"]
        proc = self.bed.run(host, argv, stdout=open(self.tmp / f"redis-{host}.log", "a"), stderr=subprocess.STDOUT)
        if host == "R":
            self.redis = proc

        def answers():
            import redis
            try:
                return os.path.exists(sock) and self.client(host).ping()
            except redis.RedisError:
                return False
        wait_until(answers, what=f"redis on {host}")
        return proc

    def redis_socket(self, host="R"):
        return str(self.tmp / f"redis-{host}.sock")

    def client(self, host="R"):
        """A client of the redis-server on `host`; with sentinels, host=None is the current master."""
        import redis
        if host is None:
            host = {self.bed.addr(h): h for h in self.bed.hosts}[self.master()]
        return redis.Redis(unix_socket_path=self.redis_socket(host), socket_timeout=5)

    # ---- Redis Sentinel: one on each of `hosts`, watching the master "quern" on R (quorum 2,
    # down after 1 s)
    SENTINEL_PORT = 26379
    MASTER = "quern"

    def start_sentinels(self, hosts):
        self.sentinel_hosts = list(hosts)
        for h in hosts:
            cfg = self.tmp / f"sentinel-{h}.conf"  # sentinel rewrites its file as it learns
            # packaging/redis/sentinel.conf with this bed's addresses and shorter timeouts.
            text = open(SENTINEL_CONF).read()
            text = text.replace("10.0.0.21", self.r).replace(f"port 26379", f"port {self.SENTINEL_PORT}")
            text = text.replace("down-after-milliseconds quern 5000", "down-after-milliseconds quern 1000")
            text = text.replace("failover-timeout quern 60000", "failover-timeout quern 10000")
            assert f"sentinel monitor {self.MASTER} {self.r} 6379 2" in text, text
            cfg.write_text(f"bind {self.bed.addr(h)}\nprotected-mode no\ndir {self.tmp}\n" + text)
            self.bed.run(h, ["redis-sentinel", str(cfg)], stdout=open(self.tmp / f"sentinel-{h}.log", "w"),
                         stderr=subprocess.STDOUT)
        # Ready when every sentinel knows the replica and the other sentinels.
        wait_until(lambda: all(self.sentinel_ask(h, "SENTINEL", "master", self.MASTER).count("\n") > 0 and
                               self._sentinel_field(h, "num-other-sentinels") == str(len(hosts) - 1) and
                               self._sentinel_field(h, "num-slaves") == "1" for h in hosts),
                   timeout=30, what="sentinels to find each other and the replica")

    def sentinel_ask(self, host, *command):
        rc, out, err = self.bed.call("P", ["redis-cli", "-h", self.bed.addr(host), "-p", str(self.SENTINEL_PORT),
                                           *command], timeout=10)
        return out if rc == 0 else ""

    def _sentinel_field(self, host, field):
        lines = self.sentinel_ask(host, "SENTINEL", "master", self.MASTER).split("\n")
        for k in range(0, len(lines) - 1):
            if lines[k] == field:
                return lines[k + 1]
        return None

    def master(self, host=None):
        """The master's address as a sentinel names it now."""
        out = self.sentinel_ask(host or self.sentinel_hosts[0], "SENTINEL", "get-master-addr-by-name", self.MASTER)
        return out.split("\n")[0] if out else None

    def redis_url(self):
        if not self.sentinel:
            return f"redis://{self.r}:6379"
        hosts = ",".join(f"{self.bed.addr(h)}:{self.SENTINEL_PORT}" for h in self.sentinel_hosts)
        return f"redis+sentinel://{hosts}/{self.MASTER}?wait_replicas=1&wait_timeout_ms=200"

    # ---- Quern hosts
    def add_quern(self, name):
        addr = self.bed.addr(name) if name in self.bed.hosts else self.bed.host(name)
        log = open(self.tmp / f"{name}.log", "w")
        self.logs[name] = log
        self.quern[name] = self.bed.run(
            name, [self.quern_bin, "serve", "--model-repository", str(self.repo), "--host", "0.0.0.0", "--http-port", "8000",
                   "--grpc-port", "8001", "--metrics-port", "8002", "--redis-url", self.redis_url(),
                   "--consume", "--consume-models", "add_sub", "--consumer-name", name,
                   "--consume-claim-idle-ms", str(CLAIM_IDLE_MS)],
            stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: self.get(f"http://{addr}:8000/v2/health/ready")[0] == 200, what=f"{name} ready")
        return addr

    def get(self, url):
        """GET from host P: (status, body); status 0 when nothing answered."""
        rc, out, _ = self.bed.call("P", ["curl", "-s", "-m", "3", "-w", "\n%{http_code}", url])
        body, _, code = out.rpartition("\n")
        return (int(code) if code.isdigit() else 0), body

    def metric(self, host, series):
        status, text = self.get(f"http://{self.bed.addr(host)}:8002/metrics")
        if status != 200:
            return None
        for line in text.splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
        return 0.0

    # ---- HAProxy on L
    def start_haproxy(self, hosts):
        """HAProxy on L with packaging/haproxy/haproxy.cfg, the file docs/deploy.md gives: its bind
        lines on L's address, its server lines for `hosts`, its stats socket in tmp and its check
        interval CHECK_INTER_MS; nothing else changed."""
        self.haproxy_sock = str(self.tmp / "haproxy.sock")
        cfg = self.tmp / "haproxy.cfg"
        cfg.write_text(haproxy_config(HAPROXY_CFG, self.l_addr, [(h, self.bed.addr(h)) for h in hosts],
                                      self.haproxy_sock, CHECK_INTER_MS))
        self.haproxy = self.bed.run("L", ["haproxy", "-db", "-f", str(cfg)], stdout=open(self.tmp / "haproxy.log", "w"),
                                    stderr=subprocess.STDOUT)
        wait_until(lambda: all(s == "UP" for s in self.servers().values()) and self.servers(),
                   what="every server UP in haproxy")

    def haproxy_command(self, command):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(3)
        s.connect(self.haproxy_sock)
        s.sendall(command.encode() + b"\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        s.close()
        return out.decode()

    def servers(self):
        """Server name -> status (UP, DOWN, ...) as HAProxy sees it now."""
        try:
            text = self.haproxy_command("show stat")
        except OSError:
            return {}
        lines = [line.split(",") for line in text.splitlines() if line and not line.startswith("#")]
        return {f[1]: f[17].split()[0] for f in lines
                if f[0] == "quern_http" and f[1] not in ("FRONTEND", "BACKEND")}

    # ---- load from P
    def start_load(self, mode, *args):
        return self.bed.run("P", [sys.executable, LOAD, mode, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def jobs(self, count, rate, prefix, wait=60, http_host=None):
        where = ["--redis", f"{self.r}:6379"]
        if http_host:  # posted to that host's HTTP port (durable jobs through the stream)
            where += ["--http", f"{self.bed.addr(http_host)}:8000"]
        if self.sentinel:  # the producer follows failovers too, and counts a job only once a replica has it
            where = ["--sentinel", ",".join(f"{self.bed.addr(h)}:{self.SENTINEL_PORT}" for h in self.sentinel_hosts),
                     "--master", self.MASTER, "--wait-replicas", "1"]
        return self.start_load("jobs", *where, "--count", str(count), "--rate", str(rate), "--prefix", prefix,
                               "--wait", str(wait))

    def infer(self, seconds, concurrency=4, grpc=False):
        """Synchronous requests from P through HAProxy on L: HTTP to :8000, or gRPC to :8001."""
        if grpc:
            return self.start_load("infer", "--grpc", "--url", f"{self.l_addr}:8001", "--seconds", str(seconds),
                                   "--concurrency", str(concurrency))
        return self.start_load("infer", "--url", f"http://{self.l_addr}:8000", "--seconds", str(seconds),
                               "--concurrency", str(concurrency))

    @staticmethod
    def report(proc, timeout=180):
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err[-3000:]
        return json.loads(out)

    def done_counts(self, hosts):
        return {h: self.metric(h, 'quern_stream_entries_total{outcome="done"}') for h in hosts}

    def close(self):
        self.bed.close()
        for log in self.logs.values():
            log.close()
