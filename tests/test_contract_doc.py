from pathlib import Path

from rlalign.contract import spec


def test_contract_doc_is_rendered_from_the_constants():
    doc = Path(__file__).resolve().parents[1] / "docs" / "contract.md"
    assert doc.read_text() == spec.render_markdown(), (
        "docs/contract.md is stale: run `python -m rlalign.contract.spec > docs/contract.md`")
