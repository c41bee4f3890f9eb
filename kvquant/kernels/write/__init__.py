"""The cache write (quantize new K/V into FP8 pages): kernel, launch, naive reference, checks."""
