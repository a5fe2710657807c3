"""The export keeper: an even, bounded sample of the checkpoints a run writes,
although the sink keeps only each session's last few."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.chaos.exportkeep import ExportKeeper


def test_the_keeper_samples_every_file_it_saw_within_its_bound(tmp_path: Path) -> None:
    sink, kept = tmp_path / "exports", tmp_path / "kept"
    sink.mkdir()
    keeper = ExportKeeper(sink, kept, limit=10, seed=1)
    for i in range(100):
        (sink / f"s-t{i:04d}-x.json").write_text(f'{{"n": {i}}}')
        if i >= 5:  # the sink keeps 5: the older ones are pruned
            (sink / f"s-t{i - 5:04d}-x.json").unlink()
        keeper.poll()
    assert len(keeper.seen) == 100
    names = sorted(p.name for p in kept.glob("*.json"))
    assert len(names) == 10
    assert sorted(keeper.kept) == names
    # an even sample: not only the first or the last files
    picked = sorted(int(n[3:7]) for n in names)
    assert picked[0] < 50 < picked[-1]
    for n in names:  # copies, byte for byte
        assert (kept / n).read_text() == f'{{"n": {int(n[3:7])}}}'
    keeper.finish()  # adds the sink's last files
    assert {p.name for p in sink.glob("*.json")} <= {p.name for p in kept.glob("*.json")}
    assert len(list(kept.glob("*.json"))) <= 10 + 5
    assert not list(kept.glob(".*"))  # no temporary file left


def test_a_file_pruned_while_listed_is_skipped(tmp_path: Path) -> None:
    keeper = ExportKeeper(tmp_path / "missing", tmp_path / "kept", limit=3, seed=0)
    keeper.poll()
    keeper.finish()
    assert keeper.seen == set()
    assert not (tmp_path / "kept").exists()
    with pytest.raises(ValueError, match="at least 1"):
        ExportKeeper(tmp_path, tmp_path / "k", limit=0, seed=0)
