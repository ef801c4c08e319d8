"""Generic webhook: POST ``{"alerts": [AlertEvent, ...]}`` as JSON; any 2xx is an acknowledgement."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from notifiers._http import DEFAULT_TIMEOUT_S, post_json, raise_for_http_status
from notifiers.redact import redact_url
from trainsentry.config import Secret
from trainsentry.errors import ConfigError
from trainsentry.events import AlertEvent

__all__ = ["Webhook", "alerts_body"]

logger = logging.getLogger(__name__)


def alerts_body(alerts: Sequence[AlertEvent]) -> dict[str, Any]:
    """The JSON body: the contract's AlertEvent objects under ``"alerts"``."""
    return {"alerts": [a.to_dict() for a in alerts]}


class Webhook:
    """Any HTTP endpoint that takes AlertEvent JSON (Alertmanager-style receivers, bots).

    2xx: delivered. 429 (``Retry-After`` honoured), 408, 5xx, timeouts: retried by the
    deliverer. 401/403/404/405: configuration error. Other 4xx: the message is rejected.
    """

    def __init__(self, *, url: str | Secret, client: httpx.AsyncClient | None = None,
                 headers: Mapping[str, str] | None = None, name: str = "webhook",
                 timeout: float = DEFAULT_TIMEOUT_S, max_batch: int = 100) -> None:
        self._url = url if isinstance(url, Secret) else Secret(url)
        if not self._url.get().startswith(("http://", "https://")):
            raise ConfigError(f"{name}: the webhook must be an http(s) URL (TRAINSENTRY_WEBHOOK_URL)")
        self.name = name
        self.timeout = timeout
        self.max_batch = max_batch
        self._headers = dict(headers or {})
        self._client = client
        self._owns_client = client is None

    def __repr__(self) -> str:
        return f"Webhook(name={self.name!r}, url={redact_url(self._url.get())!r})"

    @property
    def redacted_url(self) -> str:
        return redact_url(self._url.get())

    def _get_client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
        return self._client

    async def send(self, payload: dict[str, Any]) -> None:
        url = self._url.get()
        resp = await post_json(self._get_client(), url, payload, receiver=self.name,
                               timeout=self.timeout, headers=self._headers,
                               secrets=tuple(v for v in self._headers.values() if len(v) >= 8))
        raise_for_http_status(resp, receiver=self.name, url=url)

    async def send_alerts(self, alerts: Sequence[AlertEvent]) -> None:
        await self.send(alerts_body(alerts))

    async def aclose(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> Webhook:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
