# The interface of the compiled module built from _callframe.c and callframe.c (setup.py).
from collections.abc import Iterable, Mapping
from typing import Any

from typing_extensions import Buffer

SOURCE_DIGEST: str
SOURCES: Mapping[str, str]
HEAD_BYTES: int
REPLY_HEAD_BYTES: int
MAX_LAYERS: int

class CallFrameError(ValueError):
    status: str
    array: str | None
    index: int | None

class StepTable:
    def __new__(cls, capacity: int) -> StepTable: ...
    @property
    def capacity(self) -> int: ...
    def __len__(self) -> int: ...
    def open(
        self,
        step: int,
        owner: int,
        layers: Iterable[int],
        q_bytes: int,
        k_bytes: int,
        v_bytes: int,
        dtype: str,
        check_finite: bool,
    ) -> None: ...
    def close(self, step: int, /) -> None: ...
    def check(self, owner: int, head: Buffer | tuple[int, int, int, int], body: Buffer, /) -> tuple[int, int, int]: ...
    def claim(self, step: int, layer: int, /) -> int: ...
    def settle(self, step: int, layer: int, applied_items: int, failed_items: int, /) -> int: ...
    def info(self, step: int, /) -> dict[str, Any]: ...

def parse_head(buffer: Buffer, max_body: int = ...) -> tuple[int, int, int, int]: ...
def reply_head(seq: int, status: int, body_len: int, /) -> bytes: ...
def call_head(step: int, layer: int, seq: int, body_len: int, /) -> bytes: ...
