"""The dataset cursor: deterministic shuffles, requeue priority, epochs, resume from state."""

from __future__ import annotations

import json

import pytest

from asyncrl.spec import SpecError
from asyncrl.types import GroupId
from services.scheduler.dataset import DatasetCursor, Ticket, load_prompts


def drain(cursor: DatasetCursor) -> list[Ticket]:
    out = []
    while (t := cursor.next()) is not None:
        out.append(t)
    return out


def test_cursor_without_shuffle_visits_rows_in_order_per_epoch():
    tickets = drain(DatasetCursor(3, epochs=2, shuffle=False, seed=0))
    assert [(t.epoch, t.index, t.attempt) for t in tickets] == [
        (0, 0, 0),
        (0, 1, 0),
        (0, 2, 0),
        (1, 0, 0),
        (1, 1, 0),
        (1, 2, 0),
    ]


def test_cursor_shuffle_is_deterministic_per_seed_and_differs_across_epochs():
    a = drain(DatasetCursor(20, epochs=2, shuffle=True, seed=7))
    b = drain(DatasetCursor(20, epochs=2, shuffle=True, seed=7))
    assert a == b
    epoch0 = [t.index for t in a if t.epoch == 0]
    epoch1 = [t.index for t in a if t.epoch == 1]
    assert sorted(epoch0) == sorted(epoch1) == list(range(20))
    assert epoch0 != epoch1
    assert epoch0 != [t.index for t in drain(DatasetCursor(20, 1, True, seed=8))]


def test_cursor_requeue_takes_priority_with_same_attempt():
    # an infrastructure fault (failed RPC, lost worker) retries under the same group id
    c = DatasetCursor(5, epochs=1, shuffle=False, seed=0)
    first = c.next()
    c.next()
    c.requeue(first)
    assert c.next() == Ticket(0, 0, 0)
    assert c.next() == Ticket(0, 2, 0)


def test_cursor_requeue_new_attempt_only_when_asked():
    # a group dropped as too stale must be sampled again: a new group id
    c = DatasetCursor(5, epochs=1, shuffle=False, seed=0)
    c.requeue(Ticket(0, 4, 2), new_attempt=True)
    assert c.next() == Ticket(0, 4, 3)


def test_cursor_requeue_same_attempt_at_front():
    c = DatasetCursor(5, epochs=1, shuffle=False, seed=0)
    c.requeue(Ticket(0, 4, 2), new_attempt=True)
    c.requeue(Ticket(0, 3, 1), front=True)
    assert [c.next(), c.next()] == [Ticket(0, 3, 1), Ticket(0, 4, 3)]


def test_cursor_exhausted_only_when_epochs_done_and_requeue_empty():
    c = DatasetCursor(2, epochs=1, shuffle=False, seed=0)
    a, b = c.next(), c.next()
    assert c.exhausted and c.next() is None
    c.requeue(b)
    assert not c.exhausted
    assert c.next() == Ticket(0, b.index, 0)
    assert c.exhausted
    assert a.index == 0


def test_cursor_resume_from_json_state_continues_identically():
    c = DatasetCursor(10, epochs=3, shuffle=True, seed=3)
    for _ in range(13):
        c.next()
    c.requeue(Ticket(0, 4, 0))
    state = json.loads(json.dumps(c.state()))
    resumed = DatasetCursor(10, epochs=3, shuffle=True, seed=3, state=state)
    assert (resumed.epoch, resumed.position) == (1, 3)
    assert drain(resumed) == drain(c)


def test_ticket_group_id_round_trips_through_group_id_parse():
    t = Ticket(2, 17, 3)
    gid = t.group_id("my-exp-e1-p2-a3-abc123")
    assert gid == "my-exp-e1-p2-a3-abc123-e2-p17-a3"
    parsed = GroupId.parse(gid)
    assert (parsed.experiment_id, parsed.epoch, parsed.index, parsed.attempt) == (
        "my-exp-e1-p2-a3-abc123",
        2,
        17,
        3,
    )
    assert GroupId.parse("my-exp-eval-v0-p1") is None


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_load_prompts_reads_keys_and_truncates(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": f"{i}+1", "a": i + 1} for i in range(5)])
    prompts = load_prompts(path, "q", "a", max_prompts=3)
    assert [(p.index, p.prompt, p.answer, p.prompt_id) for p in prompts] == [
        (0, "0+1", "1", "p0"),
        (1, "1+1", "2", "p1"),
        (2, "2+1", "3", "p2"),
    ]


def test_load_prompts_missing_key_names_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": "1"}, {"prompt": "y"}])
    with pytest.raises(SpecError) as e:
        load_prompts(path, "prompt", "answer")
    assert e.value.field == "dataset.path"
    assert e.value.reason == "line 2: missing key 'answer'"


def test_load_prompts_invalid_json_and_empty_file_rejected(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": "1"}\nnot json\n')
    with pytest.raises(SpecError, match="line 2: invalid JSON"):
        load_prompts(str(bad), "prompt", "answer")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SpecError, match="no prompts") as e:
        load_prompts(str(empty), "prompt", "answer", field="eval.dataset_path")
    assert e.value.field == "eval.dataset_path"


def test_load_prompts_non_utf8_line_names_line_and_byte(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "x", "answer": "1"}\n\n{"prompt": "\xff", "answer": "2"}\n')
    with pytest.raises(SpecError) as e:
        load_prompts(str(bad), "prompt", "answer")
    assert e.value.field == "dataset.path"
    # blank line 2 is skipped but counted; '{"prompt": "' is 12 bytes, so 0xff is at offset 12
    assert e.value.reason == "line 3: not UTF-8 (byte 0xff at 12)"
