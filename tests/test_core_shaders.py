"""Every shader compiles; every params struct the WGSL reads is the host block, field by field."""

from __future__ import annotations

import re

import numpy as np
import pytest

from attnserve.gpu import params as P
from attnserve.gpu.shaders import KERNELS, load_wgsl, plain_kernel, shader_dir, wgsl_files


def test_shaders_found_and_every_kernel_listed():
    files = {p.name for p in shader_dir().glob("*.wgsl")}
    assert files == {spec.file for spec in KERNELS.values()}
    assert all(spec.folder is None for spec in KERNELS.values())  # the server builds shipped kernels only
    assert {"attention_prefill.wgsl", "flash_attention_tqx.wgsl", "tqx.wgsl", "tq_rotate.wgsl"} <= files
    for name, spec in KERNELS.items():
        assert f"fn {spec.entry_point}(" in load_wgsl(spec.file, spec.defines), name


def test_every_shipped_wgsl_is_built_by_a_kernel():
    """What ships under shaders/ (the wheel's attnserve/shaders) is exactly the files
    the kernels the server can build are made of: each kernel's file and its includes,
    transitively (research kernels live in bench/probes/shaders)."""
    root = shader_dir()
    shipped = {p.relative_to(root).as_posix() for p in root.rglob("*.wgsl")}
    used = set()
    for spec in KERNELS.values():
        used |= {p.relative_to(root).as_posix() for p in wgsl_files(spec.file, spec.defines, spec.folder)}
    assert not shipped - used, f"shipped but built by no kernel: {sorted(shipped - used)}"
    assert used <= shipped
    assert {"tqx.wgsl", "include/tqx_codebooks.wgsl", "include/kv_vec4_f16.wgsl"} <= used


def test_includes_expand_and_fail_loudly(tmp_path, monkeypatch):
    from attnserve.gpu import shaders

    for spec in KERNELS.values():
        src = load_wgsl(spec.file, spec.defines)
        assert "#include" not in src and not re.search(r"\{[A-Z][A-Z0-9_]*\}", src), spec.file
    assert "stride < head_dim" in load_wgsl("tq_rotate.wgsl")  # the butterfly is really inlined
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "x.wgsl").write_text("    let y = {VALUE};\n")
    (tmp_path / "a.wgsl").write_text('fn f() {\n    // #include "x.wgsl" VALUE="1 + 2"\n}\n')
    (tmp_path / "b.wgsl").write_text('fn f() {\n    // #include "x.wgsl"\n}\n')
    monkeypatch.setattr(shaders, "shader_dir", lambda: tmp_path)
    assert shaders._expand((tmp_path / "a.wgsl").read_text()) == "fn f() {\n    let y = 1 + 2;\n}\n"
    with pytest.raises(ValueError, match="VALUE"):
        shaders._expand((tmp_path / "b.wgsl").read_text())
    # defines name the include and fill its placeholders; an include's own args win
    (tmp_path / "include" / "kv_f16.wgsl").write_text("    let z = {KV} + {VALUE};\n")
    (tmp_path / "c.wgsl").write_text('// {KV}\n// #include "kv_{KV}.wgsl" VALUE=3\n')
    got = shaders._expand((tmp_path / "c.wgsl").read_text(), {"KV": "f16", "VALUE": "9"})
    assert got == "// f16\n    let z = f16 + 3;\n"
    # a kernel of another folder includes from its own include/ and the shipped one;
    # a shipped kernel sees only the shipped includes, and one name in both is refused
    research = tmp_path / "research"
    (research / "include").mkdir(parents=True)
    (research / "include" / "own.wgsl").write_text('    // #include "x.wgsl" VALUE=5\n')
    (research / "r.wgsl").write_text('fn g() {\n    // #include "own.wgsl"\n}\n')
    assert shaders._expand((research / "r.wgsl").read_text(), folder=research) == "fn g() {\n    let y = 5;\n}\n"
    assert shaders.wgsl_files("r.wgsl", folder=research) == {
        research / "r.wgsl",
        research / "include" / "own.wgsl",
        tmp_path / "include" / "x.wgsl",
    }
    with pytest.raises(FileNotFoundError):
        shaders._expand((research / "r.wgsl").read_text())
    (research / "include" / "x.wgsl").write_text("    let y = 0;\n")
    with pytest.raises(ValueError, match="x.wgsl is both in"):
        shaders._expand((research / "r.wgsl").read_text(), folder=research)


def test_plain_kernels_read_their_format():
    """Each plain kernel has a pipeline per plain format, reading that format's slab."""
    from attnserve.gpu.shaders import PLAIN_FORMATS

    assert PLAIN_FORMATS == ("f32", "f16", "bf16")
    for base in ("attention_prefill", "attention_prefill_tiled", "attention_prefill_rb", "attention_split"):
        f32, f16, bf16 = (KERNELS[plain_kernel(base, kv)] for kv in PLAIN_FORMATS)
        assert f32.file == f16.file == bf16.file and f32.entry_point == f16.entry_point == bf16.entry_point == base
        src32, src16, srcb16 = (load_wgsl(k.file, k.defines) for k in (f32, f16, bf16))
        assert "unpack2x16float" in src16 and "unpack2x16float" not in src32, base
        assert "array<vec2<u32>>" in src16 or "k_cache: array<u32>" in src16, base
        # bfloat16: widened by a shift or a mask, never read as IEEE halves
        assert "unpack2x16float" not in srcb16 and "0xffff0000u" in srcb16, base
        assert "array<vec2<u32>>" in srcb16 or "k_cache: array<u32>" in srcb16, base


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
    src = load_wgsl(file, next(s.defines for s in KERNELS.values() if s.file == file))
    decl = re.search(rf"var<storage, read> {var}: (?:array<(\w+)>|(\w+));", src)
    assert decl, f"{var} not declared in {file}"
    struct = decl.group(1) or decl.group(2)
    # one block per row (`let ALIAS = var[row];`), or the block copied (`let ALIAS = var;`)
    alias = re.findall(rf"let (\w+) = {var}(?:\[[^\]]*\])?;", src)
    if decl.group(1) or alias:
        assert len(set(alias)) == 1, f"{file}: {var} read through {alias}"
        var = alias[0]
    assert P.STRUCTS.get(struct) is dtype, f"{file}: {var} is a {struct}, not the host block"
    # the struct the shader compiles is the host's, field by field: same names,
    # same order, one 4-byte word each (so the same offsets), f32 where the host
    # packs f4
    body = re.search(rf"struct {struct} {{([^}}]*)}}", src)
    assert body, f"{file}: struct {struct} not declared"
    fields = re.findall(r"(\w+): (u32|f32),", body.group(1))
    assert [n for n, _ in fields] == list(dtype.names), (file, fields)
    assert len(fields) * 4 == dtype.itemsize
    for name, ty in fields:
        assert dtype.fields[name][0].itemsize == 4
        assert dtype.fields[name][0].kind == ("f" if ty == "f32" else "u"), f"{file}: {name} kind"
    # every `let NAME = var.FIELD` binds the field under its own name
    reads = re.findall(rf"let (\w+) = {var}\.(\w+);", src)
    assert reads, f"no reads of {var} in {file}"
    for name, field in reads:
        assert name == field, f"{file}: {field} read as {name}"
    # fields read anywhere (a let, an array literal), or taken from a pipeline
    # override constant instead, marked `let NAME = CONSTANT;  // = var.FIELD`
    code = re.sub(r"//(?! = ).*", "", src)
    seen = set(re.findall(rf"\b{var}\.(\w+)", code))
    assert seen <= set(dtype.names), f"{file}: reads fields the host does not pack"
    unread = [n for n in dtype.names if n not in seen and not n.startswith("_") and n != "n_queries" and n != "n_rows"]
    assert not unread, f"{file}: host fields never read by the shader: {unread}"


def test_pack_rejects_unknown_fields_and_bitcasts_floats():
    raw = P.pack(P.PREFILL_PARAMS, n_heads=3, scale=0.5, flags=P.FLAG_NON_CAUSAL)
    words = np.frombuffer(raw, np.uint32)
    assert words[0] == 3 and words[11] == 1
    assert words[5] == np.float32(0.5).view(np.uint32)
    with pytest.raises(KeyError):
        P.pack(P.PREFILL_PARAMS, nonsense=1)


@pytest.mark.gpu
def test_a_pipeline_made_after_the_start_is_logged(engine, caplog):
    """A kernel compiled on its first use after the device's start says so (on
    lavapipe its first dispatch may take seconds, which a request waits out); the
    same pipeline again says nothing."""
    constants = {"GROUP": 3, "HEAD_DIM": 124}  # a shape no other test specializes the rb kernel on
    kernel = plain_kernel("attention_prefill_rb", "f32")

    with caplog.at_level("INFO", logger="attnserve"):
        engine.call(lambda ctx: ctx.pipelines.get(kernel, constants)).result()
        engine.call(lambda ctx: ctx.pipelines.get(kernel, constants)).result()
    lines = [r for r in caplog.records if r.getMessage().startswith(f"compiled kernel {kernel} on its first use")]
    assert len(lines) == 1 and lines[0].constants == constants and lines[0].seconds >= 0
