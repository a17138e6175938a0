"""Each op family's :class:`gradops.spec.OpSpec` declarations, one module per family; :mod:`gradops.registry`
collects them in the order listed here (the order of every table: ``gradops check``, ``gradops bench``, ``env``)."""

__all__ = ["rms_norm", "layer_norm", "hardswish", "embedding", "moe_permute", "moe_routing"]  # noqa: RUF022 - the tables' order
