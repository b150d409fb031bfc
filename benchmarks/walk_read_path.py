"""The read path's walk: which of the package's modules one batch passes through, and which calls run backwards.

Usage: ``python benchmarks/walk_read_path.py [--json FILE]``

A measurement of the code's shape, not of speed. One batch of 16 samples (``RawCollate``)
is traced with ``sys.setprofile``:

* **local, warm**: the second batch of a local tar dataset (the readers open);
* **remote, cold**: the first batch of the same dataset served over HTTP on loopback
  (``tests/lying_server.py``, an honest server here), with an empty cache: manifest,
  download, cache, the readers' opening.

For each it prints the modules of ``streamload`` whose functions ran, the **steps** (the
depth of the deepest chain of calls between modules, one step a call from one module into
another), and the **back-channels**: calls from a module into one that imports it (a lower
room calling up into a higher one, through a callback or a hook), each as ``caller ->
callee`` with the function called. And, read from the source (``ast``): the **private
reaches**, ``obj._name`` where ``obj`` is not ``self``/``cls`` (another object's private
attribute), package-wide and in ``loader.py``/``watching.py``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PACKAGE = ROOT / "streamload"


def _above(graph: dict[str, set[str]]) -> Callable[[str, str], bool]:
    """``above(a, b)``: whether module ``a`` imports ``b``, directly or not (``a`` is the higher room)."""
    memo: dict[str, set[str]] = {}

    def reach(a: str) -> set[str]:
        if a not in memo:
            memo[a] = set()
            seen: set[str] = set()
            stack = list(graph.get(a, ()))
            while stack:
                m = stack.pop()
                if m not in seen:
                    seen.add(m)
                    stack.extend(graph.get(m, ()))
            memo[a] = seen
        return memo[a]

    return lambda a, b: b in reach(a)


def private_reaches(paths: list[Path]) -> int:
    """``obj._name`` in ``paths``, where ``obj`` is not ``self``/``cls`` and ``_name`` not a dunder."""
    count = 0
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                count += 1
    return count


def trace(run: Callable[[], Any], above: Callable[[str, str], bool]) -> dict[str, Any]:
    """Run ``run`` under a profiler: the package's modules entered, the steps, the backward calls."""
    modules: set[str] = set()
    backward: set[tuple[str, str, str]] = set()
    depth = [0]
    deepest = [0]
    stack: list[tuple[str, int]] = []  # (module, module-changes so far) of each Python frame

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            caller = stack[-1] if stack else ("", 0)
            if not name.startswith("streamload"):
                stack.append(caller)
                return
            modules.add(name)
            steps = caller[1] + (1 if caller[0] and caller[0] != name else 0)
            deepest[0] = max(deepest[0], steps)
            if caller[0].startswith("streamload") and caller[0] != name and above(name, caller[0]):
                backward.add((caller[0], name, frame.f_code.co_name))
            stack.append((name, steps))
        elif event == "return" and stack:
            stack.pop()
        depth[0] = len(stack)

    sys.setprofile(prof)
    try:
        run()
    finally:
        sys.setprofile(None)
    return {
        "modules": sorted(modules),
        "steps": deepest[0],
        "back_channels": sorted(f"{a} -> {b}.{f}" for a, b, f in backward),
    }


def _dataset(folder: str) -> str:
    from streamload.converters import ConvertOptions, ImageFolderSource, convert
    from streamload.synthetic import make_image_folder

    images = os.path.join(folder, "images")
    make_image_folder(images, num_classes=4, per_class=16, size=(48, 40))
    out = os.path.join(folder, "ds")
    convert(ImageFolderSource(images), out, ConvertOptions(samples_per_shard=16, progress=False))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    from streamload import StreamingDataset
    from streamload.batch import RawCollate
    from streamload.storageconfig import StorageConfig
    from tests.helpers.imports import import_graph

    above = _above(import_graph())
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ds_path = _dataset(tmp)
        ds = StreamingDataset(ds_path, shuffle=True, seed=0, batch_size=16, collate=RawCollate())
        batches = iter(ds)
        next(batches)
        result["local_warm"] = trace(lambda: next(batches), above)

        sys.path.insert(0, str(ROOT / "tests"))
        from lying_server import LyingServer

        objects = {}
        for path in Path(ds_path).rglob("*"):
            if path.is_file():
                objects["/ds/" + path.relative_to(ds_path).as_posix()] = path.read_bytes()
        server = LyingServer(objects)
        try:
            url = f"http://127.0.0.1:{server.port}/ds"
            storage = StorageConfig(cache_dir=os.path.join(tmp, "cache"))

            def cold() -> None:
                remote = StreamingDataset(
                    url, shuffle=True, seed=0, batch_size=16, collate=RawCollate(), storage=storage
                )  # noqa: E501
                next(iter(remote))

            result["remote_cold"] = trace(cold, above)
        finally:
            server.stop()
    files = sorted(PACKAGE.rglob("*.py"))
    result["private_reaches"] = {
        "package": private_reaches(files),
        "loader_and_watching": private_reaches([PACKAGE / "loader.py", PACKAGE / "watching.py"]),
    }
    for key in ("local_warm", "remote_cold"):
        walk = result[key]
        counts = f"{len(walk['modules'])} modules, {walk['steps']} steps, {len(walk['back_channels'])} back-channels"
        print(f"{key}: {counts}")
        for line in walk["back_channels"]:
            print(f"    back: {line}")
    print(
        f"private reaches: {result['private_reaches']['package']} in the package, "
        f"{result['private_reaches']['loader_and_watching']} in loader.py and watching.py"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
