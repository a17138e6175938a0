"""Compiled CPU kernels (numba): the ``cpu`` backend of :mod:`gradops.backend`.

Importing this package needs numba; without it the import fails and the dispatcher uses the pure-torch
reference instead. numba's on-disk cache goes to a folder per version of these sources under
``$GRADOPS_CACHE_DIR`` (default ``~/.cache/gradops/numba``, or ``NUMBA_CACHE_DIR`` if that is set): the default,
next to the source, fails in a read-only site-packages. The variable must be set before numba is imported,
hence here, first.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import sys
import tempfile
import warnings


def _sources_fingerprint() -> str:
    """A hash of this package's sources. numba validates a cached kernel against its own file's timestamp only,
    so a kernel whose helper (``_reduce``, ``_numeric``) changed would keep its stale machine code; one cache
    folder per version of the sources makes that impossible (measured: an edited fold stayed stale)."""
    digest = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


def cache_dir() -> str:
    """Where compiled kernels are cached: ``<base>/<hash of the sources>``, base = GRADOPS_CACHE_DIR, else
    NUMBA_CACHE_DIR, else ~/.cache/gradops/numba."""
    base = (os.environ.get("GRADOPS_CACHE_DIR") or os.environ.get("NUMBA_CACHE_DIR")
            or os.path.join(os.path.expanduser("~"), ".cache", "gradops", "numba"))
    fingerprint = _sources_fingerprint()
    # A child process inherits NUMBA_CACHE_DIR as set below: already this version's folder, share it.
    return base if os.path.basename(os.path.normpath(base)) == fingerprint else os.path.join(base, fingerprint)


def _writable_cache_dir() -> str:
    """:func:`cache_dir` when it can be created and written, else a private temporary folder for this process (and
    its children), said once. numba itself would fall back to ``__pycache__`` beside these sources, a folder shared
    by every version of them, where a kernel whose helper changed keeps its stale machine code."""
    path = cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return path
    except OSError as err:
        private = tempfile.mkdtemp(prefix="gradops-numba-")
        owner = os.getpid()
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(private, ignore_errors=True))
        warnings.warn(f"gradops: the kernel cache folder {path} is not writable ({err.strerror or err}); "
                      f"kernels compile into {private} for this process (set GRADOPS_CACHE_DIR to keep them)",
                      RuntimeWarning, stacklevel=2)
        return private


os.environ["NUMBA_CACHE_DIR"] = _writable_cache_dir()
if sys.modules.get("numba") is not None:  # numba read its config already: point the cache locator at our directory
    sys.modules["numba"].config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]

# numba keeps LLVM's own vector width. Asking it for 256-bit vectors on AVX-512 CPUs (``+prefer-256-bit`` in its CPU
# features: streaming loops over 16 MiB lost 15-20% with 512-bit loads and stores on a Zen 4)
# made results depend on the cache: a process that compiled a kernel got other last bits than every later process
# loading it from the disk cache (LayerNorm 512 x 256 fp32 forward and backward; set through NUMBA_CPU_FEATURES as
# well), which tests/test_cpu_backend.py's test_cached_kernels_give_the_bits_of_fresh_ones now catches.
import numba  # noqa: F401 - an ImportError here is how the dispatcher learns that numba is missing

from ._cache import harden
from .embedding import (
    embedding_dense_backward,
    embedding_dense_backward_shaped,
    embedding_dense_backward_workspace,
)
from .hardswish import hardswish, hardswish_backward
from .layer_norm import (
    layer_norm,
    layer_norm_backward,
    layer_norm_backward_shaped,
    layer_norm_backward_workspace,
    layer_norm_grad,
    layer_norm_grad_beta,
    layer_norm_grad_beta_shaped,
    layer_norm_grad_beta_workspace,
    layer_norm_grad_shaped,
    layer_norm_shaped,
)
from .moe_permute import (
    moe_token_permute,
    moe_token_permute_grad,
    moe_token_permute_grad_shaped,
    moe_token_permute_shaped,
    moe_token_unpermute,
    moe_token_unpermute_grad,
    moe_token_unpermute_grad_shaped,
    moe_token_unpermute_shaped,
)
from .rms_norm import rms_norm, rms_norm_grad, rms_norm_grad_shaped, rms_norm_grad_workspace, rms_norm_shaped

harden(__name__ + ".")  # a damaged cache entry is recompiled, never fatal

__all__ = [
    "cache_dir", "embedding_dense_backward", "embedding_dense_backward_shaped", "embedding_dense_backward_workspace",
    "hardswish", "hardswish_backward", "layer_norm", "layer_norm_backward", "layer_norm_backward_shaped",
    "layer_norm_backward_workspace", "layer_norm_grad", "layer_norm_grad_beta", "layer_norm_grad_beta_shaped",
    "layer_norm_grad_beta_workspace", "layer_norm_grad_shaped", "layer_norm_shaped", "moe_token_permute",
    "moe_token_permute_grad", "moe_token_permute_grad_shaped", "moe_token_permute_shaped", "moe_token_unpermute",
    "moe_token_unpermute_grad", "moe_token_unpermute_grad_shaped", "moe_token_unpermute_shaped", "rms_norm",
    "rms_norm_grad", "rms_norm_grad_shaped", "rms_norm_grad_workspace", "rms_norm_shaped",
]
