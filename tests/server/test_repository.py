"""``Repository``: which model version answers a request, whether the server takes any,
and the versions of a model coming and going.

Proved here:
- the default model is the first added, or the one named at construction, and an empty
  name selects it;
- a name nobody serves is ``Unavailable`` while models are loading and, once
  ``started()``, ``ModelNotFound`` naming every served model in the order given;
- two models with one name while starting, a default nobody serves, or no model at all
  stop the start with a ``ServerConfigError`` naming what is wrong;
- draining makes every name ``Unavailable``, known or not, default or not, loading or not;
- ``check_serving`` passes only between ``started()`` and draining;
- iteration (and ``len``) follow the order the models were added;
- versions: a handle is routable once activated; a request naming no version gets the
  newest activated, one naming a version gets it (``Unavailable`` while it loads or
  drains, ``ModelNotFound`` naming the versions served when there is none such); a
  version served already cannot be added twice;
- leases: taken with each admission, returned with the ticket's release; ``retire`` stops
  the routing at once, waits for the last lease, then closes the version's scheduler (its
  backend let go) and forgets it;
- the listeners (the health service) hear when a name starts and stops being served, and
  one that fails breaks nothing.

The handles hold real schedulers around the small model's real table backend, renamed
and re-versioned per test (the repository reads a served model's name, version and path),
so admission and tickets are the server's own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tokembed.server.core.admission import OutputBudget
from tokembed.server.core.errors import ModelNotFound, ServerConfigError, Unavailable
from tokembed.server.core.policy import Policy
from tokembed.server.core.repository import ModelHandle, ModelState, Repository
from tokembed.server.core.scheduler import Scheduler
from tokembed.server.core.served import BatchLimits, Limits, ServedModel
from tokembed.server.models.loading import LoadedModel

from support.backends import HookedBackend


@dataclass
class Job:
    """What admission counts of a job (``operations.base.Job``)."""

    tokens: int = 8
    output_bytes: int = 8 * 64 * 4


@pytest.fixture
def workers() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(1)
    yield pool
    pool.shutdown()


Make = Callable[..., Scheduler]


@pytest.fixture
def scheduler(small_loaded: LoadedModel, workers: ThreadPoolExecutor) -> Make:
    """``scheduler(name, version="1", path=None)``: a scheduler of the small model, served
    as ``name`` (version ``version``, from ``path``)."""
    budget = OutputBudget(1 << 30)

    def make(name: str, version: str = "1", path: str | None = None) -> Scheduler:
        model = small_loaded.model
        directory = replace(
            model,
            path=Path(path or f"/models/{name}/{version}"),
            manifest=replace(model.manifest, name=name, version=version),
        )
        served = ServedModel(
            directory,
            HookedBackend(small_loaded.backend),  # counts close(), does not pass it on
            Limits(max_tokens_per_request=65536, max_output_bytes_per_request=1 << 30),
            BatchLimits(16384, 0.002, 1, 1 << 20),
        )
        return Scheduler(
            served, policy=Policy(batches=False, inline_max_tokens=256), budget=budget,
            workers=workers,
        )  # fmt: skip

    return make


def repository_of(
    *schedulers: Scheduler, default: str | None = None, started: bool = True
) -> tuple[Repository, list[ModelHandle]]:
    """Each scheduler added and activated, as the server does at start."""
    repository = Repository(default)
    handles = []
    for each in schedulers:
        handle = repository.add(each)
        repository.activate(handle)
        handles.append(handle)
    if started:
        repository.started()
    return repository, handles


def closed(handle: ModelHandle) -> int:
    backend = handle.served.backend
    assert isinstance(backend, HookedBackend)
    return backend.closed


# --- names


def test_the_default_is_the_first_model_added_and_an_empty_name_selects_it(
    scheduler: Make,
) -> None:
    repository, (encoder, decoder) = repository_of(scheduler("encoder"), scheduler("decoder"))
    assert repository.default_name == "encoder"
    assert repository.route("") is encoder
    assert repository.route() is encoder
    assert repository.route("decoder") is decoder
    assert repository.route("encoder") is encoder


def test_a_named_default_answers_empty_names_even_when_added_later(scheduler: Make) -> None:
    repository, (encoder, decoder) = repository_of(
        scheduler("encoder"), scheduler("decoder"), default="decoder"
    )
    assert repository.default_name == "decoder"
    assert repository.route("") is decoder
    assert repository.route("encoder") is encoder


def test_an_unknown_name_once_started_is_not_found_naming_the_served_models_in_order(
    scheduler: Make,
) -> None:
    repository, _ = repository_of(scheduler("zeta"), scheduler("alpha"), scheduler("mid"))
    with pytest.raises(ModelNotFound) as caught:
        repository.route("nope")
    message = str(caught.value)
    assert "'nope'" in message
    # In the order given (not sorted): the operator recognises their own command line.
    assert "'zeta', 'alpha', 'mid'" in message


def test_while_loading_an_unknown_name_is_unavailable_not_not_found(scheduler: Make) -> None:
    repository, (encoder,) = repository_of(scheduler("encoder"), default="decoder", started=False)
    assert repository.starting and not repository.ready
    # "decoder" may be the next one in: a caller should retry, not give up.
    for name in ("decoder", "nope", ""):  # "" is the default, "decoder", not in yet
        with pytest.raises(Unavailable, match="loading"):
            repository.route(name)
    # A model already in is served while the others load (each has its own health name).
    assert repository.route("encoder") is encoder
    with pytest.raises(Unavailable, match="loading"):
        repository.check_serving()

    decoder = repository.add(scheduler("decoder"))
    repository.activate(decoder)
    repository.started()
    assert not repository.starting and repository.ready
    assert repository.route("") is decoder
    with pytest.raises(ModelNotFound):
        repository.route("nope")
    repository.check_serving()


def test_an_empty_repository_is_unavailable_while_loading() -> None:
    repository = Repository()
    with pytest.raises(Unavailable):
        repository.route("")
    with pytest.raises(Unavailable):
        repository.route("anything")


def test_two_models_with_one_name_stop_the_start_naming_both_paths(scheduler: Make) -> None:
    repository, _ = repository_of(scheduler("enc", path="/a/first"), started=False)
    with pytest.raises(ServerConfigError) as caught:
        repository.add(scheduler("enc", "2", path="/b/second"))
    message = str(caught.value)
    assert "'enc'" in message
    assert str(Path("/a/first")) in message and str(Path("/b/second")) in message
    # The refused one is not served in place of the first.
    assert [handle.served.model.path for handle in repository] == [Path("/a/first")]


def test_a_default_nobody_serves_stops_the_start_naming_what_is_served(scheduler: Make) -> None:
    repository, _ = repository_of(
        scheduler("encoder"), scheduler("decoder"), default="dec", started=False
    )
    with pytest.raises(ServerConfigError) as caught:
        repository.started()
    message = str(caught.value)
    assert "'dec'" in message and "'encoder', 'decoder'" in message
    assert repository.starting  # still not serving


def test_no_model_at_all_stops_the_start() -> None:
    with pytest.raises(ServerConfigError, match="no model"):
        Repository().started()


def test_draining_makes_every_name_unavailable(scheduler: Make) -> None:
    repository, _ = repository_of(scheduler("encoder"), scheduler("decoder"))
    repository.check_serving()  # started, not draining: serving
    repository.drain()
    assert not repository.ready
    for name in ("", "encoder", "decoder", "nope"):
        with pytest.raises(Unavailable, match="draining"):
            repository.route(name)
    with pytest.raises(Unavailable, match="draining"):
        repository.route("encoder", "1")
    with pytest.raises(Unavailable, match="draining"):
        repository.check_serving()


def test_draining_wins_over_loading(scheduler: Make) -> None:
    # A server told to stop while it loads: "draining" (go elsewhere), not "retry shortly".
    repository, _ = repository_of(scheduler("encoder"), started=False)
    repository.drain()
    with pytest.raises(Unavailable, match="draining"):
        repository.route("encoder")
    with pytest.raises(Unavailable, match="draining"):
        repository.check_serving()


def test_iteration_follows_the_order_models_were_added(scheduler: Make) -> None:
    repository, handles = repository_of(
        *(scheduler(name) for name in ("zeta", "alpha", "mid")), default="alpha"
    )
    assert list(repository) == handles
    assert len(repository) == 3
    assert [served.name for served in repository.serving()] == ["zeta", "alpha", "mid"]
    # A snapshot: a model added while someone iterates does not break the iteration.
    walk = iter(repository)
    repository.add(scheduler("late"))
    assert list(walk) == handles


# --- versions


def test_a_new_version_is_routed_to_once_activated_and_each_version_by_its_number(
    scheduler: Make,
) -> None:
    repository, (v1,) = repository_of(scheduler("small", "1"))
    v2 = repository.add(scheduler("small", "2"))  # once started, a name served: a version
    assert (v1.state, v2.state) == (ModelState.READY, ModelState.LOADING)
    assert len(repository) == 1 and list(repository) == [v1, v2]
    # Loading: requests still go to version 1, and version 2 cannot be asked for yet.
    assert repository.route("small") is v1
    with pytest.raises(Unavailable, match="version 2 of model 'small' is loading"):
        repository.route("small", "2")
    repository.activate(v2)
    assert v2.state is ModelState.READY
    # The newest activated answers requests naming no version; each version its own.
    assert repository.route("small") is v2 and repository.route("") is v2
    assert repository.route("small", "1") is v1
    assert repository.route("small", "2") is v2
    assert repository.serving() == [v2.served]
    with pytest.raises(ModelNotFound) as caught:
        repository.route("small", "3")
    assert "model 'small' has no version '3' (versions served: 1, 2)" in str(caught.value)
    # The same version twice is refused, naming where each comes from.
    with pytest.raises(ServerConfigError, match="version 2 of model 'small' is served already"):
        repository.add(scheduler("small", "2", path="/elsewhere"))


def test_the_newest_activated_wins_not_the_newest_added(scheduler: Make) -> None:
    repository, (v1,) = repository_of(scheduler("small", "1"))
    v3 = repository.add(scheduler("small", "3"))
    v2 = repository.add(scheduler("small", "2"))
    repository.activate(v3)
    repository.activate(v2)  # say, a roll-back to 2 after 3
    assert repository.route("small") is v2
    assert repository.route("small", "3") is v3 and repository.route("small", "1") is v1


def test_a_lease_is_taken_at_admission_and_returned_with_the_ticket(scheduler: Make) -> None:
    _, (handle,) = repository_of(scheduler("small"))
    tickets = [handle.admit(Job()) for _ in range(3)]
    assert handle.leases == 3
    tickets[0].release()
    tickets[0].release()  # idempotent: one lease back, not two
    assert handle.leases == 2
    for ticket in tickets[1:]:
        ticket.release()
    assert handle.leases == 0


def test_retire_waits_for_the_last_lease_then_closes_the_version(scheduler: Make) -> None:
    repository, (v1,) = repository_of(scheduler("small", "1"))
    v2 = repository.add(scheduler("small", "2"))
    repository.activate(v2)

    async def body() -> None:
        held = [v1.admit(Job()), v1.admit(Job())]  # admitted on 1, answers not yet sent
        retiring = asyncio.ensure_future(repository.retire(v1))
        await asyncio.sleep(0)  # retire runs up to the wait for the leases
        # At once: no new request reaches version 1; those admitted keep it alive.
        assert v1.state is ModelState.DRAINING
        assert repository.route("small") is v2
        with pytest.raises(Unavailable, match="version 1 of model 'small' is draining"):
            repository.route("small", "1")
        held[0].release()
        for _ in range(10):
            await asyncio.sleep(0)
        assert not retiring.done() and closed(v1) == 0 and v1.leases == 1
        held[1].release()  # the last answer sent
        await asyncio.wait_for(retiring, 10)
        assert v1.state is ModelState.UNLOADED and closed(v1) == 1
        assert list(repository) == [v2] and closed(v2) == 0
        with pytest.raises(ModelNotFound, match=r"no version '1' \(versions served: 2\)"):
            repository.route("small", "1")
        # Retiring it again is nothing: no second close.
        await repository.retire(v1)
        assert closed(v1) == 1

    asyncio.run(body())


def test_retire_without_leases_unloads_at_once_and_the_last_version_takes_the_name(
    scheduler: Make,
) -> None:
    repository, (small, other) = repository_of(scheduler("small"), scheduler("other"))

    async def body() -> None:
        await asyncio.wait_for(repository.retire(small), 10)

    asyncio.run(body())
    assert small.state is ModelState.UNLOADED and closed(small) == 1
    assert list(repository) == [other] and len(repository) == 1
    with pytest.raises(ModelNotFound, match="this server serves 'other'"):
        repository.route("small")
    assert repository.serving() == [other.served]


def test_listeners_hear_when_a_name_starts_and_stops_being_served(
    scheduler: Make, caplog: pytest.LogCaptureFixture
) -> None:
    heard: list[tuple[str, bool]] = []

    def broken(name: str, serving: bool) -> None:
        raise RuntimeError("the health service broke")

    repository = Repository()
    repository.listen(broken)  # first: one that fails stops no other from hearing
    repository.listen(lambda name, serving: heard.append((name, serving)))
    v1 = repository.add(scheduler("small", "1"))
    assert heard == []  # loading is not serving
    repository.activate(v1)
    other = repository.add(scheduler("other"))
    repository.activate(other)
    repository.started()
    v2 = repository.add(scheduler("small", "2"))
    repository.activate(v2)
    assert heard == [("small", True), ("other", True), ("small", True)]
    assert "a repository listener failed" in caplog.text

    async def body() -> None:
        await repository.retire(v1)  # version 2 still serves the name: nothing to tell
        assert heard[3:] == []
        await repository.retire(other)  # its only version: the name stops
        assert heard[3:] == [("other", False)]

    asyncio.run(body())
    repository.drain()
    assert heard[4:] == [("small", False)]
    failed = [r for r in caplog.records if r.getMessage().startswith("a repository listener")]
    assert len(failed) == 5 and {r.levelno for r in failed} == {logging.ERROR}  # each told


def test_a_handle_names_its_model_version_and_state(scheduler: Make) -> None:
    _, (handle,) = repository_of(scheduler("small", "7"))
    assert (handle.name, handle.version) == ("small", "7")
    ticket = handle.admit(Job())
    assert repr(handle) == "<model small v7 ready, 1 leases>"
    ticket.release()
