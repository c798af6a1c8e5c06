"""ProgressStore: all-or-nothing batches, resume after SIGKILL, exports in manifest or id order."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from vramctl import VramctlError
from vramctl.batching._adaptive import BatchingError
from vramctl.batching._manifest import Item
from vramctl.batching._progress import (
    Completed,
    Exported,
    ProgressStats,
    ProgressStore,
    RunConflictError,
    check_writable,
    failures_path,
)

# The batches the child processes commit, shared with the test that checks them: batch b
# covers a contiguous run of indices; every 5th item fails, the others output a record.
LAYOUT = textwrap.dedent(
    """
    def layout(n_batches):
        out, start = [], 0
        for b in range(n_batches):
            size = 5 + (b * 7) % 11
            out.append(list(range(start, start + size)))
            start += size
        return out

    def record(i, pad=0):
        return {"text": f"item {i}", "n": i, "pad": "x" * pad}

    def split(indices, pad=0):
        results = [(i, f"id{i:06d}", record(i, pad), 0.5) for i in indices if i % 5]
        failures = [(i, f"id{i:06d}", f"bad audio {i}") for i in indices if i % 5 == 0]
        return results, failures
    """
)
_ns: dict[str, Any] = {}
exec(LAYOUT, _ns)
layout = _ns["layout"]
split = _ns["split"]
record = _ns["record"]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def make_manifest(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"id{i:06d}", "path": f"{i}.wav", "duration": 0.5}) + "\n")
    return path


# -- commit, read, export -------------------------------------------------------------


def test_commit_then_export_in_manifest_order(tmp_path: Path) -> None:
    with ProgressStore(tmp_path / "p.db", config={"model": "m"}) as store:
        # Batches arrive out of manifest order (as from parallel workers).
        store.commit([(5, "f", {"t": "F"}, 1.0), (6, "g", [1, 2], 2.0)], failures=[(7, "h", "x")])
        store.commit([(0, "a", "A", 0.25), (2, "c", None)], failures=[(1, "b", "too long")])
        store.commit([], failures=[(3, "d", 'quote " and\nnewline \udcff')])
        assert store.stats() == ProgressStats(done=4, failed=3, seconds=3.25)
        assert store.output(5) == {"t": "F"}
        assert store.output(2) is None
        with pytest.raises(KeyError):
            store.output(1)  # failed, not done
        exported = store.export(tmp_path / "out.jsonl")

    assert exported == Exported(
        str(tmp_path / "out.jsonl"), str(tmp_path / "out.failed.jsonl"), done=4, failed=3
    )
    assert read_jsonl(exported.path) == [
        {"id": "a", "index": 0, "output": "A"},
        {"id": "c", "index": 2, "output": None},
        {"id": "f", "index": 5, "output": {"t": "F"}},
        {"id": "g", "index": 6, "output": [1, 2]},
    ]
    assert read_jsonl(exported.failed_path) == [
        {"id": "b", "index": 1, "reason": "too long"},
        {"id": "d", "index": 3, "reason": 'quote " and\nnewline \\udcff'},
        {"id": "h", "index": 7, "reason": "x"},
    ]
    # Compact JSON, one object a line.
    first = Path(exported.path).read_text().splitlines()[0]
    assert first == '{"id":"a","index":0,"output":"A"}'


def test_export_in_id_order(tmp_path: Path) -> None:
    ids = ["zeta", "Alpha", "beta", "été", "alpha", "beta", "Zeta", "δ", "10", "9"]
    with ProgressStore(tmp_path / "p.db") as store:
        store.commit([(i, id_, {"i": i}) for i, id_ in enumerate(ids) if i != 4])
        store.commit([], failures=[(4, "alpha", "no")])
        exported = store.export(tmp_path / "by_id.jsonl", order="id")
        by_index = store.export(tmp_path / "by_index.jsonl")
    lines = read_jsonl(exported.path)
    expected = sorted((id_, i) for i, id_ in enumerate(ids) if i != 4)  # code points, then index
    assert [(line["id"], line["index"]) for line in lines] == expected
    assert all(line["output"] == {"i": line["index"]} for line in lines)
    assert [line["index"] for line in read_jsonl(by_index.path)] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert read_jsonl(exported.failed_path) == [{"id": "alpha", "index": 4, "reason": "no"}]


def test_outputs_round_trip_any_json(tmp_path: Path) -> None:
    values: list[Any] = [
        {"text": "日本語のテキスト", "scores": [0.1, -2.5e-7, 1e300], "ok": True},
        "lone surrogate \ud800 kept",
        [],
        {"nested": {"deep": [None, False, 3]}},
        12345678901234567890,
    ]
    with ProgressStore(tmp_path / "p.db") as store:
        store.commit([(i, f"u{i}", v) for i, v in enumerate(values)])
        assert [store.output(i) for i in range(len(values))] == values
        exported = store.export(tmp_path / "o.jsonl")
    assert [line["output"] for line in read_jsonl(exported.path)] == values
    assert "日本語" in Path(exported.path).read_text(encoding="utf-8")  # not \\u-escaped


@pytest.mark.parametrize(
    ("bad", "words"), [(math.nan, "NaN to None"), (object(), "not JSON"), ({1j: 2}, "not JSON")]
)
def test_output_that_is_not_json_commits_nothing(tmp_path: Path, bad: Any, words: str) -> None:
    with ProgressStore(tmp_path / "p.db") as store:
        with pytest.raises(BatchingError, match=words) as info:
            store.commit([(0, "fine", 1), (1, "broken", {"v": bad})])
        assert "'broken'" in str(info.value)
        assert store.stats() == ProgressStats(0, 0, 0.0)
        assert len(store.completed()) == 0


def test_bad_tuples_are_refused(tmp_path: Path) -> None:
    with ProgressStore(tmp_path / "p.db") as store:
        with pytest.raises(BatchingError, match="must be 0 or more"):
            store.commit([(-1, "a", 1)])
        with pytest.raises(BatchingError, match="must be an int"):
            store.commit([(True, "a", 1)])
        with pytest.raises(BatchingError, match="must be an int"):
            store.commit([("3", "a", 1)])  # type: ignore[list-item]
        with pytest.raises(BatchingError, match="must be a str"):
            store.commit([(3, 3, 1)])  # type: ignore[list-item]
        with pytest.raises(BatchingError, match="a result is"):
            store.commit([(3, "a")])  # type: ignore[list-item]
        with pytest.raises(BatchingError, match="a failure is"):
            store.commit([], failures=[(3, "a")])  # type: ignore[list-item]
        assert store.stats().recorded == 0


# -- atomicity and exactly-once -------------------------------------------------------


def test_batch_with_an_index_already_done_commits_nothing(tmp_path: Path) -> None:
    with ProgressStore(tmp_path / "p.db") as store:
        store.commit([(i, f"id{i}", i) for i in range(5)], failures=[(9, "id9", "bad")])
        before = store.stats()

        with pytest.raises(BatchingError, match=r"'id3' \(index 3\) is already recorded as done"):
            store.commit([(5, "id5", 5), (6, "id6", 6), (3, "id3", 3)], failures=[(7, "id7", "x")])
        with pytest.raises(BatchingError, match=r"'id8' \(index 8\) is in the batch twice"):
            store.commit([(8, "id8", 8), (10, "id10", 10)], failures=[(8, "id8", "x")])
        with pytest.raises(BatchingError, match=r"index 9\) is already recorded as failed"):
            store.commit([(11, "id11", 11), (9, "id9", 9)])  # a failed index is recorded too
        with pytest.raises(BatchingError, match=r"index 2\) is already recorded as done"):
            store.commit([], failures=[(12, "id12", "x"), (2, "id2", "x")])

        # Nothing of the refused batches: not in the bitmap, the counts, the table or the export.
        assert store.stats() == before
        done = store.completed()
        assert [i for i in range(15) if i in done] == [0, 1, 2, 3, 4, 9]
        assert (done.done, done.failed) == (5, 1)
        for i in (5, 6, 7, 8, 10, 11, 12):
            with pytest.raises(KeyError):
                store.output(i)
        assert store.output(3) == 3  # the first record stands

        # The store still works: the refused items go in once skipped indices are taken out.
        store.commit([(i, f"id{i}", i) for i in (5, 6, 8, 10, 11)], failures=[(7, "id7", "x")])
        exported = store.export(tmp_path / "o.jsonl")
    assert [line["index"] for line in read_jsonl(exported.path)] == [0, 1, 2, 3, 4, 5, 6, 8, 10, 11]
    assert [line["index"] for line in read_jsonl(exported.failed_path)] == [7, 9]


def test_clear_failures_lets_them_be_retried(tmp_path: Path) -> None:
    with ProgressStore(tmp_path / "p.db") as store:
        store.commit([(0, "a", 1)], failures=[(1, "b", "oom"), (2, "c", "oom")])
        assert store.clear_failures() == 2
        assert store.stats() == ProgressStats(1, 0, 0.0)
        assert 1 not in store.completed()
        store.commit([(1, "b", 2), (2, "c", 3)])
        assert store.stats().done == 3


# -- opening and resuming -------------------------------------------------------------


def test_resume_checks_manifest_and_config(tmp_path: Path) -> None:
    manifest = make_manifest(tmp_path / "m.jsonl", 20)
    db = tmp_path / "p.db"
    config = {"model": "whisper-tiny", "batch": 16, "lang": "en"}
    with ProgressStore(db, manifest=manifest, config=config) as store:
        store.commit([(0, "id000000", "x")])
        assert store.manifest == os.path.realpath(manifest)
        assert store.config == config

    # Same manifest, same config: resumes (order of config keys does not matter).
    with ProgressStore.open(db, manifest=str(manifest), config=dict(reversed(config.items()))) as s:
        assert 0 in s.completed()

    with pytest.raises(BatchingError) as info:
        ProgressStore(db, manifest=manifest, config={**config, "batch": 32, "beam": 5})
    message = str(info.value)
    assert "settings differ" in message
    assert "batch: 16 in the store, 32 now" in message
    assert "beam added" in message
    assert "overwrite=True" in message and "new output path" in message
    assert isinstance(info.value, RunConflictError) and len(info.value.differences) == 1
    assert "lang" not in message  # unchanged keys are not named

    other = tmp_path / "other.jsonl"
    other.write_bytes(manifest.read_bytes())
    with pytest.raises(BatchingError, match="manifest path differs"):
        ProgressStore(db, manifest=other, config=config)

    with open(manifest, "a") as f:  # the manifest grows: its fingerprint changes
        f.write(json.dumps({"id": "late", "path": "late.wav", "duration": 1.0}) + "\n")
    with pytest.raises(BatchingError, match=r"changed since the run began \(size \d+ -> \d+ bytes"):
        ProgressStore(db, manifest=manifest, config=config)

    # Same size, new modification time: also a different manifest.
    st = os.stat(manifest)
    with ProgressStore(db, resume=False, overwrite=True, manifest=manifest) as store:
        store.commit([(0, "id000000", "x")])
    os.utime(manifest, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    with pytest.raises(BatchingError, match=r"changed since the run began \(modified"):
        ProgressStore(db, manifest=manifest)

    # The refused opens left the store as it was.
    with ProgressStore.reader(db) as store:
        assert store.stats().done == 1


def test_resume_false_and_overwrite(tmp_path: Path) -> None:
    db = tmp_path / "p.db"
    with ProgressStore(db, config={"v": 1}) as store:
        store.commit([(0, "a", 1)], failures=[(1, "b", "x")])
    with pytest.raises(BatchingError, match=r"already holds a run \(1 done, 1 failed\)"):
        ProgressStore.open(db, config={"v": 1}, resume=False)
    with pytest.raises(BatchingError, match="contradict"):
        ProgressStore.open(db, resume=True, overwrite=True)

    with ProgressStore.open(db, config={"v": 2}, resume=False, overwrite=True) as store:
        assert store.stats() == ProgressStats(0, 0, 0.0)
        assert len(store.completed()) == 0
        assert store.config == {"v": 2}
        store.commit([(0, "a", 2)])
        assert store.output(0) == 2

    # A store with nothing recorded takes the new run's identity, resume or not.
    db2 = tmp_path / "empty.db"
    ProgressStore(db2, config={"v": 1}).close()
    with ProgressStore(db2, config={"v": 9}) as store:
        assert store.config == {"v": 9}
    with ProgressStore(db2, config={"v": 10}, resume=False) as store:
        assert store.config == {"v": 10}


def test_files_that_are_not_stores_are_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not SQLite\n" * 100)
    with pytest.raises(BatchingError, match="cannot be opened as a vramctl progress store"):
        ProgressStore(text)
    assert text.read_text().startswith("hello")

    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(
        BatchingError, match=r"not a vramctl progress store \(it holds tables users"
    ):
        ProgressStore(foreign, resume=False, overwrite=True)
    conn = sqlite3.connect(foreign)
    assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("users",)]
    conn.close()

    with pytest.raises(BatchingError, match="no progress store at"):
        ProgressStore.reader(tmp_path / "missing.db")


def test_store_layout_is_documented_sqlite(tmp_path: Path) -> None:
    """Other tools may read the file with plain SQLite: WAL, the tables of the issue."""
    manifest = make_manifest(tmp_path / "m.jsonl", 3)
    with ProgressStore(tmp_path / "p.db", manifest=manifest, config={"k": [1, 2]}) as store:
        store.commit([(1, "id000001", {"t": "x"}, 0.5)], failures=[(2, "id000002", "bad")])
        conn = sqlite3.connect(tmp_path / "p.db")
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        run = dict(conn.execute("SELECT key, value FROM run"))
        assert run["manifest"] == os.path.realpath(manifest)
        assert int(run["manifest_size"]) == manifest.stat().st_size
        assert json.loads(run["config"]) == {"k": [1, 2]}
        assert run["schema"] == "1" and run["created"]
        assert conn.execute("SELECT idx, id, output, seconds FROM done").fetchall() == [
            (1, "id000001", '{"t":"x"}', 0.5)
        ]
        assert conn.execute("SELECT * FROM failed").fetchall() == [(2, "id000002", "bad")]
        conn.close()


# -- kill and resume ------------------------------------------------------------------

CHILD = LAYOUT + textwrap.dedent(
    """
        import sys, time
        from vramctl.batching._progress import ProgressStore

        path, n_batches, pause_at, pad = sys.argv[1], *map(int, sys.argv[2:5])
        store = ProgressStore(path, config={"run": "kill"})
        state = {"batch": -1, "rows": set()}

        def pause_mid_batch(sql):
            # Stop inside the transaction of batch `pause_at`, after 5 of its rows (the
            # callback may see a statement more than once: count distinct rows).
            if state["batch"] == pause_at and sql.startswith("INSERT INTO done"):
                state["rows"].add(sql[:50])
                if len(state["rows"]) == 6:
                    print("paused", flush=True)
                    time.sleep(600)

        store._conn.set_trace_callback(pause_mid_batch)
        for b, indices in enumerate(layout(n_batches)):
            state["batch"] = b
            results, failures = split(indices, pad if b == pause_at else 0)
            store.commit(results, failures)
            print(b, flush=True)
        print("finished", flush=True)
        """
)


@pytest.mark.parametrize("mode", ["mid-transaction", "free-running"])
def test_sigkill_loses_no_committed_batch_and_resume_repeats_none(
    tmp_path: Path, mode: str
) -> None:
    db = tmp_path / "p.db"
    n_batches = 4000
    # mid-transaction: 5 rows of a batch whose outputs (1 MB each) spill to the log uncommitted.
    pause_at, pad = (12, 1_000_000) if mode == "mid-transaction" else (-1, 200)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(db), str(n_batches), str(pause_at), str(pad)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    seen: list[str] = []
    try:
        for line in child.stdout:
            seen.append(line.strip())
            if line.strip() == "paused":
                # Rows of the open transaction went to the log: 5 outputs of 1 MB overflow
                # the page cache (2 MB), so the kill leaves uncommitted frames behind.
                assert os.path.getsize(f"{db}-wal") > 2_000_000
                break
            if mode == "free-running" and line.strip() == "40":
                break
    finally:
        child.send_signal(signal.SIGKILL)
        _, err = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL, err
    assert "finished" not in seen, "the child ended before it was killed"
    acknowledged = max(int(s) for s in seen if s.isdigit())

    batches = layout(n_batches)
    with ProgressStore(db, config={"run": "kill"}) as store:
        done = store.completed()
        present = [sum(i in done for i in indices) for indices in batches]
        whole = [n == len(indices) for n, indices in zip(present, batches, strict=True)]
        assert all(n in (0, len(indices)) for n, indices in zip(present, batches, strict=True))
        committed = whole.index(False)  # batches 0 .. committed-1 are in, entirely
        assert not any(whole[committed:]), "a committed batch after a missing one"
        assert committed > acknowledged  # every batch commit() returned for is there
        if mode == "mid-transaction":
            assert committed == pause_at
        stats = store.stats()
        assert (stats.done, stats.failed) == (done.done, done.failed)  # counts in the same commit
        assert stats.recorded == sum(len(b) for b in batches[:committed])
        last = [i for i in batches[committed - 1] if i % 5][-1]
        assert store.output(last) == record(last, pad if committed - 1 == pause_at else 0)

        # Resume: skip what is recorded, commit the rest batch by batch.
        resumed = 0
        for indices in batches:
            todo = [i for i in indices if i not in done]
            if todo:
                store.commit(*split(todo))
                resumed += len(todo)
        assert resumed == sum(len(b) for b in batches[committed:])
        exported = store.export(tmp_path / "out.jsonl")

    total = sum(len(b) for b in batches)
    done_lines = read_jsonl(exported.path)
    failed_lines = read_jsonl(exported.failed_path)
    assert [line["index"] for line in done_lines] == [i for i in range(total) if i % 5]
    assert [line["index"] for line in failed_lines] == list(range(0, total, 5))
    assert all(line["output"]["n"] == line["index"] for line in done_lines)
    assert all(line["id"] == f"id{line['index']:06d}" for line in done_lines + failed_lines)


# -- readers ----------------------------------------------------------------------------

READER = LAYOUT + textwrap.dedent(
    """
    import json, sys
    from vramctl.batching._progress import ProgressStore

    path, out, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    batches = layout(10_000)
    seen = []
    with ProgressStore.reader(path) as store:
        for _ in range(rounds):
            done = store.completed()
            stats = store.stats()
            # every batch in the snapshot is there entirely
            partial = [b for b in batches if 0 < sum(i in done for i in b) < len(b)]
            seen.append([len(done), stats.recorded, len(partial)])
        exported = store.export(out)
    print(json.dumps({"seen": seen, "exported": exported.done + exported.failed}))
    """
)


def test_reader_in_another_process_while_the_run_writes(tmp_path: Path) -> None:
    db = tmp_path / "p.db"
    batches = layout(10_000)
    with ProgressStore(db, config={"run": "read"}) as store:
        for b in batches[:5]:
            store.commit(*split(b))
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(db), str(tmp_path / "snap.jsonl"), "8"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        written = 5
        while reader.poll() is None and written < len(batches):
            store.commit(*split(batches[written]))  # keeps writing while the reader reads
            written += 1
            time.sleep(0.002)
        out, err = reader.communicate(timeout=60)
        assert reader.returncode == 0, err
        final = store.stats().recorded
    report = json.loads(out)
    counts = [seen[0] for seen in report["seen"]]
    assert all(recorded <= stats for recorded, stats, _ in report["seen"])  # stats came later
    assert all(partial == 0 for _, _, partial in report["seen"])
    assert counts == sorted(counts) and counts[0] >= sum(len(b) for b in batches[:5])
    assert counts[-1] <= report["exported"] <= final
    snapshot = read_jsonl(tmp_path / "snap.jsonl") + read_jsonl(tmp_path / "snap.failed.jsonl")
    assert len(snapshot) == report["exported"]

    # And once the writer is gone (its log folded back into the file).
    with ProgressStore.reader(db) as store:
        assert store.stats().recorded == final
        assert store.config == {"run": "read"}


def test_reader_cannot_write(tmp_path: Path) -> None:
    db = tmp_path / "p.db"
    with ProgressStore(db) as store:
        store.commit([(0, "a", 1)])
        with ProgressStore.reader(db) as reader:
            with pytest.raises(BatchingError, match="read-only"):
                reader.commit([(1, "b", 2)])
            with pytest.raises(BatchingError, match="read-only"):
                reader.clear_failures()
            assert 0 in reader.completed()
            assert reader.output(0) == 1
    with pytest.raises(BatchingError, match="closed"):
        store.commit([(1, "b", 2)])
    store.close()  # twice is fine


# -- the completed bitmap ---------------------------------------------------------------


def test_completed_bitmap_for_a_million_indices(tmp_path: Path) -> None:
    n = 1_000_000

    def recorded(i: int) -> bool:  # done: i % 3 == 1; failed: i % 7 == 0; else not yet
        return i % 3 == 1 or i % 7 == 0

    with ProgressStore(tmp_path / "p.db") as store:
        step = 100_000
        for start in range(0, n, step):
            span = range(start, start + step)
            store.commit(
                [(i, "", i) for i in span if i % 3 == 1 and i % 7],
                failures=[(i, "", "") for i in span if i % 7 == 0],
            )
        tracemalloc.start()
        try:
            done = store.completed()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()

    top = max(i for i in range(n - 20, n) if recorded(i))
    assert isinstance(done, Completed)
    assert done.nbytes == top // 8 + 1  # one bit per index: ~125 kB for a million
    assert peak < 1_000_000  # streamed: a set or list of the indices would take tens of MB
    expected_done = sum(1 for i in range(n) if i % 3 == 1 and i % 7)
    expected_failed = sum(1 for i in range(n) if i % 7 == 0)
    assert (done.done, done.failed) == (expected_done, expected_failed)
    assert len(done) == expected_done + expected_failed
    assert all((i in done) == recorded(i) for i in range(n))
    assert not any(i in done for i in range(n, n + 100))
    assert -1 not in done and "3" not in done and 10**12 not in done

    items = [Item(id=f"u{i}", duration=1.0, index=i) for i in range(40)]
    assert [it.index for it in done.remaining(items)] == [i for i in range(40) if not recorded(i)]


def test_completed_of_an_empty_store(tmp_path: Path) -> None:
    with ProgressStore(tmp_path / "p.db") as store:
        done = store.completed()
    assert (len(done), done.nbytes, 0 in done) == (0, 0, False)


# -- output paths -----------------------------------------------------------------------


def test_unwritable_output_paths_are_named(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "out.jsonl"
    with pytest.raises(BatchingError, match="does not exist") as info:
        check_writable(missing)
    assert str(missing) in str(info.value)
    assert isinstance(info.value, VramctlError)

    with pytest.raises(BatchingError, match="is a folder") as info:
        check_writable(tmp_path)
    assert str(tmp_path) in str(info.value)

    assert check_writable(tmp_path / "fine.jsonl") == str(tmp_path / "fine.jsonl")
    assert sorted(os.listdir(tmp_path)) == []  # the probe is gone, nothing created

    with ProgressStore(tmp_path / "p.db") as store:
        store.commit([(0, "a", 1)])
        with pytest.raises(BatchingError, match=re.escape(str(missing))):
            store.export(missing)
        with pytest.raises(BatchingError, match="is a folder"):
            store.export(tmp_path)
        with pytest.raises(BatchingError, match="would overwrite the progress store"):
            store.export(tmp_path / "p.db")
        with pytest.raises(BatchingError, match="order"):
            store.export(tmp_path / "o.jsonl", order="random")  # type: ignore[arg-type]
        with pytest.raises(BatchingError, match="format"):
            store.export(tmp_path / "o.jsonl", format="csv")  # type: ignore[arg-type]
        assert store.output(0) == 1

    with pytest.raises(BatchingError, match=re.escape(str(tmp_path / "gone"))):
        ProgressStore(tmp_path / "gone" / "p.db")
    with pytest.raises(BatchingError, match="is a folder"):
        ProgressStore(tmp_path)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write anywhere"
)
def test_folder_without_write_permission(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(BatchingError, match="cannot write in"):
            check_writable(locked / "out.jsonl")
    finally:
        locked.chmod(0o755)


def test_export_replaces_the_old_file_and_leaves_no_temporaries(tmp_path: Path) -> None:
    out = tmp_path / "out" / "res.jsonl"
    out.parent.mkdir()
    out.write_text("old contents\n" * 1000)
    with ProgressStore(tmp_path / "p.db") as store:
        store.commit([(0, "a", "first")])
        store.export(out)
        assert read_jsonl(out) == [{"id": "a", "index": 0, "output": "first"}]
        store.commit([(1, "b", "second")], failures=[(2, "c", "bad")])
        exported = store.export(out)
    assert [line["output"] for line in read_jsonl(out)] == ["first", "second"]
    assert sorted(os.listdir(out.parent)) == ["res.failed.jsonl", "res.jsonl"]
    assert exported.failed_path == failures_path(out) == str(out.parent / "res.failed.jsonl")
    mode = os.stat(out).st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # like any new file, not mkstemp's private 0600


def test_an_export_killed_before_its_rename_leaves_nothing_behind_after_the_next(
    tmp_path: Path,
) -> None:
    # A SIGKILL while the export writes leaves its temporary file (as big as the output);
    # the next export to the same target removes it, but not that of a live process.
    out = tmp_path / "res.jsonl"
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead = int(child.stdout)  # a process that has exited
    stale = [tmp_path / f".res.jsonl.{dead}.0123abcd.tmp",
             tmp_path / f".res.failed.jsonl.{dead}.89ef4567.tmp"]  # fmt: skip
    live = tmp_path / f".res.jsonl.{os.getppid()}.00000000.tmp"
    other = tmp_path / f".other.jsonl.{dead}.0123abcd.tmp"
    for path in [*stale, live, other]:
        path.write_text("half an export\n")
    with ProgressStore(tmp_path / "p.db") as store:
        store.commit([(0, "a", "first")])
        store.export(out)
    left = sorted(name for name in os.listdir(tmp_path) if not name.startswith("p.db"))
    assert left == sorted([live.name, other.name, "res.failed.jsonl", "res.jsonl"])
