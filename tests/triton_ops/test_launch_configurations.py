"""Every launch configuration a GPU user gets (the 16-bit tiles, their code paths), run in
its own dtype on the interpreter against the float64 reference.

The runs are derived from each kernel's ``static_cases()`` and select their tiles through
the launch's own selection function, so a configuration added to a kernel runs here or
``make test --launch-coverage`` names it (tests/_launch_coverage.py). Shapes span two
tiles in every tiled dimension with a ragged last tile. Tolerances: the relative RMSE
per dtype of ``FLOAT64_REL_RMSE`` (tests/_helpers.py), the one table."""
import pytest
import torch

from .._helpers import DEVICE, assert_matches_float64

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _ids(runs):
    return ["-".join(str(p) for p in run) for run in runs]


# ----------------------------------------------------------------------------
# shared_matrix: (activations, weights) x tile x split
# ----------------------------------------------------------------------------

def _shared_matrix_runs():
    from laminae.triton_ops.shared_matrix import static_cases

    return sorted({(c.tags["x"], c.tags["weights"], c.tags["tile"], c.constexprs["SPLIT"])
                   for c in static_cases() if c.name == "shared_matrix_fwd"})


SHARED_MATRIX_RUNS = _shared_matrix_runs()


@pytest.mark.parametrize("x, weights, tile, split", SHARED_MATRIX_RUNS, ids=_ids(SHARED_MATRIX_RUNS))
def test_shared_matrix_every_tile_against_float64(x, weights, tile, split):
    """Forward, dx and dW (the weight gradient with and without a delta) at each tile."""
    from laminae.primitives.shared_matrix import shared_matrix_reference
    from laminae.triton_ops.shared_matrix import DW_TILES, SMALL_M, TILES, _dtype_class, _tile, shared_matrix

    dtype, pdtype = _DTYPES[x], _DTYPES[weights]
    block_m, block_n, block_k = TILES[_dtype_class(dtype)][tile][:3]
    block_r, block_c = DW_TILES[_dtype_class(dtype)][:2]
    # tokens pick the tile (a decode-sized batch stays within one BLOCK_M); rows and
    # columns span two output tiles of fwd, dx and dW, ragged, and several K steps
    m = SMALL_M if tile == "small_m" else block_m + 3
    assert _tile(m, dtype)[:3] == (block_m, block_n, block_k)
    rows, cols = max(block_n, block_r, block_k) + 5, max(block_n, block_c, block_k) + 3
    gen = torch.Generator().manual_seed(3)
    inp = {"x": torch.randn(m, cols, generator=gen).to(DEVICE, dtype),
           "weight": (torch.randn(rows + 2, cols + 4, generator=gen) * cols ** -0.5).to(DEVICE, pdtype),
           "scale": torch.tensor([0.8], device=DEVICE, dtype=pdtype),
           "rows": rows, "cols": cols, "ratio": 3.0 if split else 1.0, "output_divisor": 2.0}
    if split:
        inp["delta"] = torch.randn(rows + 2, cols + 4, generator=gen).to(DEVICE, pdtype)
    grads = [k for k in ("x", "weight", "delta", "scale") if k in inp]
    # dσ is one sum of G ⊙ W_τ whose terms cancel: in 16 bits the reference run in the
    # inputs' dtype is itself past the bound, and the op may be twice as far as it is
    assert_matches_float64(shared_matrix, shared_matrix_reference, inp, grads, dtype=dtype,
                           conditioning=2 if dtype != torch.float32 else None)
