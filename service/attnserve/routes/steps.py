"""Steps over HTTP: open (``POST /v1/steps``), look at (``GET``) and close
(``DELETE /v1/steps/{step}``) a batch of sessions held open across layers. Its
layer calls are the data plane's (``transport/http.py``); what a step is and
its rules, ``step/steps.py`` and ``step_registry.py``. A step opened here is
bound to no connection: it closes by ``DELETE`` or after ``step_idle_timeout_s``
without a call."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..codec import decode_document, read_body, respond
from ..contract import ok, problems, request_body
from ..step import steps
from ..transport.deps import EngineDep, OwnerDep, RuntimeDep, StepPath, WireDep, merge_responses

__all__ = ["router"]

router = APIRouter(prefix="/v1/steps", tags=["steps"])


@router.post(
    "",
    summary="Open a step",
    description="Holds a fixed batch of sessions open across layers: the step is then called once per layer per "
    "token (`POST /v1/steps/{step}/layers/{layer}`, only the arrays) and closed (`DELETE`). While it is open its "
    "sessions are its own: an append, attend or batch naming one from outside the step, a second step over one, "
    "or its DELETE is 409 session-in-step (a fork, a snapshot, its info are allowed). Answers 201 with the step.",
    status_code=201,
    response_class=Response,
    openapi_extra=request_body("StepOpen"),
    responses=merge_responses(
        ok(201, "The step", "StepInfo"),
        problems(
            400,
            404,
            408,
            409,
            413,
            415,
            422,
            503,
            slugs={404: "session-not-found, layer-not-found", 408: "body-timeout", 409: "session-in-step"},
        ),  # fmt: skip
    ),
)
async def open_step(request: Request, rt: RuntimeDep, wire: WireDep, engine: EngineDep, owner: OwnerDep) -> Response:
    raw = await read_body(request, rt.settings.max_body_bytes)
    doc = await rt.offload(decode_document, raw, wire.request, rt.settings.max_body_bytes, size=len(raw))
    step = steps.open_step(rt, owner, doc, bound=None)  # no await from the checks to the open
    return respond(step.document(), wire, 201, headers={"Location": f"/v1/steps/{step.handle}"})


@router.get(
    "/{step}",
    summary="Get a step",
    description="The step as its open answered it, with its current `token`, `lengths` and `broken`.",
    response_class=Response,
    responses=merge_responses(ok(200, "The step", "StepInfo"), problems(404, 503, slugs={404: "step-not-found"})),
)
async def get_step(step: StepPath, rt: RuntimeDep, wire: WireDep, owner: OwnerDep) -> Response:
    return respond(steps.get_step(rt, owner, int(step)).document(), wire)


@router.delete(
    "/{step}",
    summary="Close a step",
    description="Closes the step and answers 204: its handle answers 404 from now on and its sessions are free at "
    "once (a call still in flight completes and is answered).",
    status_code=204,
    response_class=Response,
    responses=merge_responses({204: {"description": "Closed."}}, problems(404, 503, slugs={404: "step-not-found"})),
)
async def close_step(step: StepPath, rt: RuntimeDep, engine: EngineDep, owner: OwnerDep) -> Response:
    steps.close_step(rt, owner, int(step))
    return Response(status_code=204)
