"""Settings: sizes with units, and the ATTNSERVE_* variables that are no setting."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from attnserve.config import GiB, MiB, Settings, format_size, parse_size, unknown_env

SIZE_FIELDS = ["memory_budget_bytes", "max_body_bytes", "offload_bytes", "quota_bytes_per_key", "pool_slab_bytes"]


@pytest.mark.parametrize(
    "text, n",
    [
        ("8GiB", 8 * GiB),
        ("512MiB", 512 * MiB),
        ("64k", 65536),
        ("64K", 65536),
        ("64KiB", 65536),
        ("1.5g", 3 * GiB // 2),
        ("2 TiB", 2 << 40),
        ("10MB", 10_000_000),
        ("3kb", 3000),
        ("123", 123),
        ("0", 0),
        (" 4096 ", 4096),
        ("7b", 7),
        ("1m", MiB),
    ],
)
def test_sizes(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["lots", "8 GiBs", "-1", "1.3333b", "0x10", "", "k"])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("field", SIZE_FIELDS)
def test_every_size_setting_takes_units_as_a_variable_or_an_argument(field, monkeypatch):
    monkeypatch.setenv("ATTNSERVE_" + field.upper(), "2MiB")
    assert getattr(Settings(), field) == 2 * MiB
    assert getattr(Settings(**{field: "3MiB"}), field) == 3 * MiB
    assert getattr(Settings(**{field: 4 * MiB}), field) == 4 * MiB  # plain integers keep working
    assert getattr(Settings(**{field: "5242880"}), field) == 5 * MiB
    monkeypatch.setenv("ATTNSERVE_" + field.upper(), "two megs")
    with pytest.raises(ValidationError, match=field):
        Settings()


def test_every_bytes_field_is_a_size():
    sizes = [
        f
        for f, info in Settings.model_fields.items()
        if any(getattr(m, "func", None) is parse_size for m in info.metadata)
    ]
    assert sorted(f for f in Settings.model_fields if "bytes" in f) == sorted(sizes) == sorted(SIZE_FIELDS)


def test_format_size():
    assert [format_size(n) for n in (8 * GiB, 64 * MiB, 262144, 1000, 0)] == ["8GiB", "64MiB", "256KiB", "1000", "0"]


def test_unknown_variables_are_found_with_the_closest_setting():
    env = {
        "ATTNSERVE_PORT": "1",
        "ATTNSERVE_PORTT": "1",
        "attnserve_memory_budget": "x",
        "ATTNSERVE_API_KEY": "k",
        "ATTNSERVE_ZZZ": "1",
        "ATTNSERVE_TEST_URL": "u",
        "ATTNSERVE_HEALTHCHECK_TIMEOUT_S": "3",
        "PATH": "/bin",
        "attnserve_log_level": "debug",
    }
    assert unknown_env(env) == [
        ("ATTNSERVE_API_KEY", "ATTNSERVE_API_KEYS"),
        ("ATTNSERVE_PORTT", "ATTNSERVE_PORT"),
        ("ATTNSERVE_ZZZ", None),
        ("attnserve_memory_budget", "ATTNSERVE_MEMORY_BUDGET_BYTES"),
    ]


def test_the_docs_table_has_every_setting_and_nothing_else():
    import re
    from pathlib import Path

    from attnserve.config import env_name

    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    text = text.split("\n## Running the server\n", 1)[1].split("\n## ", 1)[0]  # its section only
    table = re.findall(r"^\| `(ATTNSERVE_[A-Z_]+)` \|", text, re.MULTILINE)
    assert sorted(table) == sorted(env_name(f) for f in Settings.model_fields)
    assert len(table) == len(set(table))


def test_the_kernel_policy_comes_from_the_settings():
    """The engine owns one KernelPolicy, built from ATTNSERVE_KERNELS and
    ATTNSERVE_SPLIT_TARGET_WORKGROUPS; batches are planned with it."""
    from attnserve.app import open_engine
    from attnserve.gpu.device import DeviceError

    try:
        engine = open_engine(Settings(kernels="single", split_target_workgroups=7))
    except DeviceError as e:
        from _core import no_adapter

        no_adapter(str(e))
    try:
        assert engine.policy.force == "single" and engine.policy.target_workgroups == 7
        assert engine.worker.policy is engine.policy
    finally:
        engine.close()
    with pytest.raises(ValueError):
        Settings(kernels="fastest")
