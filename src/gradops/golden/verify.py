"""``gradops verify DIR ACTUAL...``: judge a kernel's output files against a case written by ``gradops golden``.

ACTUAL files come in the order of the manifest's outputs (``.bin``: raw little-endian in the output's dtype,
bfloat16 as its bits; or ``.npy``, never unpickled); each is checked for size / dtype / shape before anything is
compared, and read in chunks. The case directory is not trusted: a manifest entry that is malformed or names a
file outside the directory is refused (:mod:`gradops.golden.files`). Per
output it prints MARE / MERE / RMSE, the Threshold verdict, the ratios to the case's third party and the level
they reach (Ratio standard), and the worst elements. An output passes by ``--standard``: ``ratio`` (CANN's standard
for its built-in operators; the default when the case has a third party), ``threshold`` or ``both``. The exit
status is 0 when every output passes, 1 otherwise, 2 for unusable arguments, files or manifests (one line on
stderr). ``--json`` prints the same as one JSON object (strict JSON: a non-finite number is ``null``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .files import CaseFileError, open_tensor, outputs, read_manifest
from .verdict import STANDARDS, Verdict, judge

#: Worst elements printed for an output that passed (all of them, up to verdict.WORST, for one that failed).
WORST_SHOWN = 3


def verify(directory: str | Path, actual: list[str | Path], *, ratio: bool = True,
           standard: str | None = None) -> list[Verdict]:
    """Judge ``actual`` (one file per output, in the manifest's order) against the case in ``directory``.

    Args:
        directory: a case directory (``manifest.json`` and its files).
        actual: the kernel's output files.
        ratio: compare with the case's third-party outputs (False: the Threshold standard alone).
        standard: what decides pass / fail (:data:`gradops.golden.verdict.STANDARDS`); default "ratio" where the
            case has a third-party output, else "threshold".

    Raises:
        CaseFileError: a missing or malformed manifest or file, a count / size / dtype / shape mismatch.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    entries = outputs(directory, manifest)
    if len(actual) != len(entries):
        names = ", ".join(o["name"] for o in entries)
        raise CaseFileError(f"{manifest['op']} has {len(entries)} output(s) ({names}); got {len(actual)} file(s)")
    verdicts = []
    for entry, path in zip(entries, actual):
        golden = open_tensor(entry["golden"], entry["dtype"], entry["shape"])
        got = open_tensor(Path(path), entry["dtype"], entry["shape"])
        third = open_tensor(entry["third_party"], entry["dtype"], entry["shape"]) if ratio and \
            entry["third_party"] is not None else None
        try:
            verdicts.append(judge(entry["name"], got, golden, third, standard=standard))
        except ValueError as err:
            raise CaseFileError(str(err)) from None
    return verdicts


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return "inf" if math.isinf(v) else f"{v:.3e}"


def report(op: str, verdicts: list[Verdict]) -> str:
    """The printable table of :func:`verify`'s verdicts."""
    lines = [f"gradops verify: {op}"]
    for v in verdicts:
        e = v.errors
        if v.exact:
            lines.append(f"  {v.name} ({v.dtype}, {v.numel} elements): {int(e.mere * v.numel)} differ "
                         f"(integers must match bit for bit) -> {'PASS' if v.passed else 'FAIL'}")
        else:
            lines.append(f"  {v.name} ({v.dtype}, {v.numel} elements): MARE {_num(e.mare)}  MERE {_num(e.mere)}  "
                         f"RMSE {_num(e.rmse)}")
            lines.append(f"    Threshold (T = {_num(v.threshold)}: MERE < T, MARE < 10T): "
                         f"{'pass' if v.threshold_pass else 'fail'}")
            if v.ratios is not None:
                r = v.ratios
                lines.append(f"    Ratio vs third party (MARE {_num(v.third.mare)}, MERE {_num(v.third.mere)}, "
                             f"RMSE {_num(v.third.rmse)}): {r[0]:.3g} / {r[1]:.3g} / {r[2]:.3g} -> "
                             f"{v.level or 'below L0'}; small values {e.small_errors} vs {v.third.small_errors}"
                             f" -> {'pass' if v.ratio_pass else 'fail'}")
                floored = [k for k, r, f in zip(("MARE", "MERE", "RMSE"), v.third.as_tuple(), v.floor.as_tuple())
                           if f > r]
                if floored:
                    lines.append(f"    ({', '.join(floored)} of the third party below what correct rounding to "
                                 f"{v.dtype} leaves: its rounding floor used instead, MARE {_num(v.floor.mare)}, "
                                 f"MERE {_num(v.floor.mere)}, RMSE {_num(v.floor.rmse)})")
                if not v.third_threshold_pass:
                    lines.append("    note: the third party fails Threshold itself, so this Ratio bar is low "
                                 "(gradops golden --third-party gradops sets gradops' kernel as the bar)")
            lines.append(f"    -> {'PASS' if v.passed else 'FAIL'} by the {v.standard} standard")
        for w in [w for w in v.worst if w["rel"] > 0][: WORST_SHOWN if v.passed else None]:
            lines.append(f"      at {tuple(w['index'])}: actual {w['actual']!r}, golden {w['golden']!r}, "
                         f"relative error {_num(w['rel'])}")
    passed = all(v.passed for v in verdicts)
    lines.append(f"{'PASS' if passed else 'FAIL'}: {sum(v.passed for v in verdicts)}/{len(verdicts)} output(s)")
    return "\n".join(lines)


def _finite(value: object) -> object:
    """``value`` with every non-finite float replaced by None: ``json.dumps`` would write ``Infinity`` / ``NaN``,
    which JSON does not have (a strict parser refuses the whole record)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("case", type=Path, help="case directory written by gradops golden")
    parser.add_argument("actual", nargs="+", help="your kernel's output files (.bin or .npy), in the manifest's order")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of the table (non-finite numbers as null)")
    parser.add_argument("--standard", choices=STANDARDS, default=None,
                        help="what decides pass/fail: ratio (CANN's standard for its built-in operators; the "
                             "default when the case has a third party), threshold, or both")
    parser.add_argument("--no-ratio", action="store_true",
                        help="ignore the third party: the Threshold standard only")


def run(args: argparse.Namespace) -> int:
    try:
        if args.no_ratio and args.standard not in (None, "threshold"):
            raise CaseFileError(f"--no-ratio with --standard {args.standard}: that standard needs the third party")
        verdicts = verify(args.case, args.actual, ratio=not args.no_ratio, standard=args.standard)
        op = read_manifest(args.case)["op"]
    except (CaseFileError, OSError) as err:
        message = f"{err.filename}: {err.strerror}" if isinstance(err, OSError) and err.strerror else str(err)
        print(f"gradops verify: {message}".replace("\n", "\\n"), file=sys.stderr)  # one line, whatever a path holds
        return 2
    passed = all(v.passed for v in verdicts)
    if args.json:
        record = {"op": op, "passed": passed, "outputs": [v.as_dict() for v in verdicts]}
        print(json.dumps(_finite(record), allow_nan=False))
    else:
        print(report(op, verdicts))
    return 0 if passed else 1
