"""Hardswish and aclnnHardswishBackward: the family's room (see :mod:`gradops.families`)."""
