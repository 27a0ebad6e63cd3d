"""``ModelRegistry``: which engine answers a request, and whether the server takes any.

Proved here:
- the default model is the first added, or the one named at construction, and an empty
  name selects it;
- a name nobody serves is ``Unavailable`` while models are loading and, once
  ``loaded()``, ``ModelNotFound`` naming every served model in the order given;
- two models with one name, or a default nobody serves, stop the start with a
  ``ServerConfigError`` naming what is wrong (both paths; the name and what is served);
- draining makes every name ``Unavailable``, known or not, default or not;
- ``check_serving`` passes only between ``loaded()`` and draining;
- iteration (and ``len``) follow the order the models were added.

The registry only reads an engine's ``name`` and ``served.model.path``, so the engines
here are stand-ins with just those.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tokembed.server.core.errors import ModelNotFound, ServerConfigError, Unavailable
from tokembed.server.core.registry import ModelRegistry


def engine(name: str, path: str | None = None) -> Any:
    """A stand-in for an ``Engine`` serving the model ``name`` from ``path``."""
    model = SimpleNamespace(path=Path(path or f"/models/{name}"))
    return SimpleNamespace(name=name, served=SimpleNamespace(model=model))


def registry_of(*engines: Any, default: str | None = None, loaded: bool = True) -> ModelRegistry:
    registry = ModelRegistry(default)
    for each in engines:
        registry.add(each)
    if loaded:
        registry.loaded()
    return registry


def test_the_default_is_the_first_model_added_and_an_empty_name_selects_it() -> None:
    encoder, decoder = engine("encoder"), engine("decoder")
    registry = registry_of(encoder, decoder)
    assert registry.default_name == "encoder"
    assert registry.engine("") is encoder
    assert registry.engine() is encoder
    assert registry.engine("decoder") is decoder
    assert registry.engine("encoder") is encoder


def test_a_named_default_answers_empty_names_even_when_added_later() -> None:
    encoder, decoder = engine("encoder"), engine("decoder")
    registry = registry_of(encoder, decoder, default="decoder")
    assert registry.default_name == "decoder"
    assert registry.engine("") is decoder
    assert registry.engine("encoder") is encoder


def test_an_unknown_name_once_loaded_is_not_found_naming_the_served_models_in_order() -> None:
    registry = registry_of(engine("zeta"), engine("alpha"), engine("mid"))
    with pytest.raises(ModelNotFound) as caught:
        registry.engine("nope")
    message = str(caught.value)
    assert "'nope'" in message
    # In the order given (not sorted): the operator recognises their own command line.
    assert "'zeta', 'alpha', 'mid'" in message


def test_while_loading_an_unknown_name_is_unavailable_not_not_found() -> None:
    encoder = engine("encoder")
    registry = registry_of(encoder, default="decoder", loaded=False)
    assert registry.loading
    # "decoder" may be the next one in: a caller should retry, not give up.
    for name in ("decoder", "nope", ""):  # "" is the default, "decoder", not in yet
        with pytest.raises(Unavailable, match="loading"):
            registry.engine(name)
    # A model already in is served while the others load (each has its own health name).
    assert registry.engine("encoder") is encoder
    with pytest.raises(Unavailable, match="loading"):
        registry.check_serving()

    decoder = engine("decoder")
    registry.add(decoder)
    registry.loaded()
    assert not registry.loading
    assert registry.engine("") is decoder
    with pytest.raises(ModelNotFound):
        registry.engine("nope")


def test_an_empty_registry_is_unavailable_while_loading() -> None:
    registry = ModelRegistry()
    with pytest.raises(Unavailable):
        registry.engine("")
    with pytest.raises(Unavailable):
        registry.engine("anything")


def test_two_models_with_one_name_stop_the_start_naming_both_paths() -> None:
    registry = registry_of(engine("enc", "/a/first"), loaded=False)
    with pytest.raises(ServerConfigError) as caught:
        registry.add(engine("enc", "/b/second"))
    message = str(caught.value)
    assert "'enc'" in message
    assert str(Path("/a/first")) in message and str(Path("/b/second")) in message
    # The refused one is not served in place of the first.
    assert [each.served.model.path for each in registry] == [Path("/a/first")]


def test_a_default_nobody_serves_stops_the_start_naming_what_is_served() -> None:
    registry = registry_of(engine("encoder"), engine("decoder"), default="dec", loaded=False)
    with pytest.raises(ServerConfigError) as caught:
        registry.loaded()
    message = str(caught.value)
    assert "'dec'" in message and "'encoder', 'decoder'" in message
    assert registry.loading  # still not serving


def test_no_model_at_all_stops_the_start() -> None:
    with pytest.raises(ServerConfigError, match="no model"):
        ModelRegistry().loaded()


def test_draining_makes_every_name_unavailable() -> None:
    registry = registry_of(engine("encoder"), engine("decoder"))
    registry.check_serving()  # loaded, not draining: serving
    registry.draining = True
    for name in ("", "encoder", "decoder", "nope"):
        with pytest.raises(Unavailable, match="draining"):
            registry.engine(name)
    with pytest.raises(Unavailable, match="draining"):
        registry.check_serving()


def test_draining_wins_over_loading() -> None:
    # A server told to stop while it loads: "draining" (go elsewhere), not "retry shortly".
    registry = registry_of(engine("encoder"), loaded=False)
    registry.draining = True
    with pytest.raises(Unavailable, match="draining"):
        registry.engine("encoder")
    with pytest.raises(Unavailable, match="draining"):
        registry.check_serving()


def test_iteration_follows_the_order_models_were_added() -> None:
    engines = [engine(name) for name in ("zeta", "alpha", "mid")]
    registry = registry_of(*engines, default="alpha")
    assert list(registry) == engines
    assert len(registry) == 3
    # A snapshot: a model added while someone iterates does not break the iteration.
    walk = iter(registry)
    registry.add(engine("late"))
    assert list(walk) == engines
