# The interface of the compiled module built from _commands.c (setup.py).
from typing_extensions import Buffer

SOURCE_DIGEST: str
OP_DISPATCH: int
OP_COPY: int
OP_WORDS: int

def bind(path: str, /) -> None: ...
def record(
    device: int, queue: int, writes: list[tuple[int, int, object]], program: Buffer, query_set: int, /
) -> int: ...
def submit(queue: int, commands: int, /) -> None: ...
def release(commands: int, /) -> None: ...
