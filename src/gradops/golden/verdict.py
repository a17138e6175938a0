"""CANN's precision verdicts on one output: the single-benchmark standard ("Threshold") and the dual-benchmark
standard ("Ratio").

Per element, in float64: ``rel = |actual - golden| / (|golden| + 1e-7)``. Per output:

- MARE = max rel, MERE = mean rel, RMSE = sqrt(mean((actual - golden)^2));
- Threshold (community operators): pass when ``MERE < T`` and ``MARE < 10·T``, ``T`` = 2^-10 (float16),
  2^-7 (bfloat16), 2^-13 (float32);
- Ratio (commercial operators): the kernel's MARE, MERE and RMSE divided by a third-party implementation's
  against the same golden; level L2 when the ratios are <= (2, 1.2, 1.2), else L1 at (5, 1.5, 1.5), else L0 at
  (10, 2, 2), else none; and, in the small-value range (|golden| below a per-dtype threshold), the count of
  elements off by more than a per-dtype error may be at most twice the third party's (at least 1). CANN's
  campaign also asks for a number of cases per level (L0 >= 5,000, L1 >= 10,000, L2 >= 30,000) and re-runs; one
  call judges one case.

The rounding floor (:func:`rounding_floor`). CANN's dual-benchmark comparison measures both implementations against
a higher-precision CPU result that is *not* rounded to the output dtype (msprobe's ``api_accuracy_checker`` raises
the benchmark's inputs to float32 and compares the float outputs as they are), so every implementation's error
includes its own output rounding, and a third-party error of exactly 0 does not occur for a floating output with
any rounding at all. Its ``calc_ratio`` only meets a denominator of 0 (within 1e-9) when both are 0 (ratio 1);
otherwise it returns a fixed failing value. Our golden is that float64 result rounded once to the output dtype, which
takes the rounding term out: a third party that rounds every element correctly scores 0, and one element of the
kernel one unit in the last place (ulp) off made the ratio infinite (bfloat16 rms_norm_grad, seed 3). So the
third party's MARE, MERE and RMSE enter the Ratio floored at what correct rounding of the exact result leaves -
the term CANN's own comparison carries in both: half an ulp of each golden element at most (MARE), a quarter on
average (MERE), ulp/sqrt(12) root mean square (RMSE) - and the denominator is ``max(third party's error, floor)``.
The standard's own small-value rule floors its denominator the same way (``max(ErrorCount_third, 1)``). The floor
is reported (``Verdict.floor``) and never lowers a third party's real error. A kernel one ulp off in every element
still fails against an exact third party (MERE ratio 4).

The statistics run over chunks of :data:`CHUNK` elements, read one at a time from each input (a tensor or a
:class:`gradops.golden.files.Stored` file), so a case of any size costs a few chunk-sized temporaries.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

EPS = 1e-7
#: Threshold standard: T per output dtype; pass when MERE < T and MARE < 10·T.
THRESHOLD = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -13}
#: Ratio standard: (MARE, MERE, RMSE) ratio limits per level, strictest first.
RATIO_LEVELS = (("L2", (2.0, 1.2, 1.2)), ("L1", (5.0, 1.5, 1.5)), ("L0", (10.0, 2.0, 2.0)))
#: Ratio standard's small-value range: dtype -> (|golden| threshold, allowed absolute error).
SMALL_VALUES = {torch.float16: (2.0 ** -11, 2.0 ** -16), torch.bfloat16: (2.0 ** -8, 2.0 ** -16),
                torch.float32: (2.0 ** -14, 2.0 ** -30)}
#: Ratio standard: the kernel's small-value error count may be at most this times the third party's (>= 1).
SMALL_RATIO = 2.0
#: Elements per chunk: a dozen float64 temporaries of a chunk live at once, 2 MiB each at 2^18; verify's peak
#: stays ~40 MiB above the interpreter's whatever the file sizes (2^20: ~140 MiB, no faster).
CHUNK = 1 << 18
#: Worst elements reported per output.
WORST = 5
#: What decides pass / fail. CANN judges its built-in (commercial) operators, the five gradops implements among
#: them, by the Ratio standard against a third party, and community operators by Threshold alone; "both" asks
#: for both. The default is "ratio" when a third-party output is given, else "threshold". Threshold is always
#: computed and printed: in float32, outputs with cancellation (RmsNormGrad / LayerNorm dx, hardswish near
#: x = -1.5, embedding sums near 0) miss MARE < 10·2^-13 at millions of elements for every implementation
#: measured, gradops' and PyTorch's alike (README "Golden data").
STANDARDS = ("ratio", "threshold", "both")


@dataclass
class Errors:
    """The three statistics of one output against its golden."""
    mare: float
    mere: float
    rmse: float
    small_errors: int = 0  # elements with |golden| < the small-value threshold off by more than its error

    def as_tuple(self) -> tuple[float, float, float]:
        """(MARE, MERE, RMSE)."""
        return (self.mare, self.mere, self.rmse)


class Chunked(Protocol):
    """A tensor read in parts (:class:`gradops.golden.files.Stored`): what :func:`judge` needs of its inputs."""
    dtype: torch.dtype
    shape: tuple[int, ...]

    def numel(self) -> int: ...

    def chunk(self, start: int, stop: int) -> torch.Tensor: ...


Values = torch.Tensor | Chunked


def _part(x: Values, start: int, stop: int) -> torch.Tensor:
    """Flattened elements ``[start, stop)`` of a tensor or a :class:`Chunked`."""
    if isinstance(x, torch.Tensor):
        return x.reshape(-1)[start:stop]
    return x.chunk(start, stop)


@dataclass
class Verdict:
    """The judgement of one output. ``ratios`` and ``level`` are None without a third-party output."""
    name: str
    dtype: str
    numel: int
    errors: Errors
    threshold: float | None
    threshold_pass: bool
    third: Errors | None = None
    ratios: tuple[float, float, float] | None = None
    level: str | None = None
    small_ratio: float | None = None
    worst: list[dict] = field(default_factory=list)
    exact: bool = False  # an integer output, judged element by element
    standard: str = "threshold"  # what decides `passed`: one of STANDARDS
    third_threshold_pass: bool | None = None  # the third party's own Threshold verdict
    floor: Errors | None = None  # the rounding floor of the third party's errors (module docstring)

    @property
    def ratio_pass(self) -> bool | None:
        """The Ratio standard: L0 or better and the small-value count within bounds (None without a third party)."""
        if self.ratios is None:
            return None
        return self.level is not None and (self.small_ratio or 0.0) <= SMALL_RATIO

    @property
    def passed(self) -> bool:
        """The verdict by :attr:`standard` (an integer output: every element equal, whatever the standard)."""
        if self.exact or self.standard == "threshold":
            return self.threshold_pass
        if self.standard == "ratio":
            return bool(self.ratio_pass)
        return self.threshold_pass and bool(self.ratio_pass)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["ratio_pass"], out["passed"] = self.ratio_pass, self.passed
        return out


def _rel(actual: torch.Tensor, golden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element relative and absolute error (float64), non-finite values matched exactly."""
    a, g = actual.double(), golden.double()
    diff = (a - g).abs()
    same = (a == g) | (torch.isnan(a) & torch.isnan(g))  # equal infinities, both NaN
    finite = torch.isfinite(a) & torch.isfinite(g)
    diff = torch.where(same, 0.0, torch.where(finite, diff, math.inf))
    return diff / (g.abs().nan_to_num(0.0, 0.0, 0.0) + EPS), diff


def errors(actual: Values, golden: Values, worst: int = 0) -> tuple[Errors, list[dict]]:
    """MARE, MERE and RMSE of ``actual`` against ``golden`` (same shape), and the ``worst`` elements by relative
    error (index, actual, golden, relative error), computed chunk by chunk."""
    if tuple(actual.shape) != tuple(golden.shape):
        raise ValueError(f"shape {list(actual.shape)} against the golden's {list(golden.shape)}")
    n = golden.numel()
    if n == 0:
        return Errors(0.0, 0.0, 0.0), []
    mare, rel_sum, sq_sum, small = 0.0, 0.0, 0.0, 0
    limit, allowed = SMALL_VALUES.get(golden.dtype, (0.0, 0.0))
    top: list[tuple[float, int, float, float]] = []
    for start in range(0, n, CHUNK):
        ac, gc = _part(actual, start, start + CHUNK).to(golden.dtype), _part(golden, start, start + CHUNK)
        rel, diff = _rel(ac, gc)
        mare = max(mare, float(rel.max()))
        rel_sum += float(rel.sum())
        sq_sum += float(diff.square().sum())
        small += int(((gc.double().abs() < limit) & (diff > allowed)).sum())
        if worst:
            values, idx = torch.topk(rel, min(worst, rel.numel()))
            top = sorted(top + [(float(v), start + int(i), float(ac[i]), float(gc[i])) for v, i in zip(values, idx)],
                         key=lambda row: (-row[0], row[1]))[:worst]
    rows = [{"index": list(_unravel(i, golden.shape)), "actual": a, "golden": g, "rel": r} for r, i, a, g in top]
    return Errors(mare, rel_sum / n, math.sqrt(sq_sum / n), small), rows


def rounding_floor(golden: Values) -> Errors:
    """The MARE, MERE and RMSE that correct rounding of the exact result to ``golden``'s dtype leaves, per element
    of ``golden`` (a floating tensor): the floor of a third party's errors in the Ratio standard (module
    docstring). A correctly rounded element's error is spread evenly over [-ulp/2, ulp/2]: its largest is half an
    ulp (MARE), its mean absolute value a quarter (MERE), its root mean square ulp/sqrt(12) (RMSE), each ulp that of
    the golden element. Non-finite elements count 0."""
    info = torch.finfo(golden.dtype)
    digits = round(-math.log2(info.eps)) + 1  # significand bits with the implicit one: 8 bf16, 11 fp16, 24 fp32
    n = golden.numel()
    if n == 0:
        return Errors(0.0, 0.0, 0.0)
    mare, rel_sum, sq_sum = 0.0, 0.0, 0.0
    for start in range(0, n, CHUNK):
        g = _part(golden, start, start + CHUNK).double()
        a = g.abs()
        exponent = torch.frexp(a).exponent  # a = m * 2^e, 0.5 <= m < 1: an ulp is 2^(e - digits)
        ulp = torch.where(a >= info.tiny, torch.ldexp(torch.ones_like(a), exponent - digits), info.tiny * info.eps)
        ulp = torch.where(torch.isfinite(g), ulp, 0.0)
        scale = a.nan_to_num(0.0, 0.0, 0.0) + EPS
        mare = max(mare, float((ulp / 2 / scale).max()))
        rel_sum += float((ulp / 4 / scale).sum())
        sq_sum += float(ulp.square().sum()) / 12
    return Errors(mare, rel_sum / n, math.sqrt(sq_sum / n))


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size if size else 0)
        flat //= max(size, 1)
    return tuple(reversed(out))


def _ratio(ours: float, theirs: float) -> float:
    if theirs > 0:
        return ours / theirs
    return 1.0 if ours == 0 else math.inf


def level(ratios: tuple[float, float, float]) -> str | None:
    """The strictest Ratio level the three ratios (MARE, MERE, RMSE) meet, or None."""
    for name, limits in RATIO_LEVELS:
        if all(r <= lim for r, lim in zip(ratios, limits)):
            return name
    return None


def _threshold_pass(errs: Errors, t: float | None) -> bool:
    return t is not None and errs.mere < t and errs.mare < 10 * t


def judge(name: str, actual: Values, golden: Values, third: Values | None = None, worst: int = WORST,
          standard: str | None = None) -> Verdict:
    """Judge one output of a kernel against its golden (and a third-party output for the Ratio standard).

    Args:
        name: the output's name (reports only).
        actual: the kernel's output, golden's shape and dtype (a tensor, or a file read in chunks).
        golden: the float64 result rounded once to the output dtype.
        third: the same output from another implementation (PyTorch, a GPU), or None; its errors enter the
            Ratio floored at :func:`rounding_floor` of the golden.
        worst: how many worst elements to list.
        standard: what decides pass / fail (:data:`STANDARDS`); default "ratio" with a third party, else
            "threshold".

    Raises:
        ValueError: dtype or shape mismatch; an unknown standard, or "ratio" / "both" without a third party.
    """
    standard = standard or ("ratio" if third is not None else "threshold")
    if standard not in STANDARDS:
        raise ValueError(f"standard {standard!r}: one of {', '.join(STANDARDS)}")
    if standard != "threshold" and third is None:
        raise ValueError(f"{name}: the {standard!r} standard needs a third-party output")
    if actual.dtype != golden.dtype:
        raise ValueError(f"{name}: dtype {actual.dtype} against the golden's {golden.dtype}")
    dtype = str(golden.dtype).removeprefix("torch.")
    if tuple(actual.shape) != tuple(golden.shape):
        raise ValueError(f"{name}: shape {list(actual.shape)} against the golden's {list(golden.shape)}")
    if not golden.dtype.is_floating_point:
        differ, rows = 0, []
        for start in range(0, golden.numel(), CHUNK):
            ac, gc = _part(actual, start, start + CHUNK), _part(golden, start, start + CHUNK)
            bad = (ac != gc).nonzero()[:, 0]
            differ += bad.numel()
            rows += [{"index": list(_unravel(start + int(i), golden.shape)), "actual": int(ac[i]),
                      "golden": int(gc[i]), "rel": math.inf} for i in bad[:worst - len(rows)].tolist()]
        errs = Errors(float(differ > 0), differ / max(golden.numel(), 1), 0.0)
        return Verdict(name, dtype, golden.numel(), errs, 0.0, differ == 0, worst=rows, exact=True,
                       standard=standard)
    errs, rows = errors(actual, golden, worst)
    t = THRESHOLD.get(golden.dtype)
    passed = _threshold_pass(errs, t)
    verdict = Verdict(name, dtype, golden.numel(), errs, t, passed, worst=rows, standard=standard)
    if third is not None:
        verdict.third = errors(third, golden)[0]
        verdict.third_threshold_pass = _threshold_pass(verdict.third, t)
        verdict.floor = rounding_floor(golden)
        verdict.ratios = tuple(_ratio(o, max(r, f)) for o, r, f in zip(errs.as_tuple(), verdict.third.as_tuple(),
                                                                         verdict.floor.as_tuple()))
        verdict.level = level(verdict.ratios)
        verdict.small_ratio = errs.small_errors / max(verdict.third.small_errors, 1)
    return verdict
