"""Helpers for plugin authors' tests (and kvquant's own).

Submodules are imported on demand (``kvquant.testing.conformance``,
``kvquant.testing.checkpoints``, ...); importing this package imports nothing heavy.
:mod:`kvquant.testing.checkpoints` writes small synthetic checkpoints in each producer's
convention (``kvquant demo`` shows them). kvquant's own test and benchmark harness (the
accuracy harness, the real-model fetcher, the pinned texts) is not part of the package:
it lives in ``benchmarks/harness/`` of the source checkout.

For plugin authors: :mod:`kvquant.testing.conformance` is the suite every scale
format must pass (``check_scale_format(fmt)``, or
``pytest.mark.parametrize("case", conformance_cases([fmt]), ids=str)``), and
:mod:`kvquant.testing.example_formats` holds two example user formats.
"""
