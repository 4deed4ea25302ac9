"""torch tensors through the client (attnserve_client.tensors) against the live server:
every form answers, bit for bit, what the same call with numpy arrays answers, as a
tensor on q's device in q's dtype. torch is installed by the test command."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnserve_client as ac
from attnserve_client import tensors

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
    assert np.shares_memory(tensors.as_float32(t, name="q"), t.numpy())
    out = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert np.shares_memory(tensors.answer(out, t).numpy(), out)  # writable: wrapped
    frozen = np.frombuffer(out.tobytes(), np.float32).reshape(2, 4)
    back = tensors.answer(frozen, t)
    assert not np.shares_memory(back.numpy(), frozen) and torch.equal(back, torch.from_numpy(out))
    assert tensors.answer(out, out.tolist()) is out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the H200 by bench/probes)")
def test_cuda_tensors_answer_on_their_device(client):
    a, b = twins(client)
    q = rand(3, H, D, dtype=torch.bfloat16).cuda()
    got = a.attend(0, q)
    assert got.device == q.device and got.dtype == torch.bfloat16
    assert torch.equal(got.cpu(), torch.from_numpy(b.attend(0, q.float().cpu().numpy()).copy()).bfloat16())
