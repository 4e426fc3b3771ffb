"""The FastAPI app: /v1/predict (read by hand, for speed), /v1/models, health, metrics, the page and its OpenAPI."""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from cifarkit.core.constants import VERSION
from cifarkit.core.errors import CifarkitError
from cifarkit.inference.classifier import prediction
from cifarkit.serving.gate import Gate
from cifarkit.serving.pipeline import Metrics, Pipeline, Served
from cifarkit.serving.settings import PREDICT, Refused, ServeSettings

log = logging.getLogger(__name__)

WEB = resources.files("cifarkit.serving") / "web"
RAW_TYPES = ("image/", "application/octet-stream")  # a raw body of these types is one image file


def _topk(text: str | None) -> int:
    if text is None:
        return 5
    if not text.isdigit() or not 1 <= int(text) <= 10:
        raise Refused(422, f"topk must be a whole number from 1 to 10, got {text!r}")
    return int(text)


def _answer(position: int, scores: tuple[list[float], list[int]], classes, topk: int, filename: str | None) -> dict:
    """One image's answer (inference.prediction) from its class probabilities and their ranking, best first, with
    its position in the request."""
    probabilities, ranked = scores
    answer = {"position": position, **prediction(probabilities, ranked, classes, topk)}
    if filename is not None:
        answer["filename"] = filename
    return answer


def create_app(models: dict[str, Served], settings: ServeSettings | None = None) -> FastAPI:
    """The ASGI app serving `models` (name -> Served), loaded already; warmed when its lifespan starts."""
    settings = settings or ServeSettings()
    if not models:
        raise CifarkitError("no model to serve; give one or more with --model")
    metrics = Metrics(settings.max_batch)
    state: dict = {"ready": False, "pipeline": None}
    default_model = next(iter(models))

    @asynccontextmanager
    async def lifespan(app):
        started = time.perf_counter()
        state["pipeline"] = Pipeline(models, settings, metrics)
        await asyncio.to_thread(state["pipeline"].warm.wait)
        # torch, FastAPI and the models are some 250,000 objects that live as long as the process: without this, each
        # full collection walks them all, a pause long enough to show in the p99 latency under load.
        gc.collect()
        gc.freeze()
        log.info("models %s loaded and warm on %s in %.2f s; the model thread runs on %d threads", ", ".join(models),
                 ", ".join(sorted({str(served.classifier.device) for served in models.values()})),
                 time.perf_counter() - started, settings.model_threads())
        state["ready"] = True
        try:
            yield
        finally:
            state["ready"] = False
            state["pipeline"].stop()

    app = FastAPI(title="cifarkit", version=VERSION, lifespan=lifespan,
                  description="CIFAR-10 classifiers released by cifarkit. Errors are JSON: {\"detail\": \"...\"}.")

    def shed(scope) -> Refused | None:
        """A prediction for a model whose queue is full already is refused at the door, before its body is read
        and before FastAPI sees it: under overload a 503 then costs a fraction of what an answer costs."""
        pipeline = state["pipeline"]
        if scope["path"] != PREDICT or pipeline is None or pipeline.has_room():
            return None
        name = parse_qs(scope["query_string"].decode("latin-1")).get("model", [default_model])[0]
        return pipeline.no_room(name, 1)

    for exception in (HTTPException, Refused, Exception):
        app.add_exception_handler(exception, _error_answer)

    async def predict(request: Request) -> Response:
        return await _predict(request, models, settings, state["pipeline"], metrics, default_model)

    app.add_middleware(Gate, settings=settings, metrics=metrics, shed=shed, predict=_asgi_predict(predict, metrics))

    # Its query is read by hand: FastAPI's request handler (dependency solving, parameter validation) took a quarter
    # of the event loop's time per prediction under load. openapi() documents it.
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema["paths"][PREDICT] = {"post": {
                "summary": "Classify one or several images", "operationId": "predict", **_PREDICT_DOC,
                "responses": {str(status): response for status, response in _PREDICT_RESPONSES.items()}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/v1/models", summary="The loaded releases and their measured figures")
    async def list_models():
        return {"default": default_model, "models": [served.describe() for served in models.values()],
                "batching": {"max_batch": settings.max_batch, "max_wait_ms": settings.max_wait_ms,
                             "max_queue": settings.max_queue}}

    @app.get("/healthz", summary="Alive: the process answers")
    async def healthz():
        return {"alive": True}

    @app.get("/readyz", summary="Ready: every model is loaded and warm")
    async def readyz():
        body = {"ready": state["ready"], "models": list(models) if state["ready"] else []}
        return JSONResponse(body, 200 if state["ready"] else 503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(Path(str(WEB)) / "index.html", headers=_PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=str(WEB)), name="static")
    return app


def _asgi_predict(predict, metrics: Metrics):
    """The prediction route as a bare ASGI app (the gate calls it without FastAPI's routing): POST only; a client that
    leaves mid-request is a log line and a count, any other failure a JSON answer."""
    async def predict_app(scope, receive, send):
        request = Request(scope, receive)
        try:
            if request.method != "POST":
                raise Refused(405, f"{PREDICT} takes POST", {"Allow": "POST"})
            response = await predict(request)
        except ClientDisconnect:  # nobody is left to answer: a line, a count, and no traceback
            client = f"{scope['client'][0]}:{scope['client'][1]}" if scope.get("client") else "a client"
            log.info("%s left before sending its whole request; nothing was answered", client)
            metrics.disconnects.inc()
            return
        except Exception as e:
            response = await _error_answer(request, e)
        await response(scope, receive, send)

    return predict_app


async def _predict(request: Request, models: dict[str, Served], settings: ServeSettings, pipeline: Pipeline,
                   metrics: Metrics, default_model: str) -> Response:
    """POST /v1/predict: the images of a request, classified by the model it names, each answered or refused."""
    name = request.query_params.get("model") or default_model
    topk = _topk(request.query_params.get("topk"))
    if name not in models:
        raise Refused(404, f"no model named {name!r} is loaded; loaded: {', '.join(models)}")
    files, named = await _read_images(request, settings)
    futures = pipeline.submit(name, files)
    try:
        async with asyncio.timeout(settings.timeout_s):
            outcomes = [await future for future in futures]
    except TimeoutError:
        for future in futures:
            future.cancel()  # the pipeline drops what it has not started
        raise Refused(504, f"no answer within {settings.timeout_s:g} s: the server is overloaded; retry later, "
                            f"or raise `cifarkit serve --timeout-s`") from None
    classes = models[name].classifier.classes
    answers = []
    for position, ((filename, _), outcome) in enumerate(zip(files, outcomes)):
        if isinstance(outcome, Refused):
            answers.append({"position": position, "filename": filename,
                            "error": {"status": outcome.status, "detail": outcome.detail}})
        else:
            answers.append(_answer(position, outcome, classes, topk, filename if named else None))
    failed = sum("error" in answer for answer in answers)
    metrics.images.labels(name, "ok").inc(len(answers) - failed)
    metrics.images.labels(name, "refused").inc(failed)
    if len(files) == 1 and failed:
        raise outcomes[0]  # one image: its error is the request's
    return JSONResponse({"model": name, "weights_sha256": models[name].classifier.weights_sha256,
                         "predictions": answers})


async def _error_answer(request: Request, exc: Exception) -> JSONResponse:
    """The JSON answer of an exception, for every route: {"detail": "..."} with its status and headers."""
    if isinstance(exc, Refused):
        return exc.answer()
    if isinstance(exc, HTTPException):
        return JSONResponse({"detail": exc.detail}, exc.status_code, exc.headers)
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)  # a bug of ours: the traceback too
    return JSONResponse({"detail": f"internal error ({type(exc).__name__}); see the server's log"}, 500)


async def _read_images(request: Request, settings: ServeSettings) -> tuple[list[tuple[str, bytes]], bool]:
    """(name, bytes) of each image in the request, and whether the names are the client's own filenames: multipart
    files, or one raw body of an image type."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        try:
            form = await request.form(max_files=settings.max_images, max_fields=settings.max_images)
        except HTTPException as e:
            if e.status_code == 413:
                raise
            raise Refused(422, f"the multipart body is malformed or holds too many parts ({e.detail}); send at "
                                f"most {settings.max_images} images") from None
        uploads = [value for _, value in form.multi_items() if hasattr(value, "read")]
        if not uploads:
            raise Refused(422, "the form holds no file; send images as multipart files, e.g. "
                                "`curl -F file=@cat.png URL`")
        return [(upload.filename or f"file {i + 1}", await upload.read()) for i, upload in enumerate(uploads)], True
    if kind.startswith(RAW_TYPES):
        return [("the request body", await request.body())], False
    raise Refused(415, f"unsupported media type {kind or '(none)'!r}; send one image as the body with an image/* "
                        f"Content-Type, or images as multipart/form-data files")


# The page's own scripts and styles only: nothing inline, nothing from elsewhere.
_PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:"}

_PREDICT_DOC = {"parameters": [
    {"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
     "description": "a loaded model's name (GET /v1/models); default: the first one given to --model"},
    {"name": "topk", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1, "maximum": 10,
                                                                  "default": 5},
     "description": "classes to return per image, best first"}],
    "requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {"type": "object", "properties": {
        "file": {"type": "array", "items": {"type": "string", "format": "binary"}}}}},
    "image/*": {"schema": {"type": "string", "format": "binary"}}}}}
_ERROR = {"content": {"application/json": {"example": {"detail": "what went wrong, and what to do"}}}}
_PREDICT_RESPONSES = {
    200: {"description": "One entry per image, in order, `position` its place in the request (from 0); the class "
                         "is `label` and `class_index` (0-9), as in `cifarkit predict --json` and "
                         "`Classifier.prediction`; in a multipart request, a bad image has an `error` entry instead "
                         "of a label", "content": {"application/json": {"example": {
                             "model": "B", "weights_sha256": "...", "predictions": [{
                                 "position": 0, "label": "cat", "class_index": 3, "confidence": 0.93,
                                 "topk": [{"label": "cat", "class_index": 3, "confidence": 0.93}]}]}}}},
    401: {"description": "CIFARKIT_API_KEY is set and the request lacks it", **_ERROR},
    404: {"description": "no such model is loaded", **_ERROR},
    413: {"description": "the body is over --max-body-mb", **_ERROR},
    415: {"description": "neither an image/* body nor multipart/form-data", **_ERROR},
    422: {"description": "not an image, a broken image, an image over the pixel limit, or a bad parameter",
          **_ERROR},
    503: {"description": "the model's queue is full; retry after Retry-After seconds", **_ERROR},
    504: {"description": "not answered within --timeout-s", **_ERROR},
}
