"""Helpers for kvquant's own tests and for plugin authors' tests.

Submodules are imported on demand (``kvquant.testing.smollm2``,
``kvquant.testing.texts``, ...); importing this package imports nothing heavy.

For plugin authors: :mod:`kvquant.testing.conformance` is the suite every scale
format must pass (``check_scale_format(fmt)``, or
``pytest.mark.parametrize("case", conformance_cases([fmt]), ids=str)``), and
:mod:`kvquant.testing.example_formats` holds two example user formats.
"""
