"""The one definition of attnserve's wire format for arrays and MessagePack.

Both the client and the server import this module, so it depends on numpy and
msgpack only and is strict: anything that is not exactly what the contract
(``api.md``) allows raises :class:`WireError`, a :class:`ValueError` whose
message names the argument and says what was expected and what came.

An array on the wire is, in MessagePack, the map::

    {"dtype": "<f4", "shape": [d0, d1, ...], "data": <bin: prod(shape) * itemsize bytes>}

(C order, little-endian) of one of :data:`DTYPES`: ``"<f4"`` (float32),
``"<f2"`` (IEEE float16) or ``"bfloat16"`` (the upper half of a float32, as
engines run); in JSON nested lists of numbers (float32). numpy has no bfloat16:
its arrays are held as two-byte void (:data:`BFLOAT16`, the raw bits),
:func:`to_float32` widens any of the three exactly and :func:`to_bfloat16` rounds
to bfloat16.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

__all__ = [
    "BFLOAT16",
    "DTYPE",
    "DTYPES",
    "JSON",
    "MAX_ELEMENTS",
    "MAX_NDIM",
    "MSGPACK",
    "MSGPACK_TYPES",
    "PROBLEM_JSON",
    "WireError",
    "all_finite",
    "as_float32",
    "as_wire_array",
    "check_finite",
    "dtype_name",
    "nonfinite",
    "to_bfloat16",
    "to_float32",
    "decode_array",
    "encode_array",
    "is_msgpack",
    "loads_json",
    "max_containers",
    "json_structure",
    "MAX_MEMBERS",
    "MAX_MAP_ENTRIES",
    "packb",
    "unpackb",
]

#: The media type requests and responses use by default.
MSGPACK = "application/vnd.msgpack"
#: Every MessagePack media type the contract accepts (``MSGPACK`` first).
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/msgpack")
JSON = "application/json"
#: RFC 9457 problem details, the media type of every error answer.
PROBLEM_JSON = "application/problem+json"

#: The default dtype on the wire (and JSON's): little-endian float32.
DTYPE = "<f4"
_F32 = np.dtype(DTYPE)
#: bfloat16 as numpy holds it: two bytes, the upper half of a float32's bits, as
#: void (numpy has no bfloat16, and void refuses arithmetic and casts that would
#: read the bits as something else).
BFLOAT16 = np.dtype("V2")
#: Every dtype an array may have on the wire, by its name there.
DTYPES: dict[str, np.dtype[Any]] = {DTYPE: _F32, "<f2": np.dtype("<f2"), "bfloat16": BFLOAT16}
_NAMES = {dt: name for name, dt in DTYPES.items()}
#: Most dimensions an array on the wire may have.
MAX_NDIM = 8
#: Default cap on the number of elements of one decoded array (1 GiB of float32).
MAX_ELEMENTS = 1 << 28

_ARRAY_KEYS = frozenset({"dtype", "shape", "data"})

#: Bytes of a document per array or map (object) it may hold, past the first 1024
#: (:func:`max_containers`). An empty container is one byte of MessagePack and two
#: of JSON but some 60 bytes of Python, so without a cap a 64 MiB body of them takes
#: gigabytes to parse. MessagePack arrays are maps with one ``bin``: real documents
#: hold a handful. JSON arrays are nested lists, one per row of ``head_dim``
#: numbers (``[0,0,0],`` is 8 bytes): one per 8 bytes admits them, and caps a
#: document's containers near what its numbers would cost.
BYTES_PER_CONTAINER = {"msgpack": 32, "json": 8}

#: Most members a document may hold: map entries (each counted twice: its key and
#: its value) and array elements, numbers included, all containers together. A wide
#: flat map costs some 100 bytes of Python per entry whatever its bytes, so without
#: a cap a 50 MiB body of 4M keys takes half a GB and tens of seconds to parse.
#: Request maps name their members (a few dozen); MessagePack arrays are one ``bin``
#: each; so this binds JSON's nested lists of numbers: 2**20 members hold a JSON
#: array of a million numbers (send larger arrays as MessagePack).
MAX_MEMBERS = 1 << 20
#: Most entries of one MessagePack map, refused from the map's header before the
#: map is built (a request map names at most a few dozen members).
MAX_MAP_ENTRIES = 1024


class WireError(ValueError):
    """A value is not valid on the wire; the message names it, with expected vs got."""


def is_msgpack(content_type: str | None) -> bool:
    """Whether a ``Content-Type``/``Accept`` value names one of ``MSGPACK_TYPES``.

    Parameters after ``;`` and letter case are ignored.
    """
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() in MSGPACK_TYPES


# -- arrays -------------------------------------------------------------------


def as_float32(a: Any, *, name: str = "array") -> np.ndarray:
    """Return ``a`` as a C-contiguous little-endian float32 array, converting once.

    ``a`` may be any float array or nested sequence of floats (float16, float32,
    float64, any byte order or memory layout). An array that is already C-contiguous
    ``<f4`` is returned as it is, without a copy. Values too large for float32 become
    infinite (see :func:`check_finite`).

    Raises:
        WireError: ``a`` is not a float array (integer, bool, complex, object, ...)
            or is a ragged sequence.
    """
    try:
        arr = np.asarray(a)
    except (ValueError, TypeError) as exc:
        raise WireError(f"{name}: expected a float array, got {type(a).__name__} ({exc})") from None
    if arr.dtype.kind != "f":
        raise WireError(f"{name}: expected a float array, got dtype {arr.dtype}")
    with np.errstate(over="ignore"):
        return arr.astype(_F32, order="C", copy=False)


def dtype_name(arr: np.ndarray) -> str:
    """The wire name (a key of :data:`DTYPES`) of an array's dtype.

    Raises:
        WireError: the dtype is not one the wire carries.
    """
    name = _NAMES.get(arr.dtype)
    if name is None:
        raise WireError(f"array: expected a dtype of {sorted(DTYPES)}, got {arr.dtype}")
    return name


def as_wire_array(a: Any, *, name: str = "array") -> np.ndarray:
    """``a`` as a C-contiguous array of one of :data:`DTYPES`, as it is when it
    already is one (float16 and bfloat16 stay half; no copy when contiguous);
    any other float array (float64, big-endian) converted once to float32 as
    :func:`as_float32` does.

    Raises:
        WireError: as :func:`as_float32`.
    """
    if isinstance(a, np.ndarray) and a.dtype in _NAMES:
        return a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
    return as_float32(a, name=name)


def to_float32(arr: np.ndarray) -> np.ndarray:
    """An array of :data:`DTYPES` as float32, exactly (every float16 and bfloat16
    value is one); a float32 array as it is."""
    if arr.dtype == BFLOAT16:
        bits = np.ascontiguousarray(arr).view("<u2").astype("<u4") << 16
        return bits.view(_F32)
    return arr.astype(_F32, copy=False)


def to_bfloat16(a: Any, *, name: str = "array") -> np.ndarray:
    """``a`` rounded to bfloat16 (:data:`BFLOAT16`, C-contiguous), to nearest even
    on the float32 bits, as engines and the server's GPU round: a value at or past
    the midpoint above bfloat16's largest becomes infinite, infinities stay, a NaN
    stays NaN (quiet), float32 subnormals round to bfloat16's. Any other float
    array is first converted to float32 (:func:`as_float32`).

    Raises:
        WireError: as :func:`as_float32`.
    """
    arr = as_float32(a, name=name)
    bits = arr.reshape(-1).view("<u4")  # 1-d: array arithmetic, never numpy scalars
    even = (bits >> 16) & 1  # ties go to the even upper half
    rounded = (bits + 0x7FFF + even) >> 16  # wraps only for NaNs (above 0xFF80_0000), replaced below
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    upper = np.where(nan, (bits >> 16) | 0x0040, rounded)  # a NaN keeps its sign and top bits, made quiet
    return upper.astype("<u2").reshape(arr.shape).view(BFLOAT16)


def nonfinite(arr: np.ndarray) -> np.ndarray:
    """Where a float array of :data:`DTYPES` (or any float dtype) holds a NaN or an
    infinity, as a bool array of its shape."""
    bad: np.ndarray
    if arr.dtype == BFLOAT16:  # exponent bits all ones: infinite or NaN
        bad = (np.ascontiguousarray(arr).view("<u2") & 0x7F80) == 0x7F80
    else:
        bad = ~np.isfinite(arr)
    return bad


# all_finite's block: elements checked at a time (its masks stay in the cache)
_FINITE_BLOCK = 1 << 18


def all_finite(arr: np.ndarray) -> bool:
    """Whether every element of a float array of :data:`DTYPES` (or any float
    dtype) is finite: what ``not nonfinite(arr).any()`` says, in blocks with two
    small buffers instead of a mask of the whole array (a prefill's arrays are tens
    of MB: the mask's fresh pages cost more than the check), stopping at the first
    block with a NaN or an infinity."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    if flat.size <= _FINITE_BLOCK:  # one block: the mask is as small as the buffers
        return not nonfinite(flat).any()
    if flat.dtype == BFLOAT16:  # exponent bits all ones: infinite or NaN
        bits = flat.view("<u2")
        exponent, bad = np.empty(_FINITE_BLOCK, "<u2"), np.empty(_FINITE_BLOCK, bool)
        for start in range(0, flat.size, _FINITE_BLOCK):
            block = bits[start : start + _FINITE_BLOCK]
            m = block.size
            np.bitwise_and(block, 0x7F80, out=exponent[:m])
            if np.equal(exponent[:m], 0x7F80, out=bad[:m]).any():
                return False
        return True
    finite = np.empty(_FINITE_BLOCK, bool)
    for start in range(0, flat.size, _FINITE_BLOCK):
        block = flat[start : start + _FINITE_BLOCK]
        if not np.isfinite(block, out=finite[: block.size]).all():
            return False
    return True


def check_finite(arr: np.ndarray, *, name: str = "array") -> np.ndarray:
    """Return ``arr`` unchanged if every element is finite (any of :data:`DTYPES`).

    Raises:
        WireError: an element is NaN or infinite; the message gives its index.
    """
    if not arr.size or all_finite(arr):
        return arr
    bad = nonfinite(arr)  # the mask only to name the first bad element
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise WireError(
            f"{name}: expected finite values, got {float(to_float32(arr[where][None])[0])} at index {where}"
        )
    return arr


def encode_array(a: Any, *, name: str = "array") -> dict[str, Any]:
    """Encode a float array as the wire map ``{"dtype": ..., "shape": [...], "data": ...}``.

    ``a`` keeps its dtype when it is one of :data:`DTYPES` (float32, float16,
    bfloat16) and is converted to float32 otherwise (:func:`as_wire_array`; no copy
    when it already is C-contiguous). ``data`` is a zero-copy byte view of that array (a
    ``memoryview`` of format ``"B"``, or ``b""`` when the array is empty): it is
    bytes-like, packs as MessagePack ``bin`` and compares equal to the bytes it
    holds, but it keeps the array alive and reflects later writes to it.

    Raises:
        WireError: as :func:`as_float32`.
    """
    arr = as_wire_array(a, name=name)
    data: bytes | memoryview = arr.reshape(-1).view(np.uint8).data.cast("B") if arr.size else b""
    return {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data": data}


def decode_array(
    obj: Any,
    *,
    name: str,
    ndim: int | None = None,
    finite: bool = True,
    max_elements: int = MAX_ELEMENTS,
) -> np.ndarray:
    """Decode one array from its wire form into an ndarray of the sent shape and dtype.

    ``obj`` is either the MessagePack map (exactly the keys ``dtype``, ``shape`` and
    ``data``; ``dtype`` one of :data:`DTYPES`; ``shape`` a list of ints >= 0; ``data``
    exactly ``prod(shape) * itemsize`` bytes) or, from JSON, uniformly nested lists
    of numbers (``int`` or ``float``, not ``bool``), decoded as float32.

    The map form is decoded without copying: the result is
    ``np.frombuffer(data, dtype).reshape(shape)`` and is **read-only** when ``data`` is
    ``bytes``; copy it before writing to it. The list form gives a new writable array.

    Args:
        name: what the array is called in error messages (e.g. ``"q"``).
        ndim: the number of dimensions required, or ``None`` for any (<= MAX_NDIM).
        finite: refuse NaN and infinite values.
        max_elements: refuse arrays with more elements than this.

    Raises:
        WireError: anything about ``obj`` is invalid; the message names ``name``.
    """
    if isinstance(obj, dict):
        arr = _decode_map(obj, name, ndim, max_elements)
    elif isinstance(obj, list):
        arr = _decode_lists(obj, name, ndim, max_elements)
    else:
        raise WireError(
            f"{name}: expected an array (a map with dtype, shape and data, or nested lists), got {type(obj).__name__}"
        )
    if finite:
        check_finite(arr, name=name)
    return arr


def _check_shape(shape: Sequence[int], name: str, ndim: int | None, max_elements: int) -> int:
    """Check dimension count and element cap; return the element count (a Python int)."""
    if ndim is not None and len(shape) != ndim:
        raise WireError(f"{name}: expected {ndim} dimensions, got shape {tuple(shape)}")
    if len(shape) > MAX_NDIM:
        raise WireError(f"{name}: expected at most {MAX_NDIM} dimensions, got {len(shape)}")
    count = 1
    for dim in shape:
        count *= dim
        if dim > max_elements or count > max_elements:
            raise WireError(f"{name}: expected at most {max_elements} elements, got shape {tuple(shape)}")
    return count


def _decode_map(obj: dict[Any, Any], name: str, ndim: int | None, max_elements: int) -> np.ndarray:
    keys = set(obj)
    if keys != _ARRAY_KEYS:
        raise WireError(f"{name}: expected exactly the keys ['data', 'dtype', 'shape'], got {sorted(map(str, keys))}")
    dtype = DTYPES.get(obj["dtype"]) if isinstance(obj["dtype"], str) else None
    if dtype is None:
        raise WireError(f"{name}: expected dtype one of {sorted(DTYPES)}, got {obj['dtype']!r:.40}")
    shape = obj["shape"]
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        shown = shape if isinstance(shape, (list, tuple)) and len(shape) <= MAX_NDIM else type(shape).__name__
        raise WireError(f"{name}: expected shape as a list of at most {MAX_NDIM} ints >= 0, got {shown!r}")
    count = _check_shape(shape, name, ndim, max_elements)
    data = obj["data"]
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{name}: expected data as bytes, got {type(data).__name__}")
    nbytes = memoryview(data).nbytes
    if nbytes != count * dtype.itemsize:
        raise WireError(
            f"{name}: expected {count * dtype.itemsize} data bytes for shape {tuple(shape)} of {obj['dtype']}, "
            f"got {nbytes}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _decode_lists(obj: list[Any], name: str, ndim: int | None, max_elements: int) -> np.ndarray:
    # The shape is read down the first elements; every list is then checked against it,
    # level by level (no recursion, so depth is bounded by MAX_NDIM, not the stack).
    shape: list[int] = []
    node: Any = obj
    while isinstance(node, list):
        if len(shape) == MAX_NDIM:
            raise WireError(f"{name}: expected at most {MAX_NDIM} dimensions, got more")
        shape.append(len(node))
        if not node:
            break
        node = node[0]
    _check_shape(shape, name, ndim, max_elements)
    level: list[Any] = [obj]
    for depth, size in enumerate(shape):
        below: list[Any] = []
        for item in level:
            if not isinstance(item, list) or len(item) != size:
                got = f"a list of {len(item)}" if isinstance(item, list) else type(item).__name__
                raise WireError(
                    f"{name}: expected rectangular nested lists of shape {tuple(shape)}, got {got} at depth {depth}"
                )
            below.extend(item)
        level = below
    for x in level:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise WireError(f"{name}: expected numbers, got {type(x).__name__}")
    try:
        with np.errstate(over="ignore"):
            flat = np.array(level, dtype=np.float64).astype(_F32)
    except OverflowError:
        flat = np.array([_clip_int(x) for x in level], dtype=np.float64).astype(_F32)
    return flat.reshape(shape)


def _clip_int(x: int | float) -> float:
    """A number too large for float64 (only huge ints) becomes +-inf."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


# -- MessagePack ---------------------------------------------------------------


def packb(obj: Any) -> bytes:
    """Serialise ``obj`` to MessagePack (``bin`` for bytes-like values, ``str`` for text)."""
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def unpackb(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int,
    max_containers: int | None = None,
    max_members: int = MAX_MEMBERS,
) -> Any:
    """Parse one MessagePack document of at most ``max_bytes`` bytes, safely.

    Every declared length (str, bin, array, map) is bounded by the size of ``data``
    itself, so a small body cannot make the parser allocate a huge object; a map
    declaring more than :data:`MAX_MAP_ENTRIES` entries, or an array more than
    ``max_members`` elements, is refused from its header; ext types are refused;
    map keys must be str (or bytes); str is decoded as UTF-8. Nesting deeper than
    the parser's limit is refused.

    The document may hold at most ``max_containers`` arrays and maps (default
    :func:`max_containers`, ``1024 + len(data) // 32``; see
    :data:`BYTES_PER_CONTAINER`) and ``max_members`` members (:data:`MAX_MEMBERS`);
    the parse stops as soon as either cap is passed.

    Raises:
        WireError: the body is too long, malformed, truncated, has trailing data,
            nests too deeply, holds too many arrays and maps or members, or uses
            ext types.
    """
    size = memoryview(data).nbytes
    if size > max_bytes:
        raise WireError(f"body: expected at most {max_bytes} bytes of MessagePack, got {size}")
    cap = _max_containers(size, "msgpack") if max_containers is None else max_containers
    containers = members = 0

    def counted(obj: Any, weight: int) -> Any:
        nonlocal containers, members
        containers += 1
        members += weight * len(obj)
        if containers > cap:
            raise _TooManyContainers
        if members > max_members:
            raise _TooManyMembers
        return obj

    try:
        return _unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=min(size, max_members),
            max_map_len=min(size // 2, MAX_MAP_ENTRIES),
            max_ext_len=0,
            list_hook=lambda obj: counted(obj, 1),
            object_hook=lambda obj: counted(obj, 2),
        )
    except _TooManyContainers:
        raise WireError(
            f"body: expected at most {cap} arrays and maps in {size} bytes of MessagePack, got more"
        ) from None
    except _TooManyMembers:
        raise WireError(_too_many_members(max_members, "MessagePack")) from None
    except RecursionError:
        raise WireError("body: expected MessagePack nested at most a few hundred deep, got deeper") from None
    except ValueError as exc:
        # a header declared more entries than the caps (not only than the body could hold)
        if "exceeds max_map_len" in str(exc) and size // 2 > MAX_MAP_ENTRIES:
            raise WireError(f"body: expected maps of at most {MAX_MAP_ENTRIES} entries, got {exc}") from None
        if "exceeds max_array_len" in str(exc) and size > max_members:
            raise WireError(_too_many_members(max_members, "MessagePack")) from None
        raise WireError(f"body: expected valid MessagePack, got {type(exc).__name__}: {exc}") from None
    except (TypeError, msgpack.UnpackException) as exc:
        raise WireError(f"body: expected valid MessagePack, got {type(exc).__name__}: {exc}") from None


def _too_many_members(max_members: int, kind: str) -> str:
    return (
        f"body: expected at most {max_members} members (map entries count twice, array elements once) "
        f"in a {kind} document, got more; send large arrays as MessagePack arrays ({DTYPE} bytes)"
    )


class _TooManyContainers(Exception):
    pass


class _TooManyMembers(Exception):
    pass


def max_containers(size: int, kind: str) -> int:
    """Most arrays and maps a ``kind`` (``"msgpack"``, ``"json"``) document of
    ``size`` bytes may hold: ``1024 + size // BYTES_PER_CONTAINER[kind]``."""
    return 1024 + size // BYTES_PER_CONTAINER[kind]


_max_containers = max_containers  # unpackb's parameter of that name shadows it


def loads_json(data: bytes | bytearray, *, max_bytes: int, max_members: int = MAX_MEMBERS) -> Any:
    """Parse one JSON document of at most ``max_bytes`` bytes, safely: its arrays
    and objects and its members are counted (outside strings) before any is built,
    and a document with more than :func:`max_containers` arrays and objects, or
    more than ``max_members`` members (:data:`MAX_MEMBERS`), is refused at once.

    Raises:
        WireError: the body is too long, holds too many arrays and objects or
            members, is not JSON, or nests too deeply.
    """
    size = len(data)
    if size > max_bytes:
        raise WireError(f"body: expected at most {max_bytes} bytes of JSON, got {size}")
    cap = max_containers(size, "json")
    containers, members = json_structure(data, stop_at=(cap, max_members))
    if containers > cap:
        raise WireError(f"body: expected at most {cap} arrays and objects in {size} bytes of JSON, got more")
    if members > max_members:
        raise WireError(_too_many_members(max_members, "JSON"))
    try:
        return json.loads(data)
    except RecursionError:
        raise WireError("body: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise WireError(f"body: expected valid JSON, got {type(e).__name__}: {e}") from None


_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPENERS, _SEPARATORS = (ord("["), ord("{")), (ord(","), ord(":"))
_SCAN_CHUNK = 1 << 18
_COUNT_CHUNK = 1 << 17


def count_json_containers(data: bytes | bytearray) -> int:
    """How many ``[`` and ``{`` of ``data`` open an array or object (see
    :func:`json_structure`)."""
    return json_structure(data)[0]


def json_structure(data: bytes | bytearray, *, stop_at: tuple[int, int] | None = None) -> tuple[int, int]:
    """``(containers, members)`` of a JSON document: how many ``[`` and ``{``
    open an array or object, and its members as :data:`MAX_MEMBERS` counts them
    (a ``,`` or ``:`` outside strings, plus one per container: an array of n
    elements holds n - 1 commas, an object of n entries n - 1 commas and n colons).
    Bytes inside JSON strings do not count (a quote preceded by an odd run of
    backslashes does not end a string). Exact up to the first byte that is not
    valid JSON, where any parser stops; vectorized, 256 KiB at a time, holding no
    more than a few MiB of temporaries.

    With ``stop_at=(containers, members)``, the count may stop early: when the
    document's counts of those bytes, strings and all, already stay within both
    (then those counts are returned), or once the exact counts pass either (then
    the counts so far)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    if stop_at is not None:  # counts that ignore strings bound the exact ones from above
        raw = np.zeros(256, dtype=np.int64)
        for start in range(0, buf.size, _COUNT_CHUNK):  # bincount widens each byte to 8
            raw += np.bincount(buf[start : start + _COUNT_CHUNK], minlength=256)
        containers = int(raw[_OPENERS[0]] + raw[_OPENERS[1]])
        members = containers + int(raw[_SEPARATORS[0]] + raw[_SEPARATORS[1]])
        if containers <= stop_at[0] and members <= stop_at[1]:
            return containers, members
    containers = members = 0
    in_string, run = 0, 0  # carried: inside a string, backslashes ending the last chunk
    for start in range(0, buf.size, _SCAN_CHUNK):
        c = buf[start : start + _SCAN_CHUNK]
        quotes = np.flatnonzero(c == _QUOTE)
        backslash = c == _BACKSLASH
        if quotes.size and (run or backslash.any()):
            idx = np.arange(c.size)
            # the length of the run of backslashes ending at each byte (0 at others)
            runs = idx - np.maximum.accumulate(np.where(backslash, -1 - run, idx))
            before = np.concatenate(([run], runs[:-1]))
            quotes = quotes[before[quotes] % 2 == 0]  # the unescaped ones
            run = int(runs[-1])
        elif backslash.all():
            run += c.size
        else:
            run = int(np.argmin(backslash[::-1]))  # the backslashes ending the chunk
        opened = _outside(c, quotes, in_string, _OPENERS)
        containers += opened
        members += opened + _outside(c, quotes, in_string, _SEPARATORS)
        in_string = (in_string + int(quotes.size)) % 2
        if stop_at is not None and (containers > stop_at[0] or members > stop_at[1]):
            break
    return containers, members


def _outside(chunk: np.ndarray, quotes: np.ndarray, in_string: int, chars: tuple[int, int]) -> int:
    """How many bytes of ``chunk`` equal to either of ``chars`` lie outside strings,
    given the chunk's unescaped ``quotes`` and whether it starts ``in_string``."""
    at = np.flatnonzero((chunk == chars[0]) | (chunk == chars[1]))
    inside = (np.searchsorted(quotes, at) + in_string) % 2
    return int(at.size - np.count_nonzero(inside))


# The parser used by unpackb; the C extension when available (tests swap in the
# pure-Python fallback to check that deep nesting is refused there too).
_unpackb = msgpack.unpackb
