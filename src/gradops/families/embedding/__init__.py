"""The embedding lookup and aclnnEmbeddingDenseBackward: the family's room (see :mod:`gradops.families`)."""
