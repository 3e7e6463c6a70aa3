import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from laminae.primitives.blocks.losses import abstention_loss, cross_entropy, shift_labels, z_loss


@given(seq=st.integers(1, 7), vocab=st.integers(2, 11), p_ignore=st.sampled_from([0.0, 0.5, 1.0]))
def test_cross_entropy_matches_torch_with_ignore_index(seq, vocab, p_ignore):
    logits = torch.randn(2, seq, vocab, requires_grad=True)
    labels = torch.randint(vocab, (2, seq))
    labels[torch.rand(2, seq) < p_ignore] = -100
    got = cross_entropy(logits, labels)
    if (labels != -100).any():
        torch.testing.assert_close(got, F.cross_entropy(logits.view(-1, vocab), labels.view(-1)))
    else:
        assert got.item() == 0.0
    got.backward()          # a graph even when nothing is valid
    torch.testing.assert_close(cross_entropy(logits, labels, num_items=4),
                               F.cross_entropy(logits.view(-1, vocab), labels.view(-1), reduction="sum") / 4)


def test_shift_labels():
    assert shift_labels(torch.tensor([[1, 2, 3]])).tolist() == [[2, 3, -100]]
    assert shift_labels(torch.tensor([[1, 2, 3]]), 2).tolist() == [[3, -100, -100]]


def test_z_loss_is_the_mean_square_logsumexp_of_valid_positions():
    logits = torch.randn(2, 4, 5)
    labels = torch.tensor([[1, -100, 2, 3], [-100, -100, 0, 1]])
    valid = labels != -100
    want = torch.logsumexp(logits, -1)[valid].square().mean()
    torch.testing.assert_close(z_loss(logits, labels), want)


def test_abstention_loss_targets_wrong_top1():
    logits = torch.tensor([[[5.0, 0.0], [0.0, 5.0]]])
    labels = torch.tensor([[0, 0]])                      # right, then wrong
    a = torch.tensor([[0.3, -0.2]])
    want = F.binary_cross_entropy_with_logits(a[0], torch.tensor([0.0, 1.0]), pos_weight=torch.tensor(8.0))
    torch.testing.assert_close(abstention_loss(a, logits, labels), want)
