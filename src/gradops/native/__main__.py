"""``python -m gradops.native``: build gradops' C++ extension, the CPU kernels and native nodes (once per source,
torch, Python and CPU), and say where; a build that failed before is tried again.

Exit status 0 when built (or built already), 1 when the build failed (no compiler, no ninja): CPU tensors then
take the pure-torch reference, with the same results. ``--quiet`` prints nothing on success."""

from __future__ import annotations

import argparse
import sys

from . import BuildRefused, _build_error, _fix_of, build, build_dir, reset, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradops.native", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quiet", action="store_true", help="print nothing on success")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    try:
        library = build(verbose=args.verbose)
    except Exception as err:  # the compiler's or ninja's failure, whatever it is: said, and the Python path stays
        cause = str(err) if isinstance(err, BuildRefused) else _build_error(err)
        print(f"gradops.native: build failed in {build_dir()}: {cause}. To fix: {_fix_of(err)}", file=sys.stderr)
        return 1
    reset()
    state = status()
    if state != "loaded":
        print(f"gradops.native: built {library} but {state}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"gradops.native: {library}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
