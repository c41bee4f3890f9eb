"""transformers' server with the model it loads patched, for releases that load it in a process of
its own (5.25 on; importing it raises ImportError before).

From 5.25 ``transformers serve`` loads each model in a spawned process (the engine), through
a copy of the server's ``ModelLoader`` it pickles there. :class:`PatchingModelLoader` is that
loader with :func:`kvquant.patch` applied to the model it loads, in the model's process, before
the engine builds its continuous-batching runner; :class:`PatchingServe` is transformers'
``Serve`` handing it to the engine in place of its own. Both are module-level classes so the
spawned process can unpickle them. Imported only where the serving extras are installed
(:mod:`kvquant.serve` checks).
"""

from __future__ import annotations

from typing import Any

from transformers.cli.serve import Serve
from transformers.cli.serving.model_manager import ModelLoader  # type: ignore[attr-defined]

from kvquant.integrations.hf.patch import patch

__all__ = ["PatchingModelLoader", "PatchingServe"]

# transformers' classes, typed loosely: their methods differ between the releases mypy may see
_LoaderBase: Any = ModelLoader
_ServeBase: Any = Serve


class PatchingModelLoader(_LoaderBase):
    """transformers' ``ModelLoader`` whose models come back patched with ``patch_options``."""

    patch_options: dict[str, Any]

    @classmethod
    def wrapping(cls, loader: Any, patch_options: dict[str, Any]) -> PatchingModelLoader:
        """A patching copy of ``loader`` (its settings as the server resolved them)."""
        copy: PatchingModelLoader = cls.__new__(cls)
        copy.__dict__.update(vars(loader))
        copy.patch_options = dict(patch_options)
        return copy

    def _load_model(self, *args: Any, **kwargs: Any) -> Any:
        loaded = super()._load_model(*args, **kwargs)
        patch(loaded, **self.patch_options)
        return loaded


class PatchingServe(_ServeBase):
    """transformers' ``Serve`` whose engine loads its model through a :class:`PatchingModelLoader`.

    ``Serve.__init__`` builds its loader, then runs the server (``run``, or
    ``run_api_servers`` for several API servers): both swap the loader first.
    """

    loader: Any

    def __init__(self, *args: Any, patch_options: dict[str, Any], **kwargs: Any) -> None:
        self._kvquant_patch_options = dict(patch_options)
        super().__init__(*args, **kwargs)

    def _use_patching_loader(self) -> None:
        if not isinstance(self.loader, PatchingModelLoader):
            self.loader = PatchingModelLoader.wrapping(self.loader, self._kvquant_patch_options)

    def run(self, *args: Any, **kwargs: Any) -> None:
        self._use_patching_loader()
        super().run(*args, **kwargs)

    def run_api_servers(self, *args: Any, **kwargs: Any) -> None:
        self._use_patching_loader()
        super().run_api_servers(*args, **kwargs)
