"""Settings: sizes with units, and the ATTNSERVE_* variables that are no setting."""

from __future__ import annotations

import pytest
from pydantic import ByteSize, TypeAdapter, ValidationError

from attnserve.config import GiB, MiB, Settings, format_size, parse_size, unknown_env

SIZE_FIELDS = [
    "memory_budget_bytes",
    "max_body_bytes",
    "offload_bytes",
    "quota_bytes_per_key",
    "pool_slab_bytes",
    "shm_max_region_bytes",
    "batch_arena_bytes",
    "stream_max_in_flight_bytes",
    "stream_max_unsent_bytes",
]


# Every form a size has been documented or accepted in, with what it has always meant:
# pydantic's ByteSize reads the numbers, but k, m, g, t alone stay powers of 1024 (ByteSize
# reads them as powers of 1000; test_the_short_forms_are_binary_unlike_byte_sizes).
@pytest.mark.parametrize(
    "text, n",
    [
        ("8GiB", 8 * GiB),
        ("8gib", 8 * GiB),
        ("512MiB", 512 * MiB),
        ("64k", 65536),
        ("64K", 65536),
        ("64 k", 65536),
        ("64ki", 65536),
        ("64KiB", 65536),
        ("64kib", 65536),
        ("64kb", 64000),
        ("64KB", 64000),
        ("3kB", 3000),
        ("1.5g", 3 * GiB // 2),
        ("1.5G", 3 * GiB // 2),
        ("1.5gb", 1_500_000_000),
        ("0.5k", 512),
        ("1 GiB", GiB),
        ("2 TiB", 2 << 40),
        ("1t", 1 << 40),
        ("10MB", 10_000_000),
        ("10mb", 10_000_000),
        ("10M", 10 * MiB),
        ("1m", MiB),
        ("123", 123),
        ("0", 0),
        (" 4096 ", 4096),
        ("7b", 7),
        ("7B", 7),
        ("9007199254740993", 2**53 + 1),  # a plain integer is exact at any size
    ],
)
def test_sizes(text, n):
    size = parse_size(text)
    assert size == n and type(size) is int


@pytest.mark.parametrize(
    "text",
    [
        "lots",
        "8 GiBs",
        "8GiB of it",  # ByteSize alone reads 8GiB and drops the rest
        "1,5g",  # ByteSize alone: 1 byte
        "1.5.5g",
        "-1",
        "1e3",
        "0x10",
        "",
        "k",
        "8bit",  # ByteSize alone: 1 byte
        "1kbit",
        "9" * 400 + "k",
    ],
)
def test_bad_sizes(text):
    with pytest.raises(ValueError, match="^not a size: an integer, or a number with a unit such as 64k, 512MiB"):
        parse_size(text)


@pytest.mark.parametrize("text", ["12.5", "1.3333b", "0.5b", "1.5", "0.1g"])
def test_a_size_is_a_whole_number_of_bytes(text):
    """ByteSize alone drops the fraction: 0.5b would be 0, which for a budget means none."""
    with pytest.raises(ValueError, match="^not a whole number of bytes: "):
        parse_size(text)


@pytest.mark.parametrize(
    "text, ours, byte_size",
    [("64k", 64 << 10, 64_000), ("64K", 64 << 10, 64_000), ("10m", 10 << 20, 10**7), ("1.5g", 3 << 29, 15 * 10**8)],
)
def test_the_short_forms_are_binary_unlike_byte_sizes(text, ours, byte_size):
    """Why parse_size spells the unit for ByteSize: read as ByteSize reads it, an
    operator's 64k would silently become 64000 bytes."""
    assert parse_size(text) == ours and TypeAdapter(ByteSize).validate_python(text) == byte_size


def test_a_bad_size_names_its_setting():
    with pytest.raises(ValidationError) as e:
        Settings(memory_budget_bytes="1,5g")
    (err,) = e.value.errors()
    assert err["loc"] == ("memory_budget_bytes",) and "not a size" in err["msg"]
    with pytest.raises(ValidationError) as e:
        Settings(quota_bytes_per_key="0.5b")
    (err,) = e.value.errors()
    assert err["loc"] == ("quota_bytes_per_key",) and "not a whole number of bytes: 0.5b" in err["msg"]
    with pytest.raises(ValidationError, match="max_body_bytes"):
        Settings(max_body_bytes="1kB")  # a size, but below the setting's least (1024)


@pytest.mark.parametrize("field", SIZE_FIELDS)
def test_every_size_setting_takes_units_as_a_variable_or_an_argument(field, monkeypatch):
    monkeypatch.setenv("ATTNSERVE_" + field.upper(), "2MiB")
    assert getattr(Settings(), field) == 2 * MiB
    assert getattr(Settings(**{field: "3MiB"}), field) == 3 * MiB
    assert getattr(Settings(**{field: 4 * MiB}), field) == 4 * MiB  # plain integers keep working
    assert getattr(Settings(**{field: "5242880"}), field) == 5 * MiB
    assert type(getattr(Settings(**{field: "64k"}), field)) is int  # an int to the rest of the service
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
