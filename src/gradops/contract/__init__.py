"""Validation tables: one module per op family, shared by the raising PyTorch API and the status-code APIs."""
