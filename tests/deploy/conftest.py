"""The loopback topology of docker-compose.yml, without Docker.

``topology`` (module scope) runs two real attnserve servers on 127.0.0.1
(``replica-a`` and ``replica-b``, on the wgpu adapter there is: lavapipe in CI)
and Debian's nginx in front of them, with THE routing file of the compose stack,
``deploy/nginx/attnserve.conf``, included as it is. Only what must differ is
written here: the upstream lines (the compose file's
``deploy/nginx/compose/upstreams.conf`` with each ``host:port`` replaced by a
loopback address, parameters kept) and the listen/access_log lines.

nginx is installed with apt-get when missing (CI machines start clean). Without
nginx or an adapter the tests skip on a developer machine and fail under CI.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tools.common import free_port, stop_process
from tools.router import find_nginx, write_nginx_conf

ROOT = Path(__file__).resolve().parents[2]


def unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI needs this: {reason}", pytrace=False)
    pytest.skip(reason)


def ensure_nginx() -> str:
    """The nginx binary; installs Debian's nginx when there is none (root only)."""
    found = find_nginx()
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        unavailable("nginx is not installed (apt-get install nginx) and this user cannot install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", RUNLEVEL="1")  # RUNLEVEL=1: don't start the system nginx
    subprocess.run(["apt-get", "update", "-qq"], env=env, check=False, timeout=300)
    for package in ("nginx", "nginx-light"):
        result = subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if result.returncode == 0 and find_nginx():
            return find_nginx()  # type: ignore[return-value]
    unavailable(f"could not install nginx with apt-get: {result.stderr[-500:]}")
    raise AssertionError  # unreachable


def have_adapter() -> bool:
    code = "import sys, wgpu; sys.exit(0 if wgpu.gpu.enumerate_adapters_sync() else 1)"
    env = dict(os.environ, XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120).returncode == 0


@dataclass
class Replica:
    name: str
    port: int
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")]),
            XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"),
            ATTNSERVE_INSTANCE_NAME=self.name,
            ATTNSERVE_LOG_LEVEL="warning",
            ATTNSERVE_DRAIN_DELAY_S="0",
            ATTNSERVE_MEMORY_BUDGET_BYTES=str(1 << 30),
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attnserve", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=ROOT,
            env=env,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(trust_env=False, timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    break
                try:
                    if http.get(self.url + "/readyz").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        tail = self.log.read_text(errors="replace")[-3000:]
        pytest.fail(f"replica {self.name} on {self.url} did not become ready; its log:\n{tail}", pytrace=False)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        return stop_process(self.proc, timeout)


@dataclass
class Topology:
    router_url: str
    replicas: list[Replica]
    access_log: Path
    workdir: Path
    nginx: subprocess.Popen | None = None
    upstreams_conf: str = ""
    extra: dict = field(default_factory=dict)

    def replica(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.name == name)

    def access_lines(self, settle: float = 0.05, timeout: float = 3.0) -> list[dict[str, str]]:
        """The router's access log, parsed: request, status, upstream, instance, key.
        nginx writes a request's line after the response went out, so a client may
        read the log before its last requests' lines are there: the log is read once
        it has not grown for ``settle`` seconds (at most ``timeout``)."""
        out = []
        pattern = re.compile(
            r'"(?P<request>[^"]*)" (?P<status>\d+) \d+ rt=\S+ urt=\S+ upstream=(?P<upstream>.*?) '
            r"instance=(?P<instance>\S*) key=(?P<key>\S*)$"
        )
        deadline, text = time.monotonic() + timeout, self.access_log.read_text()
        while time.monotonic() < deadline:
            time.sleep(settle)
            again = self.access_log.read_text()
            if again == text:
                break
            text = again
        for line in text.splitlines():
            m = pattern.search(line)
            if m:
                out.append(m.groupdict())
        return out


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError("nginx did not listen in time")


def children_of(pid: int) -> list[int]:
    """The ids of the processes whose parent is ``pid`` (from /proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.fixture(scope="module")
def topology() -> Iterator[Topology]:
    nginx_bin = ensure_nginx()
    if not have_adapter():
        unavailable("no wgpu adapter (install mesa-vulkan-drivers for lavapipe)")
    workdir = Path(tempfile.mkdtemp(prefix="attnserve-router-"))
    workdir.chmod(0o755)
    replicas = [Replica(name, free_port(), workdir / f"{name}.log") for name in ("replica-a", "replica-b")]
    router_port = free_port()
    access_log = workdir / "access.log"
    conf, upstreams = write_nginx_conf(workdir, [r.address for r in replicas], router_port, access_log)
    check = subprocess.run(
        [nginx_bin, "-t", "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "error.log")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, f"nginx -t refused the routing configuration:\n{check.stderr}"
    topo = Topology(f"http://127.0.0.1:{router_port}", replicas, access_log, workdir, upstreams_conf=upstreams)
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_ready()
        topo.nginx = subprocess.Popen(
            [nginx_bin, "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "error.log"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=(workdir / "nginx.stderr").open("wb"),
        )
        try:
            wait_port(router_port, topo.nginx)
        except RuntimeError as exc:
            err = (
                (workdir / "error.log").read_text(errors="replace")[-2000:] if (workdir / "error.log").exists() else ""
            )
            pytest.fail(f"{exc}:\n{err}", pytrace=False)
        yield topo
    finally:
        if topo.nginx is not None and topo.nginx.poll() is None:
            workers = children_of(topo.nginx.pid)
            topo.nginx.send_signal(signal.SIGQUIT)  # graceful stop of master and workers
            try:
                topo.nginx.wait(10)
            except subprocess.TimeoutExpired:
                topo.nginx.kill()
                topo.nginx.wait(5)
                for pid in workers:  # a killed master leaves its workers behind
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for r in replicas:
            r.stop()
        shutil.rmtree(workdir, ignore_errors=True)
