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
