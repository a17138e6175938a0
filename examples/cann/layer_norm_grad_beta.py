"""Python port of the AscendC LayerNormGradBeta kernel example of the CANN seed (003).

The C example is a kernel (``KernelLayernormGradBeta<half, false>``: Init, CopyIn, Compute, CopyOut) driven by a
host-side tiling; it prints nothing. This port keeps that structure and adds what the kernel needs around it:
the host tiling (``GetLayerNormGradBetaMaxMinTmpSize`` then ``GetLayerNormGradBetaNDTilingInfo``, here for twice
the minimum temporary buffer: 3 rows per chunk, 5 chunks and a 1-row tail) and the LayerNormGrad call that
produces resForGamma. It prints the tiling and the two outputs (``outputPdGamma[i] is: %f``).

Run: ``python examples/cann/layer_norm_grad_beta.py [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from gradops.ascendc import (
    GetLayerNormGradBetaMaxMinTmpSize,
    GetLayerNormGradBetaNDTilingInfo,
    LayerNormGrad,
    LayerNormGradBeta,
    LayerNormGradBetaTiling,
)

B, S, H = 2, 8, 16   # H * sizeof(half) = 32 bytes: one aligned block per row
EPSILON = 1e-5


class KernelLayernormGradBeta:
    """The C example's kernel class: global buffers in, local copies, LayerNormGradBeta, global buffers out."""

    def __init__(self, dtype: torch.dtype, is_reuse_source: bool = False) -> None:
        self.dtype = dtype
        self.is_reuse_source = is_reuse_source

    def init(self, res_for_gamma_gm, input_dy_gm, output_pd_gamma_gm, output_pd_beta_gm,
             tiling: LayerNormGradBetaTiling) -> None:
        self.tiling = tiling
        self.b_length, self.s_length, self.h_length = tiling.bLength, tiling.sLength, tiling.hLength
        self.res_for_gamma_global, self.input_dy_global = res_for_gamma_gm, input_dy_gm
        self.output_pd_gamma_global, self.output_pd_beta_global = output_pd_gamma_gm, output_pd_beta_gm

    def process(self) -> None:
        self.copy_in()
        self.compute()
        self.copy_out()

    def copy_in(self) -> None:  # DataCopy(GM -> local)
        self.res_for_gamma_local = self.res_for_gamma_global.clone()
        self.input_dy_local = self.input_dy_global.clone()

    def compute(self) -> None:
        h = self.h_length
        self.output_pd_gamma_local = torch.empty(h, dtype=self.dtype, device=self.input_dy_local.device)
        self.output_pd_beta_local = torch.empty(h, dtype=self.dtype, device=self.input_dy_local.device)
        LayerNormGradBeta(self.output_pd_gamma_local, self.output_pd_beta_local, self.res_for_gamma_local,
                          self.input_dy_local, self.tiling, isReuseSource=self.is_reuse_source)

    def copy_out(self) -> None:  # DataCopy(local -> GM)
        self.output_pd_gamma_global.copy_(self.output_pd_gamma_local)
        self.output_pd_beta_global.copy_(self.output_pd_beta_local)


def make_inputs(device: torch.device, dtype: torch.dtype = torch.float16):
    """Deterministic dy, x (B, S, H) and their LayerNorm statistics (mean, biased variance, shape (B, S, 1))."""
    g = torch.Generator().manual_seed(2024)
    x = torch.randn(B, S, H, generator=g).to(dtype)
    dy = torch.randn(B, S, H, generator=g).to(dtype)
    gamma = (1.0 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    variance = (xf - mean).square().mean(-1, keepdim=True)
    return [t.to(device) for t in (dy, x, variance.to(dtype), mean.to(dtype), gamma)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(parser.parse_args(argv).device)
    if device.type == "cuda" and not torch.cuda.is_available():  # one line, not torch's traceback on first use
        parser.exit(2, f"{parser.prog}: error: --device cuda, but torch sees no CUDA device (use --device cpu)\n")
    dtype, type_size = torch.float16, 2

    # Host: the temporary-buffer range, then the tiling for a buffer of twice the minimum (several chunks).
    src_shape = [B, S, H, H]
    max_value, min_value = GetLayerNormGradBetaMaxMinTmpSize(src_shape, type_size, False)
    tiling = GetLayerNormGradBetaNDTilingInfo(src_shape, 2 * min_value, type_size, False)
    print(f"tmp buffer max: {max_value} bytes, min: {min_value} bytes")
    print(f"tiling: oneCalSize={tiling.oneCalSize} loopRound={tiling.loopRound} "
          f"inputTailSize={tiling.inputTailSize} bsCurLength={tiling.bsCurLength} bsTailSize={tiling.bsTailSize}")

    # Device: LayerNormGrad gives resForGamma (and pd_x), then the example's kernel computes pdGamma / pdBeta.
    dy, x, variance, mean, gamma = make_inputs(device, dtype)
    pd_x = torch.empty_like(x)
    res_for_gamma_gm = torch.empty_like(x)
    LayerNormGrad(pd_x, res_for_gamma_gm, dy, x, variance, mean, gamma, EPSILON)
    output_pd_gamma_gm = torch.zeros(H, dtype=dtype, device=device)
    output_pd_beta_gm = torch.zeros(H, dtype=dtype, device=device)
    op = KernelLayernormGradBeta(dtype, is_reuse_source=False)
    op.init(res_for_gamma_gm, dy, output_pd_gamma_gm, output_pd_beta_gm, tiling)
    op.process()

    for i, value in enumerate(output_pd_gamma_gm.float().cpu().tolist()):
        print(f"outputPdGamma[{i}] is: {value:f}")
    for i, value in enumerate(output_pd_beta_gm.float().cpu().tolist()):
        print(f"outputPdBeta[{i}] is: {value:f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
