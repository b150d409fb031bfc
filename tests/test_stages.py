"""The read path as stages: each stage's state is plain data, a pipeline runs in a thread or a worker."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from streamload import PlanError, StorageConfig, StreamingDataset
from streamload.plan import World
from streamload.plan_stage import Position
from streamload.skips import SkipLog, Substitute
from streamload.stages import Pipeline, Steps
from streamload.timing import FETCH, StageTable
from tests.helpers.datasets import make_dataset
from tests.s3server import SeaweedS3

COUNTS = [7, 5, 9, 4]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("stages"), COUNTS)


def pipeline(ds: StreamingDataset, start: int = 0, transform: Any = None) -> Pipeline:
    """One reader's stages over epoch 0 of ``ds``, built from public parts."""
    plan = ds.plan(0, 1)
    steps = Steps(transform, None, "raise", SkipLog(ds.source), 1 << 20, True, None)
    position = Position(0, plan.chunk_size(1), start)
    return Pipeline(steps, ds.streams, ds.streams.open_storages(), plan, World(0, 1, 0, 1), position)


def test_a_pipeline_reads_what_the_dataset_reads_and_its_state_is_plain_data(root: Path) -> None:
    ds = StreamingDataset(str(root), shuffle=True, seed=3, shuffle_window=6)
    expected = [s["__key__"] for s in ds]
    stages = pipeline(ds)
    assert stages.state() == {"plan": {"epoch": 0, "chunk_size": 25, "next_item": 0, "first": 0, "origin": 0}}
    it = iter(stages)
    head = [next(it)["__key__"] for _ in range(10)]
    state = stages.state()
    assert json.loads(json.dumps(state)) == state  # plain data, all the way down
    assert state["plan"]["next_item"] == 10
    assert sum(state["read"]["opens"]) >= 1 and state["read"]["recovered"] == [[]]
    assert state["read"]["substitute"] == {"owed": {}, "stand_ins": [None]}  # the last good sample, kept
    assert head + [s["__key__"] for s in it] == expected


def test_a_chain_reset_to_anothers_nested_state_reads_the_rest(root: Path) -> None:
    # The nodes' nested state is the resume state: a fresh chain reset to it (through the JSON
    # it would be saved as) reads exactly what the first had left.
    ds = StreamingDataset(str(root), shuffle=True, seed=3, shuffle_window=6)
    expected = [s["__key__"] for s in ds]
    first = pipeline(ds)
    it = iter(first)
    head = [next(it)["__key__"] for _ in range(13)]
    saved = json.loads(json.dumps(first.state()))
    again = pipeline(ds)
    again.reset(saved)
    assert again.state()["plan"] == saved["plan"]
    assert head + [s["__key__"] for s in again] == expected
    fresh = pipeline(ds)
    fresh.reset()  # None: afresh
    assert [s["__key__"] for s in fresh] == expected


def test_a_chain_refuses_a_state_that_is_not_its_own(root: Path) -> None:
    ds = StreamingDataset(str(root), shuffle=True, seed=3, shuffle_window=6)
    good = pipeline(ds).state()
    for bad, match in [
        ({**good["plan"], "epoch": 4}, "epoch 4"),
        ({**good["plan"], "chunk_size": 7}, "chunk_size=7"),
        ({**good["plan"], "next_item": -1}, "next_item=-1"),
        ({**good["plan"], "first": "0"}, "first='0'"),
        ({**good["plan"], "origin": 1.5}, "origin=1.5"),
    ]:
        with pytest.raises(PlanError, match=match):
            pipeline(ds).reset({"plan": bad})


def test_every_node_keeps_the_one_state_protocol(root: Path) -> None:
    # state() as plain data, reset(state=None): the plan, fetch, read and skip nodes and the chain.
    import inspect

    from streamload.ahead import FetchAhead, ShardsAhead
    from streamload.node import Node
    from streamload.plan_stage import Planner
    from streamload.stages import Read

    ds = StreamingDataset(str(root), shuffle=True, seed=3, shuffle_window=6)
    chain = pipeline(ds)
    next(iter(chain))
    nodes = [chain.position, ds.planner, chain.ahead, chain.read, chain.read.substitute, chain]  # type: ignore[union-attr]
    for node in nodes:
        assert isinstance(node, Node), type(node)
        assert json.loads(json.dumps(node.state())) == node.state()
    for cls in (Position, Planner, FetchAhead, ShardsAhead, Read, Substitute, Pipeline):
        parameter = inspect.signature(cls.reset).parameters.get("state")
        assert parameter is not None and parameter.default is None, cls


def test_a_pipeline_started_at_a_position_reads_the_rest(root: Path) -> None:
    ds = StreamingDataset(str(root), shuffle=True, seed=3, shuffle_window=6)
    expected = [s["__key__"] for s in ds]
    assert [s["__key__"] for s in pipeline(ds, start=12)] == expected[12:]


def test_a_pipeline_runs_on_a_thread(root: Path) -> None:
    ds = StreamingDataset(str(root))
    got: list[str] = []
    thread = threading.Thread(target=lambda: got.extend(s["__key__"] for s in pipeline(ds)))
    thread.start()
    thread.join(60)
    assert got == [s["__key__"] for s in ds]


def test_the_skip_stage_owes_stand_ins_until_a_good_item_and_reset_forgets() -> None:
    sub = Substitute()
    assert list(sub.fail(2, "a")) == []
    assert sub.state() == {"owed": {"a": 2}, "stand_ins": []}
    assert list(sub.good("x", "a")) == ["x", "x", "x"]
    assert sub.state() == {"owed": {}, "stand_ins": ["a"]}
    assert list(sub.fail(1, "a")) == ["x"]
    sub.reset()
    assert sub.state() == {"owed": {}, "stand_ins": []}


def test_the_plan_stage_state_is_the_loaded_resume_point(root: Path) -> None:
    ds = StreamingDataset(str(root), shuffle=True, seed=3, batch_size=2)
    assert ds.planner.state() is None
    state = ds.state_dict(samples_seen=4)
    ds.load_state_dict(state)
    assert ds.planner.state() == state
    ds.planner.reset()
    assert ds.planner.state() is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_starts_with_no_stage_rows_of_its_parent() -> None:
    table = StageTable(0)
    table.clock().row[0] += 1.5  # the parent's thread recorded some fetch time
    assert table.readers() == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own rows only
        os.write(write, f"{table.readers()} {table.fields()[0]}".encode())
        os._exit(0)
    os.close(write)
    out = os.read(read, 100).decode()
    os.waitpid(pid, 0)
    assert out == "0 0.0"
    assert table.fields()[0] == 1.5


def test_a_watched_streamed_read_times_its_ranged_reads_as_fetch(
    root: Path, s3_server: SeaweedS3, s3_bucket: str, tmp_path: Path
) -> None:
    """Streaming, the reads of fetched ranges are the fetch stage's: the nodes time them, nothing in storage/.

    The whole epoch is one fetch-ahead unit: every shard's reader is opened (its sidecar
    fetched) before the first sample is read, so what fetch gains after the first item is
    the reads of ranged bytes alone.
    """
    fs = s3_server.filesystem()
    for path in sorted(root.iterdir()):
        fs.put_file(str(path), f"{s3_bucket}/stages-streamed/{path.name}")
    storage = StorageConfig(storage_options=s3_server.storage_options(), cache_dir=tmp_path, cache="none")  # type: ignore[arg-type]
    ds = StreamingDataset(f"s3://{s3_bucket}/stages-streamed", storage=storage)
    ds.stage_table = table = StageTable(0)
    it = iter(ds)
    first = next(it)
    opened = table.fields()[FETCH]
    keys = [first["__key__"]] + [s["__key__"] for s in it]
    assert sorted(keys) == sorted(f"s{i}_{j}" for i, n in enumerate(COUNTS) for j in range(n))
    assert opened > 0  # the shards' opens
    assert table.fields()[FETCH] > opened  # 24 more samples' ranged reads
