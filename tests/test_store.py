"""`store.py`'s views of a run on a (remote) filesystem, on fsspec's
`memory://`: the one-listing view the loader reads, and the shallow view
`watch` looks through."""
from fsspec.implementations.memory import MemoryFileSystem

from amp_postmortem.reading.store import fresh_view, run_location, shallow_view


def _run(root: str) -> None:
    fs = MemoryFileSystem()
    for rel, data in {"manifest.json": b"{}", "rank=0/manifest.json": b"{}", "rank=0/status.json": b"{1}",
                      "rank=0/index/part-000000.json": b"[]", "rank=0/steps/part-000000.parquet": b"x" * 9,
                      "rank=0/tensors/part-000000.parquet": b"y" * 7}.items():
        fs.pipe(f"{root}/{rel}", data)


def test_a_shallow_view_lists_only_the_directories_asked_about(monkeypatch):
    _run("/amp-store/run")
    calls = []
    real = MemoryFileSystem.find

    def counted(self, path, *args, **kwargs):  # how pyarrow's fsspec bridge lists a directory
        calls.append(path)
        return real(self, path, *args, **kwargs)
    monkeypatch.setattr(MemoryFileSystem, "find", counted)
    root = run_location("memory://amp-store/run")
    view = shallow_view(root)
    index = view / "rank=0" / "index"
    assert [p.name for p in index.iterdir()] == ["part-000000.json"]
    assert not (view / "rank=0" / "journal" / "steps").is_dir()  # known absent from its parent's listing
    assert [c.rsplit("/", 1)[-1] for c in calls] == ["run", "rank=0", "index"]  # never steps/ nor tensors/
    assert sorted(p.rsplit("/", 1)[-1] for p in view.listed_versions()) == \
        ["manifest.json", "manifest.json", "part-000000.json", "status.json"]
    assert (view / "rank=0" / "status.json").version()[0] == 3
    # A fresh full view sees every file, on the same filesystem object.
    full = fresh_view(root)
    assert (full / "rank=0" / "steps" / "part-000000.parquet").size() == 9 and full.fs is root.fs


def test_a_shallow_view_of_nothing_is_absent():
    assert not shallow_view(run_location("memory://amp-store/nothing-here")).exists()
