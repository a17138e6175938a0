"""``gradops`` command line: ``check``, ``bench``, ``demo``, ``env``, ``golden``, ``verify``, ``cann-home`` (also
``python -m gradops ...``).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this file
only wires them, and imports a module when its subcommand runs (``demo`` and ``bench`` pull in more than
``check`` needs).

A request that cannot run - a nonsensical argument value, ``GRADOPS_BACKEND`` naming no backend, a backend that
cannot run here, an output folder that cannot be written, nothing to check - ends with one line on stderr,
``gradops <command>: error: <what and what is accepted>``, and exit status 2 (:mod:`gradops.cli_support`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from .cli_support import CommandError, check_backend_variable, refusal

COMMANDS = {
    "check": ("gradops.check", "run every op, dtype and backend against the float64 reference"),
    "bench": ("gradops.bench", "time every op against PyTorch eager, torch.compile and Liger-Kernel"),
    "demo": ("gradops.demo", "train a small MoE language model with gradops beside a plain-PyTorch twin"),
    "env": ("gradops.env", "versions, devices, and which backend each op would use"),
    "golden": ("gradops.golden", "write a test case (inputs, float64 goldens, third party, manifest) for one op"),
    "verify": ("gradops.golden.verify", "judge a kernel's output files by CANN's precision standards"),
    "cann-home": ("gradops.aclnn.capi", "write a CANN toolkit tree (headers, libascendcl/nnopbase/opapi) for C hosts"),
}
#: Subcommands that run operators: a GRADOPS_BACKEND naming no backend is refused before they start. (``verify``
#: only reads files.)
RUNS_OPS = frozenset({"check", "bench", "demo", "env", "golden"})


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``gradops check: error: argument --rows: must be an integer >= 1, got '0'``.
    The message already names the argument and what it accepts; the usage block argparse prints above it (six
    lines for ``bench``) would bury that line, and ``--help`` still shows it. Subparsers inherit the class."""

    #: The subcommand's prog (``gradops bench``) once one is chosen: the top-level parser reports arguments that no
    #: parser took, and the line must name the command they were given to.
    command_prog: str | None = None

    def error(self, message: str) -> NoReturn:
        prog = self.command_prog if message.startswith("unrecognized arguments") and self.command_prog else self.prog
        self.exit(2, f"{prog}: error: {message}\n")


#: What ``gradops --help`` says above the subcommands.
DESCRIPTION = ("gradops: Huawei CANN's training backward operators for PyTorch, on CPU and NVIDIA GPUs. "
               "'gradops COMMAND --help' describes each command.")


def _version() -> str:
    from . import __version__

    torch = importlib.import_module("torch")
    return f"gradops {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})"


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="gradops", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=_version(), help="print gradops' version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # import only the subcommand that runs
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
            parser.command_prog = p.prog
    args = parser.parse_args(argv)
    try:
        if args.command in RUNS_OPS:
            check_backend_variable()
        return int(args._run(args) or 0)
    except BrokenPipeError:
        # The reader left (``gradops env | head -2``): no traceback, and none at exit either, when Python
        # flushes the closed stdout; 141 = 128 + SIGPIPE, what a shell reports for a command a pipe cut short.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (CommandError, Exception) as err:  # after BrokenPipeError, an Exception too; CommandError is not one
        message = refusal(err)
        if message is None:  # a bug: its traceback is what to report
            raise
        print(f"gradops {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
