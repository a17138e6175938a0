"""The MoE token-movement family: MoeTokenPermute / Unpermute and their grads (indices), and the routing-map
variants (``routing_*.py``: slot tables over the same kernels). The family's room (see :mod:`gradops.families`)."""
