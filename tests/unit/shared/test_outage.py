"""A retrying loop logs two lines per outage: when it starts failing and when it works again."""

import logging

from shared.redis_conn import Outage


def test_one_warning_when_it_fails_one_line_when_it_works_again(caplog):
    outage = Outage(logging.getLogger("test"), "heartbeat")
    with caplog.at_level(logging.INFO):
        assert outage.ok() is False  # nothing to end
        for _ in range(50):
            outage.failed(ConnectionError("Connection refused"))
        assert outage.ok() is True
        assert outage.ok() is False
    assert [(r.levelname, r.getMessage().split(";")[0]) for r in caplog.records] == [
        ("WARNING", "heartbeat failed: Connection refused"),
        ("INFO", "heartbeat works again after 0.0s"),
    ]
