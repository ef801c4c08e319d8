"""Silences as the HTTP API and `trainsentry silence add` create them: what is refused."""

from __future__ import annotations

import pytest

from notifiers.lifecycle import alert_labels
from stream_app.alerting_api import SILENCE_LABELS, SilenceStore, silence_from_request
from tests.chat_servers import make_alert
from trainsentry.errors import ConfigError

NOW = 1_764_528_000.0


def test_every_label_a_silence_may_name_is_one_alerts_carry() -> None:
    """The accepted names are exactly the labels alerts are matched on (host, rank when set)."""
    labels = alert_labels(make_alert(host="node-1", rank=3))
    assert set(SILENCE_LABELS) == set(labels)


@pytest.mark.parametrize("body, fragment", [
    ({"matchers": ["diagnosos=kl_drift"]}, "no alert has a label 'diagnosos'"),
    ({"matchers": [{"name": "bogus", "value": "x", "op": "!="}]}, "labels: run_id"),
    ({"run": "r", "duration": "100000d"}, "longer than the 90 days"),
    ({"run": "r", "starts_at": "tomorrow"}, "starts_at must be a Unix time"),
    ({"run": "r", "ends_at": "nan"}, "finite"),
    ({"comment": "no matcher"}, "fingerprint"),
])
def test_a_silence_that_would_not_do_what_its_author_meant_is_refused(body: dict, fragment: str) -> None:
    """A misspelt label (which would mute nothing with =, everything with !=), an absurd
    duration or an unreadable time is refused with what to fix."""
    with pytest.raises(ConfigError, match=fragment):
        silence_from_request(body, now=NOW)


def test_good_silences_pass_and_a_bad_stored_one_is_skipped_not_fatal() -> None:
    s = silence_from_request({"matchers": ["alertname=~kl_.*", "rank=3"], "duration": "30d"},
                             now=NOW)
    assert s.ends_at - s.starts_at == 30 * 86400
    store = SilenceStore()
    store.apply("silence:old", {"kind": "silence", "id": "old", "matchers": [],
                                "starts_at": NOW, "ends_at": NOW + 60})
    store.apply(f"silence:{s.id}", s.to_dict())
    assert list(store.silences) == [s.id]
