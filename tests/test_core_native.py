"""The compiled command recording (attnserve/gpu/native.py, _commands.c): what it
records is what the batch planned (a command buffer returned and submitted apart
reads back the same bytes as one submitted in the same call), a program that is
not whole commands is refused before any GPU call, wgpu-native's validation errors
come back as wgpu's exceptions and leave the device serving, and a module built
from another version of the source is refused."""

from __future__ import annotations

import hashlib
from array import array

import numpy as np
import pytest
import wgpu

from attnserve.gpu import native
from attnserve.gpu.batch import Batch
from tools import reference as ref

from _core import filled, rel_err, rows, session

pytestmark = pytest.mark.gpu


def _batch(engine, ctx) -> Batch:
    return Batch(ctx.device, ctx.pipelines, engine.worker.arenas, ctx.offset_align, engine.policy)


def test_returned_and_submitted_commands_read_back_the_same(engine, rng):
    kv, layer, k, v = filled(engine, rng, "f32", 4, 2, 40, 37)
    q = rows(rng, 3, 4, 40)

    def both(ctx):
        got = []
        for submit in (True, False):
            batch = _batch(engine, ctx)
            finish = engine.plan_attend(layer, q)(batch)
            encoded = batch.encode(submit=submit)
            assert (encoded[0] is None) == submit
            batch.queue_submit(encoded)
            got.append(finish(batch.read_back(encoded)).out)
        return got

    in_call, apart = engine.call(both).result()
    assert in_call.tobytes() == apart.tobytes()
    assert rel_err(in_call, ref.attention(q, k, v, start_pos=34)) <= 1e-5
    engine.release(kv).result()


@pytest.mark.parametrize(
    "words, message",
    [([native.OP_DISPATCH, 0, 0, 1, 1], "not whole commands"), ([7, 0, 0, 0, 0, 0], "command 0 has no opcode")],
)
def test_a_bad_program_is_refused_before_any_gpu_call(engine, words, message):
    def bad(ctx):
        with pytest.raises(ValueError, match=message):
            native.run(ctx.device, [], array("Q", words))

    engine.call(bad).result()


def test_a_validation_error_is_raised_and_the_device_serves_on(engine, rng):
    def invalid(ctx):
        usage = wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        a = ctx.device.create_buffer(size=64, usage=usage)
        b = ctx.device.create_buffer(size=64, usage=usage)
        program = array("Q", [native.OP_COPY, native.handle(a), 0, native.handle(b), 0, 4096])  # past both ends
        for submit in (True, False):
            with pytest.raises(wgpu.GPUValidationError):
                native.run(ctx.device, [], program, submit=submit)

    engine.call(invalid).result()
    kv = session(engine, "f32", 2, 1, 16)
    k, v = rows(rng, 5, 1, 16), rows(rng, 5, 1, 16)
    q = rows(rng, 1, 2, 16)
    out = engine.attend(kv.layers[0], q, k=k, v=v).result().out
    assert rel_err(out, ref.attention(q, k, v, start_pos=4)) <= 1e-5
    engine.release(kv).result()


def test_writes_land_at_their_offsets(engine):
    data = np.arange(24, dtype=np.uint32)

    def write(ctx):
        buf = ctx.device.create_buffer(size=256, usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST)
        h = native.handle(buf)
        native.run(ctx.device, [(h, 0, data[:8]), (h, 128, memoryview(data[8:].tobytes())), (h, 64, b"")], b"")
        return np.frombuffer(ctx.device.queue.read_buffer(buf), np.uint32)

    got = engine.call(write).result()
    assert got[:8].tolist() == data[:8].tolist()
    assert got[32:48].tolist() == data[8:].tolist()
    assert not got[8:32].any() and not got[48:].any()


def test_a_module_built_from_another_source_is_refused(tmp_path):
    source = tmp_path / "_commands.c"
    source.write_bytes(b"/* not the source the module was built from */\n")
    with pytest.raises(ImportError, match="built from an older _commands.c"):
        native._check_build(source)
    native._check_build(tmp_path / "absent.c")  # an installed wheel ships no source
    checkout = native.Path(native.__file__).with_name("_commands.c")
    assert hashlib.sha256(checkout.read_bytes()).hexdigest() == native._commands.SOURCE_DIGEST
