"""The README documents every metric the code exports (names are a contract)."""

from pathlib import Path

from radixpool.protocol.metrics import ALL_METRICS

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_lists_every_metric():
    text = README.read_text()
    missing = [m.name for m in ALL_METRICS if m.name not in text]
    assert not missing, f"README.md does not document: {missing}"
