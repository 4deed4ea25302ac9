"""Every shader compiles; every params mirror has the sizes and offsets the WGSL reads."""

from __future__ import annotations

import re

import numpy as np
import pytest

from attnserve.gpu import params as P
from attnserve.gpu.shaders import KERNELS, load_wgsl, shader_dir


def test_shaders_found_and_every_kernel_listed():
    files = {p.name for p in shader_dir().glob("*.wgsl")}
    assert files == {spec.file for spec in KERNELS.values()}
    assert {"attention_prefill.wgsl", "flash_attention_tq.wgsl", "turboquant.wgsl"} <= files
    for name, spec in KERNELS.items():
        assert f"fn {spec.entry_point}(" in load_wgsl(spec.file), name


def test_includes_expand_and_fail_loudly(tmp_path, monkeypatch):
    from attnserve.gpu import shaders

    for spec in KERNELS.values():
        src = load_wgsl(spec.file)
        assert "#include" not in src and not re.search(r"\{[A-Z][A-Z0-9_]*\}", src), spec.file
    assert "stride < head_dim" in load_wgsl("turboquant.wgsl")  # the butterfly is really inlined
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "x.wgsl").write_text("    let y = {VALUE};\n")
    (tmp_path / "a.wgsl").write_text('fn f() {\n    // #include "x.wgsl" VALUE="1 + 2"\n}\n')
    (tmp_path / "b.wgsl").write_text('fn f() {\n    // #include "x.wgsl"\n}\n')
    monkeypatch.setattr(shaders, "shader_dir", lambda: tmp_path)
    assert shaders._expand((tmp_path / "a.wgsl").read_text()) == "fn f() {\n    let y = 1 + 2;\n}\n"
    with pytest.raises(ValueError, match="VALUE"):
        shaders._expand((tmp_path / "b.wgsl").read_text())


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_every_kernel_compiles(engine, kernel):
    missing = set(KERNELS[kernel].features) - set(engine.ctx.features)
    if missing:
        from _core import no_adapter

        no_adapter(f"{kernel} needs the device features {sorted(missing)}")
    pipe, layout = engine.call(lambda ctx: ctx.pipelines.get(kernel)).result()
    assert pipe is not None and layout is not None


@pytest.mark.gpu
def test_bad_wgsl_is_rejected(engine):
    # The compile test above can fail: a broken shader raises at module creation.
    def compile_bad(ctx):
        ctx.device.create_shader_module(code="@compute @workgroup_size(1) fn main() { let x: u32 = 1.5; }")

    with pytest.raises(Exception):
        engine.call(compile_bad).result()


@pytest.mark.parametrize("key", sorted(P.PARAMS_OF))
def test_params_layout_matches_wgsl(key):
    file, var = key
    dtype = P.PARAMS_OF[key]
    src = load_wgsl(file)
    decl = re.search(rf"var<storage, read> {var}: array<u32, (\d+)>;", src)
    assert decl, f"{var} not declared in {file}"
    assert dtype.itemsize == 4 * int(decl.group(1)), (dtype.itemsize, decl.group(1))
    # every `let NAME = [bitcast<f32>(]var[i]` read sits at the field's offset
    reads = re.findall(rf"let (\w+) = (bitcast<f32>\()?{var}\[(\d+)\]", src)
    assert reads, f"no reads of {var} in {file}"
    seen = set()
    for name, bitcast, idx in reads:
        assert name in dtype.names, f"{file}: {name} is read but has no host field"
        off = dtype.fields[name][1]
        assert off == 4 * int(idx), f"{file}: {name} at word {idx}, host offset {off}"
        want_kind = "f" if bitcast else "u"
        assert dtype.fields[name][0].kind == want_kind, f"{file}: {name} kind"
        seen.add(name)
    # fields a kernel takes from a pipeline override constant instead, marked
    # `let NAME = CONSTANT;  // = var[i]` (the host sets both from one value)
    for name, idx in re.findall(rf"let (\w+) = [A-Z_]+;\s*// = {var}\[(\d+)\]", src):
        assert name in dtype.names, f"{file}: {name} has no host field"
        assert dtype.fields[name][1] == 4 * int(idx), f"{file}: {name} at word {idx}"
        seen.add(name)
    # centroids read in an array literal in flash_attention_tq: c0..c3 at words 10..13
    for i, word in enumerate(re.findall(rf"bitcast<f32>\({var}\[(\d+)\]\),", src)):
        name = f"c{i}"
        assert dtype.fields[name][1] == 4 * int(word)
        seen.add(name)
    unread = [n for n in dtype.names if n not in seen and not n.startswith("_") and n != "n_queries" and n != "n_rows"]
    assert not unread, f"{file}: host fields never read by the shader: {unread}"


def test_pack_rejects_unknown_fields_and_bitcasts_floats():
    raw = P.pack(P.PREFILL_PARAMS, n_heads=3, scale=0.5, flags=P.FLAG_NON_CAUSAL)
    words = np.frombuffer(raw, np.uint32)
    assert words[0] == 3 and words[11] == 1
    assert words[5] == np.float32(0.5).view(np.uint32)
    with pytest.raises(KeyError):
        P.pack(P.PREFILL_PARAMS, nonsense=1)
