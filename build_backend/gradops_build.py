"""gradops' PEP 517 build backend: setuptools' own, plus the native CPU kernels compiled at install.

gradops' CPU kernels are C++ (src/gradops/native) compiled against the torch the user runs, so they cannot ship
prebuilt in a wheel that does not know that torch. pip's build isolation hides the target environment from the
backend's own process, but not from a child started with the environment's own interpreter outside the isolation
(no PYTHONPATH, no PYTHONNOUSERSITE): that child imports the user's torch and builds the extension into gradops'
cache, where gradops finds it on first import. Without torch in the target environment, or without a compiler, the
install still succeeds: the first import of gradops builds it, or says in one line what the user gets instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - the rest of the PEP 517 / 660 hooks, unchanged

_ROOT = Path(__file__).resolve().parent.parent
_ISOLATION = ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME", "PIP_BUILD_TRACKER")


def _build_native() -> None:
    env = {k: v for k, v in os.environ.items() if k not in _ISOLATION}
    code = "\n".join([
        "import sys",
        "try:",
        "    import torch  # noqa: F401",
        "except ImportError:",
        "    print('gradops: no torch in this environment yet: the first import of gradops builds the native CPU '",
        "          'kernels', file=sys.stderr)",
        "    sys.exit(0)",
        "import os",
        "os.environ['GRADOPS_BACKEND'] = 'torch'  # no build inside the import: the one below, with its lines",
        "sys.path.insert(0, sys.argv[1])",
        "from gradops import native",
        "(native.build_dir() / native.FAILED).unlink(missing_ok=True)  # an install tries again",
        "native.ensure_built()  # a failure is said and noted beside the library",
    ])
    try:
        subprocess.run([sys.executable, "-c", code, str(_ROOT / "src")], env=env, check=False, timeout=1800)
    except (OSError, subprocess.SubprocessError) as err:  # the wheel is still good: first import builds
        print(f"gradops: the native CPU kernels were not built at install ({err}); the first import builds them",
              file=sys.stderr)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    """PEP 517: the native build, then setuptools' wheel."""
    _build_native()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """PEP 660: the native build, then setuptools' editable wheel."""
    _build_native()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
