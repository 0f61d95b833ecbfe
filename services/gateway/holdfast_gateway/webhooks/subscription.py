"""A webhook subscription as a request gives it, and its check before anything is stored.

``{"url", "events"}`` on ``/execute``, ``/v1/execution``, a schedule, or as
the tenant's default (``PUT /webhooks/default``). The URL must lead where the
outbound policy lets the engine connect (422 ``DESTINATION_NOT_ALLOWED``,
checked here and again at each delivery, since DNS answers change), and the
tenant must have a signing secret (422 naming ``POST /webhooks/secret``):
an unsigned message could not be told from a forged one.
"""

from __future__ import annotations

from typing import Any

from holdfast_shared.errors import ErrorCode
from holdfast_shared.outbound import DestinationNotAllowed, OutboundPolicy
from holdfast_shared.webhooks import WebhookSpec

from holdfast_gateway.errors import ApiError
from holdfast_gateway.state import GatewayState
from holdfast_gateway.webhooks.tenant import has_secret

Loc = tuple[str, ...]


def _refused(loc: Loc, message: str, kind: str, code: str) -> ApiError:
    problem = {"loc": list(loc), "msg": message, "type": kind}
    return ApiError(422, code, f"{'.'.join(loc)}: {message}", {"errors": [problem]})


async def accepted(
    state: GatewayState, tenant_id: str, spec: WebhookSpec | None, loc: Loc
) -> dict[str, Any] | None:
    """``spec`` as stored (None: none given), once its URL and the tenant's secret
    are checked; 422 naming ``loc`` (the ``webhook`` field) otherwise."""
    if spec is None:
        return None
    try:
        await OutboundPolicy.from_settings(state.settings).check_url(spec.url, (*loc, "url"))
    except DestinationNotAllowed as exc:
        raise _refused(
            exc.loc,
            f"the engine may not connect there: {exc.reason}",
            "destination_not_allowed",
            ErrorCode.DESTINATION_NOT_ALLOWED,
        ) from None
    async with state.sessions() as session:
        if not await has_secret(session, tenant_id):
            raise _refused(
                loc,
                "the tenant has no webhook signing secret: POST /webhooks/secret first",
                "no_signing_secret",
                ErrorCode.INVALID_REQUEST,
            )
    return spec.model_dump(mode="json")
