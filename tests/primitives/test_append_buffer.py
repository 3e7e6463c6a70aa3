"""The shared copy-on-branch storage beyond linear appends (those: tests/test_protocol.py):
the write-version mark, scattered rows at data-dependent positions (MoSRAH's per-head
rows), and the storage dtype."""
import torch

from laminae.primitives import AppendBuffer


def _rows(values):
    """[1, len(values), 1] float rows."""
    return torch.tensor(values, dtype=torch.float32)[None, :, None]


def test_scattered_rows_write_in_place_on_the_newest_buffer_and_branch_otherwise():
    base = AppendBuffer.preallocate(16, {"v": ((1,), torch.float32)}, batch=1)
    one = base.scatter(2, torch.tensor([[1, 0]]), v=_rows([10.0, 20.0]))       # positions 1 and 0
    assert one._storage is base._storage and one.get("v")[0, :, 0].tolist() == [20.0, 10.0]
    two = one.scatter(2, torch.tensor([[3, 2]]), v=_rows([30.0, 40.0]))         # in place again
    assert two._storage is one._storage and two.get("v")[0, :, 0].tolist() == [20.0, 10.0, 40.0, 30.0]
    # `one` is behind the storage's newest write: its next write copies its own rows first
    other = one.scatter(2, torch.tensor([[2, 3]]), v=_rows([-1.0, -2.0]))
    assert other._storage is not two._storage and other.capacity == two.capacity
    assert other.get("v")[0, :, 0].tolist() == [20.0, 10.0, -1.0, -2.0]
    assert two.get("v")[0, :, 0].tolist() == [20.0, 10.0, 40.0, 30.0]           # the other branch is intact
    assert one.length == 2 and one.get("v")[0, :, 0].tolist() == [20.0, 10.0]


def test_scattered_rows_grow_by_doubling_and_keep_the_storage_dtype():
    buf = AppendBuffer.preallocate(16, {"k": ((2,), torch.bfloat16)}, batch=2)
    for t in range(20):
        index = torch.full((2, 1, 2), t)                                          # broadcast over the trailing dim
        buf = buf.scatter(1, index[..., 0], k=torch.full((2, 1, 2), t + 0.5, dtype=torch.float32))
    assert buf.length == 20 and buf.capacity == 32
    k = buf.get("k")
    assert k.dtype == torch.bfloat16 and k[:, :, 0].float().tolist() == [[t + 0.5 for t in range(20)]] * 2


def test_a_buffer_made_by_hand_from_a_storage_copies_before_writing():
    """The version mark: only a buffer returned by the newest write writes in place, so
    a buffer rebuilt around the same storage and length (as a reset does) cannot
    overwrite what its lineage holds."""
    buf = AppendBuffer().append(v=_rows([1.0, 2.0]))
    again = AppendBuffer(buf._storage, buf.length).append(v=_rows([3.0]))
    assert again._storage is not buf._storage
    assert buf.append(v=_rows([4.0]))._storage is buf._storage                   # the newest buffer still does
    assert again.get("v")[0, :, 0].tolist() == [1.0, 2.0, 3.0]
