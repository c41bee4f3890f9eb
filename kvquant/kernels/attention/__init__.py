"""Paged attention over the FP8 cache: kernel, tile helpers, launch, tuning, naive reference, checks."""
