"""The table cache (server/models/table_cache.py): row tables computed once, written to a
file and mapped read-only by every process that loads a model with the same files."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tokembed.server.core.dtypes import BFLOAT16, FLOAT16, FLOAT32
from tokembed.server.models.loading import load_model
from tokembed.server.models.table_cache import HEADER_BYTES, SUFFIX
from tokembed.server.process.settings import Settings

from support.fixtures import SMALL_D, SMALL_V
from support.models import export_model_dir, reference_rows

TABLES = 3  # float32, float16 and bfloat16 (the default budgets keep all three)
SEED, PAD = 77, 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model no other test loads: its tables are never those another test's loads keep
    alive in this process (``loading._Shared`` shares them by the files' sha256)."""
    return export_model_dir(
        tmp_path_factory.mktemp("cache-model") / "model",
        vocab_size=SMALL_V, d_model=SMALL_D, seed=SEED, padding_idx=PAD, name="cached",
    )  # fmt: skip


@pytest.fixture(scope="module")
def model_rows() -> np.ndarray:
    return reference_rows(SMALL_V, SMALL_D, SEED, PAD)


def _cached(directory: Path) -> Settings:
    return Settings(table_cache_dir=directory)


def _mapped_paths() -> set[str]:
    return {line.split(maxsplit=5)[5].strip() for line in Path("/proc/self/maps").read_text()
            .splitlines() if len(line.split(maxsplit=5)) == 6}  # fmt: skip


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*" + SUFFIX))


def _header(path: Path) -> dict[str, object]:
    fields: dict[str, object] = json.loads(path.read_bytes()[:HEADER_BYTES].rstrip(b"\0"))
    return fields


def _all_rows(backend: object) -> dict[str, bytes]:
    held = {}
    for dtype in (FLOAT32, FLOAT16, BFLOAT16):
        table = backend.held_table(dtype.name)  # type: ignore[attr-defined]
        assert table is not None
        held[dtype.name] = table.tobytes()
    return held


def test_a_cached_table_is_the_computed_one_mapped_read_only(
    model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    plain = load_model(model_dir, Settings(table_cache_max_bytes=0)).backend
    want = _all_rows(plain)
    assert set(plain.memory_bytes) == {"float32 table", "float16 table", "bfloat16 table"}
    del plain
    gc.collect()

    backend = load_model(model_dir, _cached(cache)).backend
    assert _all_rows(backend) == want  # bit for bit the rows computed without the cache
    assert backend.memory_bytes == {
        "mapped float32 table": SMALL_V * SMALL_D * 4,
        "mapped float16 table": SMALL_V * SMALL_D * 2,
        "mapped bfloat16 table": SMALL_V * SMALL_D * 2,
    }
    table = backend.held_table("float32")
    assert table is not None
    assert not table.flags.writeable and table.flags.c_contiguous
    assert table.shape == (SMALL_V, SMALL_D)
    files = _files(cache)
    assert len(files) == TABLES
    assert {str(path) for path in files} <= _mapped_paths()
    assert (cache.stat().st_mode & 0o777) == 0o700


def test_unloading_lets_go_of_the_mapping(model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    loaded = load_model(model_dir, _cached(cache))
    twin = load_model(model_dir, _cached(cache))  # shared in the process, not mapped twice
    assert twin.backend.held_table("float32") is loaded.backend.held_table("float32")
    files = {str(path) for path in _files(cache)}
    assert len(files) == TABLES and files <= _mapped_paths()
    del loaded, twin
    gc.collect()
    assert not files & _mapped_paths()


@pytest.mark.parametrize(
    "damage",
    ["truncated", "longer", "header", "another table's"],
)
def test_a_damaged_cache_file_is_computed_again_never_served(
    model_dir: Path, model_rows: np.ndarray, tmp_path: Path, caplog, damage: str
) -> None:
    cache = tmp_path / "cache"
    first = load_model(model_dir, _cached(cache))
    del first
    gc.collect()
    path = next(p for p in _files(cache) if _header(p)["dtype"] == "float32")
    good = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(good[: len(good) - 4])
    elif damage == "longer":
        path.write_bytes(good + b"\0" * 4)
    elif damage == "header":
        path.write_bytes(good.replace(b'"float32"', b'"float64"', 1))
    else:  # the right size and dtype, but the file of another key (a hand-made rename)
        key = str(_header(path)["key"])
        other = ("1" if key[0] == "0" else "0") + key[1:]
        path.write_bytes(good.replace(key.encode(), other.encode(), 1))
        assert len(path.read_bytes()) == len(good)
    # What would be served if the check missed it: rows other than the model's.
    with caplog.at_level(logging.WARNING, logger="tokembed.server.models.table_cache"):
        backend = load_model(model_dir, _cached(cache)).backend
    table = backend.held_table("float32")
    assert table is not None
    np.testing.assert_array_equal(table, model_rows)
    assert backend.memory_bytes["mapped float32 table"] == SMALL_V * SMALL_D * 4
    assert path.read_bytes() == good  # written again, whole
    assert any("computed again" in r.getMessage() and str(path) in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_rows_changed_in_the_file_are_what_the_header_cannot_see(
    model_dir: Path, tmp_path: Path
) -> None:
    """The control for the damage test: the file is what is served (a change of a row's
    bytes that keeps size and header shows in the answer), so a damaged file that were
    not refused would be served."""
    cache = tmp_path / "cache"
    first = load_model(model_dir, _cached(cache))
    del first
    gc.collect()
    path = next(p for p in _files(cache) if b'"float32"' in p.read_bytes()[:HEADER_BYTES])
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES : HEADER_BYTES + 4] = np.float32(1234.5).tobytes()
    path.write_bytes(bytes(data))
    table = load_model(model_dir, _cached(cache)).backend.held_table("float32")
    assert table is not None and table[0, 0] == np.float32(1234.5)


def test_a_directory_others_may_write_in_is_refused(
    model_dir: Path, model_rows: np.ndarray, tmp_path: Path, caplog
) -> None:
    cache = tmp_path / "open"
    cache.mkdir()
    cache.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="tokembed.server.models.table_cache"):
        backend = load_model(model_dir, _cached(cache)).backend
        load_model(model_dir, _cached(cache))  # logged once per process
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1, refusals
    assert str(cache) in refusals[0] and "may write in it (mode 777)" in refusals[0]
    assert "float32 table" in backend.memory_bytes  # held in memory, not mapped
    table = backend.held_table("float32")
    assert table is not None
    np.testing.assert_array_equal(table, model_rows)
    assert not list(cache.iterdir())


def test_a_directory_of_another_user_is_refused(model_dir: Path, tmp_path: Path, caplog) -> None:
    """A directory of another uid: one made and given away when the tests run as root,
    else the root directory (root's)."""
    if os.geteuid() == 0:
        cache, owner = tmp_path / "theirs", 12345
        cache.mkdir(mode=0o700)
        os.chown(cache, owner, owner)
    else:
        cache, owner = Path("/"), 0
    with caplog.at_level(logging.WARNING, logger="tokembed.server.models.table_cache"):
        backend = load_model(model_dir, _cached(cache)).backend
    assert any(f"belongs to uid {owner}, not to the server's user" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert "float32 table" in backend.memory_bytes  # held in memory, not mapped
    assert not list(cache.glob("*" + SUFFIX))


def test_the_least_recently_used_tables_go_past_the_bound(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    one_model = sum(SMALL_V * SMALL_D * width + HEADER_BYTES for width in (4, 2, 2))
    settings = Settings(table_cache_dir=cache, table_cache_max_bytes=one_model)
    first = export_model_dir(tmp_path / "a", vocab_size=SMALL_V, d_model=SMALL_D, seed=5)
    second = export_model_dir(tmp_path / "b", vocab_size=SMALL_V, d_model=SMALL_D, seed=6)
    load_model(first, settings)
    gc.collect()
    # A writer that died left its temporary file: an hour old, it goes with the next trim;
    # a fresh one (a writer at work) stays.
    stale, fresh = cache / ".dead.1.0.tmp", cache / ".busy.2.0.tmp"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (0, time.time() - 2 * 3600))
    firsts = set(_files(cache))
    assert len(firsts) == TABLES
    load_model(second, settings)
    gc.collect()
    left = set(_files(cache))
    assert len(left) == TABLES and not left & firsts
    assert sum(path.stat().st_size for path in left) <= one_model
    assert not stale.exists() and fresh.exists()


_LOAD = textwrap.dedent("""
    import logging, sys, time
    from pathlib import Path
    from tokembed.server.models.loading import load_model
    from tokembed.server.process.settings import Settings

    from tokembed.server.backends.sessions import ModelSession

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    every_row = ModelSession.every_row

    def slow_every_row(self, chunk_bytes):  # computing takes long: the others must wait
        time.sleep(1.5)
        return every_row(self, chunk_bytes)

    ModelSession.every_row = slow_every_row
    start = float(sys.argv[3])
    time.sleep(max(0.0, start - time.time()))  # every process starts its load together
    backend = load_model(Path(sys.argv[1]), Settings(table_cache_dir=Path(sys.argv[2]))).backend
    print("HELD", sorted(backend.memory_bytes), flush=True)
""")


def test_processes_loading_together_compute_each_table_once(
    model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    start = time.time() + 4.0  # past every process's imports
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _LOAD, str(model_dir), str(cache), str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    computed = [
        line for out in outputs for line in out.splitlines() if "computed and written" in line
    ]
    assert len(computed) == TABLES, outputs
    for out in outputs:
        assert (
            "HELD ['mapped bfloat16 table', 'mapped float16 table', 'mapped float32 table']" in out
        )
