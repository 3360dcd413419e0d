"""Dataset loading: JSONL/JSON/parquet, field names, templates, splits, errors naming file and line."""

import json
import sys

import pytest

from rlalign.tasks import DatasetError, load_dataset, load_examples, split_examples


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_fields_and_template(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "solution": 2, "topic": "math"},
                                           "", {"question": "2+2?", "solution": "4", "topic": "math"}])
    ex = load_examples(f, prompt_field="question", answer_field="solution",
                       prompt_template="[{topic}] Q: {prompt}\nA:")
    assert [(e.prompt, e.answer) for e in ex] == [("[math] Q: 1+1?\nA:", "2"), ("[math] Q: 2+2?\nA:", "4")]
    assert ex[1].source == f"{f}:3"  # blank line 2 skipped, line numbers kept


def test_nested_dotted_field(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "reward_model": {"ground_truth": "7"}}])
    assert load_examples(f, answer_field="reward_model.ground_truth")[0].answer == "7"


def test_json_array(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"prompt": "a", "answer": "1"}, {"prompt": "b"}]))
    with pytest.raises(DatasetError, match=r"d.json: row 2: missing field 'answer' \(row has: prompt\)"):
        load_examples(f)


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "p", "answer": ', r"d.jsonl:2: invalid JSON"),
    ('["p", "a"]', r"d.jsonl:2: expected a JSON object, got list"),
    ('{"prompt": "p"}', r"d.jsonl:2: missing field 'answer' \(row has: prompt\)"),
    ('{"prompt": 5, "answer": "a"}', r"d.jsonl:2: field 'prompt' must be a string or a list of chat messages, got int"),
    ('{"prompt": "p", "answer": null}', r"d.jsonl:2: field 'answer' must be a string or a number, got NoneType"),
    ('{"prompt": "p", "answer": true}', r"d.jsonl:2: field 'answer' must be a string or a number, got bool"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, message):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": "1"}, line])
    with pytest.raises(DatasetError, match=message):
        load_examples(f)


def test_template_missing_key(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "1"}])
    with pytest.raises(DatasetError, match=r"d.jsonl:1: prompt_template .* cannot be filled \(KeyError: 'ctx'\)"):
        load_examples(f, prompt_template="{ctx} {prompt}")


def test_file_errors(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_examples(tmp_path / "missing.jsonl")
    (tmp_path / "d.txt").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown file type '.txt'"):
        load_examples(tmp_path / "d.txt")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no rows"):
        load_examples(tmp_path / "e.jsonl")


def test_split_deterministic_disjoint_ordered(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)])
    train, held = load_dataset(f, eval_fraction=0.25, seed=3)
    assert len(held) == 5 and len(train) == 15
    assert {e.prompt for e in train}.isdisjoint({e.prompt for e in held})
    assert [int(e.answer) for e in train] == sorted(int(e.answer) for e in train)  # file order kept
    assert load_dataset(f, eval_fraction=0.25, seed=3) == (train, held)
    assert load_dataset(f, eval_fraction=0.25, seed=4)[1] != held
    assert load_dataset(f)[1] == []


def test_split_edge_cases():
    items = [object() for _ in range(3)]
    assert len(split_examples(items, 0.01)[1]) == 1   # at least one eval row when asked for any
    assert len(split_examples(items[:1], 0.5)[1]) == 0  # a single row stays in train
    with pytest.raises(ValueError, match="eval_fraction"):
        split_examples(items, 1.0)


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    f = tmp_path / "d.parquet"
    f.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError, match="d.parquet: reading a .parquet file needs the pyarrow package, which is not "
                                           "installed here: pip install pyarrow"):
        load_examples(f)


def test_parquet_roundtrip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": ["a", "b"], "a": [1, 2]}), f)
    ex = load_examples(f, prompt_field="q", answer_field="a")
    assert [(e.prompt, e.answer, e.source) for e in ex] == [("a", "1", f"{f}: row 1"), ("b", "2", f"{f}: row 2")]
    pq.write_table(pa.table({"q": ["a"]}), f)
    with pytest.raises(DatasetError, match=r"d.parquet: row 1: missing field 'a'"):
        load_examples(f, prompt_field="q", answer_field="a")
    f.write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="cannot read parquet"):
        load_examples(f)


# ---- datasets-library sources, columns, shuffling, streaming -----------------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402

from rlalign.tasks.datasets import Columns, StreamedRows, TrainRows, in_eval_share, read_rows  # noqa: E402

ROWS = [{"question": f"q{i}", "answer": str(i), "meta": {"level": i % 3}} for i in range(12)]


def _flat(rows):
    return [{"question": r["question"], "answer": r["answer"], "level": r["meta"]["level"]} for r in rows]


def test_csv_parquet_and_save_to_disk_folders_read_like_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    flat = _flat(ROWS)
    jsonl = write_jsonl(tmp_path / "d.jsonl", flat)
    csv = tmp_path / "d.csv"
    csv.write_text("question,answer,level\n" + "".join(f"{r['question']},{r['answer']},{r['level']}\n" for r in flat))
    parquet = tmp_path / "d.parquet"
    datasets.Dataset.from_list(flat).to_parquet(str(parquet))
    datasets.Dataset.from_list(flat).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(flat), test=datasets.Dataset.from_list(flat[:2])
                         ).save_to_disk(str(tmp_path / "dict"))
    columns = Columns("question", "answer")
    expected = [(e.prompt, e.answer, e.extra) for e in load_examples(jsonl, columns=columns)]
    for source in (csv, parquet, tmp_path / "one", tmp_path / "dict"):
        got = load_examples(source, columns=columns)
        assert [(e.prompt, e.answer, e.extra) for e in got] == expected, source
        assert got[1].source == f"{source}: row 2"
    assert [e.prompt for e in load_examples(tmp_path / "dict", columns=columns, split="test")] == ["q0", "q1"]
    with pytest.raises(DatasetError, match=r"dict: no split 'validation' \(the folder has: train, test\)"):
        load_examples(tmp_path / "dict", columns=columns, split="validation")


@pytest.mark.parametrize("path, message", [
    ("openai/gsm8k", r"openai/gsm8k: no such file or folder \(rlalign reads local data only and never downloads"),
    ("{tmp}/empty_dir", r"empty_dir: not a folder written by datasets' save_to_disk"),
    ("{tmp}/bad.parquet", r"bad.parquet: cannot read parquet"),
    ("{tmp}/bad.jsonl", r"bad.jsonl:1: not UTF-8 text"),
])
def test_unreadable_sources_are_one_line(tmp_path, path, message):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "bad.jsonl").write_bytes(b"\xff\xfe{}")
    with pytest.raises(DatasetError, match=message) as err:
        load_examples(path.format(tmp=tmp_path))
    assert "\n" not in str(err.value)


def test_columns_map_prompt_answer_and_renamed_reward_fields(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", ROWS[:2])
    ex = load_examples(f, columns=Columns("question", "answer", {"difficulty": "meta.level"}))
    assert [(e.prompt, e.answer, e.extra) for e in ex] == [("q0", "0", {"meta": {"level": 0}, "difficulty": 0}),
                                                           ("q1", "1", {"meta": {"level": 1}, "difficulty": 1})]
    with pytest.raises(DatasetError, match=r"d.jsonl:1: missing field 'nope' \(row has: answer, meta, question\)"):
        load_examples(f, columns=Columns("question", "answer", {"x": "nope"}))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), seed=st.integers(0, 2**32), passes=st.integers(1, 3))
def test_shuffled_train_rows_are_a_seeded_permutation_per_pass(n, seed, passes):
    items = list(range(n))
    rows = TrainRows(items, seed, shuffle=True)
    seen = [rows(i) for i in range(n * passes)]
    for p in range(passes):
        assert sorted(seen[p * n:(p + 1) * n]) == items       # each pass holds every row once
    again = TrainRows(items, seed, shuffle=True)
    assert [again(i) for i in reversed(range(n * passes))] == seen[::-1]   # a pure function of the position
    assert [TrainRows(items, seed)(i) for i in range(n * passes)] == items * passes   # no shuffle: file order


def test_streaming_holds_out_by_hash_and_reads_positions_as_a_pure_function(tmp_path):
    pytest.importorskip("datasets")
    f = write_jsonl(tmp_path / "d.jsonl", _flat(ROWS))
    columns = Columns("question", "answer")
    stream = StreamedRows(f, columns=columns, seed=5, eval_fraction=0.25)
    held = [e.prompt for e in stream.eval_examples()]
    train = [f"q{i}" for i in range(12) if not in_eval_share(5, i, 0.25)]
    assert held == [f"q{i}" for i in range(12) if in_eval_share(5, i, 0.25)] and train and held
    assert [stream(i).prompt for i in range(2 * len(train))] == train * 2   # passes repeat, file order
    assert stream(1).prompt == train[1]                                    # an earlier position (resume) re-reads
    assert stream(1).source == f"{f}: row {int(train[1][1:]) + 1}"
    shuffled = StreamedRows(f, columns=columns, seed=5, eval_fraction=0.25, shuffle=True, shuffle_buffer=4)
    first = [shuffled(i).prompt for i in range(2 * len(train))]
    assert sorted(first[:len(train)]) == sorted(train) and sorted(first[len(train):]) == sorted(train)
    again = StreamedRows(f, columns=columns, seed=5, eval_fraction=0.25, shuffle=True, shuffle_buffer=4)
    assert [again(i).prompt for i in range(2 * len(train))] == first
    assert stream.eval_examples(limit=1) == stream.eval_examples()[:1]
    assert [row["question"] for _, row in read_rows(f, streaming=True)] == [r["question"] for r in ROWS]


def test_build_task_reads_streams_eval_paths_and_columns(tmp_path):
    datasets = pytest.importorskip("datasets")
    from rlalign.models.testing import write_tiny_tokenizer
    from rlalign.models.tokenizer import load_tokenizer
    from rlalign.train.config import TaskSection
    from rlalign.train.setup import build_task

    (tmp_path / "tok").mkdir()
    write_tiny_tokenizer(tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok")
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS[:3]),
                         test=datasets.Dataset.from_list(ROWS[3:5])).save_to_disk(str(tmp_path / "held"))
    common = dict(name="dataset", path=str(train), reward="math", columns={"prompt": "question", "level": "meta.level"},
                  eval_path=str(tmp_path / "held"))
    for streaming in (False, True):
        task = build_task(TaskSection(**common, streaming=streaming), tokenizer, seed=1)
        try:
            assert [p.prompt for p in task.eval_problems()] == ["q3", "q4"]          # the folder's test split
            problems = task.train(10, 4)                                            # positions 10..13: a second pass
            assert [p.prompt for p in problems] == ["q10", "q11", "q0", "q1"]
            assert problems[0].extra == {"meta": {"level": 1}, "level": 1}
            assert task.score(problems, ["#### 10", "\\boxed{0}", "0", "1"]) == [1.0, 0.0, 1.0, 1.0]
        finally:
            task.close()
