"""torch tensors through the client (attnserve_client.tensors) against the live server:
every form answers, bit for bit, what the same call with numpy arrays answers, as a
tensor on q's device in q's dtype (or out_dtype's). float32, float16 and bfloat16
tensors go on the wire as they are (no copy for a contiguous CPU tensor) and answers
are rebuilt from their bytes. torch is installed by the test command."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnserve_client as ac
from attnserve_client import tensors, wire

H, KV, D = 6, 2, 16
gen = torch.Generator().manual_seed(3)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.fixture
def client(live_server_url):
    with ac.Client(live_server_url) as c:
        yield c


def twins(client):
    """Two sessions with the same rows: one fed tensors, one numpy."""
    a = client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
    b = client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
    k, v = rand(37, KV, D), rand(37, KV, D)
    a.append(0, k, v)
    b.append(0, k.numpy(), v.numpy())
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_session_attend_takes_and_answers_tensors(client, dtype):
    a, b = twins(client)
    q, k, v = rand(5, H, D, dtype=dtype), rand(3, KV, D, dtype=dtype), rand(3, KV, D, dtype=dtype)
    got = a.attend(0, q, k=k, v=v)
    want = b.attend(0, q.float().numpy(), k=k.float().numpy(), v=v.float().numpy())
    assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.device == q.device
    assert torch.equal(got, torch.from_numpy(want.copy()).to(dtype))
    assert tuple(a.lengths) == tuple(b.lengths) == (40,)


def test_layouts_and_grad_are_taken_as_values(client):
    a, b = twins(client)
    q = rand(H, 4, D).transpose(0, 1)  # not contiguous
    q.requires_grad_(True)
    got = a.attend(0, q)
    want = b.attend(0, q.detach().contiguous().numpy())
    assert got.is_contiguous() and not got.requires_grad
    assert np.array_equal(got.numpy(), want)


def test_batch_stacked_and_stream_forms(client, live_server_url):
    (a, b), (c, d) = twins(client), twins(client)
    q = rand(2, 1, H, D, dtype=torch.bfloat16)
    k, v = rand(2, 1, KV, D), rand(2, 1, KV, D)
    got = client.attend_stacked([a, c], 0, q, k, v)
    want = client.attend_stacked([b, d], 0, q.float().numpy(), k.numpy(), v.numpy())
    assert got.dtype == torch.bfloat16 and got.shape == (2, 1, H, D)
    assert torch.equal(got, torch.from_numpy(want.copy()).to(torch.bfloat16))
    items = [ac.AttendItem(a, 0, q[0]), ac.AttendItem(c, 0, q[1].float().numpy())]
    outs = client.attend_batch(items)
    assert isinstance(outs[0], torch.Tensor) and isinstance(outs[1], np.ndarray)
    with client.stream() as s:
        one = s.attend(a, 0, q[0, 0:1].float())
        stacked = s.attend_stacked([a, c], 0, q[:, 0].float())  # [B, H, d]: answered [B, H, d]
        batch = s.attend_batch([ac.AttendItem(c, 0, q[1].float())])
    assert isinstance(one, torch.Tensor) and one.shape == (1, H, D)
    assert stacked.shape == (2, H, D) and isinstance(stacked, torch.Tensor)
    assert torch.equal(stacked[0], one[0]) and torch.equal(batch[0][0], stacked[1])


def test_a_tensor_that_is_not_float_is_refused_before_sending(client):
    a, _ = twins(client)
    with pytest.raises(ac.InvalidInput, match="q: expected a float tensor"):
        a.attend(0, torch.ones(1, H, D, dtype=torch.int32))
    with pytest.raises(ac.InvalidInput, match="k: expected a float tensor"):
        client.attend_stacked([a], 0, rand(1, H, D), torch.ones(1, KV, D, dtype=torch.int64), rand(1, KV, D))
    assert tuple(a.info().lengths) == (37,)


def test_conversion_without_copies_where_the_layout_allows():
    t = rand(4, H, D)
    assert np.shares_memory(tensors.as_wire_array(t, name="q"), t.numpy())
    out = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert np.shares_memory(tensors.answer(out, t).numpy(), out)  # writable: wrapped
    frozen = np.frombuffer(out.tobytes(), np.float32).reshape(2, 4)
    back = tensors.answer(frozen, t)
    assert not np.shares_memory(back.numpy(), frozen) and torch.equal(back, torch.from_numpy(out))
    assert tensors.answer(out, out.tolist()) is out


WIRE = {
    torch.float32: ("<f4", np.float32),
    torch.float16: ("<f2", np.float16),
    torch.bfloat16: ("bfloat16", wire.BFLOAT16),
}


def bits(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes as they lie in memory."""
    t = t.contiguous()
    return (t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)).numpy().tobytes()


@pytest.mark.parametrize("dtype", list(WIRE))
def test_tensors_go_on_the_wire_in_their_dtype_without_a_copy(dtype):
    t = rand(4, H, D, dtype=dtype)
    arr = tensors.as_wire_array(t, name="q")
    name, held = WIRE[dtype]
    assert arr.dtype == held and arr.shape == (4, H, D) and arr.flags.c_contiguous
    assert arr.ctypes.data == t.data_ptr() and arr.tobytes() == bits(t)  # the tensor's own memory
    enc = wire.encode_array(arr, name="q")
    assert enc["dtype"] == name and enc["data"] == bits(t)
    t.view(torch.int16 if dtype != torch.float32 else torch.int32)[0, 0, 0] = 0  # a view: writes show through
    assert arr.tobytes() == bits(t)
    # a strided view is copied once, in its dtype; a tensor that needs grad goes as its value
    strided = rand(H, 4, D, dtype=dtype).transpose(0, 1).requires_grad_(True)
    arr = tensors.as_wire_array(strided, name="q")
    assert arr.dtype == held and arr.flags.c_contiguous and arr.tobytes() == bits(strided.detach())
    # float64 is not on the wire: float32, as before
    wide = rand(2, H, D, dtype=torch.float64)
    assert tensors.as_wire_array(wide, name="q").tobytes() == bits(wide.float())


@pytest.mark.parametrize("dtype", list(WIRE))
def test_answers_are_rebuilt_from_their_bytes_in_the_tensor_s_dtype(dtype):
    name, _ = WIRE[dtype]
    out = tensors.to_wire_dtype(np.random.default_rng(4).standard_normal((2, H, D)).astype(np.float32), name)
    like = rand(1, H, D, dtype=dtype)
    back = tensors.answer(out, like)
    assert back.dtype == dtype and bits(back) == out.tobytes()
    assert back.data_ptr() == out.ctypes.data  # writable bytes: wrapped, no copy
    frozen = np.frombuffer(out.tobytes(), out.dtype).reshape(out.shape)  # as decoded from a message
    back = tensors.answer(frozen, like)
    assert back.data_ptr() != frozen.ctypes.data and bits(back) == out.tobytes()
    back.zero_()  # the tensor owns what it holds: the message's bytes stay
    assert frozen.tobytes() == out.tobytes()
    # another dtype, asked for (out_dtype) or q's (float64): a cast of the exact values
    assert tensors.answer(out, like, "<f4").dtype == torch.float32
    widened = tensors.answer(out, rand(1, dtype=torch.float64))
    assert widened.dtype == torch.float64 and np.array_equal(widened.numpy(), wire.to_float32(out))
    assert tensors.answer(out, out.tolist()) is out  # numpy queries: the array as it came


@pytest.mark.parametrize(
    "given, name",
    [
        (torch.float32, "<f4"),
        (torch.float16, "<f2"),
        (torch.bfloat16, "bfloat16"),
        ("float16", "<f2"),
        (np.float16, "<f2"),
        (wire.BFLOAT16, "bfloat16"),
        (None, None),
    ],
)
def test_out_dtype_names(given, name):
    assert tensors.out_dtype_name(given) == name


@pytest.mark.parametrize("bad", [torch.float64, torch.int8, "torch.bfloat16", np.int16, "f2", 16])
def test_out_dtype_refuses_what_the_wire_does_not_carry(bad):
    with pytest.raises(wire.WireError, match=r"^out_dtype: expected one of \['<f2', '<f4', 'bfloat16'\]"):
        tensors.out_dtype_name(bad)


def test_out_dtype_through_every_form(client):
    (a, b), (c, d) = twins(client), twins(client)
    q = rand(2, 1, H, D, dtype=torch.bfloat16)
    want = client.attend_stacked([b, d], 0, q.float().numpy(), causal=False)  # float32 of the same values
    got = client.attend_stacked([a, c], 0, q, causal=False, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(want.copy()))
    half = a.attend(0, q[0], causal=False, out_dtype="float16")
    assert half.dtype == torch.float16 and torch.equal(half, got[0].half())
    items = [ac.AttendItem(a, 0, q[0], causal=False, out_dtype="<f4"), ac.AttendItem(c, 0, q[1], causal=False)]
    outs = client.attend_batch(items)
    assert torch.equal(outs[0], got[0]) and outs[1].dtype == torch.bfloat16 and torch.equal(outs[1], got[1].bfloat16())
    with client.stream() as s:
        one = s.attend(a, 0, q[0], causal=False, out_dtype=np.float32)
        stacked = s.attend_stacked([a, c], 0, q[:, 0], causal=False, out_dtype="bfloat16", return_lse=True)
    assert torch.equal(one, got[0])
    assert stacked.out.dtype == torch.bfloat16 and torch.equal(stacked.out, got[:, 0].bfloat16())


def test_numpy_halves_answer_in_their_dtype_as_the_server_rounds(client):
    a, b = twins(client)
    q32 = rand(3, H, D).numpy()
    halves = {"<f2": q32.astype(np.float16), "bfloat16": wire.to_bfloat16(q32)}
    for name, q in halves.items():
        want = b.attend(0, wire.to_float32(q), causal=False)  # float32 of the same values
        got = a.attend(0, q, causal=False)  # rounded on the server's GPU, as wire.to_bfloat16 and numpy round
        assert got.dtype == wire.DTYPES[name] and got.tobytes() == tensors.to_wire_dtype(want, name).tobytes()
        assert a.attend(0, q, causal=False, out_dtype="<f4").tobytes() == want.tobytes()


def test_frames_carry_halves_as_they_are(start_live_server):
    server = start_live_server(frames_port=0)
    try:
        with ac.Client(server.url) as c:
            a, b = twins(c)
            q = rand(2, 1, H, D, dtype=torch.float16)
            with c.stream(transport="frames") as s:
                got = s.attend_stacked([a, b], 0, q, causal=False)
                brain = wire.to_bfloat16(q[0].float().numpy())
                wide = s.attend(a, 0, brain, causal=False, out_dtype="<f4")
            want = c.attend_stacked([a, b], 0, q, causal=False)
            assert got.dtype == torch.float16 and torch.equal(got, want)
            assert wide.dtype == np.float32
            assert wide.tobytes() == a.attend(0, wire.to_float32(brain), causal=False).tobytes()
    finally:
        server.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the H200 by bench/probes)")
def test_cuda_tensors_answer_on_their_device(client):
    a, b = twins(client)
    q = rand(3, H, D, dtype=torch.bfloat16).cuda()
    got = a.attend(0, q)
    assert got.device == q.device and got.dtype == torch.bfloat16
    assert torch.equal(got.cpu(), torch.from_numpy(b.attend(0, q.float().cpu().numpy()).copy()).bfloat16())
