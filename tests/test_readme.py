"""The README documents every metric the code exports (names are a contract), with the type and
labels the specs give it; docs/worker.md and docs/gateway.md list their component's."""

import re
from pathlib import Path

import pytest

from radixpool.protocol.metrics import ALL_METRICS, GATEWAY_METRICS, WORKER_METRICS

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
ROW = re.compile(r"^\| `(radixpool_\w+)` \| (\w+) \| ([\w, ]*) \|", re.MULTILINE)


def metric_rows() -> dict[str, tuple[str, tuple[str, ...]]]:
    """README metric table rows: exposed name -> (type, labels)."""
    return {name: (kind, tuple(label.strip() for label in labels.split(",") if label.strip()))
            for name, kind, labels in ROW.findall(README.read_text())}


def test_readme_lists_every_metric():
    text = README.read_text()
    missing = [m.name for m in ALL_METRICS if m.name not in text]
    assert not missing, f"README.md does not document: {missing}"


def test_readme_table_gives_each_metric_its_exposed_name_type_and_labels():
    rows = metric_rows()
    specs = {(s.series[0] if s.kind == "info" else s.name): s for s in ALL_METRICS}
    assert set(rows) == set(specs), (
        f"in the README only: {sorted(set(rows) - set(specs))}; "
        f"in the specs only: {sorted(set(specs) - set(rows))}")
    for name, (kind, labels) in rows.items():
        assert (kind, labels) == (specs[name].kind, specs[name].labels), name


@pytest.mark.parametrize(("doc", "specs"), [("docs/worker.md", WORKER_METRICS),
                                            ("docs/gateway.md", GATEWAY_METRICS)])
def test_component_docs_list_their_metrics(doc, specs):
    text = (REPO / doc).read_text()
    missing = [s.name for s in specs
               if f"| `{s.series[0] if s.kind == 'info' else s.name}" not in text]
    assert not missing, f"{doc} does not list: {missing}"



def server_info_docs() -> dict[str, str]:
    """Each doc's description of `GET /server_info`: worker.md's row, protocol.md's section."""
    worker = (REPO / "docs/worker.md").read_text()
    protocol = (REPO / "docs/protocol.md").read_text()
    return {"docs/worker.md": next(line for line in worker.splitlines()
                                   if line.startswith("| `GET /server_info`")),
            "docs/protocol.md": protocol.split("## `GET /server_info`")[1].split("\n## ")[0]}


@pytest.mark.parametrize("doc", ["docs/worker.md", "docs/protocol.md"])
def test_docs_name_every_server_info_field(doc):
    from dataclasses import fields

    from radixpool.protocol.server_info import ServerInfo
    section = server_info_docs()[doc]
    missing = [f.name for f in fields(ServerInfo) if f"`{f.name}`" not in section]
    assert not missing, f"{doc} does not list /server_info's {missing}"


def test_readme_lists_every_engine_option():
    from dataclasses import fields

    from radixpool.worker.config import EngineConfig
    text = README.read_text()
    options = text[text.index("- Engine options"):text.index("Supported models:")]
    missing = [f.name for f in fields(EngineConfig)
               if f.name != "model_path" and f"`{f.name}`" not in options]
    assert not missing, f"README.md's Engine options do not name {missing}"


def test_readme_engine_section_names_only_types_radixpool_worker_exports():
    import builtins

    import radixpool.worker
    text = README.read_text()
    section = text[text.index("## The engine (offline API)"):text.index("Supported models:")]
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", section)) - set(dir(builtins))
    missing = sorted(n for n in named if not hasattr(radixpool.worker, n))
    assert not missing, f"README.md's offline API names {missing}: not in radixpool.worker"
