"""The models one process serves, by name: which engine answers a request, and whether
the server takes requests at all (loading, serving, draining: tracked here and nowhere
else).

Requests name a model or leave the name empty for the default one: the model given
first, or the one named by ``--default-model``. A name nobody serves is ``ModelNotFound``
with the names that are served. While models are still loading, a model already loaded
is served (its own health name says SERVING) and any other name gets ``Unavailable``;
once the server drains, every request does.
"""

from __future__ import annotations

from collections.abc import Iterator

from tokembed.server.core.engine import Engine
from tokembed.server.core.errors import ModelNotFound, ServerConfigError, Unavailable


class ModelRegistry:
    def __init__(self, default_model: str | None = None) -> None:
        """``default_model``: the name that answers unnamed requests (None: the first
        model added)."""
        self._engines: dict[str, Engine] = {}
        self._default_name = default_model
        self.loading = True  # until every model given is in (``loaded``)
        self.draining = False

    # --- filled at start

    def add(self, engine: Engine) -> None:
        """Serve ``engine`` under its model's name."""
        name = engine.name
        if name in self._engines:
            first = self._engines[name].served.model.path
            raise ServerConfigError(
                f"two models are named {name!r}: {first} and {engine.served.model.path}; "
                "give each model directory a distinct name (tokembed export --name)"
            )
        self._engines[name] = engine
        if self._default_name is None:
            self._default_name = name

    def loaded(self) -> None:
        """Every model is in: from now on an unknown name is not found, not loading."""
        if self._default_name not in self._engines:
            raise ServerConfigError(
                f"default_model {self._default_name!r} is not one of the models served "
                f"({self._names()})"
            )
        self.loading = False

    # --- per request

    def engine(self, name: str = "") -> Engine:
        """The engine for ``name`` ("" for the default model)."""
        if self.draining:
            raise Unavailable("the server is draining; retry on another replica")
        engine = self._engines.get(name or self._default_name or "")
        if engine is None:
            if self.loading:
                raise Unavailable("the model is still loading; retry shortly")
            raise ModelNotFound(
                f"model {name!r} is not served here (this server serves {self._names()})"
            )
        return engine

    def check_serving(self) -> None:
        """Raise ``Unavailable`` unless every model is loaded and the server not draining
        (for answers about all the models at once)."""
        if self.draining:
            raise Unavailable("the server is draining; retry on another replica")
        if self.loading:
            raise Unavailable("the models are still loading; retry shortly")

    # --- for listings, metrics and shutdown

    @property
    def default_name(self) -> str:
        return self._default_name or ""

    def __iter__(self) -> Iterator[Engine]:
        """The engines in the order their models were given."""
        return iter(list(self._engines.values()))

    def __len__(self) -> int:
        return len(self._engines)

    def _names(self) -> str:
        return ", ".join(repr(name) for name in self._engines) or "no model"
