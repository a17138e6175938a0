"""Compiled CPU kernels (numba): the ``cpu`` backend of :mod:`gradops.backend`.

Importing this package needs numba; without it the import fails and the dispatcher uses the pure-torch
reference instead. numba's on-disk cache goes to ``$GRADOPS_CACHE_DIR`` (default ``~/.cache/gradops/numba``)
unless ``NUMBA_CACHE_DIR`` is already set: the default, next to the source, fails in a read-only
site-packages. The variable must be set before numba is imported, hence here, first.
"""

from __future__ import annotations

import os
import sys


def cache_dir() -> str:
    """Where compiled kernels are cached (GRADOPS_CACHE_DIR, else NUMBA_CACHE_DIR, else ~/.cache/gradops/numba)."""
    return (os.environ.get("GRADOPS_CACHE_DIR") or os.environ.get("NUMBA_CACHE_DIR")
            or os.path.join(os.path.expanduser("~"), ".cache", "gradops", "numba"))


os.environ["NUMBA_CACHE_DIR"] = cache_dir()
if sys.modules.get("numba") is not None:  # numba read its config already: point the cache locator at our directory
    sys.modules["numba"].config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]

import numba  # noqa: F401  (an ImportError here is how the dispatcher learns that numba is missing)

from .embedding import embedding_dense_backward, embedding_dense_backward_workspace
from .hardswish import hardswish, hardswish_backward
from .layer_norm import (
    layer_norm,
    layer_norm_backward,
    layer_norm_backward_workspace,
    layer_norm_grad,
    layer_norm_grad_beta,
    layer_norm_grad_beta_workspace,
)
from .moe_permute import moe_token_permute_grad
from .rms_norm import rms_norm, rms_norm_grad, rms_norm_grad_workspace

__all__ = [
    "cache_dir", "embedding_dense_backward", "embedding_dense_backward_workspace", "hardswish",
    "hardswish_backward", "layer_norm", "layer_norm_backward", "layer_norm_backward_workspace", "layer_norm_grad",
    "layer_norm_grad_beta", "layer_norm_grad_beta_workspace", "moe_token_permute_grad", "rms_norm",
    "rms_norm_grad", "rms_norm_grad_workspace",
]
