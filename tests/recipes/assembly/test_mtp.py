import torch

from laminae.primitives.blocks.losses import cross_entropy
from laminae.recipes.assembly.mtp import MTPHead, mtp_loss


def test_mtp_heads_start_as_the_lm_head_and_average_offsets():
    head = torch.nn.Linear(6, 9, bias=False)
    hidden, labels = torch.randn(2, 5, 6), torch.randint(9, (2, 5))
    heads = [MTPHead(6), MTPHead(6)]
    want = (cross_entropy(head(hidden[:, :-2]), labels[:, 2:]) + cross_entropy(head(hidden[:, :-3]), labels[:, 3:])) / 2
    torch.testing.assert_close(mtp_loss(heads, hidden, labels, head), want)
    assert mtp_loss(heads, hidden[:, :2], labels[:, :2], head).item() == 0.0
