"""What every group of endpoint calls shares: the route of an endpoint, as
:mod:`fedsec.protocol.endpoints` declares it, and the transport and pinned key the
calls use."""

from __future__ import annotations

from fedsec.aggregator_client.limits import MAX_RECEIPT_BYTES
from fedsec.aggregator_client.transport import Route, Transport
from fedsec.crypto.identity import PublicIdentity
from fedsec.protocol import endpoints
from fedsec.protocol.wire import Receipt, decode


def route(name: str, **values: int) -> Route:
    """The method and path of endpoint ``name``, its path parameters filled in.

    Raises:
        KeyError: no endpoint of that name, or a path parameter missing.
    """
    endpoint = endpoints.BY_NAME[name]
    return Route(endpoint.method, endpoint.template.format(**values))


def seconds(value: float) -> str:
    """Seconds as a plain decimal ("30", "0.5"; never exponent notation), at ms precision."""
    text = f"{min(max(value, 0.0), 1e9):.3f}".rstrip("0").rstrip(".")
    return text or "0"


class Calls:
    """The base of each group of endpoint calls; :class:`AggregatorClient` sets these."""

    _transport: Transport
    #: the aggregator's pinned key: receipts and manifests must verify under it
    aggregator: PublicIdentity
    #: per-request timeout (long polls get the wait on top)
    timeout_s: float

    def _verified_receipt(self, raw: bytes) -> Receipt:
        """Decode a receipt and check it is signed by the pinned aggregator key.

        Raises:
            PayloadError: not a receipt.
            SignatureError: not signed by the pinned key.
        """
        receipt = decode(
            raw, Receipt, max_bytes=MAX_RECEIPT_BYTES, what="receipt", unique_keys=False
        )
        receipt.verify(self.aggregator.public_bytes)
        return receipt
