"""The cached WGSL loader and the pipeline cache.

Shaders ship as package data (``attnserve.shaders``, mapped to the top-level
``shaders/`` folder by pyproject.toml); in a plain checkout they are read from
``<repo>/shaders``. Every kernel is described once in ``KERNELS``: its file, its
entry point and its bindings (number and access), from which an explicit bind
group layout is made, so the host and the WGSL cannot disagree silently. Only
what ``KERNELS`` builds ships; a kernel kept elsewhere (the research kernels of
``bench/probes/shaders``) names its folder (``KernelSpec.folder``) and includes
from that folder's ``include/`` and the shipped one alike (``include_path``).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import wgpu

import numpy as np

from ..formats import HALF_FORMATS, PLAIN_ELEMENT_BYTES, TQ_HEAD_DIMS, TQ_SPECS
from . import native
from . import params as P

__all__ = [
    "KERNELS",
    "PLAIN_FORMATS",
    "KernelSpec",
    "load_wgsl",
    "include_path",
    "wgsl_files",
    "plain_kernel",
    "tqx_kernel",
    "tqx_consts",
    "shader_dir",
    "PipelineCache",
]

log = logging.getLogger("attnserve")

R, RW = "read", "rw"


@dataclass(frozen=True)
class KernelSpec:
    file: str
    entry_point: str
    bindings: tuple[tuple[int, str], ...]
    features: tuple[str, ...] = ()  # device features the shader needs
    # {NAME} placeholders replaced in the file and its includes (``KV``: the plain
    # kv format whose slab include, ``kv_vec4_{KV}.wgsl`` / ``kv_scalar_{KV}.wgsl``,
    # the kernel reads)
    defines: tuple[tuple[str, str], ...] = ()
    # compiled by PipelineCache.warm_up at start (else on first use; every kernel is
    # compiled by the tests either way)
    warm: bool = True
    # the folder that holds ``file`` (and its own ``include/``); None: the shipped
    # shaders (shader_dir())
    folder: Path | None = None


KERNELS: dict[str, KernelSpec] = {
    # every compressed format's query rotation (constants {"SIGNED": 1}: the formats with
    # key outlier channels)
    "tq_rotate_q": KernelSpec("tq_rotate.wgsl", "tq_rotate_q", ((3, R), (4, R), (5, RW), (6, R))),
    "attention_merge": KernelSpec("attention_merge.wgsl", "attention_merge", ((0, R), (1, RW), (2, R), (3, R))),
    # the plain formats' appends (rows of whole words, the same layout in f32 and f16 slabs)
    "kv_write_rows": KernelSpec("kv_write.wgsl", "kv_write_rows", ((0, R), (1, RW), (2, RW), (3, R), (4, R))),
    # half-precision arrays in and answers out (one params block per array)
    "convert": KernelSpec("convert.wgsl", "convert", ((0, R), (1, RW), (2, R))),
}

#: The kernels over a plain (uncompressed) slab, one pipeline family per plain kv
#: format: ``plain_kernel(base, kv_format)`` names the one that reads ``kv_format``.
PLAIN_FORMATS = tuple(PLAIN_ELEMENT_BYTES)
_PLAIN_KERNELS: dict[str, tuple[str, tuple[str, ...]]] = {
    # base name (= entry point): (file, device features)
    "attention_prefill": ("attention_prefill.wgsl", ()),
    "attention_prefill_tiled": ("attention_prefill_tiled.wgsl", ()),
    "attention_prefill_rb": ("attention_prefill_rb.wgsl", ()),
    "attention_split": ("attention_split.wgsl", ()),
}


def plain_kernel(base: str, kv_format: str) -> str:
    """The ``KERNELS`` name of plain kernel ``base`` over a ``kv_format`` slab."""
    return f"{base}.{kv_format}"


for _base, (_file, _features) in _PLAIN_KERNELS.items():
    for _kv in PLAIN_FORMATS:
        KERNELS[plain_kernel(_base, _kv)] = KernelSpec(
            _file, _base, ((0, R), (1, R), (2, R), (3, RW), (4, R), (5, R)), _features, (("KV", _kv),)
        )

#: The half formats' decode split kernel over 16-byte pieces (kernels.wide_split:
#: head_dim % 8 == 0), one pipeline per half format, with attention_split's bindings.
for _kv in HALF_FORMATS:
    KERNELS[plain_kernel("attention_split_wide", _kv)] = KernelSpec(
        "attention_split_wide.wgsl",
        "attention_split_wide",
        ((0, R), (1, R), (2, R), (3, RW), (4, R), (5, R)),
        (),
        (("KV", _kv),),
    )


#: The kernels over a TurboQuant slab (every format of formats.TQ_SPECS), one pipeline
#: family per format: ``tqx_kernel(base, kv_format)`` names the one for ``kv_format``;
#: the format's constants (``tqx_consts``) replace ``{TQX_CONSTS}`` in the file.
_TQX_KERNELS: dict[str, tuple[str, tuple[tuple[int, str], ...], tuple[str, ...]]] = {
    # base name (= entry point): (file, bindings, device features)
    "tqx_encode_keys": ("tqx.wgsl", ((0, R), (1, RW), (2, R), (3, R), (7, R)), ()),
    "tqx_encode_values": ("tqx.wgsl", ((0, R), (1, RW), (2, R), (3, R), (7, R)), ()),
    "flash_attention_tqx": ("flash_attention_tqx.wgsl", ((0, R), (1, R), (2, R), (3, RW), (4, R), (5, R), (6, R)), ()),
    "attention_tqx_tiled": (
        "flash_attention_tqx_tiled.wgsl",
        ((0, R), (1, R), (2, R), (3, RW), (4, R), (5, R), (6, R)),
        (),
    ),
    "attention_split_tqx": ("flash_attention_tqx_split.wgsl", ((0, R), (1, R), (2, R), (3, RW), (4, R), (5, R)), ()),
}


def tqx_kernel(base: str, kv_format: str) -> str:
    """The ``KERNELS`` name of the tqx kernel ``base`` over a ``kv_format`` slab (any of
    ``formats.TQ_SPECS``)."""
    return f"{base}.{kv_format}"


def _wgsl_f32(x: float) -> str:
    # the float32 value exactly (its float64 repr), as an f32 literal
    return repr(float(np.float32(x))) + "f"


def tqx_consts(kv_format: str) -> str:
    """The WGSL constants of a compressed format (``turboquant`` or a variant): KB, VB,
    QJL, KO, VO, and per head_dim its
    key / value codebooks (KC_d, VC_d) and boundaries (KCB_d, VCB_d), padded to 16."""
    from ..turboquant import codebook

    spec = TQ_SPECS[kv_format]
    out = [
        f"// {kv_format}: generated by attnserve/gpu/shaders.py tqx_consts",
        f"const KB: u32 = {spec.key_bits}u;",
        f"const VB: u32 = {spec.value_bits}u;",
        f"const QJL: bool = {str(spec.qjl).lower()};",
        f"const KO: u32 = {spec.key_outliers}u;",
        f"const VO: u32 = {spec.value_outliers}u;",
    ]
    for name, bits in (("K", spec.key_bits), ("V", spec.value_bits)):
        for d in TQ_HEAD_DIMS:
            cb = codebook(d, bits)
            for suffix, vals in (("C", cb.centroids), ("CB", cb.boundaries)):
                padded = list(vals) + [0.0] * (16 - len(vals))
                out.append(f"const {name}{suffix}_{d} = array<f32, 16>({', '.join(map(_wgsl_f32, padded))});")
    return "\n".join(out)


#: The formats whose tqx kernels warm_up compiles at start (the unspecialized ones, so a
#: bad shader fails the start): turboquant and every code path of the family (2-, 3- and
#: 4-bit codes, QJL, outlier channels); the other variants' on first use (seven formats'
#: worth tripled a start on lavapipe), the recommended setting's (formats.RECOMMENDED)
#: by the kernel warm-up (warmup.py) at the session shapes it is given.
TQX_WARM = ("turboquant", "tq4", "tq4q", "tq4o")

for _base, (_file, _bindings, _features) in _TQX_KERNELS.items():
    for _fmt in TQ_SPECS:
        KERNELS[tqx_kernel(_base, _fmt)] = KernelSpec(
            _file, _base, _bindings, _features, (("TQX_CONSTS", tqx_consts(_fmt)),), warm=_fmt in TQX_WARM
        )


def shader_dir() -> Path:
    """Where the .wgsl files are: the installed package data, else the checkout."""
    # `attnserve.shaders` is a namespace package (WGSL only, no __init__.py), so
    # ask for its folders rather than `importlib.resources.files`, whose
    # MultiplexedPath is no plain path.
    try:
        spec = importlib.util.find_spec("attnserve.shaders")
    except ModuleNotFoundError:
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / "attention_prefill.wgsl").is_file():
            return Path(loc)
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent / "shaders"
        if (cand / "attention_prefill.wgsl").is_file():
            return cand
    raise FileNotFoundError("cannot find the WGSL shaders (attnserve.shaders or <repo>/shaders)")


# `// #include "file.wgsl" KEY=value KEY="value with spaces"` on a line of its own
# inlines include/file.wgsl (include_path) with each {KEY} replaced. WGSL has no includes,
# and a block with barriers cannot become a function (naga's SPIR-V path
# miscompiles a barrier reached through a call in a loop): textual inclusion keeps
# such blocks at entry-point scope while writing them once.
_INCLUDE = re.compile(r'^[ \t]*//[ \t]*#include[ \t]+"([\w.-]+)"(.*)$', re.M)
_ARG = re.compile(r'(\w+)=(?:"([^"]*)"|(\S+))')
_PLACEHOLDER = re.compile(r"\{([A-Z][A-Z0-9_]*)\}")
# `// #struct NAME` on a line of its own declares the params struct NAME,
# generated from its host definition in params.py (`P.STRUCTS`).
_STRUCT = re.compile(r"^[ \t]*//[ \t]*#struct[ \t]+(\w+)[ \t]*$", re.M)


def include_path(name: str, folder: Path | None = None) -> Path:
    """The file that ``// #include "name"`` inlines into a shader of ``folder`` (None:
    the shipped shaders): ``folder/include/name``, else the shipped
    ``include/name``; a name in both is refused (one file per name)."""
    shipped = shader_dir() / "include" / name
    own = folder / "include" / name if folder is not None else None
    if own is None or own == shipped or not own.is_file():
        return shipped
    if shipped.is_file():
        raise ValueError(f"include {name} is both in {own.parent} and in the shipped {shipped.parent}")
    return own


def _expand(
    text: str,
    defines: dict[str, str] | None = None,
    depth: int = 0,
    folder: Path | None = None,
    used: set[Path] | None = None,
) -> str:
    """``text`` with ``defines`` replaced and its includes (``include_path``) and
    structs expanded; each include file read is added to ``used`` when given."""
    defines = defines or {}
    if depth > 4:
        raise ValueError("shader includes nested too deeply")
    for k, v in defines.items():
        text = text.replace("{" + k + "}", v)

    def one(m: re.Match[str]) -> str:
        path = include_path(m.group(1), folder)
        if used is not None:
            used.add(path)
        snippet = path.read_text(encoding="utf-8")
        args = {k: (q if q else u) for k, q, u in _ARG.findall(m.group(2))}
        missing = set(_PLACEHOLDER.findall(snippet)) - set(args) - set(defines)
        if missing:
            raise ValueError(f"include {m.group(1)} needs {sorted(missing)}")
        for k, v in args.items():
            snippet = snippet.replace("{" + k + "}", v)
        return _expand(snippet.rstrip("\n"), defines, depth + 1, folder, used)

    return _STRUCT.sub(lambda m: P.wgsl_struct(m.group(1)), _INCLUDE.sub(one, text))


@functools.lru_cache(maxsize=None)
def load_wgsl(name: str, defines: tuple[tuple[str, str], ...] = (), folder: Path | None = None) -> str:
    """The source of one shader file of ``folder`` (None: the shipped shaders) with
    its includes expanded and ``defines`` (``{NAME}`` placeholders) replaced, read once."""
    return _expand(((folder or shader_dir()) / name).read_text(encoding="utf-8"), dict(defines), folder=folder)


def wgsl_files(name: str, defines: tuple[tuple[str, str], ...] = (), folder: Path | None = None) -> set[Path]:
    """The files the source of ``load_wgsl(name, defines, folder)`` is made of: the
    shader file and every include it expands, transitively."""
    top = (folder or shader_dir()) / name
    used = {top}
    _expand(top.read_text(encoding="utf-8"), dict(defines), folder=folder, used=used)
    return used


def _since(t0: float) -> float:
    return round(time.perf_counter() - t0, 3)


class PipelineCache:
    """Compute pipelines of one device, made on first use and kept. A pipeline made
    after the device's start (:meth:`warm_up`) is logged: on a software adapter its
    first dispatch may take seconds, which a request then waits out."""

    def __init__(self, device: wgpu.GPUDevice):
        self._device = device
        # (file, defines, folder) of KernelSpec; (kernel, sorted constants) of get()
        self._modules: dict[tuple[str, tuple[tuple[str, str], ...], Path | None], wgpu.GPUShaderModule] = {}
        # each pipeline with its bind group layout and its wgpu-native handle (native.handle)
        self._pipelines: dict[
            tuple[str, tuple[tuple[str, int], ...]], tuple[wgpu.GPUComputePipeline, wgpu.GPUBindGroupLayout, int]
        ] = {}
        self._lock = threading.Lock()
        self._started = False  # warm_up has run: later pipelines are logged
        #: what the pipelines compiled now are for (the kernel warm-up sets it: "f32 at
        #: 32x8x128"); None: a request's first use
        self.warming: str | None = None

    def _module(self, spec: KernelSpec) -> wgpu.GPUShaderModule:
        key = (spec.file, spec.defines, spec.folder)
        if key not in self._modules:
            label = spec.file + "".join(f" {k}={v}" for k, v in spec.defines)
            self._modules[key] = self._device.create_shader_module(label=label, code=load_wgsl(*key))
        return self._modules[key]

    def get(
        self, kernel: str, constants: dict[str, int] | None = None
    ) -> tuple[wgpu.GPUComputePipeline, wgpu.GPUBindGroupLayout]:
        """The pipeline of ``kernel`` with its WGSL ``override`` constants set
        to ``constants`` (one pipeline per distinct set)."""
        pipe, bgl, _ = self._entry(kernel, constants)
        return pipe, bgl

    def handle(self, kernel: str, constants: dict[str, int] | None = None) -> tuple[int, wgpu.GPUBindGroupLayout]:
        """What a batch's command program takes of :meth:`get`'s pipeline: its
        wgpu-native handle (the pipeline, kept here, owns it), and its layout."""
        _, bgl, handle = self._entry(kernel, constants)
        return handle, bgl

    def _entry(
        self, kernel: str, constants: dict[str, int] | None
    ) -> tuple[wgpu.GPUComputePipeline, wgpu.GPUBindGroupLayout, int]:
        key = (kernel, tuple(sorted((constants or {}).items())))
        with self._lock:
            if key not in self._pipelines:
                spec = KERNELS[kernel]
                bgl = self._device.create_bind_group_layout(
                    label=kernel,
                    entries=[
                        {
                            "binding": b,
                            "visibility": wgpu.ShaderStage.COMPUTE,
                            "buffer": {
                                "type": wgpu.BufferBindingType.storage
                                if access == RW
                                else wgpu.BufferBindingType.read_only_storage
                            },
                        }
                        for b, access in spec.bindings
                    ],
                )
                layout = self._device.create_pipeline_layout(label=kernel, bind_group_layouts=[bgl])
                stage = {"module": self._module(spec), "entry_point": spec.entry_point}
                if constants:
                    stage["constants"] = dict(constants)
                t0 = time.perf_counter()
                pipe = self._device.create_compute_pipeline(label=kernel, layout=layout, compute=stage)
                self._pipelines[key] = (pipe, bgl, native.handle(pipe))
                if self._started:
                    seconds, warming = _since(t0), self.warming
                    if warming:
                        shown = f" ({', '.join(f'{k}={v}' for k, v in constants.items())})" if constants else ""
                        what = f"compiled kernel {kernel}{shown} for the warm-up of {warming} in {seconds} s"
                    else:
                        what = (
                            f"compiled kernel {kernel} on its first use "
                            "(ATTNSERVE_WARMUP compiles a kv format's at start)"
                        )
                    log.info(
                        what,
                        extra={
                            "kernel": kernel,
                            "constants": dict(constants or {}),
                            "seconds": seconds,
                            "warmup": warming,
                        },
                    )
            return self._pipelines[key]

    def __len__(self) -> int:
        """How many pipelines have been compiled (each a distinct kernel and constants)."""
        with self._lock:
            return len(self._pipelines)

    def warm_up(self) -> None:
        """Compile every kernel the device can run now (at start), so a bad
        shader fails the start: all but the tqx kernels of the formats outside
        TQX_WARM (compiled on first use; their code paths are the warm formats')."""
        features = set(self._device.features)
        for name, spec in KERNELS.items():
            if spec.warm and set(spec.features) <= features:
                self.get(name)
        self._started = True
