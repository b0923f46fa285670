from pathlib import Path

from tuner.signals import VOCABULARY, reports
from tuner.signals import engine as es
from tuner.signals import gpu as gs

DOCS = Path(__file__).resolve().parents[2] / "docs" / "signals.md"


def test_docs_signals_md_is_in_sync_with_the_vocabulary():
    assert DOCS.read_text() == reports.vocabulary_markdown(), (
        "docs/signals.md is stale: regenerate with "
        "python -c \"from tuner.signals import reports; open('docs/signals.md','w').write(reports.vocabulary_markdown())\""
    )


def test_every_computed_signal_is_documented_and_vice_versa():
    computed = set(es.ALL_SIGNALS) | set(gs.GPU_SIGNALS)
    assert computed == set(VOCABULARY)
