"""`python -m attnserve serve` as a real process: settings from ATTNSERVE_* variables,
one JSON log line per request, draining on SIGTERM; `attnserve adapters`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from svc_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_") or k == "ATTNSERVE_ADAPTER"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), env.get("PYTHONPATH", "")])
    env.setdefault("XDG_RUNTIME_DIR", "/tmp")
    env.update(extra)
    return env


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    # ready after the default warm-up: seconds, or a minute where nothing is in Mesa's shader cache yet
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")


@pytest.mark.usefixtures("engine")  # needs an adapter: skips without one, fails under CI
def test_serve_settings_logs_and_drain():
    port = free_port()
    env = _env(
        ATTNSERVE_MAX_BODY_BYTES="123456",
        ATTNSERVE_MEMORY_BUDGET_BYTES="1000000",
        ATTNSERVE_MAX_SESSIONS="7",
        ATTNSERVE_DEFAULT_MAX_TOKENS="500",
        ATTNSERVE_DRAIN_DELAY_S="1.5",
        ATTNSERVE_LOG_LEVEL="INFO",
        ATTNSERVE_GC_THRESHOLD="12345",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnserve", "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        limits = httpx.get(url + "/v1/info").json()["limits"]
        assert limits["max_body_bytes"] == 123456 and limits["memory_budget_bytes"] == 1000000
        assert limits["max_sessions"] == 7 and limits["default_max_tokens"] == 500
        headers = {"Authorization": "Bearer s3cr3t-token", "X-Request-ID": "req-cli-1"}
        r = httpx.put(
            url + "/v1/sessions/cli-1", json={"num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 4}, headers=headers
        )
        assert r.status_code == 201 and r.json()["max_tokens"] == 500
        assert r.headers["x-request-id"] == "req-cli-1"
        r = httpx.post(
            url + "/v1/sessions/cli-1/layers/0/kv",
            headers=headers,
            json={"k": [[[0.123456789, 1, 2, 3]]], "v": [[[4, 5, 6, 7]]]},
        )
        assert r.status_code == 200 and r.json() == {"length": 1}
        assert httpx.get(url + "/v1/sessions/cli-1/layers").status_code == 404
        proc.send_signal(signal.SIGTERM)
        # draining: not ready any more, still alive, /v1 refused, until the delay has passed
        deadline = time.monotonic() + 1.0
        saw_draining = False
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(url + "/readyz", timeout=1)
            except httpx.TransportError:
                break
            if ready.status_code == 503:
                assert ready.json()["type"] == "/problems/not-ready"
                assert httpx.get(url + "/livez", timeout=1).status_code == 200
                assert httpx.get(url + "/v1/sessions/cli-1", timeout=1).status_code == 503
                saw_draining = True
                break
            time.sleep(0.05)
        assert saw_draining
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    access = [ln for ln in lines if ln["logger"] == "attnserve.access"]
    put = next(ln for ln in access if ln["method"] == "PUT")
    assert put["route"] == "/v1/sessions/{session_id}" and put["status"] == 201
    assert put["session_id"] == "cli-1" and put["request_id"] == "req-cli-1"
    assert isinstance(put["latency_ms"], float) and put["latency_ms"] >= 0
    append = next(ln for ln in access if ln["method"] == "POST")
    assert append["route"] == "/v1/sessions/{session_id}/layers/{layer}/kv" and append["layer"] == "0"
    missing = next(ln for ln in access if ln["status"] == 404)
    assert missing["route"] == "unmatched" and missing["problem"] == "not-found"
    assert "s3cr3t" not in err and "0.123456789" not in err  # no auth headers, no bodies
    msgs = [ln["msg"] for ln in lines]
    # "ready" once the port listens and the default warm-up (f32) has compiled its kernels
    ready = msgs.index("ready")
    warm = next(i for i, msg in enumerate(msgs) if msg.startswith("kernel warm-up done in "))
    assert msgs.index(f"listening on {url}") < ready and warm < ready and "stopped" in msgs
    assert lines[ready]["urls"] == [url] and lines[ready]["adapter"]["name"]
    collector = next(ln for ln in lines if ln["msg"] == "garbage collector")  # once started: gc_policy
    assert collector["gc_thresholds"][0] == 12345 and collector["frozen"] > 1000
    assert not [ln for ln in lines if ln["level"] == "warning"]  # loopback, no stray variables: no warning


def test_a_busy_port_stops_the_start_naming_the_address():
    with socket.create_server(("127.0.0.1", 0)) as busy:  # listening: the port is taken
        port = busy.getsockname()[1]
        by_option = _run("serve", "--port", str(port))
        by_variable = _run("serve", ATTNSERVE_PORT=str(port))
        # the host set too (as dev.sh does): the port is what to change, and what is named
        with_host = _run("serve", "--host", "127.0.0.1", "--port", str(port))
    hint = "another process listens there: stop it, or choose another port (--port, ATTNSERVE_PORT)"
    runs = ((by_option, f"--port={port}"), (by_variable, f"ATTNSERVE_PORT={port}"), (with_host, f"--port={port}"))
    for proc, source in runs:
        assert proc.returncode == 3
        # one line, before the device is opened: no "ready", nor any log line
        assert proc.stderr.splitlines() == [
            f"attnserve: cannot listen on 127.0.0.1:{port} ({source}): address already in use; {hint}"
        ]


def _run(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attnserve", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(**env),
        timeout=120,
    )


def test_serve_refuses_bad_settings_naming_what_the_user_set():
    proc = _run("serve", ATTNSERVE_MAX_BODY_BYTES="lots")
    assert proc.returncode == 2
    assert proc.stderr.startswith("attnserve: ATTNSERVE_MAX_BODY_BYTES=lots: not a size")
    proc = _run("serve", "--port", "abc", ATTNSERVE_PORT="8001", ATTNSERVE_MAX_SESSIONS="many")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "attnserve: --port=abc: not an integer",
        "attnserve: ATTNSERVE_MAX_SESSIONS=many: not an integer",
    ]
    proc = _run("serve", "--metrics-auth", ATTNSERVE_DRAIN_DELAY_S="soon")
    assert proc.stderr == "attnserve: ATTNSERVE_DRAIN_DELAY_S=soon: not a number\n"


def test_a_bad_key_is_named_by_its_variable_never_shown():
    proc = _run("serve", ATTNSERVE_API_KEYS="fine-key,leaked key-9f2")
    assert proc.returncode == 2
    assert proc.stderr == (
        "attnserve: ATTNSERVE_API_KEYS: key #2 is not 1 to 4096 visible ASCII characters without spaces\n"
    )
    proc = _run("serve", "--api-keys-file", "/no/such/keys", ATTNSERVE_API_KEYS="fine-key-9f2")
    assert proc.returncode == 2 and "fine-key-9f2" not in proc.stderr
    assert proc.stderr.startswith("attnserve: --api-keys-file=/no/such/keys: cannot read")


def test_version():
    from attnserve import __version__

    proc = _run("--version")
    assert proc.returncode == 0 and proc.stdout == f"attnserve {__version__}\n"


def test_every_setting_is_an_option_with_its_variable_and_built_in_default():
    from attnserve.config import Settings, env_name

    # a variable set in the environment must not show up as the default
    proc = _run("serve", "--help", ATTNSERVE_MAX_SESSIONS="777", ATTNSERVE_MEMORY_BUDGET_BYTES="12345")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    for name, field in Settings.model_fields.items():
        if name == "api_keys":  # a secret: no option (it would show in ps); its variable is named
            assert "--api-keys " not in text and "ATTNSERVE_API_KEYS," in text
            continue
        flag = "--" + name.replace("_", "-")
        assert f"{flag} " in text and f"[{env_name(name)}; default: " in text, name
        assert " ".join(field.description.split()) in text, name
    assert "[ATTNSERVE_MAX_SESSIONS; default: 1024]" in text and "777" not in text
    assert "[ATTNSERVE_MEMORY_BUDGET_BYTES; default: 8GiB]" in text and "12345" not in text
    # a size says it takes a unit, and shows its default in one (pydantic-settings' CLI: "int", "8589934592")
    assert "--memory-budget-bytes SIZE " in text and "[ATTNSERVE_OFFLOAD_BYTES; default: 256KiB]" in text


@pytest.mark.parametrize("argv", [["--api-keys", "k-1f3"], ["--api-keys=k-1f3"], ["--api-keys"]])
def test_api_keys_have_no_option(argv, capsys):
    """A key on a command line is visible to every user of the machine (ps): ``--api-keys``
    is refused, its value never shown, not just left out of the help (pydantic-settings'
    CliSuppress hides an option but still takes it), nor read as an abbreviation of
    ``--api-keys-file`` (argparse's prefix matching)."""
    from attnserve import cli

    parser = cli.build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["serve", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "k-1f3" not in err
    assert err.endswith(
        "error: --api-keys is no option: a command line is visible to every user (ps); "
        "set ATTNSERVE_API_KEYS or name a file of them with --api-keys-file\n"
    )
    assert not hasattr(parser.parse_args(["serve"]), "api_keys")


def test_a_bad_size_is_named_by_the_flag_or_variable_that_set_it(monkeypatch):
    from pydantic import ValidationError

    from attnserve import cli
    from attnserve.config import Settings

    monkeypatch.setenv("ATTNSERVE_QUOTA_BYTES_PER_KEY", "0.5b")
    args = cli.build_parser().parse_args(["serve", "--max-body-bytes", "1,5g", "--memory-budget-bytes", "8GiB"])
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    with pytest.raises(ValidationError) as e:
        Settings(**given)
    assert cli.settings_errors(e.value, given, {"ATTNSERVE_QUOTA_BYTES_PER_KEY": "0.5b"}) == [
        "--max-body-bytes=1,5g: not a size: an integer, or a number with a unit such as 64k, 512MiB, 8GiB, 10MB",
        "ATTNSERVE_QUOTA_BYTES_PER_KEY=0.5b: not a whole number of bytes: 0.5b",
    ]


def test_options_reach_the_settings(monkeypatch):
    from attnserve import cli

    seen = {}

    def fake_serve(args):
        from attnserve.config import Settings

        seen["settings"] = Settings(
            **{k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
        )
        return 0

    monkeypatch.setenv("ATTNSERVE_MAX_QUEUE", "99")
    parser = cli.build_parser()
    args = parser.parse_args(
        [
            "serve",
            "--memory-budget-bytes",
            "1GiB",
            "--max-body-bytes",
            "64k",
            "--metrics-auth",
            "--log-format",
            "text",
            "--session-ttl-seconds",
            "2.5",
            "--instance-name",
            "r1",
            "--warmup",
            "f32,tq4",
            "--warmup-shapes",
            "8x2x64",
            "--quota-bytes-per-key",
            "1048576",
        ]
    )
    fake_serve(args)
    s = seen["settings"]
    assert s.memory_budget_bytes == 1 << 30 and s.max_body_bytes == 65536 and s.quota_bytes_per_key == 1 << 20
    assert s.metrics_auth is True and s.log_format == "text" and s.session_ttl_seconds == 2.5
    assert s.instance_name == "r1" and s.max_queue == 99  # the variable still counts where no option is given
    assert s.warmup_formats() == ("f32", "tq4") and s.warmup_shape_list() == [(8, 2, 64)]
    assert parser.parse_args(["serve", "--no-metrics-auth"]).metrics_auth is False
    assert parser.parse_args(["serve"]).metrics_auth is None  # not given: the variable decides


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.8.0.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("example.org", False),
    ],
)
def test_loopback_hosts(host, loopback):
    from attnserve.cli import is_loopback

    assert is_loopback(host) is loopback


@pytest.mark.usefixtures("engine")
def test_serve_without_a_matching_adapter_exits_with_the_reason():
    proc = subprocess.run(
        [sys.executable, "-m", "attnserve", "serve", "--port", str(free_port()), "--adapter", "no-such-gpu-anywhere"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert proc.returncode == 3
    # one line that says why and names the option, no traceback
    assert proc.stderr.startswith(
        "attnserve: cannot open a GPU device (--adapter=no-such-gpu-anywhere): "
        "no adapter matches 'no-such-gpu-anywhere'; available: [0] "
    )
    assert len(proc.stderr.splitlines()) == 1
    proc = _run("serve", "--port", str(free_port()), ATTNSERVE_ADAPTER="no-such-gpu-anywhere")
    assert proc.returncode == 3 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("attnserve: cannot open a GPU device (ATTNSERVE_ADAPTER=no-such-gpu-anywhere)")


@pytest.mark.usefixtures("engine")
def test_serve_warns_of_misspelled_variables_and_of_serving_everyone():
    port = free_port()
    env = _env(
        ATTNSERVE_MAX_SESION="3",
        ATTNSERVE_NOT_A_THING="x",
        ATTNSERVE_TEST_WHATEVER="1",
        ATTNSERVE_API_KEY="client-side-key-5e1",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnserve", "serve", "--host", "0.0.0.0", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/info").json()["auth"] is False
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    warnings = [ln for ln in map(json.loads, err.splitlines()) if ln["level"] == "warning"]
    assert [(w["variable"], w["did_you_mean"]) for w in warnings if "variable" in w] == [
        ("ATTNSERVE_API_KEY", "ATTNSERVE_API_KEYS"),
        ("ATTNSERVE_MAX_SESION", "ATTNSERVE_MAX_SESSIONS"),
        ("ATTNSERVE_NOT_A_THING", None),
    ]
    assert warnings[1]["msg"] == (
        "ATTNSERVE_MAX_SESION is not a setting and is ignored; did you mean ATTNSERVE_MAX_SESSIONS?"
    )
    open_warning = [w for w in warnings if w["msg"].startswith("no API keys:")]
    assert len(open_warning) == 1 and "0.0.0.0" in open_warning[0]["msg"]
    assert "client-side-key-5e1" not in err


@pytest.mark.usefixtures("engine")
def test_adapters_lists_them():
    proc = subprocess.run(
        [sys.executable, "-m", "attnserve", "adapters", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    adapters = json.loads(proc.stdout)
    assert adapters and {"index", "name", "backend", "adapter_type"} <= set(adapters[0])
