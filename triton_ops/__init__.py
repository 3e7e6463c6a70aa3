"""laminae.triton_ops: Triton forward/backward kernels, one file per mechanism.

Each public function has the signature of its ``*_reference`` twin in
``laminae.primitives`` and is differentiable (registered with
``torch.library.triton_op`` + ``register_autograd``)."""
from .laurel import laurel

__all__ = ["laurel"]
