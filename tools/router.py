"""The router of docker-compose.yml (Debian's nginx with deploy/nginx/attnserve.conf)
on loopback, in front of replicas that already run: the one place that writes its
configuration outside compose (tests/deploy and loadtest/bench.sh use it).

    python -m tools.router --nginx BIN --port PORT --workdir DIR HOST:PORT [HOST:PORT ...]

writes DIR/nginx.conf, checks it (``nginx -t``) and runs nginx in the foreground
(stop it with SIGQUIT or SIGTERM). Only what must differ from compose is written:
the upstream lines (``deploy/nginx/compose/upstreams.conf``'s, each ``host:port``
replaced by a replica's address, its parameters kept; more replicas than compose's
lines take the first line's parameters) and the listen / access_log lines.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROUTING_CONF = ROOT / "deploy" / "nginx" / "attnserve.conf"
COMPOSE_UPSTREAMS = ROOT / "deploy" / "nginx" / "compose" / "upstreams.conf"
SERVER_LINE = re.compile(r"^(\s*server\s+)(\S+)(.*)$", re.M)

__all__ = ["ROUTING_CONF", "COMPOSE_UPSTREAMS", "find_nginx", "upstream_lines", "write_nginx_conf"]


def find_nginx() -> str | None:
    """nginx on PATH or at Debian's path, else None."""
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


def upstream_lines(addresses: list[str]) -> str:
    """The compose upstream lines with the replicas' addresses in place of its hosts:
    the first ``len(compose)`` lines keep their own parameters, further replicas take
    the first line's."""
    compose = COMPOSE_UPSTREAMS.read_text()
    lines = SERVER_LINE.findall(compose)
    if len(addresses) == len(lines):
        it = iter(addresses)
        return SERVER_LINE.sub(lambda m: f"{m.group(1)}{next(it)}{m.group(3)}", compose)
    prefix, _, params = lines[0]
    return "".join(f"{prefix}{a}{params}\n" for a in addresses)


def write_nginx_conf(workdir: Path, addresses: list[str], listen_port: int, access_log: Path) -> tuple[Path, str]:
    """``workdir/nginx.conf`` for replicas at ``addresses``, including
    deploy/nginx/attnserve.conf as it is; returns it and the upstream lines."""
    conf_dir = workdir / "attnserve"
    conf_dir.mkdir()
    upstreams = upstream_lines(addresses)
    (conf_dir / "upstreams.conf").write_text(upstreams)
    (conf_dir / "server.conf").write_text(f"listen 127.0.0.1:{listen_port};\naccess_log {access_log} attnserve;\n")
    temp = workdir / "temp"
    temp.mkdir()
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (temp / sub).mkdir()
        (temp / sub).chmod(0o777)  # nginx's workers run as nobody when started as root
    main = workdir / "nginx.conf"
    workers = "auto" if len(addresses) > 2 else "1"
    main.write_text(
        f"""worker_processes {workers};
pid {workdir}/nginx.pid;
error_log {workdir}/error.log info;
events {{ worker_connections 1024; }}
http {{
    client_body_temp_path {temp}/client_body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    # THE routing configuration of docker-compose.yml's router, unchanged:
    include {ROUTING_CONF};
}}
"""
    )
    return main, upstreams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nginx", default=None, help="the nginx binary (default: on PATH or /usr/sbin/nginx)")
    ap.add_argument("--port", type=int, required=True, help="the router's 127.0.0.1 port")
    ap.add_argument("--workdir", type=Path, required=True, help="an empty folder for its configuration and logs")
    ap.add_argument("addresses", nargs="+", help="the replicas, HOST:PORT")
    args = ap.parse_args(argv)
    nginx = args.nginx or find_nginx()
    if not nginx:
        ap.error("no nginx found: give --nginx")
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.workdir.chmod(0o755)
    conf, _ = write_nginx_conf(args.workdir, args.addresses, args.port, args.workdir / "access.log")
    base = [nginx, "-p", str(args.workdir), "-c", str(conf), "-e", str(args.workdir / "error.log")]
    check = subprocess.run([*base, "-t"], capture_output=True, text=True)
    if check.returncode:
        sys.stderr.write(f"nginx -t refused the configuration:\n{check.stderr}")
        return 1
    os.execv(nginx, [*base, "-g", "daemon off;"])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
