"""minipar: every way deep-learning training is split across workers, in numpy, over real MPI ranks."""

from minipar import functional, nn, optim
from minipar.autograd import Function, Tensor, no_grad

__all__ = ["Function", "Tensor", "functional", "launch", "nn", "no_grad", "optim"]


def __getattr__(name: str):  # launch lives in the comm layer; imported on first use
    if name == "launch":
        from minipar.comm import launch

        return launch
    raise AttributeError(f"module 'minipar' has no attribute {name!r}")
